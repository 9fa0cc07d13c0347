"""The service's back-end deployments: the frozen encoder, the optional cross-encoder, background warm jobs.

- `Encoder`: the frozen encoder of the model's manifest, `@serve.batch`ed across requests, with a bounded
  LRU of sentence vectors. A batch that fails is retried text by text, so a text the encoder cannot take
  fails only the request that sent it, never the other requests batched with it.
- `CrossEncoderBatches`: a cross-encoder for `scorer="cross_encoder"` and the cascade, `@serve.batch`ed across
  requests as well (a cascade sends a few pairs per request: scored one request at a time, each pass would
  cost mostly its fixed overhead), with the same per-request isolation of a failing batch; as a deployment
  of its own (`CrossEncoderScorer`) or inside the ingress replica (`cross_encoder_placement`).
- `WarmJobs` (one replica: it owns the job table): pre-embeds a large corpus in chunks, in the
  background, with progress, a bound on its size and cancellation.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from ray import serve

from embed_lib.config import EncoderConfig
from embed_lib.data.tables import TABLE_SUFFIXES, table_texts
from embed_lib.data.tasks import SPLITS, distinct_texts, load_splits
from embed_lib.encoding.cache import EmbeddingCache, manifest_mismatch
from embed_lib.encoding.encoders import FrozenEncoder
from embed_lib.teacher.cross_encoder import PairCrossEncoder
from embed_lib.tracking.cross_encoder_registry import resolve_cross_encoder
from serving.args import AppArgs
from serving.scorer import LRU

log = logging.getLogger("ray.serve")


#: batches a model deployment computes at once, each on its own thread: under concurrent load a replica with a
#: fractional CPU share keeps a small node's cores busy, where one batch at a time would leave all but one idle
BATCHES_IN_FLIGHT = 2


#: how often a stopping replica checks whether its in-flight requests are done (Serve's default is 2 s): a replica
#: always waits one period before it stops, so each idle replica of a redeploy, a scale-down or a shutdown
#: otherwise holds its CPU share (and the next replica's stop) for the whole period
SHUTDOWN_POLL_S = 0.2


def set_threads(num_cpus: float, batches: int = 1) -> int:
    """torch's intra-op threads for a replica of `num_cpus` running `batches` batches at once; returns them."""
    threads = max(1, int(num_cpus) // batches)
    torch.set_num_threads(threads)
    return threads


def corpus_texts(corpus: str, columns: list[str] | None = None) -> list[str]:
    """'task:<name>' -> the task's distinct sentences; a .csv / .tsv / .jsonl / .parquet file (your own
    pairs) -> the distinct texts of its `columns` (default: every text column); otherwise a text file,
    one sentence per line."""
    if corpus.startswith("task:"):
        return distinct_texts(load_splits(corpus[5:], SPLITS))
    if Path(corpus).suffix.lower() in TABLE_SUFFIXES:
        return table_texts(Path(corpus), columns)
    with open(corpus, encoding="utf-8") as fh:
        return list(dict.fromkeys(line.rstrip("\n") for line in fh if line.strip()))


def run_isolated(run: Callable[[list], Sequence], items: list) -> list:
    """One result per item from `run` over all of them (a batch Serve gathered from several requests); when
    that fails, each item alone, and the exception in place of the items that fail by themselves, so one
    request's bad input fails only that request."""
    try:
        return list(run(items))
    except Exception:
        if len(items) == 1:
            raise
    out: list = []
    for item in items:
        try:
            out.append(run([item])[0])
        except Exception as exc:  # noqa: BLE001 -- handed to the request that sent this item
            out.append(exc)
    return out


class EncodeError(ValueError):
    """A text the encoder could not take (the edge checks let it through)."""


@serve.deployment(graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
class Encoder:
    """Frozen encoder of the model's manifest, with a bounded LRU of sentence vectors."""

    def __init__(self, manifest: dict[str, Any], cache_size: int, max_batch_size: int, batch_wait_timeout_s: float,
                 warm_corpus: str | None, num_cpus: float, warm_corpus_columns: list[str] | None = None) -> None:
        set_threads(num_cpus, BATCHES_IN_FLIGHT)
        self.encoder = FrozenEncoder(EncoderConfig.from_manifest(manifest, batch_size=max_batch_size))
        diff = manifest_mismatch(manifest, self.encoder.manifest())
        if diff:
            raise RuntimeError(f"Refusing to start: the serving encoder differs from the model's "
                               f"(field: (trained, serving) = {diff}).")
        self.manifest = manifest
        self.cache = LRU(cache_size)
        self._encode_batch.set_max_batch_size(max_batch_size)
        self._encode_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        if warm_corpus:
            self._warm_from(warm_corpus, warm_corpus_columns)

    def _warm_from(self, corpus: str, columns: list[str] | None = None) -> int:
        texts = corpus_texts(corpus, columns)
        # through the embedding cache embed_lib built: cached sentences are read, not encoded
        vectors = EmbeddingCache(self.manifest).get(texts, self.encoder)
        for t, v in zip(texts, vectors):
            self.cache.put(t, v)
        log.info("warmed %d sentences from %s", len(texts), corpus)
        return len(texts)

    def _encode(self, texts: list[str]) -> np.ndarray:
        return self.encoder.encode(texts, show_progress=False)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005, max_concurrent_batches=BATCHES_IN_FLIGHT)
    async def _encode_batch(self, texts: list[str]) -> list[np.ndarray | Exception]:
        return await asyncio.to_thread(run_isolated, self._encode, texts)

    async def embed(self, texts: list[str]) -> np.ndarray:
        """(n, d) raw vectors; cached sentences are not encoded again."""
        found, missing = self.cache.get_many(texts)
        if missing:
            vectors = await asyncio.gather(*[self._encode_batch(t) for t in missing])
            failed = [(t, v) for t, v in zip(missing, vectors) if isinstance(v, Exception)]
            if failed:
                t, exc = failed[0]
                raise EncodeError(f"The encoder could not take the text {t[:40]!r} ({type(exc).__name__}: {exc}).")
            for t, v in zip(missing, vectors):
                self.cache.put(t, v)
                found[t] = v
        return np.stack([found[t] for t in texts]) if texts else np.zeros((0, self.manifest["dim"]), np.float32)

    async def warm(self, texts: list[str], return_vectors: bool = False):
        """Encode the texts not cached yet, in chunks; returns how many were new, and with return_vectors
        also {text: vector} of every text (what the ingress's near cache takes, in the same call)."""
        distinct = list(dict.fromkeys(texts))
        vectors, new = self.cache.get_many(distinct) if return_vectors else ({}, [t for t in distinct
                                                                                 if t not in self.cache])
        for i in range(0, len(new), 256):
            chunk = new[i: i + 256]
            for t, v in zip(chunk, await asyncio.to_thread(run_isolated, self._encode, chunk)):
                if not isinstance(v, Exception):
                    self.cache.put(t, v)
                    vectors[t] = v
        return (len(new), vectors) if return_vectors else len(new)

    async def truncate(self, texts: list[str], keep: int | None, side: str, counting_special: bool = False):
        """`FrozenEncoder.truncate` off the event loop: a request's truncation options (serving/truncation.py)."""
        return await asyncio.to_thread(self.encoder.truncate, texts, keep, side, counting_special)

    def stats(self) -> dict[str, Any]:
        return self.cache.stats()


#: the CPU share of the cross-encoder: its deployment's, and the threads it computes with in either placement
CROSS_ENCODER_CPUS = 0.5
#: requests in one cross-encoder batch. Requests a batch answered return together, and their clients' next requests
#: arrive together: with room for 8, a closed loop of 8 clients formed one batch of all 8, computed on one thread
#: while the other batch thread idled (cross-encoder in the ingress, c=8: 1 core of 2 used; 4: cascade 3,617 against
#: 2,676 pairs/s, cross-encoder alone 583 against 389; a deployment's batches, ~1.5 requests each, did not change)
CROSS_ENCODER_MAX_BATCH = 4


class CrossEncoderBatches:
    """Scores pairs with a cross-encoder; a served teacher's scores are on the frozen cosine's scale (its
    calibration), so the cascade can mix them with the adapter's. Runs inside a Serve replica (`@serve.batch`):
    its own deployment (`CrossEncoderScorer`), or the ingress replica (cross_encoder_placement='ingress')."""

    placement = "ingress"

    def __init__(self, model: str, backend: str, num_cpus: float, tracking_uri: str | None) -> None:
        threads = set_threads(num_cpus, BATCHES_IN_FLIGHT)
        self.name = model
        self.ce = PairCrossEncoder(resolve_cross_encoder(model, tracking_uri), backend=backend, threads=threads)

    def info(self) -> dict[str, Any]:
        rec, cal = self.ce.record, self.ce.calibration
        return {"name": self.name, "backend": self.ce.backend, "placement": self.placement, "calibrated": bool(cal),
                "middle": self.ce.middle,
                **{k: rec[k] for k in ("teacher_key", "test_spearman", "validation_spearman", "recipe") if k in rec}}

    def _score_requests(self, requests: list[list[tuple[str, str]]]) -> list[np.ndarray]:
        """Scores per request from one pass over all their pairs (length-sorted batches)."""
        scores = self.ce.score([p for r in requests for p in r])
        bounds = np.cumsum([0, *[len(r) for r in requests]])
        return [scores[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def _score_isolated(self, requests: list[list[tuple[str, str]]]) -> list[np.ndarray | Exception]:
        return run_isolated(self._score_requests, requests)

    @serve.batch(max_batch_size=CROSS_ENCODER_MAX_BATCH, batch_wait_timeout_s=0.002,
                 max_concurrent_batches=BATCHES_IN_FLIGHT)
    async def _score_batch(self, requests: list[list[tuple[str, str]]]) -> list[np.ndarray | Exception]:
        return await asyncio.to_thread(self._score_isolated, requests)

    async def score(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        """(n,) scores; concurrent requests (a cascade routes a few pairs of each) are scored together."""
        out = await self._score_batch(list(pairs))
        if isinstance(out, Exception):
            raise out
        return out


@serve.deployment(graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
class CrossEncoderScorer(CrossEncoderBatches):
    """The cross-encoder as a deployment of its own (cross_encoder_placement='deployment'): it scales apart
    from the ingress and can sit on a GPU node; each call to it costs the ingress a deployment hop."""

    placement = "deployment"


def cross_encoder_calls(handle, args: AppArgs, tracking_uri: str | None):
    """(score, info): coroutine functions of the app's cross-encoder, `score(pairs) -> (n,) scores` and
    `info() -> dict`; through its deployment's handle, or a cross-encoder loaded in this replica
    (cross_encoder_placement='ingress': no deployment hop); (None, None) without a cross-encoder."""
    if handle is not None:
        return (lambda pairs: handle.score.remote(pairs)), (lambda: handle.info.remote())
    if args.cross_encoder is None or args.cross_encoder_placement != "ingress":
        return None, None
    local = CrossEncoderBatches(args.cross_encoder, args.cross_encoder_backend, CROSS_ENCODER_CPUS, tracking_uri)

    async def info() -> dict[str, Any]:
        return local.info()

    return local.score, info


# no CPU share: it only awaits the encoder, and with one the encoder's and ingress's second replicas (0.5 each, as
# serving/config.yaml lets them scale) would not all fit a 2-CPU node (2 x 0.5 + 2 x 0.5 + 0.05)
@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0},
                  graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
class WarmJobs:
    """Background warm jobs over the encoder's cache: submit, poll, cancel. Finished jobs are kept (the
    `keep` most recent) so their outcome can be read after they end."""

    def __init__(self, encoder, max_running: int = 1, chunk: int = 256, keep: int = 100) -> None:
        self.encoder, self.max_running, self.chunk, self.keep = encoder, max_running, chunk, keep
        self.jobs: dict[str, dict[str, Any]] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def submit(self, texts: list[str]) -> dict[str, Any] | None:
        """The new job, or None when max_running jobs are running already."""
        if sum(j["state"] == "running" for j in self.jobs.values()) >= self.max_running:
            return None
        texts = list(dict.fromkeys(texts))
        job = {"id": uuid.uuid4().hex[:16], "state": "running", "total": len(texts), "done": 0, "added": 0,
               "error": None, "created": time.time()}
        self.jobs[job["id"]] = job
        self.tasks[job["id"]] = asyncio.create_task(self._run(job, texts))
        self._forget_old()
        return self.public(job)

    async def _run(self, job: dict[str, Any], texts: list[str]) -> None:
        try:
            for i in range(0, len(texts), self.chunk):
                part = texts[i: i + self.chunk]
                job["added"] += await self.encoder.warm.remote(part)
                job["done"] += len(part)
            job["state"] = "succeeded"
        except asyncio.CancelledError:
            job["state"] = "cancelled"
        except Exception as exc:  # noqa: BLE001 -- the job's outcome, read by the client
            job["state"], job["error"] = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("warm job %s failed", job["id"])
        finally:
            self.tasks.pop(job["id"], None)

    def _forget_old(self) -> None:
        finished = [j for j in self.jobs.values() if j["state"] != "running"]
        for j in sorted(finished, key=lambda j: j["created"])[: max(0, len(self.jobs) - self.keep)]:
            self.jobs.pop(j["id"], None)

    @staticmethod
    def public(job: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in job.items() if k != "created"}

    def status(self, job_id: str) -> dict[str, Any] | None:
        job = self.jobs.get(job_id)
        return None if job is None else self.public(job)

    async def cancel(self, job_id: str) -> dict[str, Any] | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        task = self.tasks.get(job_id)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            job["state"] = "cancelled"
        return self.public(job)
