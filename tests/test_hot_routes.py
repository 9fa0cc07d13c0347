"""serving/hot.py: a hot route answers every body exactly as its FastAPI route does, and passes FastAPI by only
for the bodies its request model accepts. No Serve here: tests/test_serving.py serves the app and checks the
served routes' counts in /v1/models."""
from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from serving import errors, hot
from serving.api import json_response
from serving.errors import ApiError
from serving.schemas import ScoreRequest


def _client(with_hot: bool, max_body: int | None = None):
    """An app with POST /v1/score (ScoreRequest) and, with_hot, the same handler as a hot route. The handler
    records which path called it."""
    taken: list[str] = []
    app = FastAPI()
    errors.install(app)

    async def handle(body, via):
        taken.append(via)
        if body.model == "busy":
            raise ApiError(503, "Overloaded; retry later.", headers={"Retry-After": "1"})
        if body.model == "boom":
            raise RuntimeError("secret detail")
        return json_response({"pairs": body.resolved_pairs(4, 50), "budget": body.budget})

    async def route(body):
        return await handle(body, "fastapi")

    async def fast(body):
        return await handle(body, "hot")

    route.__annotations__ = fast.__annotations__ = {"body": ScoreRequest}  # real classes (this module's are strings)
    app.post("/v1/score")(route)
    table = hot.HotRouteTable({"/v1/score": fast}, max_body=max_body)
    if with_hot:
        app.add_middleware(hot.HotRoutes, find=lambda: table)
    return TestClient(app, raise_server_exceptions=False), taken, table


JSON = {"content-type": "application/json"}
CASES = [  # (body bytes, headers, the path the hot app must take)
    (b'{"pairs": [["a", "b"], ["c", "d"]]}', JSON, "hot"),
    (b'{"text_1": "q", "text_2": ["x", "y"], "budget": 1}', {"content-type": "application/json; charset=utf-8"}, "hot"),
    (b'{"pairs": [["a", "b"]], "model": "busy"}', JSON, "hot"),  # the handler's ApiError: 503 + Retry-After
    (b'{"pairs": [["a", "b"]], "model": "boom"}', JSON, "hot"),  # an unexpected error: 500, no detail
    (json.dumps({"pairs": [["a", "b"]] * 5}).encode(), JSON, "hot"),  # over max_pairs: the handler's 422
    (b'{"pairs": [["a", "\\u0000"]]}', JSON, "hot"),  # a control character: check_texts' 422
    (b'{"pairs": [["a", "b"]], "model": "m", "model": "n"}', JSON, "hot"),  # duplicate keys: the last wins
    (b'{"pairs": [["a", "b"]], "extra": 1}', JSON, "fastapi"),
    (b'{"pairs": [["a", 3]]}', JSON, "fastapi"),
    (b'{"pairs": [["a", "b"]], "budget": NaN}', JSON, "fastapi"),
    (b'{"pairs": [["a", "\\ud800"]]}', JSON, "fastapi"),  # a lone surrogate: the stdlib parses it, pydantic not
    (b'{not json', JSON, "fastapi"),
    ('{"pairs": [["\xe9", "b"]]}'.encode("latin-1"), JSON, "fastapi"),
    ('{"pairs": [["a", "b"]]}'.encode("utf-16"), JSON, "fastapi"),  # the stdlib reads UTF-16 JSON
    (b"[" * 10_000 + b"]" * 10_000, JSON, "fastapi"),
    (b"", JSON, "fastapi"),
    (b'{"pairs": [["a", "b"]]}', {"content-type": "text/plain"}, "fastapi"),
    (b'{"pairs": [["a", "b"]]}', {}, "fastapi"),
]


def _answer(client, body, headers, path="/v1/score", method="POST"):
    r = client.request(method, path, content=body, headers=headers, follow_redirects=False)
    return r.status_code, r.headers.get("content-type"), r.headers.get("retry-after"), r.content


@pytest.mark.parametrize("body,headers,via", CASES)
def test_a_hot_route_answers_as_its_fastapi_route(body, headers, via):
    hot_client, taken, table = _client(True)
    plain_client, plain_taken, _ = _client(False)
    got, want = _answer(hot_client, body, headers), _answer(plain_client, body, headers)
    assert got == want
    if via == "hot":
        assert taken == ["hot"] and plain_taken == ["fastapi"]
    else:  # FastAPI's route, or nothing where FastAPI refused the body
        assert taken == plain_taken and "hot" not in taken
    assert table.served["/v1/score"] == (via == "hot")


