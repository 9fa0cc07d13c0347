"""The cascade's routing (embed_lib.cascade) and the service's cascade path (without Serve)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from embed_lib.cascade import mix, n_routed, route

ADAPTER = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
CE = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
DIFFICULTY = np.array([0.2, 0.9, 0.1, 0.8, 0.3, 0.5])
BASELINE = np.array([0.0, 0.45, 0.9, 0.55, 0.2, 0.5])


@pytest.mark.parametrize("policy", ["difficulty", "random", "cosine_middle"])
def test_budget_zero_is_the_adapter_and_budget_one_the_cross_encoder(policy):
    kw = dict(difficulty=DIFFICULTY, baseline=BASELINE, seed=3)
    np.testing.assert_array_equal(mix(ADAPTER, CE, route(0.0, policy, **kw)), ADAPTER)
    np.testing.assert_array_equal(mix(ADAPTER, CE, route(1.0, policy, **kw)), CE)


def test_each_policy_routes_what_it_says():
    # half of 6 pairs: the three the gate rates hardest (0.9, 0.8, 0.5 at rows 1, 3, 5)
    assert route(0.5, "difficulty", difficulty=DIFFICULTY).tolist() == [1, 3, 5]
    # the three cosines nearest 0.5: 0.5, 0.45 / 0.55 (rows 5, 1, 3)
    assert route(0.5, "cosine_middle", baseline=BASELINE, middle=0.5).tolist() == [1, 3, 5]
    # nearest the median when no middle is given (median 0.475: rows 1, 5, 3)
    assert route(0.5, "cosine_middle", baseline=BASELINE).tolist() == [1, 3, 5]
    # only the routed pairs' cross-encoder scores, in routed order, are enough to mix
    np.testing.assert_array_equal(mix(ADAPTER, CE[[1, 3]], np.array([1, 3])), [0.1, 0.8, 0.3, 0.6, 0.5, 0.6])


def test_random_routing_is_reproducible_at_a_seed_and_varies_across_seeds():
    a = route(0.3, "random", n=1000, seed=7)
    assert a.tolist() == route(0.3, "random", n=1000, seed=7).tolist()
    assert len(a) == 300 and a.tolist() != route(0.3, "random", n=1000, seed=8).tolist()


def test_budget_rounding_meets_the_budget_on_average():
    rng = np.random.default_rng(0)
    counts = [n_routed(3, 0.1, rng) for _ in range(20000)]  # 0.3 of a pair per request
    assert set(counts) == {0, 1} and abs(np.mean(counts) - 0.3) < 0.01
    assert n_routed(10, 0.5, rng) == 5 and n_routed(10, 1.0, rng) == 10


def test_bad_routing_inputs_are_named():
    with pytest.raises(ValueError, match=r"budget=1.5 must lie in \[0, 1\]"):
        route(1.5, "random", n=4)
    with pytest.raises(ValueError, match="routing='best' is not a policy"):
        route(0.5, "best", n=4)
    with pytest.raises(ValueError, match="needs the adapter's difficulty.*no gate"):
        route(0.5, "difficulty", difficulty=np.full(4, np.nan))


class _Handle:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def result():
            return self.fn(*args)
        return result()


class _FakeCrossEncoder:
    """Stands in for the CrossEncoderScorer handle: scores 0.99 - 0.01 * len(a); `score_many` (the routed
    pairs of several cascade requests in one call) answers each request, failing a request with a text "bad"
    alone, after `delay` seconds."""

    def __init__(self, delay: float = 0.0):
        self.calls: list[list] = []
        self.many_calls: list[int] = []  # requests per score_many call
        self.score = _Handle(lambda pairs: self.calls.append(list(pairs)) or np.array(
            [0.99 - 0.01 * len(a) for a, _ in pairs], np.float32))
        self.info = _Handle(lambda: {"name": "fake", "middle": 0.5, "calibrated": True})
        fake = self

        class _Many:
            def remote(self, requests):
                async def result():
                    fake.many_calls.append(len(requests))
                    await asyncio.sleep(delay)
                    return [ValueError("bad text") if any("bad" in t for p in r for t in p) else fake.score.fn(r)
                            for r in requests]
                return result()
        self.score_many = _Many()


def _ingress(form: str, cross_encoder, args: dict | None = None):
    from tests.test_serving_unit import _FakeEncoder, _model
    from serving.app import Ingress

    cls = Ingress.func_or_class.__mro__[1]
    ingress = cls(_FakeEncoder(), cross_encoder, None, args or {}, None)
    ingress.scorer.set_model(_model(form, dim=4), {"name": "m", "version": "1"})
    return ingress


PAIRS = [("a", "bb"), ("ccc", "d"), ("ee", "ffff"), ("g", "hh")]


def test_the_service_cascade_routes_by_budget_and_says_which_path_scored():
    ce = _FakeCrossEncoder()
    ingress = _ingress("pair_gated", ce)
    plain = asyncio.run(ingress._score_pairs(PAIRS))
    assert "cascade" not in plain and all("path" not in r for r in plain["data"])
    none = asyncio.run(ingress._score_pairs(PAIRS, cascade={"budget": 0.0, "routing": "difficulty", "seed": 0}))
    assert [r["score"] for r in none["data"]] == [r["score"] for r in plain["data"]] and ce.calls == []
    assert none["cascade"]["routed"] == 0 and {r["path"] for r in none["data"]} == {"adapter"}
    half = asyncio.run(ingress._score_pairs(PAIRS, cascade={"budget": 0.5, "routing": "difficulty", "seed": 0}))
    hardest = sorted(np.argsort([-r["difficulty"] for r in plain["data"]])[:2].tolist())
    assert [r["index"] for r in half["data"] if r["path"] == "cross_encoder"] == hardest
    assert ce.calls == [[PAIRS[i] for i in hardest]]  # the cross-encoder saw only the routed pairs
    for i in hardest:
        assert half["data"][i]["score"] == pytest.approx(0.99 - 0.01 * len(PAIRS[i][0]))
        assert half["data"][i]["baseline"] == plain["data"][i]["baseline"]
    every = asyncio.run(ingress._score_pairs(PAIRS, cascade={"budget": 1.0, "routing": "random", "seed": 0}))
    assert [r["score"] for r in every["data"]] == pytest.approx([0.99 - 0.01 * len(a) for a, _ in PAIRS])


def test_cascade_refusals_name_the_option():
    from serving.errors import ApiError

    with pytest.raises(ApiError) as e:  # no cross-encoder configured
        asyncio.run(_ingress("pair_gated", None)._score_pairs(PAIRS, cascade={"budget": 0.5, "routing": "random",
                                                                              "seed": 0}))
    assert e.value.status == 422 and e.value.field == "cascade" and "cross_encoder=" in str(e.value)
    with pytest.raises(ApiError) as e:  # an ungated adapter has no difficulty to route by
        asyncio.run(_ingress("pair_ungated", _FakeCrossEncoder())._score_pairs(
            PAIRS, cascade={"budget": 0.5, "routing": "difficulty", "seed": 0}))
    assert e.value.status == 422 and e.value.field == "routing" and "no gate" in str(e.value)


@pytest.mark.parametrize("body,field", [({"budget": 1.5}, "budget"), ({"budget": -0.1}, "budget"),
                                        ({"budget": "0.1"}, "budget"), ({"routing": "best"}, "routing")])
def test_a_budget_outside_the_unit_interval_is_a_422(body, field):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serving import errors
    from serving.schemas import ScoreRequest

    app = FastAPI()
    errors.install(app)

    async def score(body):
        return {}

    score.__annotations__ = {"body": ScoreRequest}
    app.post("/score")(score)
    r = TestClient(app).post("/score", json={"pairs": [["a", "b"]], **body})
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text


def test_mean_combining_averages_the_routed_pairs_only():
    routed = np.array([0, 5])
    np.testing.assert_allclose(mix(ADAPTER, CE, routed, "mean"), [0.5, 0.2, 0.3, 0.4, 0.5, 0.5])
    with pytest.raises(ValueError, match="combine='max'"):
        mix(ADAPTER, CE, routed, "max")


def test_default_routing_follows_the_served_adapter():
    """Without `routing`, a gated adapter routes by its difficulty, an ungated one by the cosine's middle."""
    assert _ingress("pair_gated", _FakeCrossEncoder()).scorer.default_routing() == "difficulty"
    assert _ingress("pair_ungated", _FakeCrossEncoder()).scorer.default_routing() == "cosine_middle"


