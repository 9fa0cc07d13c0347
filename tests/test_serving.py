"""Ray Serve end to end on loopback: a tiny registered model, real Ray, real MLflow, real HTTP."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading

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


def test_the_warm_corpus_reaches_the_ingress_near_cache(served):
    """First in this module: the near cache then holds the warm corpus only. It warms from the embedding cache
    at start, or, where the encoder replica had not finished writing it, from the encoder at a health check."""
    import time

    deadline = time.time() + 60
    while True:
        (info,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
        if info["near_cache"]["size"] == len(CORPUS) or time.time() > deadline:
            break
        time.sleep(1)
    assert info["near_cache"]["size"] == len(CORPUS), info["near_cache"]
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
    assert all(0 < d["difficulty"] < 1 for d in body["data"]) and body["model"] == "pair-residual-stsb/1"
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


@pytest.mark.parametrize("path,body,message", [
    ("/v1/score", {"pairs": [["ok", ""]]}, "pairs[0][1] is empty or blank"),
    ("/v1/score", {"pairs": [["ok", 3]]}, "pairs.0.1: Input should be a valid string"),
    ("/v1/score", {"pairs": [["a", "b"]] * 9}, "pairs has 9 pairs; the limit is 8 per request (max_pairs)"),
    ("/v1/score", {"pairs": [["a", "b" * 201]]}, "pairs[0][1] has 201 characters; the limit is 200"),
    ("/v1/score", {"text_1": ["a"], "text_2": ["b", "c"]}, "text_1 has 1 items and text_2 2"),
    ("/v1/score", {}, "pairs is missing"),
    ("/v1/score", {"pairs": [["a", "b"]], "bogus": 1}, "bogus: Extra inputs are not permitted"),
    ("/v1/score", {"pairs": [["a", "b"]], "cascade": True}, "need a cross-encoder"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents is empty"),
    ("/v1/rerank", {"query": " ", "documents": ["d"]}, "query is empty or blank"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n: Input should be greater than or equal to 1"),
])
def test_invalid_input_is_a_4xx_naming_field_and_limit(served, path, body, message):
    r = requests.post(served["url"] + path, json=body, timeout=30)
    assert r.status_code == 422, r.text
    text = json.dumps(r.json())
    assert message in text, text


def test_malformed_json_is_a_4xx(served):
    r = requests.post(served["url"] + "/v1/score", data="{not json", headers={"content-type": "application/json"},
                      timeout=30)
    assert r.status_code == 422 and "JSON decode error" in r.text


def test_health_and_model_info(served):
    assert requests.get(served["url"] + "/healthz", timeout=30).json() == {"status": "ok", "model": "pair-residual-stsb/1"}
    (info,) = requests.get(served["url"] + "/v1/models", timeout=30).json()["data"]
    assert info["name"] == "pair-residual-stsb" and info["alias"] == "champion" and info["version"] == "1"
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


def test_overload_is_503_with_retry_after(served):
    def cold_request(i):
        pairs = [[f"request {i} sentence {j} about topic {j * i}", f"another {i}-{j} text"] for j in range(8)]
        return requests.post(served["url"] + "/v1/score", json={"pairs": pairs}, timeout=120)

    with cf.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(cold_request, range(16)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers.get("Retry-After") == "1" and "Overloaded" in rejected.text


def test_moving_the_champion_switches_models_without_dropping_requests(served, encoder):
    from ray import serve

    from serving.app import build_app

    version = _register(served["tracking_uri"], served["data"], seed0=7)  # better on validation by construction
    assert str(version) == "2"
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
    assert requests.get(served["url"] + "/healthz", timeout=30).json()["model"] == "pair-residual-stsb/2"
    # the sentences scored under version 1 had their projections cached: version 2 must not reuse them
    got = requests.post(served["url"] + "/v1/score", json={"pairs": PAIRS}, timeout=60).json()["data"]
    offline = _offline(served, encoder, PAIRS, "models:/pair-residual-stsb/2")["score"]
    np.testing.assert_allclose([d["score"] for d in got], offline, atol=1e-5)


def test_an_encoder_mismatch_refuses_to_start(served):
    from serving.app import build_app

    _register(served["tracking_uri"], served["data"], manifest_override={"weights_fingerprint": "0" * 32})
    with pytest.raises(ValueError, match="Refusing to serve models:/pair-residual-broken@champion: its encoder differs"):
        build_app({"model_uri": "models:/pair-residual-broken@champion", "tracking_uri": served["tracking_uri"]})


def test_serve_deploy_of_the_config_through_local_sh(served, ray_cluster, tmp_path):
    """The deploy path users run (`make serve`): serving/config.yaml through `cluster/local.sh serve`.
    Last in this module: a declarative deploy replaces the applications the fixture started."""
    import subprocess

    import yaml

    from tests.conftest import REPO

    config = yaml.safe_load((REPO / "serving" / "config.yaml").read_text())
    # Serve's HTTP options are fixed once it runs: keep the fixture's port
    config["http_options"]["port"] = int(served["url"].rsplit(":", 1)[1])
    (app,) = config["applications"]
    app["args"].update(tracking_uri=served["tracking_uri"], warm_corpus=None,
                       encoder={"min": 1, "max": 1, "num_cpus": 0.25}, ingress={"min": 1, "max": 1, "num_cpus": 0.25})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([str(REPO / "cluster" / "local.sh"), "serve", str(path)], env=ray_cluster,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Serve application RUNNING" in out.stdout
    health = requests.get(served["url"] + "/healthz", timeout=30).json()
    assert health["status"] == "ok" and health["model"].startswith("pair-residual-stsb/")
    r = requests.post(served["url"] + "/v1/score", json={"pairs": PAIRS}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == len(PAIRS)
