from __future__ import annotations

import numpy as np
import pytest

from embed_lib.training.diagnostics import baseline_error, headroom, length_collapse


def test_baseline_error_is_the_residual_of_a_linear_calibration():
    s0 = np.array([0.0, 0.5, 1.0, 1.5])
    y = 2 * s0 + 1  # perfectly calibratable: no error left
    np.testing.assert_allclose(baseline_error(s0, y), 0, atol=1e-9)
    y2 = np.array([1.0, 0.0, 1.0, 0.0])  # least squares: y = 0.8 - 0.4 s0 -> fitted 0.8, 0.6, 0.4, 0.2
    np.testing.assert_allclose(baseline_error(s0, y2), [0.2, 0.6, 0.6, 0.2], atol=1e-9)


def test_headroom_finds_the_signal_that_tracks_the_error():
    rng = np.random.default_rng(0)
    s0 = rng.random(500)
    noise = rng.normal(size=500)
    y = s0 + 0.3 * noise
    out = headroom(s0, y, {"oracle": np.abs(noise), "random": rng.random(500)})
    assert out["oracle"]["spearman"] > 0.8 and abs(out["random"]["spearman"]) < 0.15


def test_length_collapse_buckets_and_tau_columns():
    texts = ["short one"] * 3 + [" ".join(["word"] * 20) + f" {i}" for i in range(3)]
    vecs = {"tau_attn=1.0": np.array([[1, 0], [1, 0.1], [1, -0.1], [0, 1], [0.1, 1], [-0.1, 1]], float)}
    rows = length_collapse(texts, vecs, pairs_per_bucket=200)
    assert [r["bucket"] for r in rows] == ["1-8", "17-32"]
    assert rows[0]["n_sentences"] == 3 and rows[0]["tau_attn=1.0"] == pytest.approx(0.99, abs=0.02)


def test_a_first_run_clone_gets_a_newcomers_environment():
    """`make first-run` exports this clone's caches, store and make's own variables: the fresh clone must not see
    them (it would read this clone's embeddings and write to its MLflow store), and keeps the rest (data, offline)."""
    from benchmarks.first_run import NOT_A_NEWCOMERS, newcomer_env
    mine = {"EMBED_CACHE_DIR": "/repo/.cache/embed_lib", "MLFLOW_TRACKING_URI": "sqlite:////repo/mlflow.db",
            "MLFLOW_ARTIFACT_ROOT": "/repo/mlartifacts", "EMBED_STORAGE_DIR": "/repo/.cache/ray_results",
            "MAKELEVEL": "1", "MAKEFLAGS": "w", "EMBED_DATA_DIR": "/shared/data", "HF_HUB_OFFLINE": "1", "PATH": "/bin"}
    assert newcomer_env(mine) == {"EMBED_DATA_DIR": "/shared/data", "HF_HUB_OFFLINE": "1", "PATH": "/bin"}
    assert {"EMBED_RAY_DIR", "RAY_ADDRESS"} <= set(NOT_A_NEWCOMERS)


def test_replica_cpu_counts_only_the_named_replicas_processes():
    """serve_bench's CPU per request: the CPU of the processes whose title names the application's replicas (a
    stand-in titled like one, busy for ~0.4 s), nothing for an application without replicas."""
    import subprocess
    import sys
    import time

    from benchmarks.load import replica_cpu_s

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", busy, "ray::ServeReplica:cpu-test:Ingress"])
    try:
        deadline = time.time() + 20
        while (replica_cpu_s("cpu-test") or 0) < 0.35 and time.time() < deadline:
            time.sleep(0.1)
        assert 0.35 <= replica_cpu_s("cpu-test") < 5
        assert replica_cpu_s("cpu-test", "Encoder") is None and replica_cpu_s("no-such-app") is None
    finally:
        p.kill()
        p.wait()
