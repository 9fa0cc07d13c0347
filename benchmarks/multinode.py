"""A sweep and a service across several Ray nodes that share no disk, each losing a worker node mid-way
-> results/benchmarks/multinode.json (needs root: cluster/nodes.py makes network namespaces and a second user).

    sudo .venv/bin/python benchmarks/multinode.py [--samples 8] [--seeds 5] [--load-s 100] [--kill-at-s 30]

1. A cluster of its own (cluster/nodes.py: own bridge EMBED_NET=10.213.9, own state, own MLflow store): a CPU head
   that runs no trials and two `gpu_worker` nodes (1 CPU, 1 logical GPU each) as the worker user. What a worker's
   user gets when it opens the head's files is recorded (`worker_isolation`).
2. The sweep (`cluster/local.sh submit -- python sweeps/pair_residual.py --task stsb --gpus-per-trial 0.25 ...`);
   once a trial runs on worker w1 (its MLflow run tagged with w1's address), w1 is killed (SIGKILL, its raylet and
   every worker process) and a replacement node is started, as the autoscaler would. Tune's FailureConfig retries
   the trials w1 held. From the MLflow server: trials by node, completed, retried, left RUNNING, duplicated.
3. Serving: serving/config_multinode.yaml with the champion the sweep registered (one ingress and one encoder
   replica per worker); a warm closed loop (c=8 x 32 pairs) from the head for `--load-s` seconds; the first worker
   is killed at `--kill-at-s` and a replacement started. Failed requests in the 60 s around the kill; recovery =
   kill to the first 5 s window back at >= 90% of the throughput before it.
4. Every listening socket of every node, and what it answers without the token.

5. Autoscaling: a head alone with Ray's autoscaler (cluster/autoscale.yaml); a smaller sweep's GPU trials make it
   add gpu_worker nodes from zero (`scale_up_s`), which it removes once idle (`scale_down_s`). Then a service from
   one replica each under c=32 load: Serve asks for replicas no node has room for, the autoscaler adds nodes for
   them, and both give them back after the load (`serve_autoscale`, replicas by node every 5 s).

The replacement nodes of 2 and 3 are started by this script (the static cluster has no autoscaler).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import REPO, write_results

#: the environment that names one cluster of cluster/nodes.py (its bridge, state and MLflow store)
CLUSTER_ENV = ("EMBED_NET", "EMBED_MULTI_DIR", "EMBED_RAY_DIR", "EMBED_CLUSTER_STORE", "EMBED_CLUSTER_ARTIFACTS")


def net() -> str:
    return os.environ.get("EMBED_NET", "10.213.9")


def start_cluster(state: Path, net_prefix: str = "10.213.9", workers: int = 2, autoscale: bool = False
                  ) -> dict[str, str]:
    """A cluster of its own (bridge `net_prefix`, state and MLflow store under `state`): {node name: address}.
    autoscale: Ray's autoscaler adds and removes the worker nodes (cluster/autoscale.yaml)."""
    os.environ.update(EMBED_NET=net_prefix, EMBED_MULTI_DIR=str(state), EMBED_RAY_DIR=str(state),
                      EMBED_CLUSTER_STORE=f"sqlite:///{state}/mlflow.db", EMBED_CLUSTER_ARTIFACTS=f"{state}/art")
    os.chmod(state, 0o700)
    subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), "start", "--workers", str(workers),
                    "--cpus-per-worker", "1", "--gpus-per-worker", "1", *(["--autoscale"] if autoscale else [])],
                   check=True)
    return {n: v["ip"] for n, v in json.loads(nodes("status"))["nodes"].items()}


def stop_cluster() -> None:
    subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), "stop"], check=False)


def nodes(*args: str, check: bool = True) -> str:
    return subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), *args], check=check, text=True,
                          capture_output=True).stdout


def client_env() -> dict[str, str]:
    return dict(line[len("export "):].split("=", 1) for line in nodes("env").splitlines() if line.startswith("export "))


