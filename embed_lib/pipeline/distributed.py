"""Distributed precompute: sentence encoding sharded over a pool of Ray actors, into the same cache.

Optional (imports Ray lazily; nothing else in embed_lib needs it). `DistributedEncoder` has the
FrozenEncoder interface that `EmbeddingCache.get` uses (`manifest()`, `encode(texts)`), so only the
sentences missing from the cache are sent out, and the vectors land in the cache exactly as a
single-process encode would put them there. Each actor holds one FrozenEncoder (`num_gpus=1` when
GPUs are used, fractional CPUs otherwise); shards are contiguous chunks, reassembled in order.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from embed_lib.config import EncoderConfig, default_cache_dir
from embed_lib.data.tasks import SPLITS, load_splits
from embed_lib.encoding.cache import EmbeddingCache, embed_task
from embed_lib.encoding.encoders import FrozenEncoder, encoder_manifest
from embed_lib.pipeline.prepare import transfer_splits
from embed_lib.progress import Progress

log = logging.getLogger(__name__)


class _EncoderActor:
    def __init__(self, config: EncoderConfig, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.encoder = FrozenEncoder(EncoderConfig(**{**config.to_dict(), "device": usable_device(config.device)}))

    def encode(self, texts: list[str]) -> np.ndarray:
        return self.encoder.encode(texts, show_progress=False)


_SAID: set[str] = set()


def usable_device(device: str) -> str:
    """`device`, or "cpu" when it names CUDA and this process has none (a node with logical GPUs only, as Ray's
    fake clusters and `ray start --num-gpus` on a CPU machine give): said once per process in the log."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        if "cuda" not in _SAID:
            _SAID.add("cuda")
            log.warning("this node has a logical GPU and no CUDA device: running on CPU")
        return "cpu"
    return device


class DistributedEncoder:
    """FrozenEncoder-compatible front of an actor pool (see module docstring)."""

    def __init__(self, config: EncoderConfig, workers: int = 2, use_gpu: bool = False, cpus_per_worker: float = 1.0,
                 memo_dir: str | Path | None = None, shard_size: int = 512) -> None:
        # lazy: embed_lib runs without Ray; only this encoder pool needs it
        import ray

        if workers < 1:
            raise ValueError(f"workers={workers}; allowed 1 or more.")
        device = "cuda" if use_gpu else "cpu"
        self.config = EncoderConfig(**{**config.to_dict(), "device": device})
        self._manifest = encoder_manifest(config, memo_dir)
        actor = ray.remote(num_gpus=1 if use_gpu else 0, num_cpus=0 if use_gpu else cpus_per_worker)(_EncoderActor)
        self.actors = [actor.remote(self.config, int(cpus_per_worker)) for _ in range(workers)]
        self.shard_size = shard_size

    def manifest(self) -> dict[str, Any]:
        return self._manifest

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        # lazy: embed_lib runs without Ray; only this encoder pool needs it
        from ray.util import ActorPool

        texts = list(texts)
        if not texts:
            return np.zeros((0, int(self._manifest["dim"])), np.float32)
        shards = [texts[i: i + self.shard_size] for i in range(0, len(texts), self.shard_size)]
        pool = ActorPool(self.actors)
        progress = Progress(len(texts), f"encode {self.config.model} ({len(self.actors)} Ray actors)")
        out = []
        for vectors in pool.map(lambda a, shard: a.encode.remote(shard), shards):  # map keeps order
            out.append(vectors)
            progress.update(len(vectors))
        progress.close()
        return np.concatenate(out)

    def shutdown(self) -> None:
        # lazy: embed_lib runs without Ray; only this encoder pool needs it
        import ray

        for a in self.actors:
            ray.kill(a)


class LazyPool:
    """What `embed_splits` takes (like study.LazyEncoder): the actor pool starts only when a sentence is
    missing from the cache; `shutdown()` ends it."""

    def __init__(self, config: EncoderConfig, workers: int = 1, use_gpu: bool = False) -> None:
        self.config, self.workers, self.use_gpu = config, workers, use_gpu
        self._pool: DistributedEncoder | None = None
        self._memo: str | Path | None = None

    def manifest(self, memo_dir: str | Path | None) -> dict[str, Any]:
        self._memo = memo_dir
        return encoder_manifest(self.config, memo_dir)

    def __call__(self) -> DistributedEncoder:
        if self._pool is None:
            self._pool = DistributedEncoder(self.config, self.workers, self.use_gpu, memo_dir=self._memo)
        return self._pool

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def precompute_embeddings(task: str, config: EncoderConfig, *, data_dir=None, cache_dir=None, workers: int = 2,
                          use_gpu: bool = False, limit: int | None = None, transfer=()) -> dict[str, int]:
    """Encode every sentence of `task` (and of its transfer checks) missing from the cache with `workers`
    actors; returns cache stats."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    splits = load_splits(task, SPLITS, data_dir)
    if limit is not None:
        splits = {k: v.subset(limit) for k, v in splits.items()}
    splits.update(transfer_splits(task, splits["train"], transfer, data_dir, limit))
    cache = EmbeddingCache(encoder_manifest(config, root), root)
    holder: list[DistributedEncoder] = []

    def make() -> DistributedEncoder:  # built only if something is missing from the cache
        holder.append(DistributedEncoder(config, workers, use_gpu, memo_dir=root))
        return holder[0]

    try:
        embed_task(splits, cache, make)
    finally:
        for enc in holder:
            enc.shutdown()
    return {"hits": cache.stats.hits, "misses": cache.stats.misses, "workers": workers if holder else 0}