def test_other_methods_paths_and_a_missing_table_go_to_fastapi():
    client, taken, table = _client(True)
    for method, path in [("GET", "/v1/score"), ("PUT", "/v1/score"), ("POST", "/v1/score/"), ("POST", "/v1/scores")]:
        status = _answer(client, b'{"pairs": [["a", "b"]]}', JSON, path, method)[0]
        assert status in (404, 405, 307) and not taken, (method, path, status)
    app = FastAPI()
    errors.install(app)
    app.add_middleware(hot.HotRoutes, find=lambda: None)  # outside a replica the default finds no table
    assert TestClient(app).post("/v1/score", json={"pairs": [["a", "b"]]}).status_code == 404
    assert hot.replica_table() is None


def test_the_served_routes_take_their_request_models_from_the_handlers():
    from serving.app import Ingress
    from serving.schemas import RerankRequest, TeiRerankRequest

    cls = Ingress.func_or_class
    table = hot.HotRouteTable({"/v1/score": cls.score, "/v1/rerank": cls.rerank, "/rerank": cls.rerank_tei})
    assert {p: m for p, (m, _) in table.routes.items()} == {
        "/v1/score": ScoreRequest, "/v1/rerank": RerankRequest, "/rerank": TeiRerankRequest}
    assert table.served == {"/v1/score": 0, "/v1/rerank": 0, "/rerank": 0}


_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                    max_size=3), max_leaves=12)
_fields = st.sampled_from(["pairs", "text_1", "text_2", "model", "budget", "cascade", "routing", "routing_seed",
                           "combine", "scorer", "encoding_format", "truncate_prompt_tokens", "other"])
_pairs = st.lists(st.lists(st.text(max_size=6), min_size=0, max_size=3), max_size=5)


@settings(max_examples=150, deadline=None)
@given(body=st.dictionaries(_fields, _values | _pairs, max_size=4), ascii=st.booleans())
def test_any_body_answers_the_same_through_both_paths(body, ascii):
    """Random bodies over the request's own fields (most of them invalid): the same status, headers and bytes."""
    raw = json.dumps(body, ensure_ascii=ascii).encode()
    hot_client, _, _ = _client(True)
    plain_client, _, _ = _client(False)
    assert _answer(hot_client, raw, JSON) == _answer(plain_client, raw, JSON)


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    """413 with the app's error body: declared too large (Content-Length; any content type), or a chunked body
    (no Content-Length) once what has arrived passes the limit. Within the limit nothing changes."""
    client, taken, table = _client(True, max_body=64)
    small = b'{"pairs": [["a", "b"]]}'
    assert _answer(client, small, JSON)[0] == 200 and taken == ["hot"]
    big = json.dumps({"pairs": [["a" * 40, "b" * 40]]}).encode()
    for headers in (JSON, {"content-type": "text/plain"}):
        r = client.post("/v1/score", content=big, headers=headers)
        assert r.status_code == 413, r.text
        assert r.json()["error"] == {
            "type": "payload_too_large", "field": "body",
            "message": f"The request body has {len(big)} bytes; the limit is 64 (max_body_bytes). Send fewer or "
                       "shorter texts per request."}
    r = client.post("/v1/score", content=iter([big[:50], big[50:]]), headers=JSON)  # chunked: no Content-Length
    assert r.status_code == 413 and f"has {len(big)} bytes or more; the limit is 64" in r.json()["error"]["message"]
    assert taken == ["hot"] and table.served["/v1/score"] == 1  # the refused bodies reached no handler
    assert _answer(_client(True)[0], big, JSON)[0] == 200  # no limit: as before