def mlflow_client():
    import mlflow  # lazy: the load mode (run in the head's namespace) needs no MLflow

    os.environ.update({k: v for k, v in client_env().items() if k.startswith("MLFLOW_")})
    return mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def autoscale_phase(state: Path, sweep_args: list[str]) -> dict:
    """A cluster of the head alone with Ray's autoscaler (cluster/autoscale.yaml, node types min 0): the sweep's
    GPU trials make it add gpu_worker nodes; they are removed once idle. scale_up_s: from the autoscaler queueing the
    first node (its monitor log; it looks every second, so the demand is at most ~1 s older) to the first trial
    result from a new node (MLflow). scale_down_s: from the last trial's end to the last node's removal."""
    ips = start_cluster(state, net(), workers=0, autoscale=True)
    out = sweep_with_node_loss(state, sweep_args, expected=int(sweep_args[sweep_args.index("--num-samples") + 1]),
                               kill=None)
    client = mlflow_client()
    runs = trial_runs(client, out.pop("parent_run_id"))
    monitor = Path(f"/tmp/emb{net().split('.')[-1]}-head/ray/session_latest/logs/monitor.log").read_text()
    queued = next((line[:23] for line in monitor.splitlines() if "new nodes for launch" in line), None)
    t_queue = time.mktime(time.strptime(queued[:19], "%Y-%m-%d %H:%M:%S")) + int(queued[20:23]) / 1000 if queued else None
    first = {}
    for r in runs:
        hist = client.get_metric_history(r.info.run_id, "objective")
        if hist and r.data.tags.get("node_ip"):
            first[r.data.tags["node_ip"]] = min(first.get(r.data.tags["node_ip"], 1e18), min(m.timestamp for m in hist))
    last_end = max((r.info.end_time or 0) for r in runs) / 1000 if runs else None
    deadline = time.time() + 180
    while time.time() < deadline and len(json.loads(nodes("status"))["nodes"]) > 1:
        time.sleep(2)
    status = json.loads(nodes("status"))
    removed = [r["at"] for r in status["removed"]]
    return {"autoscale": {"config": "cluster/autoscale.yaml", "started_with": list(ips),
                          "nodes_added": len(removed) + len(status["nodes"]) - 1, "worker_nodes_used": len(first),
                          "trials_completed": out["trials_completed"], "trials_expected": out["trials_expected"],
                          "removed_after_idle": len(removed), "nodes_left": list(status["nodes"])},
            "scale_up_s": round(min(first.values()) / 1000 - t_queue, 1) if first and t_queue else None,
            "scale_down_s": round(max(removed) - last_end, 1) if removed and last_end else None}


def trial_runs(client, parent_id: str) -> list:
    """The sweep's trial runs (its other child, the winner's retraining, has no trial_id)."""
    exp = client.get_run(parent_id).info.experiment_id
    runs = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent_id}'", max_results=1000)
    return [r for r in runs if r.data.tags.get("trial_id")]


def sweep_with_node_loss(state: Path, sweep_args: list[str], expected: int, kill: str | None = "w1") -> dict:
    """The STS-B sweep submitted to the cluster; once a trial runs on node `kill`, that node is killed and a
    replacement started. Figures from the MLflow server's trial runs and the job's outcome."""
    name = f"multinode-{time.strftime('%H%M%S')}"
    cmd = [str(REPO / "cluster" / "local.sh"), "submit", "--", "python", "sweeps/pair_residual.py", "--task", "stsb",
           "--gpus-per-trial", "0.25", "--max-concurrent", "2", "--name", name, "--experiment", "multinode", *sweep_args]
    ips = {n: v["ip"] for n, v in json.loads(nodes("status"))["nodes"].items()}
    log = open(state / "sweep.log", "w")
    t0 = time.time()
    # the job's store is the cluster's MLflow server (local.sh submit names it): never a store of this process's
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    client, parent, killed_at, replaced = mlflow_client(), None, None, None
    while job.poll() is None:
        time.sleep(0.3)
        if parent is None:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                      f"attributes.run_name = '{name}'")
            parent = runs[0].info.run_id if runs else None
            continue
        if killed_at is None and kill:
            running = [r for r in trial_runs(client, parent) if r.info.status == "RUNNING"
                       and r.data.tags.get("node_ip") == ips[kill] and r.data.metrics]
            if running:
                nodes("kill-node", kill)
                killed_at = time.time() - t0
                print(f"killed {kill} at {killed_at:.0f} s (trial {running[0].data.tags['trial_id']} ran there)", flush=True)
                replaced = nodes("add-worker", "--cpus", "1", "--gpus", "1").strip()
    log.close()
    text = (state / "sweep.log").read_text()
    outcome = next((json.loads(line) for line in reversed(text.splitlines()) if line.startswith('{"complete"')), {})
    runs = trial_runs(client, parent) if parent else []
    ip_name = {f"{net()}.{10 + i}": f"w{i}" for i in range(1, 50)}  # cluster/nodes.py's addresses, replacements too
    by_node: dict[str, int] = {}
    for r in runs:  # the node each trial finished on (a retried trial: the node of its last attempt)
        label = ip_name.get(r.data.tags.get("node_ip"), r.data.tags.get("node_ip") or "never placed")
        by_node[label] = by_node.get(label, 0) + 1
    history = {r.data.tags.get("trial_id"): r.data.tags.get("node_history", "").split(",") for r in runs}
    trial_ids = [r.data.tags.get("trial_id") for r in runs]
    return {"sweep": {"command": " ".join(cmd[2:]), "job_succeeded": job.returncode == 0, "seconds": round(time.time() - t0, 1),
                      "outcome": {k: outcome.get(k) for k in ("complete", "stopped_early", "winner", "version", "alias",
                                                              "registered_name", "orphans_closed", "stages")}},
            "trials_expected": expected,
            "trials_completed": sum(r.info.status == "FINISHED" for r in runs),
            "trials_stopped_by_asha": sum(r.data.tags.get("stopped_early") == "true" for r in runs),
            "trials_by_node": by_node,
            "trials_by_node_id": {tid: h for tid, h in history.items()},
            "trials_retried": sum(len(h) > 1 for h in history.values()),
            "mlflow_running_after": sum(r.info.status == "RUNNING" for r in runs),
            "mlflow_duplicate_runs": len(trial_ids) - len(set(trial_ids)),
            "node_killed_at_s": None if killed_at is None else round(killed_at, 1),
            "replacement_node": replaced, "registered_name": outcome.get("registered_name"), "parent_run_id": parent}


