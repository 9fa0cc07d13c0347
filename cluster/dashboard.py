"""What `cluster/local.sh` asks the local cluster's dashboard REST API, with the token of $RAY_AUTH_TOKEN_PATH
(standard library only, plus PyYAML to read a Serve config). Polling from one process, not a new `ray` / `serve`
command per look (each imports Ray), and not `ray job submit`'s own log tail, which notices a job's end only
after its polling rounds, seconds after the job's last line.

    python3 cluster/dashboard.py follow-job <dashboard address> <submission id>
        prints the job's log as it grows, then `Job '<id>' SUCCEEDED` / FAILED / STOPPED as the last line; exit 0
        only for SUCCEEDED. Ctrl-C stops the job and follows it to its end (a sweep closes its MLflow runs,
        registers nothing); a second Ctrl-C stops following, not the job.
    python3 cluster/dashboard.py stop-job <dashboard address> <submission id>
        stops the job and waits for its end; prints `Job '<id>' STOPPED` (or the status it ended with); exit 3: no
        such job, 1: the API did not answer.
    python3 cluster/dashboard.py wait-serve <dashboard address> <Serve config>
        waits until every application of the config is RUNNING with healthy deployments (exit 0, prints the
        docs URL) or one of them has failed (exit 1, with its message); 600 s at the most.
    python3 cluster/dashboard.py serve-port <dashboard address> <Serve config> [<the config's name to print>]
        exits 1 naming the port and what holds it when Serve has not started on this cluster yet and the config's
        http_options host and port are taken by another process (Serve's ingress would fail on it ~15 s into the
        deploy, with HAProxy's own line); exits 0 otherwise (a running Serve's ingress holds its port itself).
    python3 cluster/dashboard.py port-free <host> <port> <what> <advice>
        exits 1 with "<what>: <host>:<port> is in use by <holder>: <advice>" when the port is taken (`make mlflow-ui`:
        MLflow's server says only "Address already in use", and exits 0), else exits 0.
    python3 cluster/dashboard.py holder <port>
        prints 'process, pid N' listening on the port (nothing when `ss` names none): `local.sh start`'s port check.
    python3 cluster/dashboard.py busy <dashboard address>
        prints the cluster's other work (a job not ended, a Serve application; exit 0), else exits 1 (also when the
        API does not answer): what `local.sh release` asks before it stops a cluster.
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

#: a Ctrl-C while `follow-job` starts (right after the submit) is kept for it, and stops the job (Python's own
#: handler ended the start in a traceback, the job left running); PyYAML is imported only for a Serve config
EARLY_CTRL_C: list[int] = []
if sys.argv[1:2] == ["follow-job"]:
    signal.signal(signal.SIGINT, lambda *_: EARLY_CTRL_C.append(1))

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
FAILED = {"DEPLOY_FAILED", "UNHEALTHY"}
#: seconds between a job's status reads; its log is read at most every LOG_EVERY seconds while it runs; seconds
#: between reads of the Serve applications' status
STATUS_EVERY, LOG_EVERY, SERVE_EVERY = 0.25, 1.0, 0.5


def _token() -> str | None:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return open(path, encoding="utf-8").read().strip() if path and os.path.isfile(path) else None


def _api(url: str, token: str | None, method: str = "GET") -> dict:
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"{}")


def _answer(url: str, token: str | None) -> dict | None:
    """_api (GET); None when the API does not answer."""
    try:
        return _api(url, token)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def follow(address: str, job_id: str, token: str | None, out=sys.stdout, give_up_s: float = 60.0,
           interrupt_stops: bool = False) -> str:
    """Print the job's log as it grows until the job ends; returns its final status. Transient errors of the
    API (the job not yet listed, a refused connection) are retried for `give_up_s` seconds in a row.
    interrupt_stops: a first Ctrl-C stops the job (the API's POST .../stop: SIGTERM to its driver) and goes on
    following it to its end, its last lines included (a sweep closes its runs); a second one raises, leaving it."""
    base = f"{address.rstrip('/')}/api/jobs/{job_id}"
    printed, last_log, failing_since, stopping = 0, 0.0, None, False
    while True:
        try:
            if EARLY_CTRL_C and not stopping:
                raise KeyboardInterrupt
            try:
                status = _api(base, token)["status"]
                if status in TERMINAL or time.monotonic() - last_log >= LOG_EVERY:
                    logs = _api(f"{base}/logs", token).get("logs") or ""
                    out.write(logs[printed:])
                    out.flush()
                    printed, last_log = len(logs), time.monotonic()
                failing_since = None
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > give_up_s:
                    raise RuntimeError(f"the job API at {address} did not answer for {give_up_s:.0f} s: {exc}") from exc
                status = None
            if status in TERMINAL:
                return status
            time.sleep(STATUS_EVERY)
        except KeyboardInterrupt:
            if not interrupt_stops or stopping:
                raise
            stopping = True
            print(f"\nCtrl-C: stopping job '{job_id}' (Ctrl-C again: stop following it, and it goes on)",
                  file=sys.stderr, flush=True)
            try:
                _api(f"{base}/stop", token, "POST")
            except (urllib.error.URLError, OSError, ValueError) as exc:  # the API down: stop following instead
                print(f"Could not stop job '{job_id}': {exc}", file=sys.stderr)
                raise KeyboardInterrupt from exc


def stop_job(address: str, job_id: str, token: str | None) -> str:
    """Stop the job (SIGTERM to its driver) and wait for its end: its final status."""
    _api(f"{address.rstrip('/')}/api/jobs/{job_id}/stop", token, "POST")
    with open(os.devnull, "w", encoding="utf-8") as quiet:
        return follow(address, job_id, token, out=quiet)


def verdict(config: dict, answer: dict | None) -> str:
    """One line on a deploy of `config` from the Serve REST answer (GET /api/serve/applications/; None: no
    answer): `running <http port>` when every application of the config is RUNNING and each of its deployments
    HEALTHY; `failed <application: status, message>` when one of them failed (or the config lists none);
    `waiting <statuses>` otherwise (including while the controller has not listed an application yet)."""
    names = [a.get("name", "default") for a in config.get("applications") or []]
    if not names:
        return "failed the config lists no application"
    try:
        apps = answer["applications"] or {}
    except (KeyError, TypeError):
        return "waiting for the Serve REST API"
    states = {n: apps[n]["status"] for n in names if n in apps}
    for n in states:
        deployments = apps[n].get("deployments") or {}
        bad = {d: v["status"] for d, v in deployments.items() if v.get("status") in FAILED}
        if states[n] in FAILED or bad:
            parts = [f"failed {n}: {states[n]}", *(f"deployment {d} {st}" for d, st in bad.items()),
                     apps[n].get("message") or ""]
            return "; ".join(p for p in parts if p)
    healthy = all(states.get(n) == "RUNNING" and all(v.get("status") == "HEALTHY" for v in
                                                      (apps[n].get("deployments") or {}).values()) for n in names)
    if healthy:
        return f"running {(config.get('http_options') or {}).get('port', 8000)}"
    return "waiting " + ", ".join(f"{n}: {states.get(n, 'not listed')}" for n in names)


def wait_serve(address: str, config: dict, token: str | None, deadline_s: float = 600.0) -> str:
    """Poll the Serve REST API every SERVE_EVERY seconds until the verdict is running or failed (returned), or
    `deadline_s` has passed (the last waiting verdict)."""
    end = time.monotonic() + deadline_s
    while True:
        line = verdict(config, _answer(f"{address.rstrip('/')}/api/serve/applications/", token))
        if not line.startswith("waiting") or time.monotonic() > end:
            return line
        time.sleep(SERVE_EVERY)


def other_work(jobs: list | None, serve: dict | None) -> list[str]:
    """What a cluster still holds, from the dashboard's answers to GET /api/jobs/ and /api/serve/applications/
    (None: no answer): submitted jobs that have not ended, drivers connected by hand, Serve applications."""
    live = [j for j in jobs or [] if j.get("status") not in TERMINAL]
    work = [f"job {j.get('submission_id') or j.get('job_id')} {j.get('status')}" for j in live]
    apps = (serve or {}).get("applications") or {}
    return work + [f"Serve application {name} {app.get('status')}" for name, app in apps.items()]


def busy(address: str, token: str | None) -> list[str]:
    """other_work of the cluster at `address`; [] when its API does not answer."""
    base = address.rstrip("/")
    return other_work(_answer(f"{base}/api/jobs/", token), _answer(f"{base}/api/serve/applications/", token))


def port_taken(host: str, port: int) -> bool:
    """Whether a listening socket on `host`:`port` could not be opened now (as Serve's ingress opens it: with
    SO_REUSEADDR, so that closed connections in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def holder(port: int) -> str:
    """'process, pid N' listening on `port` as `ss` sees it; '' when it names none (another user's process)."""
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r'users:\(\("([^"]+)",pid=(\d+)', out)
    return f"{m.group(1)}, pid {m.group(2)}" if m else ""


def serve_port_problem(config: dict, serve: dict | None, where: str) -> str | None:
    """Why Serve's ingress could not listen where `config` (the file `where`) asks, from the dashboard's answer to
    GET /api/serve/applications/ (None: no answer): a running Serve on other HTTP options (Ray keeps them), or the
    port taken by another process; None when Serve already runs there (its ingress holds the port itself), when the
    API did not answer, or when the port is free."""
    if serve is None:
        return None
    http = config.get("http_options") or {}
    host, port = str(http.get("host") or "127.0.0.1"), int(http.get("port") or 8000)
    if serve.get("controller_info"):  # Ray keeps a running Serve's HTTP options whatever a later deploy asks
        now = serve.get("http_options") or {}
        if (now.get("host"), now.get("port")) in ((None, None), (host, port)):
            return None
        return (f"serve: Serve already runs on this cluster on {now.get('host')}:{now.get('port')}; {where} asks for "
                f"{host}:{port}, and Ray keeps the HTTP options of a running Serve. Serve on {now.get('port')}, or "
                "stop the cluster first (`make cluster-stop`).")
    if not port_taken(host, port):
        return None
    who = holder(port)
    return (f"serve: {host}:{port} (http_options of {where}) is in use" + (f" by {who}" if who else "")
            + ": Serve's ingress could not listen there. Stop what holds it (another `make serve`? `make cluster-stop` "
            "in that clone), or serve on another port: `make serve SERVE_PORT=8001` (`cluster/local.sh serve "
            "<config> http_options.port=8001`).")


def _config(path: str) -> dict:
    import yaml  # PyYAML: only a Serve config needs it

    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh) or {}


