"""Does the ingress autoscale under load? The default application shape (ingress and encoder at 1 replica, up to 2,
0.5 CPU each; serving/args.py) on a Ray of 2 CPUs, under one closed loop of c=8 x 32 warm pairs (90 s by default),
through Serve's HAProxy ingress (the default) and then through Serve's Python proxy, each on a new Ray.

Every 10 s it records the ingress replicas running, what Serve's controller
counts as the ingress's ongoing requests (the figure Serve's own policy scales on) and the ingress replicas' CPU
share (`busy`, the metric serving/autoscale.py's policy adds). Behind HAProxy Serve's count reads 0, so the ingress
scales on `busy`; through the proxy the proxy's handle counts the requests. The summary: seconds of load until a
second ingress replica ran. Writes results/benchmarks/ingress_autoscale.json.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

from benchmarks._common import write_results
from benchmarks.load import Bodies, run_load
from benchmarks.serve_bench import _register
from embed_lib.data.tasks import load_task


def _controller_view(app: str) -> dict:
    """Serve's own figures for the app's ingress: ongoing requests and the last `busy` report per replica (through
    the controller's testing hooks, Ray has no public call for them; None where a Ray lacks them)."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ingress = DeploymentID(name="Ingress", app_name=app)
    try:
        total = ray.get(controller._get_total_num_requests_for_deployment_for_testing.remote(ingress))
        metrics = ray.get(controller._get_metrics_for_deployment_for_testing.remote(ingress))
    except AttributeError:
        return {"controller_ongoing_requests": None, "busy": None}
    busy = [round(series[-1].value, 2) for series in metrics.get("busy", []) if series]
    return {"controller_ongoing_requests": round(total, 2), "busy": busy}


def _one_topology(tmp: str, tracking: str, sentences: list[str], steps: int, seconds: float) -> dict:
    """A new Ray and Serve with the environment's ingress, the app deployed with its default replicas, then one
    closed loop for steps x seconds, read every `seconds`; the load's figures, the readings and the seconds of load
    until two ingress replicas ran."""
    import ray
    from ray import serve

    from serving.app import build_app
    from serving.serve_env import free_port

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w") as fh:
        fh.write("\n".join(sentences))
    serve.run(build_app({"model_uri": "models:/pair-residual-stsb@champion", "tracking_uri": tracking,
                         "warm_corpus": corpus, "max_inflight": 256}), name="scale")
    url, rows, done = f"http://127.0.0.1:{port}/v1/score", [], {}
    # one closed loop for the whole time (a client process per step would leave gaps of idle seconds)
    bodies = Bodies("warm", sentences, 32)
    load = threading.Thread(target=lambda: done.update(run_load(url, bodies, 8, steps * seconds)))
    load.start()
    t0 = time.time()
    while load.is_alive():
        time.sleep(min(seconds, max(0.1, t0 + (len(rows) + 1) * seconds - time.time())))
        running = dict(serve.status().applications["scale"].deployments["Ingress"].replica_states).get("RUNNING", 0)
        rows.append({"t_s": round(time.time() - t0, 1), "ingress_replicas": running, **_controller_view("scale")})
        print(rows[-1], flush=True)
    load.join()
    serve.shutdown()
    ray.shutdown()
    scaled = next((r["t_s"] for r in rows if r["ingress_replicas"] >= 2), None)
    return {"load": {k: round(v, 1) if isinstance(v, float) else v for k, v in done.items()}, "timeline": rows,
            "seconds_of_load_until_two_ingress_replicas": scaled, "failed_requests": done.get("errors")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=9, help="readings per topology (default 9)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds between readings (default 10)")
    ap.add_argument("--encoder-backend", default="onnx-int8", choices=("torch", "onnx", "onnx-int8"))
    args = ap.parse_args()
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    from serving.serve_env import apply_serve_env, ingress

    tmp = tempfile.mkdtemp()
    apply_serve_env(haproxy_dir=os.path.join(tmp, "haproxy"))
    tracking = f"sqlite:///{tmp}/mlflow.db"
    _register(tracking, args.encoder_backend)
    sentences = load_task("stsb", "validation").texts()[:2000]
    out = {"seconds_between_readings": args.seconds, "load_seconds": args.steps * args.seconds, "concurrency": 8,
           "pairs_per_request": 32,
           "replicas": "ingress and encoder: min 1, max 2, 0.5 CPU (serving/args.py defaults)"}
    out[ingress()] = _one_topology(tmp, tracking, sentences, args.steps, args.seconds)
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"  # the same through Serve's Python proxy, on a new Ray
    out["proxy"] = _one_topology(tmp, tracking, sentences, args.steps, args.seconds)
    write_results("ingress_autoscale", out)


if __name__ == "__main__":
    main()
