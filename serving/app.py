"""Ray Serve application: the MLflow champion adapter as a pair-scoring and re-ranking HTTP service.

    serve run serving.app:build_app model_uri=models:/pair-residual-stsb@champion
    serve deploy serving/config.yaml

Deployments: `Encoder` (the frozen encoder of the model's manifest, `@serve.batch`ed, with a bounded
LRU of sentence vectors), an optional `CrossEncoderScorer` (cascade / comparison) and `Ingress`
(FastAPI, OpenAPI docs at /docs), which is also the pair scorer: it holds the adapter (`reconfigure`
swaps models in place), a near cache of vectors and a cache of each sentence's adapter projection, so a
request whose sentences are cached makes no call beyond the ingress replica and runs only the adapter's
pair-level layers. On 2 cores every deployment hop costs several ms of CPU while scoring 32 cached pairs
costs ~0.7 ms: a separate scorer deployment would cost the service most of its throughput.
The builder refuses a model whose encoder manifest does not match the serving encoder.

Handlers never block the replica's event loop for long (encoding and the cross-encoder run in worker
threads): the clusters run with Serve's user code on the main loop (cluster/serve.env).
"""
# no `from __future__ import annotations`: FastAPI reads the request models from real annotations

import asyncio
import json
import logging
import os
from collections import OrderedDict
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from ray import serve

from embed_lib.export import ensemble_scores, project
from serving.schemas import RerankRequest, ScoreRequest, WarmRequest, check_texts

log = logging.getLogger("ray.serve")  # Serve's logger: lines land in the replica's log, tagged with the replica


class Replicas(BaseModel):
    min: int = Field(1, ge=0)
    max: int = Field(2, ge=1)
    num_cpus: float = Field(0.25, gt=0, description="fractional CPUs per replica (a whole CPU each deadlocks 2 cores)")


class AppArgs(BaseModel):
    """Typed arguments of the application builder (`serve run ... key=value`, or `args:` in config.yaml)."""

    model_uri: str = "models:/pair-residual-stsb@champion"
    tracking_uri: str | None = Field(None, description="MLflow tracking URI (default $MLFLOW_TRACKING_URI)")
    max_pairs: int = Field(256, ge=1, description="pairs per /v1/score request")
    max_documents: int = Field(1000, ge=1, description="documents per /v1/rerank request")
    max_text_chars: int = Field(2000, ge=1, description="characters per text")
    max_batch_size: int = Field(64, ge=1, description="sentences per encoder forward pass (@serve.batch)")
    batch_wait_timeout_s: float = Field(0.005, ge=0)
    cache_size: int = Field(200_000, ge=0, description="sentence vectors kept per encoder replica (LRU) and per "
                            "ingress replica (near cache)")
    projection_cache_size: int = Field(50_000, ge=0, description="sentences whose adapter projection (seeds x width "
                                       "floats: 2.5 KB for 5 seeds of width 128) each ingress replica keeps (LRU, "
                                       "emptied when the model changes)")
    warm_corpus: str | None = Field(None, description="pre-embed at startup: 'task:<name>' (from the embedding "
                                    "cache embed_lib built) or a text file, one sentence per line")
    max_inflight: int = Field(64, ge=1, description="requests in flight per ingress replica before 503")
    access_log: bool = Field(False, description="per-request access logs in the replicas (each costs CPU on "
                             "every request; errors are logged either way)")
    request_timeout_s: float = Field(30.0, gt=0)
    cross_encoder: str | None = Field(None, description="cross-encoder id/path for the cascade and comparison")
    cascade_threshold: float = Field(0.5, ge=0, le=1)
    encoder: Replicas = Replicas(min=1, max=2, num_cpus=0.5)
    ingress: Replicas = Replicas(min=1, max=2, num_cpus=0.5)


def _deployment_options(r: Replicas, access_log: bool = False, **extra) -> dict[str, Any]:
    return {"ray_actor_options": {"num_cpus": r.num_cpus},
            "logging_config": {"enable_access_log": access_log},
            "autoscaling_config": {"min_replicas": r.min, "max_replicas": r.max, "initial_replicas": max(1, r.min),
                                   "target_ongoing_requests": 4}, **extra}