def test_a_route_fastapi_answers_is_held_to_its_own_limit():
    """A limited path that is no hot route (the warm routes): 413 naming its option from a Content-Length past the
    limit, or once a chunked body passes it, and FastAPI never sees the body; within the limit FastAPI answers as
    before, a chunked body replayed whole. A hot route's non-JSON chunked body is held to max_body_bytes too."""
    from serving.schemas import WarmRequest

    seen: list[int] = []
    app = FastAPI()
    errors.install(app)

    async def warm(body: WarmRequest):
        seen.append(len(body.texts))
        return {"added": len(body.texts)}

    warm.__annotations__ = {"body": WarmRequest}  # the real class (this module's annotations are strings)
    app.post("/v1/warm")(warm)
    table = hot.HotRouteTable({}, limits={"/v1/warm": (64, "max_warm_body_bytes")})
    app.add_middleware(hot.HotRoutes, find=lambda: table)
    client = TestClient(app, raise_server_exceptions=False)
    small, big = b'{"texts": ["a", "b"]}', json.dumps({"texts": ["a" * 80]}).encode()
    assert client.post("/v1/warm", content=small, headers=JSON).json() == {"added": 2}
    assert client.post("/v1/warm", content=iter([small[:9], small[9:]]), headers=JSON).json() == {"added": 2}
    for content in (big, iter([big[:40], big[40:]])):
        r = client.post("/v1/warm", content=content, headers=JSON)
        assert r.status_code == 413 and r.json()["error"]["field"] == "body", r.text
        assert "the limit is 64 (max_warm_body_bytes). Send the texts in several smaller requests" in r.json()["error"][
            "message"]
    assert seen == [2, 2]  # the refused bodies reached no route
    assert client.post("/v1/other", content=big, headers=JSON).status_code == 404  # no limit there: as before

    client, taken, _ = _client(True, max_body=64)
    r = client.post("/v1/score", content=iter([big[:40], big[40:]]), headers={"content-type": "text/plain"})
    assert r.status_code == 413 and "or more; the limit is 64 (max_body_bytes)" in r.json()["error"]["message"]
    assert _answer(client, small, {"content-type": "text/plain"}) == _answer(_client(False)[0], small,
                                                                           {"content-type": "text/plain"})
    assert not taken


def test_the_warm_body_limits_admit_the_largest_valid_warm():
    """warm_body_limits(): max_warm_sync / max_warm_job texts of max_text_chars characters at their longest
    escape fit, and the default stops at WARM_BODY_CAP; max_warm_body_bytes sets both."""
    from serving.args import WARM_BODY_CAP, AppArgs

    args = AppArgs.parse({"max_warm_sync": 5, "max_warm_job": 20, "max_text_chars": 30})
    limits = args.warm_body_limits()
    for path, n in (("/v1/warm", 5), ("/v1/warm/jobs", 20)):
        widest = json.dumps({"texts": ["\U0001F600" * 30] * n}).encode()
        assert len(widest) <= limits[path][0] < len(widest) + 64 * 1024 + 1 and limits[path][1] == "max_warm_body_bytes"
    assert AppArgs.parse({}).warm_body_limits()["/v1/warm/jobs"][0] == WARM_BODY_CAP  # 100,000 x 2,000: 2.4 GB
    assert AppArgs.parse({}).warm_body_limits()["/v1/warm"][0] == 12 * 2000 * 1000 + 64 * 1024
    fixed = AppArgs.parse({"max_warm_body_bytes": 4096})
    assert {p: b for p, (b, _) in fixed.warm_body_limits().items()} == {"/v1/warm": 4096, "/v1/warm/jobs": 4096}
    assert fixed.limits()["max_warm_job_body_bytes"] == 4096 and fixed.limits()["max_body_bytes"] == fixed.body_limit()


def test_the_default_body_limit_admits_the_largest_valid_request():
    """body_limit(): max_pairs pairs of max_text_chars characters that JSON escapes at their longest (astral
    characters as two \\uXXXX) fit; one pair more does not (the handler's own 422 would name it)."""
    from serving.args import AppArgs

    args = AppArgs.parse({"max_pairs": 4, "max_text_chars": 50, "max_documents": 3})
    text = "\U0001F600" * 50
    widest = json.dumps({"pairs": [[text, text]] * 4}).encode()  # ensure_ascii: 12 bytes per character
    assert len(widest) <= args.body_limit() < len(widest) + 64 * 1024 + 1
    assert AppArgs.parse({"max_body_bytes": 2048}).body_limit() == 2048
