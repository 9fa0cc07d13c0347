"""Ray Serve application: the MLflow champion adapter as a pair-scoring and re-ranking HTTP service.

    serve run serving.app:build_app model_uri=models:/pair-residual-stsb@champion
    serve deploy serving/config.yaml

Deployments: `Encoder` (the frozen encoder of the model's manifest, `@serve.batch`ed, with a bounded
LRU of sentence vectors), `Scorer` (the adapter; `reconfigure` swaps models in place), an optional
`CrossEncoderScorer` (cascade / comparison) and `Ingress` (FastAPI, OpenAPI docs at /docs).
The builder refuses a model whose encoder manifest does not match the serving encoder.
"""
# no `from __future__ import annotations`: FastAPI reads the request models from real annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from ray import serve

from serving.schemas import RerankRequest, ScoreRequest, WarmRequest, check_texts

log = logging.getLogger("serving")


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
    cache_size: int = Field(200_000, ge=0, description="sentence vectors kept per encoder replica (LRU)")
    warm_corpus: str | None = Field(None, description="pre-embed at startup: 'task:<name>' (from the embedding "
                                    "cache embed_lib built) or a text file, one sentence per line")
    max_inflight: int = Field(64, ge=1, description="requests in flight per ingress replica before 503")
    request_timeout_s: float = Field(30.0, gt=0)
    cross_encoder: str | None = Field(None, description="cross-encoder id/path for the cascade and comparison")
    cascade_threshold: float = Field(0.5, ge=0, le=1)
    encoder: Replicas = Replicas(min=1, max=2, num_cpus=0.5)
    scorer: Replicas = Replicas()
    ingress: Replicas = Replicas()


def _deployment_options(r: Replicas, **extra) -> dict[str, Any]:
    return {"ray_actor_options": {"num_cpus": r.num_cpus},
            "autoscaling_config": {"min_replicas": r.min, "max_replicas": r.max, "initial_replicas": max(1, r.min),
                                   "target_ongoing_requests": 4}, **extra}


