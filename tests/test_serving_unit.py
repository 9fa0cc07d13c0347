"""The serving layer without Ray: the PairScorer and its caches, the edge checks on texts, the error contract,
encode-failure isolation, admission control and warm jobs."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest


def _ingress(**args):
    """The Ingress class itself (under Serve's ASGI wrapper, whose async __init__ starts the FastAPI app)."""
    from serving.app import Ingress

    cls = Ingress.func_or_class.__mro__[1]
    assert cls.__name__ == "Ingress" and "ASGI" not in cls.__init__.__qualname__
    return cls(_FakeEncoder(), None, None, args, None)


class _FakeEncoder:
    """Stands in for the Encoder deployment's handle: `embed.remote(texts)` -> (n, 4) vectors."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        outer = self

        class _Embed:
            def remote(self, texts):
                outer.calls.append(list(texts))

                async def result():
                    return np.stack([np.full(4, len(t), np.float32) for t in texts])
                return result()
        self.embed = _Embed()


def _model(form="pair_gated", dim=8, seeds=(0, 1)):
    import torch

    from embed_lib.training.adapters import PairAdapter

    model = PairAdapter(form, dim, list(seeds)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    return model


def test_lru_is_bounded_and_counts_hits_and_misses():
    from serving.scorer import LRU

    cache = LRU(2)
    for t in ("a", "b", "c"):
        cache.put(t, np.zeros(1))
    found, missing = cache.get_many(["a", "b", "c", "c"])
    assert set(found) == {"b", "c"} and missing == ["a"]  # "a" evicted first; duplicates counted once
    assert cache.stats() == {"size": 2, "capacity": 2, "hits": 2, "misses": 1, "hit_rate": 2 / 3}
    cache.get_many(["b"])
    cache.put("d", np.zeros(1))  # "c" is now the least recently used
    assert "c" not in cache and "b" in cache
    off = LRU(0)
    off.put("a", np.zeros(1))
    assert off.stats()["size"] == 0


def test_projection_cache_reuses_projections_and_matches_the_plain_path():
    from embed_lib.training.export import ensemble_scores
    from serving.scorer import LRU, gather, projections

    model = _model()
    texts = [f"t{i}" for i in range(6)]
    vectors = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    table = dict(zip(texts, vectors))
    cache = LRU(100)
    ia, ib = [0, 1, 2], [3, 4, 5]
    plain = ensemble_scores(model, vectors[ia], vectors[ib])["score"]
    for expected_misses in (6, 6):  # the second request computes nothing new
        h = projections(model, cache, texts + texts[:2], table)  # a text asked twice is projected once
        assert set(h) == set(texts) and h["t0"].shape == (2, model.norm.weight.shape[-1])
        assert cache.stats()["misses"] == expected_misses
        ha, hb = gather(h, texts[:3], axis=1), gather(h, texts[3:], axis=1)
        assert ha.shape == (2, 3, model.norm.weight.shape[-1])
        np.testing.assert_allclose(ensemble_scores(model, vectors[ia], vectors[ib], ha, hb)["score"],
                                   plain, rtol=0, atol=1e-6)
    assert cache.stats()["hits"] == 6
    assert projections(_model(form="baseline"), cache, texts, table) is None


def test_gather_is_np_stack_in_float32():
    from serving.scorer import gather

    rng = np.random.default_rng(3)
    table = {k: rng.standard_normal((2, 3)) for k in "abc"}  # float64 in: float32 out, like the scorer's inputs
    for axis in (0, 1, 2):
        keys = ["c", "a", "c", "b"]
        got = gather(table, keys, axis)
        np.testing.assert_array_equal(got, np.stack([table[k] for k in keys], axis).astype(np.float32))
        assert got.dtype == np.float32


def test_pair_scorer_scores_like_the_library_fetches_once_and_forgets_projections_on_a_swap():
    from embed_lib.training.export import ensemble_scores
    from serving.scorer import PairScorer

    rng = np.random.default_rng(1)
    table = {f"s{i}": rng.standard_normal(8).astype(np.float32) for i in range(5)}
    asked: list[list[str]] = []

    async def source(texts):
        asked.append(list(texts))
        return np.stack([table[t] for t in texts])

    model = _model()
    scorer = PairScorer(model, {"name": "m"}, cache_size=100, projection_cache_size=100)
    pairs = [("s0", "s1"), ("s2", "s0"), ("s3", "s4")]
    got = asyncio.run(scorer.score(pairs, source))
    expected = ensemble_scores(model, np.stack([table[a] for a, _ in pairs]), np.stack([table[b] for _, b in pairs]))
    np.testing.assert_allclose(got["score"], expected["score"], atol=1e-6)
    np.testing.assert_allclose(got["baseline"], expected["baseline"], atol=1e-6)
    assert asked == [["s0", "s1", "s2", "s3", "s4"]]  # each distinct text once
    asyncio.run(scorer.score(pairs[::-1], source))
    assert len(asked) == 1 and scorer.stats()["projection_cache"]["hits"] == 5  # nothing fetched or projected again
    other = _model(seeds=(5, 6))
    scorer.set_model(other, {"name": "m2"})
    swapped = asyncio.run(scorer.score(pairs, source))
    np.testing.assert_allclose(swapped["score"], ensemble_scores(other, np.stack([table[a] for a, _ in pairs]),
                                                                 np.stack([table[b] for _, b in pairs]))["score"],
                               atol=1e-6)


def test_pair_scorer_answers_no_pairs_with_empty_arrays():
    from serving.scorer import PairScorer

    out = PairScorer(_model(), {"name": "m"}).score_vectors([], {})
    assert {k: v.shape for k, v in out.items()} == {"score": (0,), "baseline": (0,), "difficulty": (0,),
                                                  "novelty": (0,), "unclipped": (0,)}


def test_scores_and_baselines_never_leave_the_unit_interval():
    """Identical sentences: the float32 cosine can land a hair above 1; the service answers within [-1, 1]."""
    from serving.scorer import PairScorer

    v = np.full(384, 0.1, np.float32)
    v[::7] = 0.3337

    async def source(texts):
        return np.stack([v for _ in texts])

    for form in ("baseline", "pair_ungated"):
        out = asyncio.run(PairScorer(_model(form, 384)).score([("a", "b")] * 3, source))
        assert np.all(np.abs(out["score"]) <= 1.0) and np.all(np.abs(out["baseline"]) <= 1.0)


def _ingress_over(table: dict, scorer):
    """An Ingress whose encoder answers the vectors of `table` (text -> vector), scoring with `scorer`."""
    class Table:
        class embed:
            @staticmethod
            async def remote(texts):
                return np.stack([table[t] for t in texts])

    ingress = _ingress()
    ingress.encoder, ingress.scorer, ingress.manifest = Table(), scorer, {"max_seq_length": 256}
    return ingress


def test_cohere_return_documents_gives_each_document_as_the_request_did():
    """Objects with all their fields (Cohere: "all other fields will be preserved in the response"), strings as
    {"text": ...}; not the 'field: value' lines that rank_fields were scored as."""
    import json

    from serving.schemas import RerankRequest
    from serving.scorer import PairScorer

    docs = [{"title": "Guitars", "text": "A man plays.", "id": "7"}, {"title": "Markets", "text": "Stocks fell."}]
    joined = ["title: Guitars\ntext: A man plays.", "title: Markets\ntext: Stocks fell."]
    rng = np.random.default_rng(1)
    table = {t: rng.standard_normal(8).astype(np.float32) for t in ["q", *joined, "plain"]}
    ingress = _ingress_over(table, PairScorer(_model(), {"name": "m", "version": "1"}))
    body = RerankRequest(query="q", documents=docs, rank_fields=["title", "text"], return_documents=True)
    results = json.loads(asyncio.run(ingress._cohere_rerank(body, "1")).body)["results"]
    assert sorted(r["index"] for r in results) == [0, 1]
    assert all(r["document"] == docs[r["index"]] for r in results)
    body = RerankRequest(query="q", documents=["plain"], return_documents=True)
    assert json.loads(asyncio.run(ingress._cohere_rerank(body, "2")).body)["results"][0]["document"] == {
        "text": "plain"}


def test_rerank_orders_the_pairs_the_clip_ties_by_the_models_score():
    """Near-duplicates of the query that the model scores above 1 are all answered 1.0 (the clip to [-1, 1]), and
    ranked in the model's order, not the documents' (a query's exact copy was ranked behind a paraphrase); TEI's
    raw_scores answers the scores before the clip."""
    from embed_lib.training.export import ensemble_scores
    from serving.scorer import PairScorer, best_first

    assert best_first([1.0, 1.0, 0.5, 1.0], [1.02, 1.06, 0.5, 1.0]).tolist() == [1, 0, 3, 2]  # by hand
    assert best_first([0.3, 0.3], [0.3, 0.3]).tolist() == [0, 1]  # a true tie keeps the order given
    rng = np.random.default_rng(0)
    q = rng.standard_normal(8).astype(np.float32)
    table = {"q": q, **{f"d{i}": (q + 0.1 * rng.standard_normal(8)).astype(np.float32) for i in range(12)}}
    docs = [t for t in table if t != "q"]
    model = _model()
    expected = ensemble_scores(model, np.stack([q] * len(docs)), np.stack([table[d] for d in docs]))["score"]
    assert (expected > 1).sum() >= 2  # the case: several documents the clip ties at 1.0
    ingress = _ingress_over(table, PairScorer(model, {"name": "m"}))
    ranked, headers = asyncio.run(ingress._ranked("q", docs))
    assert headers == {}  # no rerank_budget: no cascade
    assert [r["index"] for r in ranked] == np.argsort(-expected, kind="stable").tolist()
    np.testing.assert_allclose([r["score"] for r in ranked], np.clip(np.sort(expected)[::-1], -1, 1), atol=1e-6)
    raw, _ = asyncio.run(ingress._ranked("q", docs, raw=True))  # TEI's raw_scores: the scores before the clip
    assert [r["index"] for r in raw] == [r["index"] for r in ranked]
    np.testing.assert_allclose([r["score"] for r in raw], np.sort(expected)[::-1], atol=1e-6)


def test_rerank_budget_routes_the_gates_hardest_documents_to_the_cross_encoder():
    """rerank_budget=0.25 of 12 documents: the 3 the gate rates hardest get the cross-encoder's scores (Cohere's and
    TEI's requests carry no budget: the app's), ranked by them (two it puts above 1: tied at 1.0 as served, in its
    order); the headers say what was routed; without a cross-encoder the option is refused, naming both."""
    import json

    from embed_lib.training.export import ensemble_scores
    from serving.args import AppArgs
    from serving.schemas import RerankRequest
    from serving.scorer import PairScorer

    rng = np.random.default_rng(0)
    q = rng.standard_normal(8).astype(np.float32)
    table = {"q": q, **{f"d{i}": rng.standard_normal(8).astype(np.float32) for i in range(12)}}
    docs = [t for t in table if t != "q"]
    model = _model()
    adapter = ensemble_scores(model, np.stack([q] * len(docs)), np.stack([table[d] for d in docs]))
    hardest = np.sort(np.argsort(-adapter["difficulty"])[:3])  # by hand: 0.25 x 12 = 3, the gate's hardest
    # the cross-encoder puts above 1 (both answered 1.0) first the one of the two that the adapter puts lower
    top, other = sorted(hardest[:2], key=lambda i: adapter["score"][i])
    ce = {top: 1.2, other: 1.05, hardest[2]: -0.4}
    sent = []

    async def cross_encoder(pairs):
        sent.append(list(pairs))
        return np.array([ce[i] for i in hardest])

    ingress = _ingress_over(table, PairScorer(model, {"name": "m", "version": "1"}))
    ingress.args = AppArgs(rerank_budget=0.25, cross_encoder="stub", cascade_familiarity_floor=0.0)
    ingress.ce_score, ingress._ce_info = cross_encoder, {"middle": 0.5}
    ranked, headers = asyncio.run(ingress._ranked("q", docs))
    assert sent == [[("q", docs[i]) for i in hardest]] and headers["x-cascade-routed"] == "3"
    served = np.clip(adapter["score"], -1, 1)
    served[hardest] = np.clip([ce[i] for i in hardest], -1, 1)
    assert [r["index"] for r in ranked[:2]] == [top, other]  # 1.2 before 1.05, both answered 1.0
    np.testing.assert_allclose([r["score"] for r in ranked], np.sort(served)[::-1], atol=1e-6)
    body = RerankRequest(query="q", documents=docs, top_n=2)
    response = asyncio.run(ingress._cohere_rerank(body, "2"))
    assert response.headers["x-cascade-routed"] == "3" and float(response.headers["x-cascade-familiarity"]) == 1.0
    assert [r["index"] for r in json.loads(response.body)["results"]] == [top, other]
    assert AppArgs(rerank_budget=0.1, cross_encoder="x").rerank_cascade("difficulty", [("a", "b")])[
        "familiarity_floor"] == AppArgs().cascade_familiarity_floor
    with pytest.raises(ValueError, match=r"rerank_budget=0.1 routes documents to a cross-encoder.*cross_encoder="):
        AppArgs.parse({"rerank_budget": 0.1})


@pytest.mark.parametrize("text,rule", [
    ("bad \ud800 surrogate", "unpaired UTF-16 surrogate (U+D800) at character 4"),
    ("\udfff", "unpaired UTF-16 surrogate (U+DFFF) at character 0"),
    ("nul\x00inside", "control character U+0000 at character 3"),
    ("bell\x07", "control character U+0007"),
    ("\u200b\u200b\ufeff", "no visible character"),
    ("\x00\x00", "control character U+0000"),
    ("   \t\n", "no visible character"),
    ("", "no visible character"),
    ("x" * 21, "has 21 characters; the limit is 20"),
])
def test_edge_checks_name_the_rule(text, rule):
    from serving.schemas import text_problem

    assert rule in text_problem(text, 20)


@pytest.mark.parametrize("text", ["plain", "tab\tand\nnewline", "café ☕", "日本語のテキスト", "emoji 👍🏽", "a\u200bb"])
def test_edge_checks_accept_ordinary_text(text):
    from serving.schemas import text_problem

    assert text_problem(text, 100) is None


def test_the_whole_request_check_agrees_with_the_text_by_text_rules():
    """check_texts decides a request of plain ASCII texts in one pass (_all_plain): it must never pass a list that
    text_problem would refuse, and it must take the common case (else the test of agreement proves nothing)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from serving.schemas import _all_plain, text_problem

    ascii_ish = st.text(st.sampled_from(["a", "Z", " ", "~", "\t", "\n", "\r", "\x0b", "\x0c", "\x00", "\x1f",
                                         "\x7f", "\x85", "\u200b", "\ud800", "é"]), max_size=12)

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.lists(ascii_ish, min_size=1, max_size=6), st.integers(1, 12))
    def agree(texts, max_chars):
        if _all_plain(texts, max_chars):
            assert all(text_problem(t, max_chars) is None for t in texts), texts

    agree()
    assert _all_plain(["A plain sentence.", "tab\tand\nnewline", "x" * 20], 20)
    for bad in (["fine", "   \t\n"], ["fine", "nul\x00"], ["fine", "x" * 21], ["fine", "\x7f"], ["fine", ""]):
        assert not _all_plain(bad, 20) and text_problem(bad[1], 20) is not None
    assert not _all_plain(["café"], 20) and text_problem("café", 20) is None  # not ASCII: checked text by text


