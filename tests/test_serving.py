"""Ray Serve end to end on loopback: a tiny registered model, real Ray, real MLflow, real HTTP."""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time

import numpy as np
import pytest
import requests

from tests.conftest import free_ports

pytestmark = pytest.mark.integration
CORPUS = ["A corpus sentence about warm caches.", "Another corpus sentence, warmed at start.",
          "A third sentence of the warm corpus."]
PAIRS = [["A man is playing a guitar.", "A man plays the guitar."],
         ["A woman is slicing an onion.", "The stock market fell sharply."],
         ["Two dogs run through the snow.", "Two dogs are running in snow."]]


def _register(tracking_uri, data, seed0=0, manifest_override=None):
    import mlflow

    from embed_lib.config import AdapterConfig
    from embed_lib.registry import log_adapter_model, model_name, promote
    from embed_lib.train import train_seed_group

    from embed_lib.tracking import set_experiment

    set_experiment("serving-tests", tracking_uri)  # explicit: other tests leave MLflow's fluent state behind
    cfg = AdapterConfig(adapter="pair_gated", target="lexical", n_seeds=2, epochs=2, seed0=seed0, width=32, hidden=32)
    result = train_seed_group(cfg, data)
    if manifest_override:
        data = type(data)(**{**data.__dict__, "manifest": {**data.manifest, **manifest_override}})
    name = model_name("stsb") if not manifest_override else "pair-residual-broken"
    with mlflow.start_run():
        info = log_adapter_model(result, data, registered_name=name)
    promote(name, info.registered_model_version, result.summary["ensemble/val/spearman"] + seed0)  # later = better
    return info.registered_model_version


@pytest.fixture(scope="module")
def served(ray_cluster, stsb_embedded, tmp_path_factory):
    import ray
    from ray import serve

    from embed_lib.cache import EmbeddedSplit, EmbeddedTask
    from embed_lib.study_data import prepare_study
    from serving.app import build_app

    keep = {"train": 300, "validation": 150, "test": 150}
    splits = {k: EmbeddedSplit(s.data.subset(keep[k]), s.ia[: keep[k]], s.ib[: keep[k]])
              for k, s in stsb_embedded.splits.items()}
    data = prepare_study(EmbeddedTask("stsb", stsb_embedded.vectors, stsb_embedded.texts, splits, stsb_embedded.manifest))
    tracking_uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    _register(tracking_uri, data)
    ray.init(address=ray_cluster["RAY_ADDRESS"], ignore_reinit_error=True, log_to_driver=False)
    (port,) = free_ports(1)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text("\n".join(CORPUS) + "\n")
    args = {"model_uri": "models:/pair-residual-stsb@champion", "tracking_uri": tracking_uri, "max_pairs": 8,
            "max_text_chars": 200, "max_inflight": 2, "warm_corpus": str(corpus)}
    serve.run(build_app(args), name="scorer", route_prefix="/")
    yield {"url": f"http://127.0.0.1:{port}", "tracking_uri": tracking_uri, "data": data, "args": args}
    serve.shutdown()
    ray.shutdown()


def _offline(served, encoder, pairs, uri="models:/pair-residual-stsb@champion"):
    from embed_lib.export import ensemble_scores
    from embed_lib.registry import load_registered

    model, _, _ = load_registered(uri, served["tracking_uri"])
    xa = encoder.encode([a for a, _ in pairs])
    xb = encoder.encode([b for _, b in pairs])
    return ensemble_scores(model, xa, xb)


def _champion(served) -> str:
    """The registered version the champion alias points at now (tests may move it)."""
    from serving.model import registry_info

    return registry_info("models:/pair-residual-stsb@champion", served["tracking_uri"])["version"]


