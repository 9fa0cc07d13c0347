"""benchmarks/multinode.py's serving phases: serving/config_multinode.yaml on the cluster, a closed loop of warm
requests from the head (`python benchmarks/multinode_serving.py _load SECONDS OUT [C N SETTLE]`, run in the head's
namespace), a worker node killed under it, and Serve's autoscaling across nodes."""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import mlflow
import requests
import yaml

from benchmarks.load import Bodies
from benchmarks.multinode_cluster import REPO, mlflow_client, net, node_ids, nodes, on_head
from embed_lib.config import AdapterConfig
from embed_lib.data.tasks import load_task
from embed_lib.pipeline.prepare import load_study
from embed_lib.tracking.registry import evidence_of, log_adapter_model, promote
from embed_lib.tracking.runs import set_experiment
from embed_lib.training.seed_group import train_seed_group


async def _timed_loop(url: str, bodies, concurrency: int, seconds: float) -> list[tuple[float, int, int]]:
    events: list[tuple[float, int, int]] = []  # (seconds since start, ok, pairs)
    t0 = time.time()

    async def worker(session, k: int) -> None:
        i = 0
        while time.time() - t0 < seconds:
            body, n = bodies(k, i)
            try:
                async with session.post(url, json=body) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            events.append((time.time() - t0, int(ok), n))
            i += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*[worker(session, k) for k in range(concurrency)])
    return events


def load_main(seconds: float, out: str, concurrency: int = 8, n_sentences: int = 2000, settle_s: float = 20) -> None:
    """The closed loop, run in the head's namespace (the proxy listens on its loopback): events to `out`.
    `n_sentences` of STS-B validation warmed first, then `settle_s` seconds of the loop unrecorded."""
    sentences = load_task("stsb", "validation").texts()[:n_sentences]
    for _ in range(3):  # every replica's cache warm (each call lands on one replica), then the loop, unrecorded
        for i in range(0, len(sentences), 1000):
            requests.post("http://127.0.0.1:8000/v1/warm", json={"texts": sentences[i: i + 1000]}, timeout=600)
    asyncio.run(_timed_loop("http://127.0.0.1:8000/v1/score", Bodies("warm", sentences, 32), 8, settle_s))
    t0 = time.time()
    (Path(out).parent / "load_started").write_text(str(t0))
    events = asyncio.run(_timed_loop("http://127.0.0.1:8000/v1/score", Bodies("warm", sentences, 32), concurrency,
                                     seconds))
    Path(out).write_text(json.dumps({"t0": t0, "events": events}))


def replicas_by_node() -> dict[str, list[str]]:
    """{node name: the Serve deployments with a live replica there} (asked from the head)."""
    live = on_head("[[a.class_name, a.node_id] for a in ray.util.state.list_actors(filters=[('state', '=', 'ALIVE')])"
                   " if a.class_name.startswith('ServeReplica')]", imports=", ray.util.state")
    ids = {n["node_id"]: n["name"] for n in node_ids()}
    found: dict[str, list[str]] = {}
    for cls, node_id in live:
        found.setdefault(ids.get(node_id, node_id[:8]), []).append(cls.rsplit(":", 1)[-1])
    return found


def register_any(name: str = "pair-residual-stsb-limited") -> str:
    """A small adapter (200 STS-B pairs a split, 2 seeds, 2 epochs) registered as `name`'s champion through the
    cluster's MLflow server, from this process (for a sweep that found no winner); returns `name`."""
    mlflow_client()  # the server's URL and credentials into this process's environment
    data, _ = load_study("stsb", limit=200)
    set_experiment("multinode-register", os.environ["MLFLOW_TRACKING_URI"])
    result = train_seed_group(AdapterConfig(adapter="pair_gated", target="lexical", n_seeds=2, epochs=2, width=32,
                                            hidden=32), data)
    with mlflow.start_run():
        info = log_adapter_model(result, data, registered_name=name)
    promote(name, info.registered_model_version, evidence_of(result, data))
    return name