# ------------------------------------------------------------------------------------------ the load (head's namespace)
async def _timed_loop(url: str, bodies, concurrency: int, seconds: float) -> list[tuple[float, int, int]]:
    import aiohttp

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
    from benchmarks.load import Bodies
    from embed_lib.data.tasks import load_task

    import requests

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
    code = ("import json, ray; from ray.util.state import list_actors; ray.init(log_to_driver=False); "
            "print(json.dumps([[a.class_name, a.node_id] for a in list_actors(filters=[('state', '=', 'ALIVE')]) "
            "if a.class_name.startswith('ServeReplica')]))")
    out = subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), "exec", "--", sys.executable, "-c", code],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    ids = {n["node_id"]: n["name"] for n in node_ids()}
    found: dict[str, list[str]] = {}
    for cls, node_id in json.loads(out):
        found.setdefault(ids.get(node_id, node_id[:8]), []).append(cls.rsplit(":", 1)[-1])
    return found


def register_any(name: str = "pair-residual-stsb-limited") -> str:
    """A small adapter (200 STS-B pairs a split, 2 seeds, 2 epochs) registered as `name`'s champion through the
    cluster's MLflow server, from this process (for a sweep that found no winner); returns `name`."""
    import mlflow

    from embed_lib.config import AdapterConfig
    from embed_lib.pipeline.prepare import load_study
    from embed_lib.tracking.registry import evidence_of, log_adapter_model, promote
    from embed_lib.tracking.runs import set_experiment
    from embed_lib.training.seed_group import train_seed_group

    mlflow_client()  # the server's URL and credentials into this process's environment
    data, _ = load_study("stsb", limit=200)
    set_experiment("multinode-register", os.environ["MLFLOW_TRACKING_URI"])
    result = train_seed_group(AdapterConfig(adapter="pair_gated", target="lexical", n_seeds=2, epochs=2, width=32,
                                            hidden=32), data)
    with mlflow.start_run():
        info = log_adapter_model(result, data, registered_name=name)
    promote(name, info.registered_model_version, evidence_of(result, data))
    return name


def node_ids() -> list[dict]:
    """[{name, node_id}] of the live nodes."""
    code = ("import json, ray; ray.init(log_to_driver=False); "
            "print(json.dumps([[n['NodeID'], n['NodeManagerAddress']] for n in ray.nodes() if n['Alive']]))")
    out = subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), "exec", "--", sys.executable, "-c", code],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    names = {v["ip"]: n for n, v in json.loads(nodes("status"))["nodes"].items()}
    return [{"node_id": i, "name": names.get(ip, ip)} for i, ip in json.loads(out)]


def serve_with_node_loss(state: Path, model: str, load_s: float, kill_at_s: float, kill: str,
                         n_sentences: int = 2000, settle_s: float = 20) -> dict:
    """serving/config_multinode.yaml with `model`@champion; a warm closed loop (c=8 x 32 pairs drawn from `n_sentences`
    warmed sentences, `settle_s` unrecorded) from the head for `load_s` seconds; node `kill` killed at `kill_at_s` and a
    replacement started."""
    config = state / "serve.yaml"
    config.write_text((REPO / "serving" / "config_multinode.yaml").read_text().replace(
        "models:/pair-residual-stsb@champion", f"models:/{model}@champion"))
    deploy = subprocess.run([str(REPO / "cluster" / "local.sh"), "serve", str(config)], text=True, capture_output=True)
    if deploy.returncode != 0:
        return {"serving": {"deployed": False, "error": (deploy.stdout + deploy.stderr)[-800:]}}
    before_kill = replicas_by_node()
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