def test_the_warm_corpus_reaches_the_ingress_near_cache(served):
    """The near cache warms from the embedding cache at start or, where the encoder replica had not finished
    writing it, from the encoder at a health check; then the corpus is scored without a miss."""
    deadline = time.time() + 60
    while True:
        (info,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
        if not info["near_cache"]["warming"] or time.time() > deadline:
            break
        time.sleep(1)
    assert not info["near_cache"]["warming"] and info["near_cache"]["size"] >= len(CORPUS), info["near_cache"]
    assert requests.post(served["url"] + "/v1/score", json={"pairs": [CORPUS[:2]]}, timeout=60).status_code == 200
    (after,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
    assert after["near_cache"]["hits"] == info["near_cache"]["hits"] + 2
    assert after["near_cache"]["misses"] == info["near_cache"]["misses"]


def test_scores_equal_the_offline_library(served, encoder):
    r = requests.post(served["url"] + "/v1/score", json={"pairs": PAIRS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    got = np.array([d["score"] for d in body["data"]])
    offline = _offline(served, encoder, PAIRS)
    np.testing.assert_allclose(got, offline["score"], atol=1e-5)
    np.testing.assert_allclose([d["baseline"] for d in body["data"]], offline["baseline"], atol=1e-5)
    assert all(0 < d["difficulty"] < 1 for d in body["data"]) and body["model"] == f"pair-residual-stsb/{_champion(served)}"
    assert all(-1 <= d["score"] <= 1 and -1 <= d["baseline"] <= 1 for d in body["data"])
    same = requests.post(served["url"] + "/v1/score", json={"text_1": [p[0] for p in PAIRS],
                                                           "text_2": [p[1] for p in PAIRS]}, timeout=60).json()
    assert [d["score"] for d in same["data"]] == [d["score"] for d in body["data"]]


def test_rerank_orders_by_score(served, encoder):
    docs = ["A man plays the guitar.", "The stock market fell sharply.", "Someone is playing an instrument."]
    r = requests.post(served["url"] + "/v1/rerank", json={"query": "A man is playing a guitar.", "documents": docs,
                                                          "top_n": 2, "return_documents": True}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
    offline = _offline(served, encoder, [("A man is playing a guitar.", d) for d in docs])["score"]
    assert [x["index"] for x in results] == list(np.argsort(-offline)[:2])
    assert results[0]["document"] == docs[results[0]["index"]]


def _assert_error_shape(r, status, field=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"type", "message"} <= set(body["error"]), body
    if field is not None:
        assert body["error"].get("field") == field, body
    return body["error"]


@pytest.mark.parametrize("path,body,message,field", [
    ("/v1/score", {"pairs": [["ok", ""]]}, "pairs[0][1] is empty or blank", "pairs[0][1]"),
    ("/v1/score", {"pairs": [["ok", 3]]}, "pairs[0][1]: Input should be a valid string", "pairs[0][1]"),
    ("/v1/score", {"pairs": [["a", "b"]] * 9}, "pairs has 9 pairs; the limit is 8 per request (max_pairs)", "pairs"),
    ("/v1/score", {"pairs": [["a", "b" * 201]]}, "pairs[0][1] has 201 characters; the limit is 200", "pairs[0][1]"),
    ("/v1/score", {"pairs": [["bad \ud800 surrogate", "b"]]}, "unpaired UTF-16 surrogate", "pairs[0][0]"),
    ("/v1/score", {"pairs": [["a", "\u200b\u200b"]]}, "no visible character", "pairs[0][1]"),
    ("/v1/score", {"pairs": [["\u0000", "b"]]}, "control character U+0000", "pairs[0][0]"),
    ("/v1/score", {"text_1": ["a"], "text_2": ["b", "c"]}, "text_1 has 1 items and text_2 2", "text_2"),
    ("/v1/score", {}, "pairs is missing", "pairs"),
    ("/v1/score", {"pairs": [["a", "b"]], "bogus": 1}, "bogus: Extra inputs are not permitted", "bogus"),
    ("/v1/score", {"pairs": [["a", "b"]], "cascade": True}, "need a cross-encoder", "cascade"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents is empty", "documents"),
    ("/v1/rerank", {"query": " ", "documents": ["d"]}, "query is empty or blank", "query"),
    ("/v1/rerank", {"query": "q", "documents": ["\udfff"]}, "surrogate", "documents[0]"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n: Input should be greater than or equal to 1",
     "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": "2"}, "top_n: Input should be a valid integer", "top_n"),
])
def test_invalid_input_is_a_422_naming_field_and_limit(served, path, body, message, field):
    r = requests.post(served["url"] + path, json=body, timeout=30)  # a lone surrogate travels as a \\u escape
    error = _assert_error_shape(r, 422, field)
    assert message in error["message"], error


@pytest.mark.parametrize("method,path,data,status", [
    ("post", "/v1/score", b"{not json", 400),
    ("post", "/v1/score", '{"pairs": [["\xe9", "b"]]}'.encode("latin-1"), 400),
    ("post", "/v1/score", b"[" * 50_000 + b"]" * 50_000, 400),
    ("get", "/v1/nowhere", None, 404),
    ("get", "/v1/score", None, 405),
    ("get", "/v1/warm/jobs/no-such-job", None, 404),
])
def test_every_error_has_one_shape(served, method, path, data, status):
    r = getattr(requests, method)(served["url"] + path, data=data, headers={"content-type": "application/json"},
                                  timeout=30)
    _assert_error_shape(r, status)


def test_one_bad_text_does_not_fail_concurrent_good_requests(served):
    """80 concurrent requests, every fifth with a bad text: the bad ones get 422, every good one 200."""
    def request(i):
        bad = i % 5 == 0
        text = f"bad \ud800 text {i}" if bad else f"a good sentence number {i} about concurrency"
        for _ in range(20):  # admission control may ask a good request to retry (503); it must then succeed
            r = requests.post(served["url"] + "/v1/score", json={"pairs": [[text, f"the other side {i}"]]},
                              timeout=120)
            if r.status_code != 503:
                break
            time.sleep(float(r.headers.get("Retry-After", 1)))
        return bad, r.status_code

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(request, range(80)))
    assert all(code == (422 if bad else 200) for bad, code in results), results


def test_docs_work_offline_and_the_spec_documents_every_error(served):
    page = requests.get(served["url"] + "/docs", timeout=30)
    assert page.status_code == 200 and "/docs-assets/swagger-ui-bundle.js" in page.text and "cdn" not in page.text
    js = requests.get(served["url"] + "/docs-assets/swagger-ui-bundle.js", timeout=30)
    assert js.status_code == 200 and len(js.content) > 100_000
    spec = requests.get(served["url"] + "/openapi.json", timeout=30).json()
    score = spec["paths"]["/v1/score"]["post"]["responses"]
    assert {"200", "400", "422", "500", "503", "504"} <= set(score)
    assert score["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert score["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ScoreResponse")
    assert "413" in spec["paths"]["/v1/warm"]["post"]["responses"]


def test_large_warms_are_background_jobs(served):
    r = requests.post(served["url"] + "/v1/warm", json={"texts": [f"t {i}" for i in range(1001)]}, timeout=30)
    assert "POST /v1/warm/jobs" in _assert_error_shape(r, 413, "texts")["message"]
    texts = [f"background warm sentence {i}" for i in range(300)]
    job = requests.post(served["url"] + "/v1/warm/jobs", json={"texts": texts}, timeout=30)
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    deadline = time.time() + 120
    while True:
        status = requests.get(served["url"] + f"/v1/warm/jobs/{job_id}", timeout=30).json()
        if status["state"] != "running" or time.time() > deadline:
            break
        time.sleep(0.5)
    assert status == {"id": job_id, "state": "succeeded", "total": 300, "done": 300, "added": 300, "error": None}
    (before,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
    requests.post(served["url"] + "/v1/score", json={"pairs": [texts[:2]]}, timeout=60)
    (after,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
    assert after["embedding_cache"]["misses"] == before["embedding_cache"]["misses"]  # already encoded
    cancelled = requests.delete(served["url"] + f"/v1/warm/jobs/{job_id}", timeout=30).json()
    assert cancelled["state"] == "succeeded"  # a finished job stays as it ended


def test_health_and_model_info(served):
    version = _champion(served)
    assert requests.get(served["url"] + "/healthz", timeout=30).json() == {"status": "ok",
                                                                          "model": f"pair-residual-stsb/{version}"}
    (info,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
    assert info["name"] == "pair-residual-stsb" and info["alias"] == "champion" and info["version"] == version
    assert info["encoder"]["encoder"] == "minilm" and info["task"] == "stsb"
    assert "ensemble/val/spearman" in info["validation"] and info["embedding_cache"]["size"] > 0
    assert info["limits"]["max_pairs"] == 8


def test_warm_cache_then_hits(served):
    texts = ["warm sentence number one.", "warm sentence number two."]
    r = requests.post(served["url"] + "/v1/warm", json={"texts": texts}, timeout=60).json()
    assert r["added"] == 2
    (before,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
    requests.post(served["url"] + "/v1/score", json={"pairs": [texts]}, timeout=60)
    (after,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
    assert after["near_cache"]["hits"] == before["near_cache"]["hits"] + 2  # served from the ingress replica
    assert after["embedding_cache"]["misses"] == before["embedding_cache"]["misses"]  # nothing encoded
    # the adapter's per-sentence projections are kept too: the second time only the pair layers run
    assert after["projection_cache"]["misses"] == before["projection_cache"]["misses"] + 2
    requests.post(served["url"] + "/v1/score", json={"pairs": [texts[::-1]]}, timeout=60)
    (again,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
    assert again["projection_cache"]["hits"] == after["projection_cache"]["hits"] + 2
    assert again["projection_cache"]["misses"] == after["projection_cache"]["misses"]


def test_the_cluster_runs_with_the_serve_settings(served):
    import ray

    from serving.serve_env import serve_env

    @ray.remote(num_cpus=0)
    def settings(keys):
        return {k: os.environ.get(k) for k in keys}

    # cluster/local.sh exported cluster/serve.env (where the environment did not set a value) before
    # `ray start`: every worker process inherits it
    expected = {k: os.environ.get(k, v) for k, v in serve_env().items()}
    assert ray.get(settings.remote(list(expected))) == expected


def test_a_burst_gets_only_200_or_503_with_retry_after(served):
    """A load test that counts statuses: 16 cold requests against max_inflight=2. Which requests are refused
    depends on timing (the deterministic check is the admission-control unit test); every answer is a 200 or
    a 503 in the error shape with Retry-After."""
    def cold_request(i):
        pairs = [[f"request {i} sentence {j} about topic {j * i}", f"another {i}-{j} text"] for j in range(8)]
        return requests.post(served["url"] + "/v1/score", json={"pairs": pairs}, timeout=120)

    with cf.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(cold_request, range(16)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 200 in codes, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers.get("Retry-After") == "1" and _assert_error_shape(r, 503)["type"] == "overloaded"


def test_moving_the_champion_switches_models_without_dropping_requests(served, encoder):
    from ray import serve

    from serving.app import build_app

    version = _register(served["tracking_uri"], served["data"], seed0=7)  # better on validation by construction
    assert _champion(served) == str(version)
    codes, stop = [], threading.Event()

    def hammer():
        while not stop.is_set():
            codes.append(requests.post(served["url"] + "/v1/score", json={"pairs": PAIRS[:1]}, timeout=60).status_code)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        serve.run(build_app(served["args"]), name="scorer", route_prefix="/")  # redeploy: the alias now points at 2
    finally:
        stop.set()
        t.join()
    assert codes and set(codes) == {200}, codes
    assert requests.get(served["url"] + "/healthz", timeout=30).json()["model"] == f"pair-residual-stsb/{version}"
    # the sentences scored under version 1 had their projections cached: version 2 must not reuse them
    got = requests.post(served["url"] + "/v1/score", json={"pairs": PAIRS}, timeout=60).json()["data"]
    offline = _offline(served, encoder, PAIRS, f"models:/pair-residual-stsb/{version}")["score"]
    np.testing.assert_allclose([d["score"] for d in got], offline, atol=1e-5)


def test_an_encoder_mismatch_refuses_to_start(served):
    from serving.app import build_app

    _register(served["tracking_uri"], served["data"], manifest_override={"weights_fingerprint": "0" * 32})
    with pytest.raises(ValueError, match="Refusing to serve models:/pair-residual-broken@champion: its encoder differs"):
        build_app({"model_uri": "models:/pair-residual-broken@champion", "tracking_uri": served["tracking_uri"]})


def test_serve_deploy_of_the_config_through_local_sh(served, ray_cluster, tmp_path):
    """The deploy path users run (`make serve`): serving/config.yaml through `cluster/local.sh serve`, as a
    second application under /deployed beside the fixture's (removed again at the end)."""
    import subprocess

    import yaml

    from tests.conftest import REPO

    config = yaml.safe_load((REPO / "serving" / "config.yaml").read_text())
    # Serve's HTTP options are fixed once it runs: keep the fixture's port
    config["http_options"]["port"] = int(served["url"].rsplit(":", 1)[1])
    (app,) = config["applications"]
    app["route_prefix"] = "/deployed"
    app["args"].update(tracking_uri=served["tracking_uri"], warm_corpus=None,
                       encoder={"min": 1, "max": 1, "num_cpus": 0.25}, ingress={"min": 1, "max": 1, "num_cpus": 0.25})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([str(REPO / "cluster" / "local.sh"), "serve", str(path)], env=ray_cluster,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Serve application RUNNING" in out.stdout
    try:
        health = requests.get(served["url"] + "/deployed/healthz", timeout=30).json()
        assert health == {"status": "ok", "model": f"pair-residual-stsb/{_champion(served)}"}
        r = requests.post(served["url"] + "/deployed/v1/score", json={"pairs": PAIRS}, timeout=60)
        assert r.status_code == 200 and len(r.json()["data"]) == len(PAIRS)
    finally:
        from ray import serve

        serve.delete(app["name"])