def _gather(*coros):
    async def main():
        return await asyncio.gather(*coros, return_exceptions=True)
    return asyncio.run(main())


def test_coalescer_merges_callers_that_arrive_while_calls_are_in_flight():
    from serving.scorer import Coalescer

    calls: list[list[int]] = []

    async def call_many(items):
        calls.append(list(items))
        await asyncio.sleep(0.02)
        return [ValueError(f"item {i}") if i == 5 else i * 10 for i in items]

    co = Coalescer(call_many, max_in_flight=2, max_items=3)
    out = _gather(*(co(i) for i in range(8)))
    # the first two go alone at once (nothing waits on an idle coalescer); the rest wait for a free call and go
    # together, at most max_items a call
    assert calls == [[0], [1], [2, 3, 4], [5, 6, 7]]
    assert out[:5] == [0, 10, 20, 30, 40] and out[6:] == [60, 70]
    assert isinstance(out[5], ValueError) and str(out[5]) == "item 5"  # only the caller whose item failed
    assert (co.calls, co.items, co.in_flight, co.waiting) == (4, 8, 0, [])
    assert asyncio.run(co(9)) == 90 and calls[-1] == [9]  # idle again: a lone caller goes at once


def test_coalescer_hands_a_failed_call_to_its_callers_only():
    from serving.scorer import Coalescer

    async def call_many(items):
        await asyncio.sleep(0.01)
        if 0 in items:
            raise RuntimeError("replica died")
        return list(items)

    out = _gather(*(Coalescer(call_many, max_in_flight=1)(i) for i in range(1)))
    assert isinstance(out[0], RuntimeError)
    co = Coalescer(call_many, max_in_flight=1)
    out = _gather(*(co(i) for i in range(4)))  # [0] fails; [1, 2, 3] went in the next call
    assert isinstance(out[0], RuntimeError) and out[1:] == [1, 2, 3]

    async def short(items):
        return items[:-1]

    with pytest.raises(RuntimeError, match="call_many returned 0 results for 1 items"):
        asyncio.run(Coalescer(short)(1))
    with pytest.raises(ValueError, match="max_in_flight >= 1"):
        Coalescer(short, max_in_flight=0)


