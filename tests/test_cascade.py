"""The cascade's routing (embed_lib.training.cascade) and the service's cascade path (without Serve)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from embed_lib.training.cascade import FAMILIARITY_FLOOR, mix, n_routed, pairs_seed, route

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


@pytest.mark.parametrize("policy", ["difficulty", "random", "cosine_middle"])
def test_an_unfamiliar_request_routes_nothing_and_a_familiar_one_routes_as_before(policy):
    kw = dict(difficulty=DIFFICULTY, baseline=BASELINE, seed=3)
    plain = route(0.5, policy, **kw)
    assert len(plain) == 3
    familiar = np.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.5])  # mean 0.25
    assert route(0.5, policy, novelty=familiar, familiarity_floor=0.25, **kw).tolist() == plain.tolist()
    assert route(0.5, policy, novelty=familiar, familiarity_floor=0.26, **kw).tolist() == []
    assert route(0.5, policy, novelty=np.zeros(6), familiarity_floor=0.0, **kw).tolist() == plain.tolist()  # 0: off
    assert route(0.5, policy, familiarity_floor=0.9, **kw).tolist() == plain.tolist()  # no novelty gate: no floor


def test_requests_are_routed_each_on_its_own_and_seeded_by_its_pairs():
    from embed_lib.training.cascade import route_requests

    pairs = [(f"a{i}", f"b{i}") for i in range(6)]
    scored = {"difficulty": DIFFICULTY, "baseline": BASELINE, "novelty": np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])}
    first, second = np.array([0, 1, 2]), np.array([3, 4, 5])
    # the first request (familiar) routes its hardest of three (row 1, difficulty 0.9); the second (weight 0) nothing
    assert route_requests(1 / 3, "difficulty", [first, second], pairs, scored, familiarity_floor=0.5).tolist() == [1]
    # floor 0: each request its own hardest (rows 1 and 3), not the two hardest of all six
    assert route_requests(1 / 3, "difficulty", [first, second], pairs, scored).tolist() == [1, 3]
    half = route_requests(0.5, "random", [first, second], pairs, scored)  # 1.5 of 3 pairs: rounded per request
    expected = [r[route(0.5, "random", n=3, seed=pairs_seed([pairs[i] for i in r]))] for r in (first, second)]
    assert half.tolist() == sorted(np.concatenate(expected).tolist())


def test_bad_routing_inputs_are_named():
    with pytest.raises(ValueError, match=r"budget=1.5 must lie in \[0, 1\]"):
        route(1.5, "random", n=4)
    with pytest.raises(ValueError, match="routing='best' is not a policy"):
        route(0.5, "best", n=4)
    with pytest.raises(ValueError, match="needs the adapter's difficulty.*no gate"):
        route(0.5, "difficulty", difficulty=np.full(4, np.nan))
    with pytest.raises(ValueError, match="needs the adapter's difficulty.*no gate"):  # held back or not
        route(0.5, "difficulty", difficulty=np.full(4, np.nan), novelty=np.zeros(4), familiarity_floor=0.5)
    with pytest.raises(ValueError, match=r"familiarity_floor=1.5 must lie in \[0, 1\]"):
        route(0.5, "random", n=4, familiarity_floor=1.5)


class _Handle:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def result():
            return self.fn(*args)
        return result()


class _FakeCrossEncoder:
    """Stands in for the CrossEncoderScorer handle: scores 0.99 - 0.01 * len(a)."""

    def __init__(self):
        self.calls: list[list] = []
        self.score = _Handle(lambda pairs: self.calls.append(list(pairs)) or np.array(
            [0.99 - 0.01 * len(a) for a, _ in pairs], np.float32))
        self.info = _Handle(lambda: {"name": "fake", "middle": 0.5, "calibrated": True})


def _ingress(form: str, cross_encoder):
    from tests.test_serving_unit import _FakeEncoder, _model
    from serving.app import Ingress

    cls = Ingress.func_or_class.__mro__[1]
    ingress = cls(_FakeEncoder(), cross_encoder, None, {}, None)
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


class _TwoDomainEncoder:
    """Stands in for the Encoder handle: texts that start with "f" point along the novelty gate's reference sentence
    (familiar: weight 1), the others orthogonal to it (unfamiliar: weight 0)."""

    def __init__(self):
        class _Embed:
            def remote(self, texts):
                async def result():
                    return np.stack([np.array([len(t), 1, 0, 0] if t.startswith("f") else [0, 0, len(t), 1],
                                              np.float32) for t in texts])
                return result()
        self.embed = _Embed()


def test_the_service_cascade_holds_back_an_unfamiliar_request():
    import torch

    from embed_lib.training.adapters import NoveltyGate, PairAdapter
    from serving.app import Ingress

    gate = NoveltyGate(torch.tensor([[3.0, 1.0, 0.0, 0.0]]), lo=0.5, hi=0.9)
    model = PairAdapter("pair_gated", 4, [0, 1], novelty=gate).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    ce = _FakeCrossEncoder()
    ingress = Ingress.func_or_class.__mro__[1](_TwoDomainEncoder(), ce, None, {}, None)
    ingress.scorer.set_model(model, {"name": "m", "version": "1"})
    familiar = [("fa", "fbb"), ("fccc", "fd"), ("fee", "ff"), ("fg", "fhhhh")]
    unfamiliar = [("a", "bb"), ("ccc", "d"), ("ee", "ffff"), ("g", "hh")]
    cascade = {"budget": 0.5, "routing": "difficulty", "seed": 0, "familiarity_floor": 0.05}

    out = asyncio.run(ingress._score_pairs(familiar, cascade=cascade))
    assert out["cascade"]["routed"] == 2 and out["cascade"]["familiarity"] == pytest.approx(1.0)
    assert out["cascade"]["familiarity_floor"] == 0.05 and len(ce.calls) == 1
    plain = asyncio.run(ingress._score_pairs(unfamiliar))
    held = asyncio.run(ingress._score_pairs(unfamiliar, cascade=cascade))
    assert held["cascade"]["routed"] == 0 and held["cascade"]["familiarity"] == 0.0 and len(ce.calls) == 1
    assert {r["path"] for r in held["data"]} == {"adapter"}
    # the adapter itself is back on the frozen cosine there, and so is the cascade
    assert [r["score"] for r in held["data"]] == [r["score"] for r in plain["data"]] == [r["baseline"] for r in
                                                                                       plain["data"]]
    off = asyncio.run(ingress._score_pairs(unfamiliar, cascade={**cascade, "familiarity_floor": 0.0}))
    assert off["cascade"]["routed"] == 2 and len(ce.calls) == 2  # floor 0: routed whatever the pairs


def test_a_request_sets_its_own_familiarity_floor_else_the_apps():
    from serving.args import AppArgs
    from serving.schemas import ScoreRequest

    default = AppArgs.model_fields["cascade_familiarity_floor"].default
    assert default == FAMILIARITY_FLOOR
    pairs = [("a", "b")]
    own = ScoreRequest(pairs=pairs, budget=0.2, familiarity_floor=0.0, routing_seed=7).cascade_options(
        0.1, default, "random", pairs)
    assert own == {"budget": 0.2, "routing": "random", "seed": 7, "combine": "replace", "familiarity_floor": 0.0}
    assert ScoreRequest(pairs=pairs, cascade=True).cascade_options(0.1, 0.3, "difficulty", pairs)[
        "familiarity_floor"] == 0.3
    assert ScoreRequest(pairs=pairs).cascade_options(0.1, 0.3, "difficulty", pairs) is None


def test_the_default_routing_seed_follows_the_pairs_so_small_requests_meet_the_budget_on_average():
    """Without routing_seed, the seed is the pairs' hash: the same request routes the same way, and requests of one
    pair at budget 0.1 route about a tenth of them (one fixed seed would round 0.1 the same way every time: never)."""
    from serving.schemas import ScoreRequest

    def seed(pairs):
        return ScoreRequest(pairs=pairs, budget=0.1).cascade_options(0.1, 0.0, "random", pairs)["seed"]

    assert seed([("a", "b")]) == seed([("a", "b")]) == pairs_seed([("a", "b")])
    assert len({seed([("a", "b")]), seed([("b", "a")]), seed([("a", "b"), ("c", "d")]), seed([("a\x1fb", "")])}) == 4
    routed = [len(route(0.1, "random", n=1, seed=seed([(f"query {i}", "document")]))) for i in range(4000)]
    assert abs(np.mean(routed) - 0.1) < 0.015
    assert {len(route(0.1, "random", n=1, seed=0)) for _ in range(10)} == {0}  # what a fixed seed 0 gave
    assert pairs_seed([("\ud800", "x")]) >= 0  # a lone surrogate (valid JSON) hashes too


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
                                        ({"budget": "0.1"}, "budget"), ({"routing": "best"}, "routing"),
                                        ({"familiarity_floor": 1.2}, "familiarity_floor"),
                                        ({"routing_seed": -1}, "routing_seed")])
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


def test_a_failing_cross_encoder_is_not_reported_as_a_routing_error():
    """Only the routing's own refusals are 422s on `routing`; the cross-encoder's failure stays what it is."""
    from serving.errors import ApiError

    def refuse(pairs):
        raise ValueError("tokenizer refused a text")

    ce = _FakeCrossEncoder()
    ce.score = _Handle(refuse)
    with pytest.raises(ValueError, match="tokenizer refused") as e:
        asyncio.run(_ingress("pair_gated", ce)._score_pairs(PAIRS, cascade={"budget": 1.0, "routing": "random",
                                                                             "seed": 0}))
    assert not isinstance(e.value, ApiError)