def _wait_serve_command(address: str, config_path: str) -> int:
    """`wait-serve`: its line, and its exit status."""
    config = _config(config_path)
    try:
        line = wait_serve(address, config, _token())
    except KeyboardInterrupt:  # `make serve` stops the cluster it started; a cluster already there keeps the deploy
        print("\nStopped waiting for the Serve deploy (Ctrl-C).", file=sys.stderr)
        return 130
    if line.startswith("running"):
        print(f"Serve application RUNNING: http://127.0.0.1:{line.split()[1]}/docs")
        return 0
    print(f"Serve application failed: {line[len('failed '):]}" if line.startswith("failed") else
          f"Serve application not RUNNING after 600 s: {line}", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["busy"] and len(argv) == 2:
        work = busy(argv[1], _token())
        print(", ".join(work))
        return 0 if work else 1
    if argv[:1] == ["port-free"] and len(argv) == 5 and argv[2].isdigit():
        if not port_taken(argv[1], int(argv[2])):
            return 0
        who = holder(int(argv[2]))
        print(f"{argv[3]}: {argv[1]}:{argv[2]} is in use{f' by {who}' if who else ''}: {argv[4]}", file=sys.stderr)
        return 1
    if argv[:1] == ["holder"] and len(argv) == 2 and argv[1].isdigit():
        print(holder(int(argv[1])))
        return 0
    if argv[:1] == ["serve-port"] and len(argv) in (3, 4):
        serve = _answer(f"{argv[1].rstrip('/')}/api/serve/applications/", _token())
        problem = serve_port_problem(_config(argv[2]), serve, argv[-1])
        if problem:
            print(problem, file=sys.stderr)
        return 1 if problem else 0
    if argv[:1] == ["stop-job"] and len(argv) == 3:
        try:
            status = stop_job(argv[1], argv[2], _token())
        except (urllib.error.URLError, OSError, RuntimeError) as exc:
            unknown = getattr(exc, "code", None) == 404
            print(f"stop-job: could not stop job '{argv[2]}' at {argv[1]}: "
                  f"{'no such job on this cluster' if unknown else exc}", file=sys.stderr)
            return 3 if unknown else 1
        print(f"Job '{argv[2]}' {status}")
        return 0
    if len(argv) != 3 or argv[0] not in ("follow-job", "wait-serve"):
        print(__doc__.split("\n\n", 1)[1].rstrip(), file=sys.stderr)
        return 2
    command, address, target = argv
    if command == "wait-serve":
        return _wait_serve_command(address, target)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a Ctrl-C kept since the start is seen at once
    try:
        status = follow(address, target, _token(), interrupt_stops=True)
    except KeyboardInterrupt:
        print(f"\nStopped following job '{target}'; it goes on running (`cluster/local.sh stop-job {target}` ends it, "
              "`make cluster-stop` ends it and the cluster).", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"Job '{target}' UNKNOWN: {exc}")
        return 1
    print(f"Job '{target}' {status}")
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
