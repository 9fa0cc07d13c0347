"""Typed arguments of the serving application (`serve run ... key=value`, or `args:` in config.yaml)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from embed_lib.training.cascade import FAMILIARITY_FLOOR, pairs_seed


#: the default ceiling of a warm body (max_warm_body_bytes): 256 MiB, about 100,000 texts of 2,000 ASCII characters
WARM_BODY_CAP = 256 * 1024 * 1024


class Replicas(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error naming it, not a silent default

    min: int = Field(1, ge=0)
    max: int = Field(2, ge=1)
    num_cpus: float = Field(0.25, gt=0, description="fractional CPUs per replica: replicas that each ask for a "
                            "whole CPU cannot all be placed on a small node, and Serve waits for them")
    max_per_node: int | None = Field(None, ge=1, description="replicas of this deployment per Ray node at the most "
                                     "(Serve's max_replicas_per_node): 1 spreads them over the nodes of a cluster, so "
                                     "that losing one node loses one replica")
    downscale_delay_s: float = Field(600.0, ge=0, description="seconds of low load before Serve removes a replica "
                                     "(Serve's default); shorter gives idle nodes back to the autoscaler sooner")
    upscale_delay_s: float = Field(30.0, ge=0, description="seconds of high load before Serve adds a replica "
                                   "(Serve's default)")

    @model_validator(mode="after")
    def _min_within_max(self) -> "Replicas":
        if self.min > self.max:
            raise ValueError(f"min={self.min} is above max={self.max}; give min <= max")
        return self


class AppArgs(BaseModel):
    """Typed arguments of the application builder (`serve run ... key=value`, or `args:` in config.yaml)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error naming it, not a silent default

    model_uri: str = "models:/pair-residual-stsb@champion"
    tracking_uri: str | None = Field(None, description="MLflow tracking URI (default $MLFLOW_TRACKING_URI)")
    max_pairs: int = Field(256, ge=1, description="pairs per /v1/score request")
    max_documents: int = Field(1000, ge=1, description="documents per /v1/rerank request")
    max_text_chars: int = Field(2000, ge=1, description="characters per text")
    max_warm_sync: int = Field(1000, ge=1, description="texts per synchronous /v1/warm request (more: 413; use "
                               "/v1/warm/jobs). Keep it to what the encoder embeds within request_timeout_s")
    max_warm_job: int = Field(100_000, ge=1, description="texts per background warm job")
    max_batch_size: int = Field(64, ge=1, description="sentences per encoder forward pass (@serve.batch)")
    batch_wait_timeout_s: float = Field(0.005, ge=0)
    cache_size: int = Field(200_000, ge=0, description="sentence vectors kept per encoder replica (LRU) and per "
                            "ingress replica (near cache)")
    projection_cache_size: int = Field(50_000, ge=0, description="sentences whose adapter projection (seeds x width "
                                       "floats each) each ingress replica keeps (LRU, emptied when the model changes)")
    warm_corpus: str | None = Field(None, description="pre-embed at startup: 'task:<name>' (from the embedding "
                                    "cache embed_lib built), a .csv / .tsv / .jsonl / .parquet file of your pairs, or "
                                    "a text file, one sentence per line")
    warm_corpus_columns: list[str] | None = Field(None, description="the text columns of a table warm_corpus "
                                                  "(default: every column holding only text)")
    max_body_bytes: int | None = Field(None, ge=1024, description="bytes per /v1/score, /v1/rerank, /v2/rerank and "
                                       "/rerank request body, 413 past it before the rest is read (default: the "
                                       "most the limits above allow, every character JSON-escaped: body_limit)")
    max_warm_body_bytes: int | None = Field(None, ge=1024, description="bytes per /v1/warm and /v1/warm/jobs "
                                            "request body, 413 past it before the rest is read (default: the most "
                                            "max_warm_sync / max_warm_job texts allow, as body_limit counts them, "
                                            "and at most 256 MiB: split a larger corpus into several jobs)")
    max_inflight: int = Field(64, ge=1, description="requests in flight per ingress replica before 503")
    access_log: bool = Field(False, description="per-request access logs in the replicas (each costs CPU on "
                             "every request; errors are logged either way)")
    request_timeout_s: float = Field(30.0, gt=0)
    cross_encoder: str | None = Field(None, description="cross-encoder for the cascade and scorer='cross_encoder': a "
                                      "registered teacher (models:/cross-encoder-<task>/<version> or @alias), a "
                                      "folder `python -m embed_lib teacher` saved, or any cross-encoder id / path")
    cross_encoder_backend: Literal["torch", "onnx", "onnx-int8"] = Field(
        "torch", description="inference backend of the cross-encoder (onnx-int8: ~2x faster on CPU)")
    cross_encoder_placement: Literal["deployment", "ingress"] = Field(
        "ingress", description="where the cross-encoder runs: inside each ingress replica (no deployment hop, one "
        "process fewer: the faster cascade on one node, results/README.md; give the ingress's num_cpus a share for "
        "it), or a deployment of its own (scales apart from the ingress, can sit on a GPU node; every call is a hop)")
    cascade_budget: float = Field(0.1, ge=0, le=1, description="default fraction of a cascade request's pairs sent to "
                                  "the cross-encoder (a request may set its own `budget`)")
    cascade_familiarity_floor: float = Field(
        FAMILIARITY_FLOOR, ge=0, le=1, description="default least mean novelty-gate weight of a cascade request's "
        "pairs for any to go to the cross-encoder: an unfamiliar request (off the adapter's training data, where the "
        "cross-encoder harmed) is scored by the adapter alone; 0 routes every request (a request may set its own "
        "`familiarity_floor`; embed_lib.training.cascade)")
    rerank_budget: float = Field(0.0, ge=0, le=1, description="fraction of each re-ranking request's documents "
                                 "(/v1/rerank, /v2/rerank, /rerank) sent to the cross-encoder, routed as /v1/score's "
                                 "cascade routes a request's pairs (the adapter's default routing, "
                                 "cascade_familiarity_floor); 0: the adapter alone scores them. Needs cross_encoder")
    encoder: Replicas = Replicas(min=1, max=2, num_cpus=0.5)
    ingress: Replicas = Replicas(min=1, max=2, num_cpus=0.5)
    ingress_target_cpu: float = Field(0.5, gt=0, le=8, description="share of one core an ingress replica uses on "
                                      "average before the autoscaler adds another (serving/autoscale.py); lower "
                                      "scales out sooner, e.g. on a node whose cores other work shares")

    @model_validator(mode="after")
    def _rerank_budget_has_a_cross_encoder(self) -> "AppArgs":
        if self.rerank_budget > 0 and not self.cross_encoder:
            raise ValueError(f"rerank_budget={self.rerank_budget} routes documents to a cross-encoder, and none is "
                             "configured: give cross_encoder=<models:/cross-encoder-<task>/<version>, folder, id or "
                             "path>, or rerank_budget=0")
        return self

    def rerank_cascade(self, routing: str, pairs: list[tuple[str, str]]) -> dict[str, Any] | None:
        """The cascade of a re-ranking request's (query, document) pairs: rerank_budget of them, routed by `routing`
        (the served adapter's default) under cascade_familiarity_floor, seeded by the pairs as /v1/score seeds a
        request without routing_seed; None at rerank_budget=0."""
        if not self.rerank_budget:
            return None
        return {"budget": self.rerank_budget, "routing": routing, "seed": pairs_seed(pairs), "combine": "replace",
                "familiarity_floor": self.cascade_familiarity_floor}

    def body_limit(self) -> int:
        """max_body_bytes, else the largest body the other limits let through: max_pairs pairs (or a query and
        max_documents documents) of max_text_chars characters each, each character escaped as JSON's longest
        form (12 bytes: a surrogate pair of \\uXXXX), with 64 KiB for the rest of the body."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return 12 * self.max_text_chars * max(2 * self.max_pairs, self.max_documents + 1) + 64 * 1024

    def warm_body_limits(self) -> dict[str, tuple[int, str]]:
        """path -> (the most bytes a warm route's body may have, the option that sets it): max_warm_body_bytes, else
        max_warm_sync (/v1/warm) or max_warm_job (/v1/warm/jobs) texts of max_text_chars characters, escaped as in
        body_limit, with 64 KiB for the rest; at most WARM_BODY_CAP (the ingress holds a body whole while it parses
        it, and a job's default limits would allow 2.4 GB)."""
        def limit(texts: int) -> int:
            if self.max_warm_body_bytes is not None:
                return self.max_warm_body_bytes
            return min(12 * self.max_text_chars * texts + 64 * 1024, WARM_BODY_CAP)
        return {"/v1/warm": (limit(self.max_warm_sync), "max_warm_body_bytes"),
                "/v1/warm/jobs": (limit(self.max_warm_job), "max_warm_body_bytes")}

    def limits(self) -> dict[str, int]:
        """What one request may hold, as /v1/models reports it (max_body_bytes, max_warm_*_body_bytes: the limits in
        force)."""
        warm = self.warm_body_limits()
        return {**{k: getattr(self, k) for k in ("max_pairs", "max_documents", "max_text_chars", "max_inflight",
                                                 "max_warm_sync", "max_warm_job")},
                "max_body_bytes": self.body_limit(), "max_warm_sync_body_bytes": warm["/v1/warm"][0],
                "max_warm_job_body_bytes": warm["/v1/warm/jobs"][0]}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> "AppArgs":
        """The builder's arguments validated; an error lists what was wrong and the arguments there are."""
        try:
            return cls.model_validate(args)
        except ValidationError as exc:
            raise ValueError(f"Invalid application arguments: {exc}\nValid arguments: {sorted(cls.model_fields)}; "
                             f"encoder / ingress take {sorted(Replicas.model_fields)}.") from None


def log_options(access_log: bool) -> dict[str, Any]:
    """Serve's logging option of every deployment of the app: per-request access logs only when asked for."""
    return {"logging_config": {"enable_access_log": access_log}}


def deployment_options(r: Replicas, access_log: bool = False, policy: dict[str, Any] | None = None,
                       **extra) -> dict[str, Any]:
    """Serve options of a deployment from its Replicas settings; `policy`: Serve's AutoscalingPolicy fields
    (`policy_function`, an import path, and `policy_kwargs`; default: Serve's queue-length policy)."""
    spread = {"max_replicas_per_node": r.max_per_node} if r.max_per_node else {}
    scaling = {"min_replicas": r.min, "max_replicas": r.max, "initial_replicas": max(1, r.min),
               "target_ongoing_requests": 4, "downscale_delay_s": r.downscale_delay_s,
               "upscale_delay_s": r.upscale_delay_s, **({"policy": policy} if policy else {})}
    return {"ray_actor_options": {"num_cpus": r.num_cpus}, **spread,
            **log_options(access_log), "autoscaling_config": scaling, **extra}


def ingress_autoscaling(target_cpu: float) -> dict[str, Any]:
    """The ingress's autoscaling policy for Serve (serving/autoscale.py), scaling out above `target_cpu` of a core
    per replica: Serve builds the class once in its controller with these keyword arguments."""
    return {"policy_function": "serving.autoscale:IngressPolicy", "policy_kwargs": {"target_busy": target_cpu}}
