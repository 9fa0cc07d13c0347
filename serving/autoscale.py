"""The ingress's autoscaling: Serve's queue-length rule, plus the replicas' own CPU use.

Serve scales a deployment on its ongoing requests, which a replica samples every few seconds on its event loop.
Behind Serve's HAProxy ingress (the default, cluster/serve.env) a warm request never waits on anything inside
the replica, and the samples read 0 (also with one yield to the loop per request): the queue sits in the sockets
and in HAProxy, where Serve does not look. Measured on 2 cores at c=8 x 32 pairs: 0 ongoing requests at the
controller for 110 s, one replica throughout; through Serve's Python proxy (whose handle counts what it sent) ~8,
and a second replica after ~35 s. So the ingress reports a metric of its own, the share of one core its process
used since the last report (`CpuShare`, via Serve's `record_autoscaling_stats`), and `IngressPolicy` asks for
max(Serve's queue-length decision, the replicas' summed share / its target: the app's `ingress_target_cpu`, by
default TARGET_BUSY). Serve applies the deployment's bounds, scaling factors and delays to the result as it does to
its own policy's.

Serve ships the policy to its controller by value (cloudpickle): this module imports nothing outside the
standard library.
"""
from __future__ import annotations

import time
from typing import Any, Callable

#: the share of one core an ingress replica may use on average before the policy asks for another: its event loop
#: is one thread and saturates near 0.9 of a core, so at 0.5 the replicas scale out before requests queue
TARGET_BUSY = 0.5
#: the metric's name in Serve's custom autoscaling metrics
BUSY = "busy"


class IngressPolicy:
    """Replicas wanted (Serve rounds up and bounds them): the larger of Serve's queue-length rule
    (ongoing requests / target_ongoing_requests) and the replicas' summed CPU share / `target_busy`.

    A class so that Serve hands it the app's `ingress_target_cpu` (its `policy_kwargs` go to the constructor of a
    class policy, which the controller builds once and then calls on every autoscaling tick)."""

    def __init__(self, target_busy: float = TARGET_BUSY):
        if not 0 < target_busy:
            raise ValueError(f"target_busy must be a share of a core above 0, got {target_busy!r}")
        self.target_busy = float(target_busy)

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        if ctx.current_num_replicas == 0:  # Serve's own cold start (requests waiting at a handle) decides
            return ctx.target_num_replicas, {}
        by_queue = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
        busy = (ctx.aggregated_metrics or {}).get(BUSY) or {}
        return max(by_queue, sum(busy.values()) / self.target_busy), {}


class CpuShare:
    """The share of one core this process used between two readings (all its threads: the event loop, a
    cross-encoder placed in the replica, Ray's own)."""

    def __init__(self, wall: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.process_time):
        self.wall, self.cpu = wall, cpu
        self.at = (wall(), cpu())

    def read(self) -> float:
        now = (self.wall(), self.cpu())
        (wall0, cpu0), self.at = self.at, now
        return max(0.0, now[1] - cpu0) / max(now[0] - wall0, 1e-6)
