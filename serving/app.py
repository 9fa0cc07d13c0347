"""Ray Serve application: the MLflow champion adapter as a pair-scoring and re-ranking HTTP service.

    make serve                                   # cluster/local.sh serve serving/config.yaml on a local cluster
    serve run serving/config.yaml                # on that cluster, in the foreground (docs/serving.md)

Deployments (serving/deployments.py): `Encoder`, an optional `CrossEncoderScorer` (or the same cross-encoder inside
the ingress replica: `cross_encoder_placement`), `WarmJobs`; and `Ingress` here: the routes (our API, plus the
request shapes of Cohere's rerank v1 / v2, vLLM's score and TEI's rerank, so the clients people have work
unchanged, with their truncation options: serving/truncation.py), admission control, timeouts, model swapping, the
near cache's warming (serving/near_warm.py), and a `PairScorer` (serving/scorer.py) that holds the
adapter and its caches. The scorer lives in the ingress replica rather than in a deployment of its own: a request
whose sentences are cached then makes no call beyond the ingress, and every deployment hop costs more CPU than
scoring a request's pairs. The FastAPI app, its one error body and the offline /docs are in serving/api.py. The
builder refuses a model whose encoder manifest does not match the serving encoder; the ingress autoscales on its
own CPU share as well as on its requests (serving/autoscale.py).

Handlers never block the replica's event loop for long (encoding and the cross-encoder run in worker threads):
the clusters run with Serve's user code on the main loop (cluster/serve.env).
"""
# no `from __future__ import annotations`: FastAPI reads the request models from real annotations

import asyncio
import logging
import math
import os
import time
import uuid
from typing import Any

import numpy as np
from fastapi.responses import Response
from ray import serve

from embed_lib.training.export import as_served
from serving import hot
from serving.api import ERRORS, WARM_ERRORS, api, found_job, json_response, reranked
from serving.args import AppArgs, deployment_options, ingress_autoscaling, log_options
from serving.autoscale import BUSY, CpuShare
from serving.deployments import (CROSS_ENCODER_CPUS, SHUTDOWN_POLL_S, CrossEncoderScorer, EncodeError, Encoder,
                                 WarmJobs, cross_encoder_calls, set_threads)
from serving.errors import ApiError, error_responses
from serving.model import check_requested_model, load_served, pinned_uri, resolve_manifest
from serving.schemas import (RerankRequest, RerankResponse, ScoreRequest, ScoreResponse, TeiRank, TeiRerankRequest,
                             WarmJob, WarmRequest, check_texts)
from serving.near_warm import NearCacheWarming
from serving.scorer import PairScorer, RoutingError, best_first, cascade_scores
from serving.serve_env import ingress
from serving.truncation import Truncation, truncated_pairs

log = logging.getLogger("ray.serve")  # Serve's logger: lines land in the replica's log, tagged with the replica