def test_score_request_names_the_field_and_index():
    from serving.errors import ApiError
    from serving.schemas import ScoreRequest

    with pytest.raises(ApiError) as e:
        ScoreRequest(pairs=[["ok", "fine"], ["ok", "bad \ud800"]]).resolved_pairs(8, 100)
    assert e.value.status == 422 and e.value.field == "pairs[1][1]" and "surrogate" in e.value.message
    with pytest.raises(ApiError) as e:
        ScoreRequest(text_1=["a", "\u200b"], text_2=["b", "c"]).resolved_pairs(8, 100)
    assert e.value.field == "text_1[1]"


def test_vllm_text_1_text_2_forms_resolve_to_pairs():
    from serving.schemas import ScoreRequest

    assert ScoreRequest(text_1="q", text_2=["a", "b"]).resolved_pairs(8, 50) == [("q", "a"), ("q", "b")]
    assert ScoreRequest(text_1=["a", "b"], text_2="q").resolved_pairs(8, 50) == [("a", "q"), ("b", "q")]
    assert ScoreRequest(text_1="a", text_2="b").resolved_pairs(8, 50) == [("a", "b")]
    assert ScoreRequest(text_1=["a", "b"], text_2=["c", "d"]).resolved_pairs(8, 50) == [("a", "c"), ("b", "d")]