def _set_threads(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


class LRU:
    """A bounded text -> vector map with hit / miss counts."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.data, self.hits, self.misses = capacity, OrderedDict(), 0, 0

    def get_many(self, texts: list[str]) -> tuple[dict[str, np.ndarray], list[str]]:
        found, missing = {}, []
        for t in dict.fromkeys(texts):
            v = self.data.get(t)
            if v is None:
                missing.append(t)
            else:
                self.data.move_to_end(t)
                found[t] = v
        self.hits += len(found)
        self.misses += len(missing)
        return found, missing

    def put(self, text: str, vec: np.ndarray) -> None:
        if self.capacity <= 0:
            return
        self.data[text] = vec
        self.data.move_to_end(text)
        while len(self.data) > self.capacity:
            self.data.popitem(last=False)

    def __contains__(self, text: str) -> bool:
        return text in self.data

    def stats(self) -> dict[str, Any]:
        total = self.hits + self.misses
        return {"size": len(self.data), "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / total if total else None}


def corpus_texts(corpus: str) -> list[str]:
    """'task:<name>' -> the task's distinct sentences; otherwise a text file, one sentence per line."""
    if corpus.startswith("task:"):
        from embed_lib.tasks import SPLITS, distinct_texts, load_splits

        return distinct_texts(load_splits(corpus[5:], SPLITS))
    with open(corpus, encoding="utf-8") as fh:
        return list(dict.fromkeys(line.rstrip("\n") for line in fh if line.strip()))


@serve.deployment
class Encoder:
    """Frozen encoder of the model's manifest, with a bounded LRU of sentence vectors."""

    def __init__(self, manifest: dict[str, Any], cache_size: int, max_batch_size: int, batch_wait_timeout_s: float,
                 warm_corpus: str | None, num_cpus: float) -> None:
        from embed_lib.cache import manifest_mismatch
        from embed_lib.config import EncoderConfig
        from embed_lib.encoders import FrozenEncoder

        _set_threads(num_cpus)
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
            self._warm_from(warm_corpus)

    def _warm_from(self, corpus: str) -> int:
        from embed_lib.cache import EmbeddingCache

        texts = corpus_texts(corpus)
        # through the embedding cache embed_lib built: cached sentences are read, not encoded
        vectors = EmbeddingCache(self.manifest).get(texts, self.encoder)
        for t, v in zip(texts, vectors):
            self.cache.put(t, v)
        log.info("warmed %d sentences from %s", len(texts), corpus)
        return len(texts)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)
    async def _encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        vectors = await asyncio.to_thread(self.encoder.encode, texts, show_progress=False)
        return list(vectors)

    async def embed(self, texts: list[str]) -> np.ndarray:
        """(n, d) raw vectors; cached sentences are not encoded again."""
        found, missing = self.cache.get_many(texts)
        if missing:
            vectors = await asyncio.gather(*[self._encode_batch(t) for t in missing])
            for t, v in zip(missing, vectors):
                self.cache.put(t, v)
                found[t] = v
        return np.stack([found[t] for t in texts]) if texts else np.zeros((0, self.manifest["dim"]), np.float32)

    async def warm(self, texts: list[str]) -> int:
        new = [t for t in dict.fromkeys(texts) if t not in self.cache]
        for i in range(0, len(new), 256):
            chunk = new[i: i + 256]
            for t, v in zip(chunk, await asyncio.to_thread(self.encoder.encode, chunk, show_progress=False)):
                self.cache.put(t, v)
        return len(new)

    def stats(self) -> dict[str, Any]:
        return self.cache.stats()