def serve_with_node_loss(state: Path, model: str, load_s: float, kill_at_s: float, kill: str,
                         n_sentences: int = 2000, settle_s: float = 20) -> dict:
    """serving/config_multinode.yaml with `model`@champion; a warm closed loop (c=8 x 32 pairs drawn from `n_sentences`
    warmed sentences, `settle_s` unrecorded) from the head for `load_s` seconds; node `kill` ("any": a worker node
    holding a replica) killed at `kill_at_s` and a replacement started."""
    config = state / "serve.yaml"
    config.write_text((REPO / "serving" / "config_multinode.yaml").read_text().replace(
        "models:/pair-residual-stsb@champion", f"models:/{model}@champion"))
    deploy = subprocess.run([str(REPO / "cluster" / "local.sh"), "serve", str(config)], text=True, capture_output=True)
    if deploy.returncode != 0:
        return {"serving": {"deployed": False, "error": (deploy.stdout + deploy.stderr)[-800:]}}
    # the versions the deployed copy names (its aliases resolved through the cluster's MLflow server)
    copy = yaml.safe_load((state / "serve" / config.name).read_text())
    versions = [a["runtime_env"]["env_vars"]["EMBED_SERVE_MODELS"] for a in copy["applications"]]
    before_kill = replicas_by_node()
    if kill == "any":
        kill = next((n for n in sorted(before_kill) if n != "head"), "w1")
    events_file = state / "events.json"
    load = subprocess.Popen([sys.executable, str(REPO / "cluster" / "nodes.py"), "exec", "--", sys.executable,
                             str(Path(__file__).resolve()), "_load", str(load_s), str(events_file), "8",
                             str(n_sentences), str(settle_s)])
    while not (state / "load_started").exists() and load.poll() is None:
        time.sleep(0.2)
    time.sleep(kill_at_s)
    t_kill = time.time()
    nodes("kill-node", kill)
    replaced = nodes("add-worker", "--cpus", "1", "--gpus", "1").strip()
    load.wait()
    subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), "exec", "--", "serve", "shutdown", "-y",
                    "--address", f"http://{net()}.2:8265"], capture_output=True, check=False)  # the CPUs back
    record = json.loads(events_file.read_text())
    events, kill_s = record["events"], t_kill - record["t0"]
    window = [e for e in events if kill_s - 30 <= e[0] < kill_s + 30]
    per_s = {}
    for t, ok, n in events:
        per_s[int(t)] = per_s.get(int(t), 0) + (n if ok else 0)
    before = statistics.median([per_s.get(s, 0) for s in range(5, int(kill_s) - 1)] or [0])
    recovery = next((s - kill_s for s in range(int(kill_s) + 1, int(load_s) - 4)
                     if sum(per_s.get(s + j, 0) for j in range(5)) / 5 >= 0.9 * before), None)
    return {"serving": {"deployed": True, "config": "serving/config_multinode.yaml", "model": f"{model}@champion",
                        "deployed_versions": versions,
                        "load": "warm, c=8 x 32 pairs, closed loop from the head", "killed_node": kill,
                        "killed_at_s": round(kill_s, 1), "replacement_node": replaced,
                        "replicas_by_node_before": before_kill, "replicas_by_node_after": replicas_by_node(),
                        "pairs_per_s_before": before},
            "requests": len(events), "requests_in_kill_window": len(window),
            "failed_requests": sum(1 - e[1] for e in window),
            "failed_requests_total": sum(1 - e[1] for e in events),
            "failed_fraction": round(sum(1 - e[1] for e in window) / max(1, len(window)), 4),
            "recovery_s": None if recovery is None else round(recovery, 1),
            "pairs_per_s_by_second": [per_s.get(s, 0) for s in range(int(load_s))]}


def serve_autoscale_phase(state: Path, model: str, load_s: float = 90, concurrency: int = 32) -> dict:
    """On the autoscaling cluster: serving/config_multinode.yaml with `model`@champion from one replica each (min 1,
    max 4, one per node, Serve's downscale delay 10 s); a closed loop of `concurrency` x 32 warm pairs for `load_s`
    seconds makes Serve ask for replicas no node has room for, Ray's autoscaler adds nodes for them; after the load
    Serve removes the replicas and the autoscaler the idle nodes. Replicas by node are sampled every 5 s."""
    config = state / "serve.yaml"
    text = (REPO / "serving" / "config_multinode.yaml").read_text().replace(
        "models:/pair-residual-stsb@champion", f"models:/{model}@champion")
    for name in ("encoder", "ingress"):
        text = text.replace(f"{name}: {{min: 2, max: 4, num_cpus: 0.5, max_per_node: 1}}",
                            f"{name}: {{min: 1, max: 4, num_cpus: 0.5, max_per_node: 1, downscale_delay_s: 10}}")
    config.write_text(text)
    deploy = subprocess.run([str(REPO / "cluster" / "local.sh"), "serve", str(config)], text=True, capture_output=True)
    if deploy.returncode != 0:
        return {"serve_autoscale": {"deployed": False, "error": (deploy.stdout + deploy.stderr)[-800:]}}
    t0 = time.time()
    samples = [{"t": 0.0, "nodes": len(json.loads(nodes("status"))["nodes"]), "replicas": replicas_by_node()}]
    events_file = state / "events_autoscale.json"
    (state / "load_started").unlink(missing_ok=True)
    load = subprocess.Popen([sys.executable, str(REPO / "cluster" / "nodes.py"), "exec", "--", sys.executable,
                             str(Path(__file__).resolve()), "_load", str(load_s), str(events_file), str(concurrency)])
    while load.poll() is None or time.time() - t0 < load_s + 150:
        time.sleep(5)
        samples.append({"t": round(time.time() - t0, 1), "load": load.poll() is None,
                        "nodes": len(json.loads(nodes("status"))["nodes"]), "replicas": replicas_by_node()})
        if load.poll() is not None and samples[-1]["nodes"] <= samples[0]["nodes"] and \
                sum(len(v) for v in samples[-1]["replicas"].values()) <= sum(len(v) for v in samples[0]["replicas"].values()):
            break
    record = json.loads(events_file.read_text())
    events = record["events"]
    peak = max(samples, key=lambda s: len(s["replicas"]))  # nodes holding a replica ("head": WarmJobs, 0 CPUs)
    return {"serve_autoscale": {
        "deployed": True, "load": f"warm, c={concurrency} x 32 pairs for {load_s:.0f} s, closed loop from the head",
        "load_measured_from_s": round(record["t0"] - t0, 1),  # the samples' clock: after the load's warm-up
        "replica_nodes_start": len(samples[0]["replicas"]), "replica_nodes_peak": len(peak["replicas"]),
        "nodes_start": samples[0]["nodes"], "nodes_peak": max(s["nodes"] for s in samples),
        "nodes_end": samples[-1]["nodes"], "replica_nodes_end": len(samples[-1]["replicas"]),
        "requests": len(events), "failed_requests": sum(1 - e[1] for e in events), "samples": samples}}


if __name__ == "__main__" and sys.argv[1:2] == ["_load"]:
    load_main(float(sys.argv[2]), sys.argv[3], *[int(c) for c in sys.argv[4:6]], *[float(s) for s in sys.argv[6:7]])