def socket_check(head: str) -> dict:
    """Every listening socket of every node; a non-loopback one is asked for / over HTTP without a token."""
    import urllib.error
    import urllib.request

    out = []
    for s in json.loads(nodes("sockets")):
        if not s["loopback"]:
            host = s["address"].strip("[]").replace("::ffff:", "")
            host = {"*": None, "0.0.0.0": None}.get(host, host)
            ip = host or json.loads(nodes("status"))["nodes"][s["node"]]["ip"]
            # the dashboard serves its static page to anyone (the browser then asks for the token): ask its API
            path = "/api/jobs/" if s["port"] == 8265 else "/"
            try:
                with urllib.request.urlopen(f"http://{ip}:{s['port']}{path}", timeout=3) as r:
                    s["without_token"] = f"HTTP {r.status} on {path}"
            except urllib.error.HTTPError as exc:
                s["without_token"] = f"HTTP {exc.code} on {path}"
            except Exception as exc:  # not HTTP: Ray's gRPC (token auth mode) resets or speaks HTTP/2
                s["without_token"] = f"no HTTP answer ({type(exc).__name__})"
        out.append(s)
    answering = [s for s in out if not s["loopback"] and s["without_token"].startswith("HTTP 2")]
    # Ray's gRPC servers (GCS, raylets, workers) check the token in token mode: a client without it, from the host
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{head}:6379'); print('CONNECTED')"],
                           env={**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}, capture_output=True, text=True,
                           timeout=120, check=False)
    tail = [line for line in (probe.stdout + probe.stderr).splitlines() if line.strip()][-1:]
    return {"sockets": out, "sockets_answering_without_token": answering, "firewall": json.loads(nodes("status"))["firewall"],
            "gcs_without_token": {"connected": "CONNECTED" in probe.stdout, "answer": tail[0][:300] if tail else ""}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--load-s", type=float, default=100)
    p.add_argument("--kill-at-s", type=float, default=30)
    p.add_argument("--serve-kill", default="w2", help="the worker node killed under load (w1 is gone by then)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    p.add_argument("--phases", default="static,autoscale", help="static (node loss: sweep, serving, sockets), "
                   "autoscale (a sweep and a service scaling nodes from zero); a subset updates the existing results")
    p.add_argument("--teacher", action="store_true", help="the sweep with its teacher (its first training: ~30 min on a "
                   "worker node; without it the sweep has no ce_margin target)")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/multinode.py needs root (cluster/nodes.py: network namespaces, a second user)")
    phases = set(args.phases.split(","))
    out = REPO / "results" / "benchmarks" / "multinode.json"
    figures = {k: v for k, v in json.loads(out.read_text()).items() if k not in ("benchmark", "when", "machine")} \
        if phases != {"static", "autoscale"} and out.is_file() else {}
    try:
        if "static" in phases:
            state = Path(tempfile.mkdtemp(prefix="embed-multinode-"))
            ips = start_cluster(state)
            status = json.loads(nodes("status"))
            figures.update({"nodes": {"count": len(ips), "types": {n: v["kind"] for n, v in status["nodes"].items()},
                                      "how": "cluster/nodes.py: a network namespace per node on a host-only bridge"},
                            "worker_isolation": json.loads(nodes("isolation"))})
            sweep_args = ["--num-samples", str(args.samples), "--seeds", str(args.seeds)]
            figures.update(sweep_with_node_loss(state, sweep_args + ([] if args.teacher else ["--no-teacher"]),
                                                expected=args.samples, kill="w1"))
            figures.pop("parent_run_id")
            figures["nodes"]["after_sweep"] = {n: v["kind"] for n, v in json.loads(nodes("status"))["nodes"].items()}
            if figures.get("registered_name"):
                figures.update(serve_with_node_loss(state, figures["registered_name"], args.load_s, args.kill_at_s,
                                                    args.serve_kill))
            figures.update(socket_check(ips["head"]))
            stop_cluster()
            figures.setdefault("phase_when", {})["static"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        if "autoscale" in phases:
            scaled = Path(tempfile.mkdtemp(prefix="embed-autoscale-"))
            figures.update(autoscale_phase(scaled, ["--limit", "300", "--num-samples", "4", "--seeds", "2",
                                                    "--epochs", "6", "--no-teacher"]))
            figures.update(serve_autoscale_phase(scaled, register_any()))
            figures.setdefault("phase_when", {})["autoscale"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        figures.pop("not_measured", None)
        write_results("multinode", figures)
    finally:
        if not args.keep:
            stop_cluster()


if __name__ == "__main__":
    if sys.argv[1:2] == ["_load"]:
        load_main(float(sys.argv[2]), sys.argv[3], *[int(c) for c in sys.argv[4:6]], *[float(s) for s in sys.argv[6:7]])
    else:
        main()
