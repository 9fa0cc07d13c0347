"""Distributed precompute on a real local Ray: identical vectors, same cache."""
from __future__ import annotations

import numpy as np
import pytest

from embed_lib.encoding.cache import EmbeddingCache
from embed_lib.config import EncoderConfig
from embed_lib.data.tasks import load_task

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_local(ray_cluster):
    import ray

    ray.init(address=ray_cluster["RAY_ADDRESS"], ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


def test_actor_pool_encoding_equals_single_process_and_fills_the_same_cache(ray_local, encoder, tmp_path):
    from embed_lib.pipeline.distributed import DistributedEncoder

    texts = load_task("stsb", "test").texts()[:300]
    dist = DistributedEncoder(EncoderConfig(), workers=2, cpus_per_worker=0.5, memo_dir=tmp_path, shard_size=64)
    try:
        assert dist.manifest() == encoder.manifest()
        cache = EmbeddingCache(dist.manifest(), tmp_path)
        vectors = cache.get(texts, dist)
    finally:
        dist.shutdown()
    np.testing.assert_allclose(vectors, encoder.encode(texts), atol=1e-5)
    again = EmbeddingCache(encoder.manifest(), tmp_path)
    np.testing.assert_array_equal(again.get(texts), vectors)  # a single-process reader finds them all
    assert again.stats.misses == 0


def test_precompute_embeddings_reports_cache_use(ray_local, tmp_path):
    from embed_lib.pipeline.distributed import precompute_embeddings

    first = precompute_embeddings("mrpc", EncoderConfig(), cache_dir=tmp_path, workers=2, limit=40)
    second = precompute_embeddings("mrpc", EncoderConfig(), cache_dir=tmp_path, workers=2, limit=40)
    assert first["misses"] > 0 and first["workers"] == 2
    assert second == {"hits": first["hits"] + first["misses"], "misses": 0, "workers": 0}


def test_a_logical_gpu_without_cuda_runs_on_cpu_and_says_so_once(caplog, monkeypatch):
    import logging

    import torch

    from embed_lib.pipeline import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(distributed, "_SAID", set())
    with caplog.at_level(logging.WARNING, logger="embed_lib.pipeline.distributed"):
        assert [distributed.usable_device(d) for d in ("cuda", "cuda:0", "cpu")] == ["cpu", "cpu", "cpu"]
    assert [r.getMessage() for r in caplog.records] == ["this node has a logical GPU and no CUDA device: running on CPU"]