def test_cohere_documents_as_objects_and_rank_fields():
    from serving.schemas import RerankRequest

    docs = [{"text": "plain"}, {"text": "x", "title": "T"}]
    assert RerankRequest(query="q", documents=["s", docs[0]]).texts() == ["s", "plain"]
    assert RerankRequest(query="q", documents=docs[1:], rank_fields=["title", "text"]).texts() == ["title: T\ntext: x"]
    from serving.errors import ApiError

    with pytest.raises(ApiError, match="documents\\[0\\] has no field 'title'"):
        RerankRequest(query="q", documents=docs, rank_fields=["title", "text"]).texts()


def test_a_malformed_pair_or_union_value_is_named_in_json_terms():
    """Pydantic speaks of tuples ("Input should be a valid tuple", "Field required" at pairs[0][1]) and tags a
    union's members in the location (text_1.list[str][1]); a client sent JSON and reads what to send instead."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serving import errors
    from serving.schemas import RerankRequest, ScoreRequest

    app = FastAPI()
    errors.install(app)

    async def score(body):
        return {}

    async def rerank(body):
        return {}

    score.__annotations__, rerank.__annotations__ = {"body": ScoreRequest}, {"body": RerankRequest}
    app.post("/score")(score)
    app.post("/rerank")(rerank)
    client = TestClient(app, raise_server_exceptions=False)
    pair = 'each pair is a list of two texts, ["text a", "text b"]'
    cases = [
        ("/score", {"pairs": [["a", "b"], ["c"]]}, f"pairs[1]: {pair} (it has 1).", "pairs[1]"),
        ("/score", {"pairs": [[]]}, f"pairs[0]: {pair} (it has 0).", "pairs[0]"),  # said once, not per text
        ("/score", {"pairs": [["a", "b", "c"]]}, f"pairs[0]: {pair} (it has 3).", "pairs[0]"),
        ("/score", {"pairs": ["a b"]}, f"pairs[0]: {pair} (got one string).", "pairs[0]"),
        ("/score", {"pairs": [None]}, f"pairs[0]: {pair} (got null).", "pairs[0]"),
        ("/score", {"pairs": {"a": "b"}}, 'pairs: a list of pairs, [["text a", "text b"], ...] (got an object).',
         "pairs"),
        ("/score", {"pairs": [["a", 3]]}, "pairs[0][1]: Input should be a valid string", "pairs[0][1]"),
        ("/score", {"text_1": 3, "text_2": "b"}, "text_1: should be a string or a list of strings (got a number)",
         "text_1"),
        ("/score", {"text_1": ["a", 3], "text_2": "b"}, "text_1[1]: Input should be a valid string", "text_1[1]"),
        ("/rerank", {"query": "q", "documents": ["d", True]},
         "documents[1]: should be a string or an object of strings (got true or false)", "documents[1]"),
        ("/rerank", {"query": "q", "documents": [{"text": 3}]}, "documents[0].text: Input should be a valid string",
         "documents[0].text"),
    ]
    for path, body, message, field in cases:
        r = client.post(path, json=body)
        assert r.status_code == 422 and r.json()["error"] == {"type": "invalid_request", "message": message,
                                                              "field": field}, (body, r.json())


def test_one_error_shape_for_every_failure():
    """Through the FastAPI app (no Serve): validation, parse failures, unknown routes and methods, and an
    unexpected exception all answer {"error": {"type", "message", "field"?}}."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serving import errors
    from serving.schemas import ScoreRequest

    app = FastAPI()
    errors.install(app)

    async def score(body):
        return {"pairs": body.resolved_pairs(4, 50)}

    score.__annotations__ = {"body": ScoreRequest}  # a real class: this module's annotations are strings
    app.post("/score")(score)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret detail")

    client = TestClient(app, raise_server_exceptions=False)
    cases = [
        (client.post("/score", json={"pairs": [["a", "\x00"]]}), 422, "pairs[0][1]"),
        (client.post("/score", json={"pairs": [["a", 3]]}), 422, "pairs[0][1]"),
        (client.post("/score", json={"pairs": [["a", "b"]], "cascade": "yes"}), 422, "cascade"),
        (client.post("/score", content=b"{not json", headers={"content-type": "application/json"}), 400, "body"),
        (client.post("/score", content="{\"pairs\": [[\"\xe9\", \"b\"]]}".encode("latin-1"),
                     headers={"content-type": "application/json"}), 400, None),
        (client.post("/score", content=b"[" * 100_000 + b"]" * 100_000,
                     headers={"content-type": "application/json"}), 400, None),
        (client.get("/nowhere"), 404, None),
        (client.get("/score"), 405, None),
        (client.get("/boom"), 500, None),
    ]
    for r, status, field in cases:
        assert r.status_code == status, (r.status_code, r.text)
        body = r.json()
        assert set(body) == {"error"} and {"type", "message"} <= set(body["error"]), body
        assert body["error"].get("field") == field, body
    assert "secret detail" not in cases[-1][0].text
    # a JSON body sent as a form (`curl -d` without -H), as text or with no Content-Type (which FastAPI does not read
    # as JSON): 415 naming the header to send (it was a 422 "body: Input should be a valid dictionary")
    for media, sent in (("application/x-www-form-urlencoded", "as 'application/x-www-form-urlencoded'"),
                        ("text/plain; charset=utf-8", "as 'text/plain'"), (None, "without a Content-Type")):
        r = client.post("/score", content=b'{"pairs": [["a", "b"]]}', headers={"content-type": media} if media else {})
        assert r.status_code == 415 and r.json()["error"] == {
            "type": "unsupported_media_type", "field": "body",
            "message": f"The request body was sent {sent}; send it as JSON with Content-Type: application/json "
                       "(curl: -H 'content-type: application/json')."}
    for media in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = client.post("/score", content=b'{"pairs": [["a", "b"]]}', headers={"content-type": media})
        assert r.status_code == 200, (media, r.text)
    r = client.post("/score", content=b'[1]', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("body: Input should be a valid dict")
    assert 415 in errors.error_responses(400, 422) and 415 not in errors.error_responses(404)


def test_a_body_meant_for_another_endpoint_names_that_endpoint():
    """A rerank body posted to the score route (and the reverse, and TEI's shape to Cohere's route) is told where
    it belongs; an unknown field that no route takes gets no such hint."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serving import errors
    from serving.schemas import RerankRequest, ScoreRequest, TeiRerankRequest

    app = FastAPI()
    errors.install(app)
    for path, model in (("/v1/score", ScoreRequest), ("/v1/rerank", RerankRequest), ("/rerank", TeiRerankRequest)):
        async def route(body):
            return {}

        route.__annotations__ = {"body": model}
        app.post(path)(route)
    client = TestClient(app, raise_server_exceptions=False)

    def message(path, body):
        r = client.post(path, json=body)
        assert r.status_code == 422, r.text
        return r.json()["error"]["message"]

    assert message("/v1/score", {"query": "q", "documents": ["a"]}).endswith(
        "(documents, query: fields of POST /v1/rerank; send this body there, see /docs)")
    assert message("/v1/rerank", {"pairs": [["a", "b"]]}).endswith(
        "(pairs: fields of POST /v1/score; send this body there, see /docs)")
    assert "fields of POST /rerank;" in message("/v1/rerank", {"query": "q", "texts": ["a"]})
    assert "fields of POST" not in message("/v1/score", {"pairs": [["a", "b"]], "colour": "red"})
    assert "fields of POST" not in message("/v1/rerank", {"query": 3, "documents": ["a"], "pairs": [["a", "b"]]})


def test_encode_failures_stay_with_the_text_that_caused_them():
    from serving.deployments import run_isolated

    def encode(texts):
        if any("poison" in t for t in texts):
            raise TypeError("tokenizer cannot take this")
        return np.stack([np.full(2, len(t), np.float32) for t in texts])

    out = run_isolated(encode, ["good one", "poison", "good two"])
    assert out[0][0] == 8 and out[2][0] == 8 and isinstance(out[1], TypeError)
    assert all(isinstance(v, np.ndarray) for v in run_isolated(encode, ["fine", "also fine"]))


def test_a_joint_cross_encoder_pass_gives_each_request_its_scores_and_failures_stay_with_their_request():
    """What the cross-encoder deployment's batch does with the requests Serve batched (the batching itself runs
    only inside a replica; test_serving.py drives it there): one pass over all their pairs, split back per
    request; pairs the model cannot take fail only the request that sent them."""
    from serving.deployments import CrossEncoderScorer

    class FakeCE:
        def __init__(self):
            self.calls = []

        def score(self, pairs):
            self.calls.append(list(pairs))
            if any("poison" in a for a, _ in pairs):
                raise TypeError("cannot take this pair")
            return np.array([len(a) + len(b) / 100 for a, b in pairs], np.float32)

    scorer = CrossEncoderScorer.func_or_class.__new__(CrossEncoderScorer.func_or_class)
    scorer.ce = FakeCE()
    requests = [[("a", "bb")], [("ccc", "d"), ("ee", "ffff")], [("g", "hhhhh")]]
    out = scorer._score_isolated(requests)
    assert scorer.ce.calls == [[p for r in requests for p in r]]  # one pass over every request's pairs
    for r, scores in zip(requests, out):
        np.testing.assert_allclose(scores, [len(a) + len(b) / 100 for a, b in r], rtol=1e-6)
    scorer.ce.calls.clear()
    out = scorer._score_isolated([requests[0], [("poison", "x")], requests[2]])
    assert isinstance(out[1], TypeError) and out[0][0] == pytest.approx(1.02) and out[2][0] == pytest.approx(1.05)
    assert len(scorer.ce.calls) == 4  # the joint pass, then request by request


def test_admission_control_rejects_beyond_max_inflight_and_recovers():
    """Deterministic: with max_inflight requests held open, the next is a 503 with Retry-After; once they
    finish, requests are admitted again."""
    from serving.errors import ApiError

    ingress = _ingress(max_inflight=2)

    async def scenario():
        gate = asyncio.Event()

        async def held():
            await gate.wait()
            return "done"

        running = [asyncio.create_task(ingress._guarded(held())) for _ in range(2)]
        await asyncio.sleep(0)
        assert ingress.inflight == 2
        with pytest.raises(ApiError) as e:
            await ingress._guarded(held())
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        gate.set()
        assert await asyncio.gather(*running) == ["done", "done"]
        assert ingress.inflight == 0 and await ingress._guarded(held()) == "done"

    asyncio.run(scenario())


def test_the_request_timeout_is_a_504():
    from serving.errors import ApiError

    ingress = _ingress(request_timeout_s=0.05)
    with pytest.raises(ApiError) as e:
        asyncio.run(ingress._guarded(asyncio.sleep(5)))
    assert e.value.status == 504 and ingress.inflight == 0


def test_warm_jobs_report_progress_finish_and_cancel():
    from serving.deployments import WarmJobs

    jobs = WarmJobs.func_or_class.__new__(WarmJobs.func_or_class)
    release = asyncio.Event()

    class _Warm:
        def __init__(self):
            self.seen = []

        def remote(self, texts):
            self.seen.append(list(texts))

            async def result():
                if len(self.seen) > 1:
                    await release.wait()
                return len(texts)
            return result()

    class _Encoder:
        warm = _Warm()

    async def scenario():
        WarmJobs.func_or_class.__init__(jobs, _Encoder(), max_running=1, chunk=2)
        job = await jobs.submit(["a", "b", "c", "d", "a"])
        assert job["state"] == "running" and job["total"] == 4
        assert await jobs.submit(["x"]) is None  # one running job at a time
        await asyncio.sleep(0.01)
        mid = jobs.status(job["id"])
        assert mid["done"] == 2 and mid["state"] == "running"
        cancelled = await jobs.cancel(job["id"])
        assert cancelled["state"] == "cancelled" and cancelled["done"] == 2
        release.set()
        second = await jobs.submit(["e", "f"])
        await asyncio.sleep(0.01)
        assert jobs.status(second["id"]) == {**second, "state": "succeeded", "done": 2, "added": 2}
        assert jobs.status("nope") is None and await jobs.cancel("nope") is None

    asyncio.run(scenario())


def test_a_cold_start_warms_the_near_cache_from_the_encoder(tmp_path, encoder):
    corpus = tmp_path / "corpus.txt"
    texts = [f"never embedded before, sentence {i} of the cold corpus" for i in range(5)]
    corpus.write_text("\n".join(texts) + "\n")
    ingress = _ingress(warm_corpus=str(corpus))
    ingress.manifest = encoder.manifest()
    ingress._warm_near(str(corpus))  # not in the embedding cache: nothing read, the corpus kept for later
    assert ingress.scorer.near.stats()["size"] == 0 and ingress._pending_warm == texts

    async def health_check_then_wait():
        await ingress.check_health()
        await ingress._warm_task
        await ingress.check_health()  # nothing pending any more: no second fetch

    asyncio.run(health_check_then_wait())
    assert ingress.encoder.calls == [texts]
    found, missing = ingress.scorer.near.get_many(texts)
    assert not missing and found[texts[0]][0] == len(texts[0])


def test_a_model_load_is_not_counted_as_load_by_the_autoscaler(monkeypatch):
    """The ingress's CPU share (what its autoscaling policy reads) starts after the model loads: a start or a swap
    in place costs CPU that more replicas would not absorb (with a low ingress_target_cpu it would scale out idle)."""
    from serving.autoscale import BUSY, CpuShare

    ingress = _ingress()
    clock = {"wall": 0.0, "cpu": 0.0}
    ingress._cpu = CpuShare(wall=lambda: clock["wall"], cpu=lambda: clock["cpu"])

    def load(user_config, tracking_uri, previous):
        clock.update(wall=clock["wall"] + 5, cpu=clock["cpu"] + 5)  # the load: a whole core for 5 s
        return _model(), {"name": "m"}

    # the class Serve's decorator holds runs in a copy of serving.app's globals: patch the ones it reads
    monkeypatch.setitem(type(ingress).reconfigure.__globals__, "load_served", load)
    ingress.reconfigure({"model_uri": "models:/m/1"})
    clock.update(wall=clock["wall"] + 10, cpu=clock["cpu"] + 1)  # then 10 s of light requests
    assert ingress.record_autoscaling_stats() == {BUSY: pytest.approx(0.1)}  # 0.4 had the load been counted
    ingress.reconfigure({"model_uri": "models:/m/2"})  # a swap in place: the same
    clock.update(wall=clock["wall"] + 4, cpu=clock["cpu"] + 2)
    assert ingress.record_autoscaling_stats() == {BUSY: pytest.approx(0.5)}


@pytest.mark.parametrize("bad", [{"projection_cache_size": -1}, {"cache_size": "many"},
                                 {"cross_encoder_placement": "gpu"}, {"cross_encoder_placment": "ingress"},
                                 {"ingress": {"max": 2, "num_cpu": 1}}, {"ingress_target_cpu": 0},
                                 {"ingress_target_cpu": "half"}, {"encoder": {"min": 3, "max": 2}}])
def test_app_args_reject_bad_cache_sizes(bad):
    from pydantic import ValidationError

    from serving.args import AppArgs

    with pytest.raises(ValidationError, match=next(iter(bad))):
        AppArgs.model_validate(bad)
    with pytest.raises(ValueError, match=f"(?s){next(iter(bad))}.*Valid arguments: .*'cross_encoder_placement'"):
        AppArgs.parse(bad)  # what the builder raises: the same, with the arguments there are


@pytest.mark.parametrize("name", ["config.yaml", "config_cascade.yaml"])
def test_the_shipped_serve_configs_hold_only_valid_app_args(name):
    """Both configs `make serve` / `make serve-cascade` deploy validate as AppArgs (unknown keys are refused)."""
    from pathlib import Path

    import yaml

    from serving.args import AppArgs

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "serving" / name).read_text())
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert (args.cross_encoder is not None) == (name == "config_cascade.yaml")
    assert args.cross_encoder_placement == "ingress"


def test_the_cross_encoder_is_called_through_its_handle_or_not_at_all():
    """With a deployment's handle the ingress calls it; without one (no cross-encoder, or placement='deployment'
    and no handle bound) there is nothing to call."""
    from serving.args import AppArgs
    from serving.deployments import cross_encoder_calls
    from tests.test_cascade import _FakeCrossEncoder

    handle = _FakeCrossEncoder()
    score, info = cross_encoder_calls(handle, AppArgs(cross_encoder="some/ce"), None)
    assert asyncio.run(score([("ab", "c")])).tolist() == pytest.approx([0.97]) and handle.calls == [[("ab", "c")]]
    assert asyncio.run(info())["name"] == "fake"
    assert cross_encoder_calls(None, AppArgs(), None) == (None, None)
    assert cross_encoder_calls(None, AppArgs(cross_encoder="some/ce", cross_encoder_placement="deployment"),
                               None) == (None, None)


def test_a_pair_file_is_a_warm_corpus(tmp_path):
    """Your own pairs as the warm corpus: the distinct texts of its text columns (a CSV's numeric label
    column left out), or of the columns named."""
    from serving.deployments import corpus_texts

    f = tmp_path / "pairs.csv"
    f.write_text("a,b,score\nA cat sleeps.,A dog runs.,3.5\nA dog runs.,Stocks fell.,0\n")
    assert corpus_texts(str(f)) == ["A cat sleeps.", "A dog runs.", "Stocks fell."]
    assert corpus_texts(str(f), ["b"]) == ["A dog runs.", "Stocks fell."]
    with pytest.raises(ValueError, match="no column 'c'"):
        corpus_texts(str(f), ["c"])
    j = tmp_path / "pairs.jsonl"
    j.write_text('{"q1": "How?", "q2": "Why?", "dup": 1}\n')
    assert corpus_texts(str(j)) == ["How?", "Why?"]


def test_the_default_config_at_its_most_replicas_fits_a_two_cpu_node():
    """serving/config.yaml lets the encoder and the ingress scale out; at their max they and WarmJobs must fit the
    2-CPU node the project is sized for, or Serve leaves a replica pending for ever (measured: with WarmJobs at
    0.05 CPU the config with both at 2 replicas never became RUNNING on the local cluster)."""
    from pathlib import Path

    import yaml

    from serving.args import AppArgs
    from serving.deployments import WarmJobs

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "serving" / "config.yaml").read_text())
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert args.cross_encoder is None  # the cascade's own config adds the cross-encoder's share
    need = args.encoder.max * args.encoder.num_cpus + args.ingress.max * args.ingress.num_cpus
    need += WarmJobs.ray_actor_options["num_cpus"]
    assert args.encoder.max >= 2 and args.ingress.max >= 2 and need <= 2.0, need


def test_replicas_spread_over_nodes_and_give_idle_ones_back_when_asked():
    from serving.args import Replicas, deployment_options

    plain = deployment_options(Replicas())
    assert "max_replicas_per_node" not in plain and plain["autoscaling_config"]["downscale_delay_s"] == 600.0
    spread = deployment_options(Replicas(min=1, max=4, max_per_node=1, downscale_delay_s=10, upscale_delay_s=5))
    assert spread["max_replicas_per_node"] == 1
    assert spread["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                            "target_ongoing_requests": 4, "downscale_delay_s": 10,
                                            "upscale_delay_s": 5}
    policy = {"policy_function": "m:C", "policy_kwargs": {"k": 1}}
    assert deployment_options(Replicas(), policy=policy)["autoscaling_config"]["policy"] == policy
    with pytest.raises(ValueError, match="max_per_node"):
        Replicas(max_per_node=0)


def test_requests_arriving_together_fill_both_cross_encoder_batch_threads(monkeypatch):
    """Eight requests that arrive at once (a closed loop of 8 clients whose previous requests one batch answered)
    are computed as two batches at the same time, each on its own thread, never as one batch of 8 on one thread
    while the other idles; each request still gets its own pairs' scores."""
    import threading
    import time
    from types import SimpleNamespace

    from ray import serve

    from serving.deployments import BATCHES_IN_FLIGHT, CROSS_ENCODER_MAX_BATCH, CrossEncoderBatches

    lock, running, peak, batches = threading.Lock(), [0], [0], []

    class SlowCrossEncoder:  # one pair per request; a pair's score is its number
        def score(self, pairs):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
                batches.append(len(pairs))
            time.sleep(0.3)
            with lock:
                running[0] -= 1
            return np.array([float(a) for a, _ in pairs], np.float32)

    # outside a replica: @serve.batch reads the replica's max_ongoing_requests when its queue starts
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=64)))
    batcher = CrossEncoderBatches.__new__(CrossEncoderBatches)
    batcher.ce = SlowCrossEncoder()

    async def together():
        return await asyncio.gather(*[batcher.score([(str(i), "x")]) for i in range(8)])

    scores = asyncio.run(together())
    assert [s.tolist() for s in scores] == [[float(i)] for i in range(8)]
    assert max(batches) <= CROSS_ENCODER_MAX_BATCH < 8 and sum(batches) == 8, batches
    assert peak[0] == BATCHES_IN_FLIGHT == 2, (peak, batches)