def _set_threads(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


@serve.deployment
class Encoder:
    """Frozen encoder of the model's manifest, with a bounded LRU of sentence vectors."""

    def __init__(self, manifest: dict[str, Any], cache_size: int, max_batch_size: int, batch_wait_timeout_s: float,
                 warm_corpus: str | None, num_cpus: float) -> None:
        from embed_lib.cache import cache_key
        from embed_lib.config import EncoderConfig
        from embed_lib.encoders import FrozenEncoder

        _set_threads(num_cpus)
        self.encoder = FrozenEncoder(EncoderConfig(model=manifest["encoder"], revision=manifest.get("revision"),
                                                   tau_attn=manifest["tau_attn"], max_seq_length=manifest["max_seq_length"],
                                                   batch_size=max_batch_size))
        if cache_key(self.encoder.manifest()) != cache_key(manifest):
            raise RuntimeError(f"Refusing to start: the serving encoder ({self.encoder.manifest()}) differs from the "
                               f"model's ({manifest}).")
        self.manifest = manifest
        self.capacity = cache_size
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0
        self._encode_batch.set_max_batch_size(max_batch_size)
        self._encode_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        if warm_corpus:
            self._warm_from(warm_corpus)

    def _put(self, text: str, vec: np.ndarray) -> None:
        if self.capacity <= 0:
            return
        self.cache[text] = vec
        self.cache.move_to_end(text)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    def _warm_from(self, corpus: str) -> int:
        if corpus.startswith("task:"):
            from embed_lib.cache import EmbeddingCache
            from embed_lib.tasks import SPLITS, load_splits

            splits = load_splits(corpus[5:], SPLITS)
            texts = list(dict.fromkeys(t for d in splits.values() for t in (*d.sentence1, *d.sentence2)))
            vectors = EmbeddingCache(self.manifest).get(texts, self.encoder)  # cached vectors: no encoding
        else:
            with open(corpus, encoding="utf-8") as fh:
                texts = list(dict.fromkeys(line.rstrip("\n") for line in fh if line.strip()))
            vectors = self.encoder.encode(texts)
        for t, v in zip(texts, vectors):
            self._put(t, v)
        log.info("warmed %d sentences from %s", len(texts), corpus)
        return len(texts)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)
    async def _encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        vectors = await asyncio.to_thread(self.encoder.encode, texts, show_progress=False)
        return list(vectors)

    async def embed(self, texts: list[str]) -> np.ndarray:
        """(n, d) raw vectors; cached sentences are not encoded again."""
        unique = list(dict.fromkeys(texts))
        missing = [t for t in unique if t not in self.cache]
        self.hits += len(unique) - len(missing)
        self.misses += len(missing)
        if missing:
            for t, v in zip(missing, await asyncio.gather(*[self._encode_batch(t) for t in missing])):
                self._put(t, v)
        found = {t: self.cache[t] for t in dict.fromkeys(texts) if t in self.cache}
        if len(found) < len(set(texts)):  # cache smaller than one request: encode what was evicted
            rest = [t for t in dict.fromkeys(texts) if t not in found]
            found.update(zip(rest, self.encoder.encode(rest)))
        for t in found:
            if t in self.cache:
                self.cache.move_to_end(t)
        return np.stack([found[t] for t in texts]) if texts else np.zeros((0, self.manifest["dim"]), np.float32)

    async def warm(self, texts: list[str]) -> int:
        new = [t for t in dict.fromkeys(texts) if t not in self.cache]
        for i in range(0, len(new), 256):
            chunk = new[i: i + 256]
            for t, v in zip(chunk, await asyncio.to_thread(self.encoder.encode, chunk, show_progress=False)):
                self._put(t, v)
        return len(new)

    def stats(self) -> dict[str, Any]:
        total = self.hits + self.misses
        return {"size": len(self.cache), "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / total if total else None}


@serve.deployment
class Scorer:
    """The adapter of a registered model; `reconfigure({'model_uri': ...})` swaps it in place."""

    def __init__(self, tracking_uri: str | None, num_cpus: float) -> None:
        _set_threads(num_cpus)
        self.tracking_uri = tracking_uri
        self.info: dict[str, Any] = {}

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        from serving.model import load_model

        model, info = load_model(user_config.get("pinned") or user_config["model_uri"], self.tracking_uri)
        info["requested_uri"] = user_config["model_uri"]
        if "@" in user_config["model_uri"]:  # served through an alias: report it
            info["alias"] = user_config["model_uri"].rsplit("@", 1)[1]
        if getattr(self, "model", None) is not None and info["encoder_key"] != self.info["encoder_key"]:
            raise RuntimeError("Refusing to switch to a model trained on another encoder; redeploy the application.")
        self.model, self.info = model, info

    def score(self, xa: np.ndarray, xb: np.ndarray) -> dict[str, np.ndarray]:
        from embed_lib.export import ensemble_scores

        return ensemble_scores(self.model, xa, xb)

    def model_info(self) -> dict[str, Any]:
        return self.info


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


api = FastAPI(title="pair-adapter scorer", version="1",
              description="Pair scoring and re-ranking with a pair-level adapter over frozen sentence embeddings.")


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = ["{}: {}".format(".".join(str(p) for p in e["loc"] if p != "body") or "body", e["msg"]) for e in exc.errors()]
    return JSONResponse(status_code=422, content={"error": "; ".join(errors)})


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, encoder, scorer, cross_encoder, args: dict[str, Any]) -> None:
        self.encoder, self.scorer, self.cross_encoder = encoder, scorer, cross_encoder
        self.args = AppArgs.model_validate(args)
        self.inflight = 0

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
        vectors = await self.encoder.embed.remote(texts)
        row = {t: i for i, t in enumerate(texts)}
        xa = vectors[[row[a] for a, _ in pairs]]
        xb = vectors[[row[b] for _, b in pairs]]
        out = await self.scorer.score.remote(xa, xb)
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
    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        pairs = body.resolved_pairs(self.args.max_pairs, self.args.max_text_chars)
        out = await self._guarded(self._score_pairs(pairs, body.cascade, body.scorer))
        return {**out, "model": await self._model_name()}

    @api.post("/v1/rerank")
    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        check_texts("query", [body.query], self.args.max_text_chars)
        check_texts("documents", body.documents, self.args.max_text_chars, max_items=self.args.max_documents)
        out = await self._guarded(self._score_pairs([(body.query, d) for d in body.documents], False, "adapter"))
        ranked = sorted(out["data"], key=lambda r: -r["score"])[: body.top_n or len(body.documents)]
        results = [{"index": r["index"], "relevance_score": r["score"],
                    **({"document": body.documents[r["index"]]} if body.return_documents else {})} for r in ranked]
        return {"results": results, "model": await self._model_name()}

    @api.post("/v1/warm")
    async def warm(self, body: WarmRequest) -> dict[str, Any]:
        check_texts("texts", body.texts, self.args.max_text_chars, max_items=100_000)
        added = await self._guarded(self.encoder.warm.remote(body.texts))
        return {"added": added, "cache": await self.encoder.stats.remote()}

    async def _model_name(self) -> str:
        info = await self.scorer.model_info.remote()
        return f"{info.get('name')}/{info.get('version')}"

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        info = await self.scorer.model_info.remote()
        return {"status": "ok", "model": f"{info.get('name')}/{info.get('version')}"}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        info = dict(await self.scorer.model_info.remote())
        info.pop("encoder_key", None)
        return {"data": [{**info, "embedding_cache": await self.encoder.stats.remote(),
                          "cross_encoder": self.args.cross_encoder, "limits": {
                              "max_pairs": self.args.max_pairs, "max_documents": self.args.max_documents,
                              "max_text_chars": self.args.max_text_chars, "max_inflight": self.args.max_inflight}}]}


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder: resolves the model once (and refuses an encoder mismatch), then binds."""
    from serving.model import pinned_uri, resolve_manifest

    a = AppArgs.model_validate(args)
    tracking_uri = a.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    manifest = resolve_manifest(a.model_uri, tracking_uri)
    # the alias resolved to a version now: after the alias moves, redeploying changes the scorer's
    # user_config and Serve reconfigures it in place (no replica restart, no dropped request)
    encoder = Encoder.options(**_deployment_options(a.encoder)).bind(
        manifest, a.cache_size, a.max_batch_size, a.batch_wait_timeout_s, a.warm_corpus, a.encoder.num_cpus)
    scorer = Scorer.options(**_deployment_options(
        a.scorer, user_config={"model_uri": a.model_uri, "pinned": pinned_uri(a.model_uri, tracking_uri)})).bind(
        tracking_uri, a.scorer.num_cpus)
    cross = (CrossEncoderScorer.options(ray_actor_options={"num_cpus": 0.5}).bind(a.cross_encoder, 0.5)
             if a.cross_encoder else None)
    # Serve's own bounds sit above the ingress's admission control: a bounded queue, never an unbounded one
    bounds = {"max_ongoing_requests": max(a.max_inflight * 2, 8), "max_queued_requests": max(a.max_inflight * 4, 16)}
    return Ingress.options(**_deployment_options(a.ingress, **bounds)).bind(
        encoder, scorer, cross, a.model_dump())
