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
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks._common import REPO, write_results
from benchmarks.multinode_cluster import (CLUSTER_ENV, client_env, mlflow_client, net, node_ids, nodes,  # noqa: F401
                                         start_cluster, stop_cluster, trial_runs)
from benchmarks.multinode_serving import (register_any, replicas_by_node, serve_autoscale_phase,  # noqa: F401
                                         serve_with_node_loss)


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


def sweep_with_node_loss(state: Path, sweep_args: list[str], expected: int, kill: str | None = "w1") -> dict:
    """The STS-B sweep submitted to the cluster; once a trial runs on node `kill` ("any": the first worker node seen
    running one; Ray, not we, places trials), that node is killed and a replacement started. Figures from the MLflow
    server's trial runs and the job's outcome."""
    name = f"multinode-{time.strftime('%H%M%S')}"
    cmd = [str(REPO / "cluster" / "local.sh"), "submit", "--", "python", "sweeps/pair_residual.py", "--task", "stsb",
           "--gpus-per-trial", "0.25", "--max-concurrent", "2", "--name", name, "--experiment", "multinode", *sweep_args]
    ips = {n: v["ip"] for n, v in json.loads(nodes("status"))["nodes"].items()}
    log = open(state / "sweep.log", "w")
    t0 = time.time()
    # the job's store is the cluster's MLflow server (local.sh submit names it): never a store of this process's
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    client, parent, killed_at, killed, replaced = mlflow_client(), None, None, None, None
    targets = {ip: n for n, ip in ips.items() if n != "head" and kill in ("any", n)}
    while job.poll() is None:
        time.sleep(0.3)
        if parent is None:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                      f"attributes.run_name = '{name}'")
            parent = runs[0].info.run_id if runs else None
            continue
        if killed_at is None and kill:
            # a trial's run is opened on the node that runs it, tagged with its address: RUNNING there means in progress
            running = [r for r in trial_runs(client, parent) if r.info.status == "RUNNING"
                       and r.data.tags.get("node_ip") in targets]
            if running:
                killed = targets[running[0].data.tags["node_ip"]]
                nodes("kill-node", killed)
                killed_at = time.time() - t0
                print(f"killed {killed} at {killed_at:.0f} s (trial {running[0].data.tags['trial_id']} ran there)",
                      flush=True)
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
            "trial_seconds": sorted(round(((r.info.end_time or r.info.start_time) - r.info.start_time) / 1000, 1)
                                    for r in runs),
            "mlflow_running_after": sum(r.info.status == "RUNNING" for r in runs),
            "mlflow_duplicate_runs": len(trial_ids) - len(set(trial_ids)),
            "node_killed": killed, "node_killed_at_s": None if killed_at is None else round(killed_at, 1),
            "replacement_node": replaced, "registered_name": outcome.get("registered_name"), "parent_run_id": parent}


# ------------------------------------------------------------------------------------------ the load (head's namespace)


def socket_check(head: str) -> dict:
    """Every listening socket of every node; a non-loopback one is asked for / over HTTP without a token."""

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
    main()
