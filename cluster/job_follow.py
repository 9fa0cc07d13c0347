"""`cluster/local.sh submit`'s follower: prints a submitted Ray job's log as it grows and exits when the job
ends, with the job's verdict as its last line (`Job '<id>' SUCCEEDED` / FAILED / STOPPED) and exit status 0
only for SUCCEEDED.

It reads the dashboard's job REST API (GET /api/jobs/<id> for the status, GET /api/jobs/<id>/logs for the
log), so it imports nothing beyond the standard library. `ray job submit` without --no-wait follows the
job's log too, but notices the end only after its log tail's polling rounds (seconds after the job's last
line); this asks for the status several times a second and fetches the log's remainder once the job has
ended. Interrupting it (Ctrl-C) stops following, not the job.

    python3 cluster/job_follow.py <dashboard address> <submission id>    # token from $RAY_AUTH_TOKEN_PATH
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
#: seconds between status reads; the log is read at most every LOG_EVERY seconds while the job runs
STATUS_EVERY, LOG_EVERY = 0.25, 1.0


def _get(url: str, token: str | None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def follow(address: str, job_id: str, token: str | None, out=sys.stdout, give_up_s: float = 60.0) -> str:
    """Print the job's log as it grows until the job ends; returns its final status. Transient errors of the
    API (the job not yet listed, a refused connection) are retried for `give_up_s` seconds in a row."""
    base = f"{address.rstrip('/')}/api/jobs/{job_id}"
    printed, last_log, failing_since = 0, 0.0, None
    while True:
        try:
            status = _get(base, token)["status"]
            if status in TERMINAL or time.monotonic() - last_log >= LOG_EVERY:
                logs = _get(f"{base}/logs", token).get("logs") or ""
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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    address, job_id = argv
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    token = open(path, encoding="utf-8").read().strip() if path and os.path.isfile(path) else None
    try:
        status = follow(address, job_id, token)
    except KeyboardInterrupt:
        print(f"\nStopped following job '{job_id}'; it keeps running (`ray job stop --address {address} {job_id}` "
              "ends it).", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"Job '{job_id}' UNKNOWN: {exc}")
        return 1
    print(f"Job '{job_id}' {status}")
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