@serve.deployment
class CrossEncoderScorer:
    def __init__(self, model: str, num_cpus: float) -> None:
        from sentence_transformers import CrossEncoder

        from embed_lib.encoders import resolve_model

        _set_threads(num_cpus)
        self.name = model
        self.ce = CrossEncoder(resolve_model(model), device="cpu")

    async def score(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        return await asyncio.to_thread(lambda: np.asarray(self.ce.predict([list(p) for p in pairs], batch_size=32,
                                                                            show_progress_bar=False), np.float32))


def _json(body: dict[str, Any]) -> Response:
    """The hot endpoints' responses, serialised once with the stdlib: FastAPI's generic encoder walks every
    value of the body again, which costs more than the scoring itself."""
    return Response(json.dumps(body), media_type="application/json")


api = FastAPI(title="pair-adapter scorer", version="1",
              description="Pair scoring and re-ranking with a pair-level adapter over frozen sentence embeddings.")


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = ["{}: {}".format(".".join(str(p) for p in e["loc"] if p != "body") or "body", e["msg"]) for e in exc.errors()]
    return JSONResponse(status_code=422, content={"error": "; ".join(errors)})


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, encoder, cross_encoder, args: dict[str, Any], tracking_uri: str | None) -> None:
        self.encoder, self.cross_encoder = encoder, cross_encoder
        self.args = AppArgs.model_validate(args)
        _set_threads(self.args.ingress.num_cpus)
        self.tracking_uri = tracking_uri
        self.inflight = 0
        self._pending_warm: list[str] | None = None  # corpus to fetch from the encoder (see check_health)
        self._warm_task: asyncio.Task | None = None
        self.model, self.info, self.manifest = None, {}, None
        self.near = LRU(self.args.cache_size)  # vectors this replica has seen: warm requests need no hop
        self.projected = LRU(self.args.projection_cache_size)  # per-sentence adapter projections of self.model

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Load (or swap in place) the adapter: Serve calls this at start and whenever user_config changes."""
        from serving.model import load_model

        model, info = load_model(user_config.get("pinned") or user_config["model_uri"], self.tracking_uri)
        if self.info and info["encoder_key"] != self.info["encoder_key"]:
            raise RuntimeError("Refusing to switch to a model trained on another encoder; redeploy the application.")
        info["requested_uri"] = user_config["model_uri"]
        if "@" in user_config["model_uri"]:  # served through an alias: report it
            info["alias"] = user_config["model_uri"].rsplit("@", 1)[1]
        first = self.model is None
        # the model and its projections change together (a request reads both at once, with no await between)
        self.model, self.projected = model, LRU(self.args.projection_cache_size)
        self.info, self.manifest = info, user_config.get("manifest")
        if first and self.args.warm_corpus and self.manifest:
            self._warm_near(self.args.warm_corpus)

    def _warm_near(self, corpus: str) -> None:
        from embed_lib.cache import EmbeddingCache

        texts = corpus_texts(corpus)
        try:
            vectors = EmbeddingCache(self.manifest).get(texts)  # no encoder here: only what is cached
        except KeyError:
            # a cold start: the encoder replica is still encoding the corpus; fetch it from there later
            log.info("%s is not fully in the embedding cache yet: the near cache warms from the encoder", corpus)
            self._pending_warm = texts
            return
        for t, v in zip(texts, vectors):
            self.near.put(t, v)

    async def check_health(self) -> None:
        """Serve's periodic health check (every 10 s); after a cold start it also begins warming the near cache
        from the encoder deployment, in the background."""
        if self._pending_warm:
            texts, self._pending_warm = self._pending_warm, None
            self._warm_task = asyncio.create_task(self._warm_near_from_encoder(texts))

    async def _warm_near_from_encoder(self, texts: list[str], chunk: int = 1024) -> None:
        try:
            for i in range(0, len(texts), chunk):
                part = [t for t in texts[i: i + chunk] if t not in self.near]
                if part:
                    for t, v in zip(part, await self.encoder.embed.remote(part)):
                        self.near.put(t, v)
            log.info("near cache warmed from the encoder: %d sentences", len(texts))
        except Exception:  # the service works without it: warm requests then make one hop more
            log.exception("warming the near cache from the encoder failed")

    async def _vectors(self, texts: list[str]) -> np.ndarray:
        found, missing = self.near.get_many(texts)
        if missing:
            for t, v in zip(missing, await self.encoder.embed.remote(missing)):
                self.near.put(t, v)
                found[t] = v
        return np.stack([found[t] for t in texts])

    @staticmethod
    def _projections(model, cache: LRU, texts: list[str], vectors: np.ndarray) -> np.ndarray | None:
        """(S, n, width) adapter projections of the texts under `model`, kept per text: a pair of cached
        sentences then costs only the pair-level layers (about half the adapter's arithmetic)."""
        if model.form == "baseline":
            return None
        found, missing = cache.get_many(texts)
        if missing:
            at = {t: i for i, t in enumerate(texts)}
            h = project(model, vectors[[at[t] for t in missing]])
            for j, t in enumerate(missing):
                found[t] = h[:, j].copy()
                cache.put(t, found[t])
        return np.stack([found[t] for t in texts], axis=1)

    @property
    def model_name(self) -> str:
        return f"{self.info.get('name')}/{self.info.get('version')}"

    async def _guarded(self, coro):
        """Admission control (503 + Retry-After beyond max_inflight) and the request timeout (504)."""
        if self.inflight >= self.args.max_inflight:
            coro.close()
            raise HTTPException(503, f"Overloaded: {self.inflight} requests in flight (max_inflight="
                                     f"{self.args.max_inflight}); retry later.", headers={"Retry-After": "1"})
        self.inflight += 1
        try:
            return await asyncio.wait_for(coro, self.args.request_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPException(504, f"Request exceeded request_timeout_s={self.args.request_timeout_s}.")
        finally:
            self.inflight -= 1

    async def _score_pairs(self, pairs: list[tuple[str, str]], cascade: bool, scorer: str) -> dict[str, Any]:
        if (cascade or scorer == "cross_encoder") and self.cross_encoder is None:
            raise HTTPException(422, "cascade / scorer='cross_encoder' need a cross-encoder: start the app with "
                                     "cross_encoder=<id or path>.")
        if scorer == "cross_encoder":
            ce = await self.cross_encoder.score.remote(pairs)
            return {"data": [{"index": i, "score": float(s), "path": "cross_encoder"} for i, s in enumerate(ce)]}
        texts = list(dict.fromkeys(t for p in pairs for t in p))
        vectors = await self._vectors(texts)
        model, projected = self.model, self.projected  # from here on no await: one model for the whole request
        h = self._projections(model, projected, texts, vectors)
        row = {t: i for i, t in enumerate(texts)}
        ia, ib = [row[a] for a, _ in pairs], [row[b] for _, b in pairs]
        out = ensemble_scores(model, vectors[ia], vectors[ib], *((None, None) if h is None else (h[:, ia], h[:, ib])))
        paths = ["adapter"] * len(pairs)
        scores = out["score"].astype(np.float64)
        if cascade:
            hard = [i for i, d in enumerate(out["difficulty"]) if d > self.args.cascade_threshold]
            if hard:
                ce = await self.cross_encoder.score.remote([pairs[i] for i in hard])
                for i, s in zip(hard, ce):
                    scores[i], paths[i] = float(s), "cross_encoder"
        data = [{"index": i, "score": float(scores[i]), "baseline": float(out["baseline"][i]),
                 "difficulty": None if np.isnan(out["difficulty"][i]) else float(out["difficulty"][i]),
                 **({"path": paths[i]} if cascade else {})} for i in range(len(pairs))]
        return {"data": data}

    @api.post("/v1/score")
    async def score(self, body: ScoreRequest) -> Response:
        pairs = body.resolved_pairs(self.args.max_pairs, self.args.max_text_chars)
        out = await self._guarded(self._score_pairs(pairs, body.cascade, body.scorer))
        return _json({**out, "model": self.model_name})

    @api.post("/v1/rerank")
    async def rerank(self, body: RerankRequest) -> Response:
        check_texts("query", [body.query], self.args.max_text_chars)
        check_texts("documents", body.documents, self.args.max_text_chars, max_items=self.args.max_documents)
        out = await self._guarded(self._score_pairs([(body.query, d) for d in body.documents], False, "adapter"))
        ranked = sorted(out["data"], key=lambda r: -r["score"])[: body.top_n or len(body.documents)]
        results = [{"index": r["index"], "relevance_score": r["score"],
                    **({"document": body.documents[r["index"]]} if body.return_documents else {})} for r in ranked]
        return _json({"results": results, "model": self.model_name})

    @api.post("/v1/warm")
    async def warm(self, body: WarmRequest) -> dict[str, Any]:
        check_texts("texts", body.texts, self.args.max_text_chars, max_items=100_000)
        added = await self._guarded(self.encoder.warm.remote(body.texts))
        await self._vectors(list(dict.fromkeys(body.texts)))  # and into this replica's near cache
        return {"added": added, "cache": await self.encoder.stats.remote(), "near_cache": self.near.stats()}

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok" if self.model is not None else "loading", "model": self.model_name}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        info = dict(self.info)
        info.pop("encoder_key", None)
        return {"data": [{**info, "embedding_cache": await self.encoder.stats.remote(),
                          "near_cache": self.near.stats(), "projection_cache": self.projected.stats(),
                          "cross_encoder": self.args.cross_encoder, "limits": {
                              "max_pairs": self.args.max_pairs, "max_documents": self.args.max_documents,
                              "max_text_chars": self.args.max_text_chars, "max_inflight": self.args.max_inflight}}]}


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder: resolves the model once (and refuses an encoder mismatch), then binds."""
    from serving.model import pinned_uri, resolve_manifest

    a = AppArgs.model_validate(args)
    tracking_uri = a.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    manifest = resolve_manifest(a.model_uri, tracking_uri)
    # the alias resolved to a version now: after the alias moves, redeploying changes the ingress's
    # user_config and Serve reconfigures it in place (no replica restart, no dropped request)
    encoder = Encoder.options(**_deployment_options(a.encoder, a.access_log)).bind(
        manifest, a.cache_size, a.max_batch_size, a.batch_wait_timeout_s, a.warm_corpus, a.encoder.num_cpus)
    user_config = {"model_uri": a.model_uri, "pinned": pinned_uri(a.model_uri, tracking_uri), "manifest": manifest}
    cross = (CrossEncoderScorer.options(ray_actor_options={"num_cpus": 0.5}).bind(a.cross_encoder, 0.5)
             if a.cross_encoder else None)
    # Serve's own bounds sit above the ingress's admission control: a bounded queue, never an unbounded one
    bounds = {"max_ongoing_requests": max(a.max_inflight * 2, 8), "max_queued_requests": max(a.max_inflight * 4, 16)}
    return Ingress.options(**_deployment_options(a.ingress, a.access_log, user_config=user_config, **bounds)).bind(
        encoder, cross, a.model_dump(), tracking_uri)