def test_concurrent_cascade_requests_share_cross_encoder_calls_and_keep_their_own_scores():
    ce = _FakeCrossEncoder(delay=0.02)
    ingress = _ingress("pair_gated", ce)
    requests = [[(f"{'x' * (k + 1)} {j}", f"y{j}") for j in range(4)] for k in range(8)]
    requests[3][1] = ("bad", "text")  # a text the cross-encoder refuses: its request fails, no other
    cascade = {"budget": 1.0, "routing": "random", "seed": 0}
    out = _gather(*(ingress._score_pairs(r, cascade=cascade) for r in requests))
    assert len(ce.many_calls) < len(requests) and sum(ce.many_calls) == len(requests)
    assert isinstance(out[3], ValueError)
    for k, r in enumerate(requests):
        if k != 3:
            assert [row["score"] for row in out[k]["data"]] == pytest.approx([0.99 - 0.01 * len(a) for a, _ in r])
            assert {row["path"] for row in out[k]["data"]} == {"cross_encoder"}
    # cascade_coalesce=False: one cross-encoder call per request, the same scores
    ce_off = _FakeCrossEncoder(delay=0.02)
    off = _ingress("pair_gated", ce_off, {"cascade_coalesce": False})
    out_off = _gather(*(off._score_pairs(r, cascade=cascade) for r in requests if r is not requests[3]))
    assert ce_off.many_calls == [] and len(ce_off.calls) == len(requests) - 1
    assert [o["data"] for o in out_off] == [o["data"] for k, o in enumerate(out) if k != 3]
