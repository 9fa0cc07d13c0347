"""The load side of the serving benchmarks: request bodies, a closed-loop client in a process of its own (bounded
in time, loopback only), the in-process baseline, and the direct-ingress port of an application."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import statistics
import time
import zlib

import aiohttp
import torch


def _closed_loop(url: str, body_fn, concurrency: int, seconds: float, out: mp.Queue) -> None:
    """Closed loop in a separate process: `concurrency` aiohttp clients, each sends its next request on a reply
    (an asyncio client: a thread-per-connection client would spend the 2 cores on itself)."""
    lat, pairs, errors, statuses = [], [0], [0], {}

    async def worker(session, k: int, stop: float) -> None:
        i = 0
        while time.time() < stop:
            body, n = body_fn(k, i)
            t = time.perf_counter()
            async with session.post(url, json=body) as r:
                text = await r.read()
                ok = r.status == 200
            dt = time.perf_counter() - t
            if ok:
                lat.append(dt)
                pairs[0] += n
            else:  # which failure: its status, and the first body of each status (the service's error body)
                errors[0] += 1
                seen = statuses.setdefault(str(r.status),
                                           {"count": 0, "first_body": text[:300].decode("utf-8", "replace")})
                seen["count"] += 1
            i += 1

    async def main() -> float:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            t0 = time.time()
            await asyncio.gather(*[worker(session, k, t0 + seconds) for k in range(concurrency)])
            return time.time() - t0

    cpu0 = time.process_time()
    wall = asyncio.run(main())
    client_cpu = time.process_time() - cpu0
    lat.sort()
    out.put({"requests": len(lat), "errors": errors[0], **({"error_statuses": statuses} if statuses else {}),
             "pairs_per_s": pairs[0] / wall,
             "client_cores": client_cpu / wall,
             "p50_ms": 1000 * statistics.median(lat) if lat else None,
             "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None})


class Bodies:
    """Picklable request factories (the load runs in another process)."""

    def __init__(self, kind: str, sentences: list[str], n_pairs: int, scorer: str = "adapter", salt: str = "",
                 budget: float | None = None) -> None:
        self.kind, self.sentences, self.n, self.scorer, self.salt = kind, sentences, n_pairs, scorer, salt
        self.budget = budget

    def __call__(self, k: int, i: int):
        m, pairs = len(self.sentences), []
        for j in range(self.n):  # cold: sentences never seen before (the encoder must run)
            a, b = self.sentences[(k * 97 + i * 31 + j) % m], self.sentences[(k * 13 + i * 7 + j + 1) % m]
            pairs.append([self._new(a, f"{k}-{i}-{j}a"), self._new(b, f"{k}-{i}-{j}b")] if self.kind == "cold" else [a, b])
        body = {"pairs": pairs, "scorer": self.scorer}
        if self.budget is not None:  # a cascade: routing_seed varies per request, so the budget's rounding averages out
            body.update(budget=self.budget, routing="difficulty", routing_seed=i)
        return body, self.n

    def _new(self, sentence: str, key: str) -> str:
        """The sentence's words in an order seeded by (salt, key): a text the service has not seen, of the same
        length as the warm ones (a prefix would lengthen every cold text and slow the encoder unfairly)."""
        words = sentence.split()
        random.Random(zlib.crc32(f"{self.salt}{key}".encode())).shuffle(words)
        return " ".join(words)


def run_load(url, bodies, concurrency, seconds, cpu_of: str | None = None):
    """One cell's figures. cpu_of: an application whose ingress replicas' CPU per request the figures get
    (`ingress_cpu_ms_per_request`): on the 2-core VM of the targets the same request cost 1.5 ms of CPU in one second
    and 2.2-3.7 ms in another, and a cell's latency follows it."""
    cpu = replica_cpu_s(cpu_of) if cpu_of else None
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_closed_loop, args=(url, bodies, concurrency, seconds, q))
    p.start()
    res = q.get(timeout=seconds + 300)
    p.join()
    after = replica_cpu_s(cpu_of) if cpu is not None else None
    if after is not None:
        res["ingress_cpu_ms_per_request"] = 1000 * (after - cpu) / max(1, res["requests"])
    return res


def replica_cpu_s(app: str, deployment: str = "Ingress") -> float | None:
    """CPU seconds used so far by the replica processes of `deployment` in application `app` on this machine, all
    their threads (from /proc, found by the process title Ray gives a replica); None without /proc or replica."""
    if not os.path.isdir("/proc"):
        return None
    tag, total, found = f"ServeReplica:{app}:{deployment}".encode(), 0.0, False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if tag not in fh.read():
                    continue
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
            found = True
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
    return total if found else None


def one_thread_pairs_per_s(score, seconds: float) -> float:
    """Pairs/s of `score()` (32 pairs a call) called back to back in this process on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        score()
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < seconds:
            score()
            n += 32
        return n / (time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)


def direct_ingress_port(app: str) -> int:
    """The HTTP port the application's ingress replica serves on under direct ingress (asked of the Serve
    controller: `get_target_groups` is what Serve's own HAProxy manager reads; Ray has no public call for it)."""
    # lazy: a benchmark sets Serve's environment (apply_serve_env, direct ingress) before Ray is first imported
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    for group in ray.get(controller.get_target_groups.remote(app)):
        if str(group.protocol).upper().endswith("HTTP") and group.targets:
            return group.targets[0].port
    raise RuntimeError(f"no direct-ingress HTTP target for application {app!r}")