@serve.deployment(graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
@serve.ingress(api)
class Ingress(NearCacheWarming):
    def __init__(self, encoder, cross_encoder, warm_jobs, args: dict[str, Any], tracking_uri: str | None) -> None:
        self.encoder, self.warm_jobs = encoder, warm_jobs
        self.args = AppArgs.model_validate(args)
        set_threads(self.args.ingress.num_cpus)
        self.ce_score, self.ce_info = cross_encoder_calls(cross_encoder, self.args, tracking_uri)
        self.tracking_uri, self.inflight = tracking_uri, 0
        self.manifest = None
        self._ce_info: dict[str, Any] | None = None
        self.scorer = PairScorer(cache_size=self.args.cache_size, projection_cache_size=self.args.projection_cache_size)
        self._cpu = CpuShare()
        self.hot_routes = hot.HotRouteTable({"/v1/score": self.score, "/v1/rerank": self.rerank,
                                             "/v2/rerank": self.rerank_v2, "/rerank": self.rerank_tei},
                                            max_body=self.args.body_limit(), limits=self.args.warm_body_limits())

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve reads this every few seconds for the ingress's policy (serving/autoscale.py)."""
        return {BUSY: self._cpu.read()}

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Load (or swap in place) the adapter: Serve calls this at start and whenever user_config changes."""
        model, info = load_served(user_config, self.tracking_uri, self.scorer.info)
        first = self.scorer.model is None
        self.scorer.set_model(model, info)
        self.manifest = user_config.get("manifest")
        if first and self.args.warm_corpus and self.manifest:
            self._warm_near(self.args.warm_corpus)
        self._cpu.read()  # a load is no request load: the autoscaler's next reading starts after it

    async def _embed(self, texts: list[str]) -> np.ndarray:
        try:
            return await self.encoder.embed.remote(texts)
        except EncodeError as exc:  # a text the edge checks passed but the encoder refused: this request only
            raise ApiError(422, str(exc).splitlines()[-1]) from None

    @property
    def model_name(self) -> str:
        return f"{self.scorer.info.get('name')}/{self.scorer.info.get('version')}"

    async def _guarded(self, coro):
        """Admission control (503 + Retry-After beyond max_inflight) and the request timeout (504)."""
        if self.inflight >= self.args.max_inflight:
            if asyncio.iscoroutine(coro):
                coro.close()  # never awaited; a handle call already sent runs to its end
            raise ApiError(503, f"Overloaded: {self.inflight} requests in flight (max_inflight="
                                f"{self.args.max_inflight}); retry later.", headers={"Retry-After": "1"})
        self.inflight += 1
        try:
            if hasattr(asyncio, "timeout"):  # Python 3.11+: a deadline on this task (wait_for starts a task more)
                async with asyncio.timeout(self.args.request_timeout_s):
                    return await coro
            return await asyncio.wait_for(coro, self.args.request_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(504, f"Request exceeded request_timeout_s={self.args.request_timeout_s}.") from None
        finally:
            self.inflight -= 1

    async def _cross_encoder_info(self) -> dict[str, Any]:
        if self._ce_info is None:
            self._ce_info = await self.ce_info()
        return self._ce_info

    async def _score_pairs(self, pairs: list[tuple[str, str]], scorer: str = "adapter",
                           cascade: dict[str, Any] | None = None,
                           truncation: Truncation | None = None) -> dict[str, Any]:
        """Every pair's score, its texts first cut as `truncation` asks (serving/truncation.py); `cascade` ({budget,
        routing, seed}) re-scores the routed pairs with the cross-encoder (embed_lib.training.cascade.route).
        'unclipped': the scores before their clip to [-1, 1] (a routed pair's the cross-encoder's), for `_ranked` (not
        part of a response)."""
        if (cascade or scorer == "cross_encoder") and self.ce_score is None:
            raise ApiError(422, "cascade / budget / scorer='cross_encoder' need a cross-encoder: start the app with "
                                "cross_encoder=<models:/cross-encoder-<task>/<version>, folder, id or path>.",
                           "cascade" if cascade else "scorer")
        pairs = await truncated_pairs(self.encoder, pairs, truncation)
        if scorer == "cross_encoder":
            ce = await self.ce_score(pairs)
            return {"data": [{"index": i, "score": float(s), "path": "cross_encoder"} for i, s in enumerate(ce)],
                    "unclipped": ce}
        out = await self.scorer.score(pairs, self._embed)
        scores, info, routed = out["score"].astype(np.float64), None, np.zeros(0, np.int64)
        if cascade:
            middle = (await self._cross_encoder_info())["middle"]
            try:
                scores, routed = await cascade_scores(pairs, out, cascade, middle, self.ce_score)
            except RoutingError as exc:
                raise ApiError(422, str(exc), "routing") from None
            info = {**{k: v for k, v in cascade.items() if k != "seed"}, "routed": int(len(routed)),
                    "familiarity": float(out["novelty"].mean()), "cross_encoder": self.args.cross_encoder}
        to_ce, unclipped = set(routed.tolist()), out["unclipped"]
        if len(routed):
            unclipped = np.array(unclipped, np.float64)
            unclipped[routed] = scores[routed]
        # whole arrays to Python floats at once: per-pair numpy calls cost ~0.2 ms of a ~1.7 ms 32-pair request
        rows = zip(as_served(scores).tolist(), out["baseline"].tolist(), out["difficulty"].tolist())
        data = [{"index": i, "score": s, "baseline": b, "difficulty": None if math.isnan(d) else d,
                 **({"path": "cross_encoder" if i in to_ce else "adapter"} if cascade else {})}
                for i, (s, b, d) in enumerate(rows)]
        return {"data": data, **({"cascade": info} if info else {}), "unclipped": unclipped}

    @api.post("/v1/score", response_model=None, responses={200: {"model": ScoreResponse}, **ERRORS})
    async def score(self, body: ScoreRequest) -> Response:
        """Similarity of each pair (`pairs`, or vLLM's `text_1` / `text_2`), with the frozen cosine as `baseline`."""
        check_requested_model(body.model, self.scorer.info)
        pairs = body.resolved_pairs(self.args.max_pairs, self.args.max_text_chars)
        cascade = body.cascade_options(self.args.cascade_budget, self.args.cascade_familiarity_floor,
                                       self.scorer.default_routing(), pairs)
        cut = body.truncation(self.manifest["max_seq_length"])
        out = await self._guarded(self._score_pairs(pairs, body.scorer, cascade, cut))
        del out["unclipped"]
        for row in out["data"]:
            row["object"] = "score"
        return json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": self.model_name, **out})

    async def _ranked(self, query: str, documents: list[str], truncation: Truncation | None = None,
                      field: str = "documents", raw: bool = False) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """The documents' rows, best first (`best_first`), and the response's headers: with the app's rerank_budget,
        the cascade's routed documents and familiarity (Cohere's and TEI's bodies have no place for them); `raw`:
        each score before its clip to [-1, 1]."""
        check_texts("query", [query], self.args.max_text_chars)
        check_texts(field, documents, self.args.max_text_chars, max_items=self.args.max_documents)
        pairs = [(query, d) for d in documents]
        cascade = self.args.rerank_cascade(self.scorer.default_routing(), pairs)
        out = await self._guarded(self._score_pairs(pairs, cascade=cascade, truncation=truncation))
        data, unclipped, info = out["data"], out["unclipped"], out.get("cascade")
        if raw:
            for row, s in zip(data, unclipped.tolist()):
                row["score"] = s
        headers = {"x-cascade-routed": str(info["routed"]), "x-cascade-familiarity": f"{info['familiarity']:.4f}"
                   } if info else {}
        return [data[i] for i in best_first([r["score"] for r in data], unclipped)], headers

    async def _cohere_rerank(self, body: RerankRequest, version: str) -> Response:
        check_requested_model(body.model, self.scorer.info)
        texts = body.texts()
        cut = body.truncation(self.manifest["max_seq_length"])
        ranked, headers = await self._ranked(body.query, texts, cut)
        ranked = ranked[: body.top_n or len(texts)]
        results = [{"index": r["index"], "relevance_score": r["score"],
                    **({"document": body.document(r["index"])} if body.return_documents else {})} for r in ranked]
        return json_response({"id": str(uuid.uuid4()), "results": results, "model": self.model_name,
                      "meta": {"api_version": {"version": version}, "billed_units": {"search_units": 1}}},
                             headers=headers)

    @api.post("/v1/rerank", response_model=None, responses=reranked(RerankResponse))
    async def rerank(self, body: RerankRequest) -> Response:
        """The documents ordered by their score against the query, best first (`top_n` of them): Cohere's
        v1 rerank request and response."""
        return await self._cohere_rerank(body, "1")

    @api.post("/v2/rerank", response_model=None, responses=reranked(RerankResponse))
    async def rerank_v2(self, body: RerankRequest) -> Response:
        """Cohere's v2 rerank (what `cohere.ClientV2.rerank` posts)."""
        return await self._cohere_rerank(body, "2")

    @api.post("/rerank", response_model=list[TeiRank], responses=reranked())
    async def rerank_tei(self, body: TeiRerankRequest) -> Response:
        """Text Embeddings Inference's rerank: `{"query", "texts"}` -> `[{"index", "score", "text"?}]`."""
        ranked, headers = await self._ranked(body.query, body.texts, body.truncation(), field="texts",
                                             raw=body.raw_scores)
        rows = [{"index": r["index"], "score": r["score"],
                 **({"text": body.texts[r["index"]]} if body.return_text else {})} for r in ranked]
        return json_response(rows, headers=headers)

    @api.post("/v1/warm", responses=error_responses(400, 413, 422, 500, 503, 504))
    async def warm(self, body: WarmRequest) -> dict[str, Any]:
        """Pre-embed up to max_warm_sync texts now; larger corpora go to POST /v1/warm/jobs."""
        if len(body.texts) > self.args.max_warm_sync:
            raise ApiError(413, f"texts has {len(body.texts)} items; a synchronous warm takes at most "
                                f"{self.args.max_warm_sync} (max_warm_sync). Submit larger corpora as a background "
                                "job: POST /v1/warm/jobs, then GET /v1/warm/jobs/{id}.", "texts")
        check_texts("texts", body.texts, self.args.max_text_chars)
        added, vectors = await self._guarded(self.encoder.warm.remote(body.texts, return_vectors=True))
        self.scorer.add_vectors(list(vectors), list(vectors.values()))  # this replica's near cache, same call
        return {"added": added, "cache": await self.encoder.stats.remote(), "near_cache": self.scorer.near.stats()}

    @api.post("/v1/warm/jobs", status_code=202, response_model=WarmJob, responses=WARM_ERRORS)
    async def submit_warm_job(self, body: WarmRequest) -> dict[str, Any]:
        """Start a background warm of up to max_warm_job texts; poll GET /v1/warm/jobs/{id}."""
        check_texts("texts", body.texts, self.args.max_text_chars, max_items=self.args.max_warm_job)
        job = await self.warm_jobs.submit.remote(body.texts)
        if job is None:
            raise ApiError(503, "A warm job is already running; wait for it (GET /v1/warm/jobs/{id}) or cancel it "
                                "(DELETE /v1/warm/jobs/{id}).", headers={"Retry-After": "5"})
        return job

    @api.get("/v1/warm/jobs/{job_id}", response_model=WarmJob, responses=error_responses(404))
    async def warm_job(self, job_id: str) -> dict[str, Any]:
        """Progress of a warm job: state, texts done, texts newly encoded."""
        return found_job(await self.warm_jobs.status.remote(job_id), job_id)

    @api.delete("/v1/warm/jobs/{job_id}", response_model=WarmJob, responses=error_responses(404))
    async def cancel_warm_job(self, job_id: str) -> dict[str, Any]:
        """Cancel a running warm job (texts already encoded stay cached)."""
        return found_job(await self.warm_jobs.cancel.remote(job_id), job_id)

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok" if self.scorer.model is not None else "loading", "model": self.model_name}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """The served version: registry name / version / alias, validation, transfer and selection figures,
        cache statistics and limits."""
        info = dict(self.scorer.info)
        info.pop("encoder_key", None)
        a = self.args
        caches = self.scorer.stats()
        caches["near_cache"]["warming"] = self.near_cache_warming()
        # hot_routes: requests each scoring / re-ranking path answered past FastAPI's routing (serving/hot.py); code:
        # the fingerprint of serving/ and embed_lib/ a deploy through cluster/local.sh gave (cluster/serve_config.py)
        return {"data": [{**info, "ingress": ingress(), "code": os.environ.get("EMBED_SERVE_CODE"),
                          "hot_routes": self.hot_routes.served,
                          "embedding_cache": await self.encoder.stats.remote(), **caches,
                          "cross_encoder": (await self._cross_encoder_info()) if self.ce_score else None,
                          "cascade_budget": a.cascade_budget, "cascade_familiarity_floor": a.cascade_familiarity_floor,
                          "rerank_budget": a.rerank_budget,
                          "limits": a.limits()}]}


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder: resolves the model once (and refuses an encoder mismatch), then binds."""
    a = AppArgs.parse(args)
    tracking_uri = a.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    # the alias resolved to a version once, and everything read from that version: after the alias moves,
    # redeploying changes the ingress's user_config and Serve moves to the new version without dropping a request
    pinned = pinned_uri(a.model_uri, tracking_uri)
    manifest = resolve_manifest(pinned, tracking_uri, requested=a.model_uri)
    # Serve's own bounds sit above the ingress's admission control: a bounded queue, never an unbounded one. The
    # model deployments take as many requests at once as the ingress admits, so their batches can fill (at
    # Serve's default of 5 the callers beyond it wait in the router's back-off, seconds under load)
    bounds = {"max_ongoing_requests": max(a.max_inflight * 2, 8), "max_queued_requests": max(a.max_inflight * 4, 16)}
    encoder = Encoder.options(**deployment_options(a.encoder, a.access_log, **bounds)).bind(
        manifest, a.cache_size, a.max_batch_size, a.batch_wait_timeout_s, a.warm_corpus, a.encoder.num_cpus,
        a.warm_corpus_columns)
    user_config = {"model_uri": a.model_uri, "pinned": pinned, "manifest": manifest}
    # cross_encoder_placement='ingress': no deployment; each ingress replica loads the cross-encoder itself
    logs = log_options(a.access_log)  # every deployment follows access_log
    cross = (CrossEncoderScorer.options(ray_actor_options={"num_cpus": CROSS_ENCODER_CPUS}, **logs, **bounds).bind(
        a.cross_encoder, a.cross_encoder_backend, CROSS_ENCODER_CPUS, tracking_uri)
        if a.cross_encoder and a.cross_encoder_placement == "deployment" else None)
    jobs = WarmJobs.options(**logs).bind(encoder)
    # the ingress scales on its replicas' CPU share too: behind HAProxy, Serve's count of its requests reads 0
    policy = ingress_autoscaling(a.ingress_target_cpu)
    return Ingress.options(**deployment_options(a.ingress, a.access_log, policy, user_config=user_config, **bounds)
                           ).bind(encoder, cross, jobs, a.model_dump(), tracking_uri)
