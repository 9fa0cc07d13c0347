"""`cluster/local.sh serve`'s verdict on a deploy: the dashboard's Serve REST API answer (GET
/api/serve/applications/) on stdin, the deployed config's path as the argument. Prints one line:
`running <http port>` when every application of the config is RUNNING and each of its deployments
HEALTHY; `failed <application: status, message>` when one of them failed (or the config lists none);
`waiting <statuses>` otherwise (including while the controller has not listed an application yet)."""
from __future__ import annotations

import json
import sys

import yaml

FAILED = {"DEPLOY_FAILED", "UNHEALTHY"}


def verdict(config: dict, answer: str) -> str:
    names = [a.get("name", "default") for a in config.get("applications") or []]
    if not names:
        return "failed the config lists no application"
    try:
        apps = json.loads(answer)["applications"] or {}
    except (ValueError, KeyError, TypeError):
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


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as fh:
        print(verdict(yaml.safe_load(fh), sys.stdin.read()))
