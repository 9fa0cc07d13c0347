"""cluster/nodes.py's checks and file modes: the cluster is up, what a worker node's user can open, what listens
where; the head's data closed to other users while the cluster runs."""
from __future__ import annotations

import base64
import json
import os
import pwd
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from node_base import DASH_PORT, HEAD_IP, PRIVATE, ROOT, STATE, VENV, sh, token


def _get(url: str, auth: str | None = None, basic: tuple[str, str] | None = None) -> int:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", f"Bearer {auth}")
    if basic:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(basic).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_up(st: dict, timeout_s: float = 180) -> None:
    """The dashboard and the MLflow server answer (with the token), and every node has joined."""
    deadline = time.monotonic() + timeout_s
    want = len(st["nodes"])
    while time.monotonic() < deadline:
        if _get(f"http://{HEAD_IP}:{DASH_PORT}/api/version", auth=token()) == 200 and (
                "mlflow" not in st or _get(f"{st['mlflow']['url']}/health") == 200):
            if alive_nodes() >= want:
                return
        time.sleep(0.5)
    raise SystemExit(f"the cluster did not come up within {timeout_s:.0f} s; see {STATE}/*.log")


def alive_nodes() -> int:
    req = urllib.request.Request(f"http://{HEAD_IP}:{DASH_PORT}/nodes?view=summary",
                                 headers={"Authorization": f"Bearer {token()}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            summary = json.loads(resp.read())["data"]["summary"]
    except (OSError, ValueError, KeyError):
        return 0
    return sum(1 for n in summary if n.get("raylet", {}).get("state") == "ALIVE")


def isolation(st: dict) -> dict:
    """How the no-shared-disk rule is enforced, and what a worker node's user gets when it opens the head's files."""
    name = next((n for n in st["nodes"] if n != "head"), None)
    if name is None:
        return {"enforced": False, "why": "no worker node"}
    node, attempts = st["nodes"][name], {}
    user = pwd.getpwnam(node["user"])
    store = [Path(st["mlflow"][k].replace("sqlite:///", "")) for k in ("store", "artifacts") if k in st.get("mlflow", {})]
    for path in dict.fromkeys([*PRIVATE, *store, STATE / "auth_token"]):
        if not path.exists():
            continue
        probe = ("import sys\ntry:\n    open(sys.argv[1], 'rb').read(1) if __import__('os').path.isfile(sys.argv[1]) "
                 "else __import__('os').listdir(sys.argv[1])\n    print('READ')\nexcept OSError as e:\n"
                 "    print(type(e).__name__ + ': ' + str(e))")
        r = sh("ip", "netns", "exec", node["ns"], "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
               "--clear-groups", "--", sys.executable, "-c", probe, str(path), check=False)
        attempts[str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)] = (r.stdout or r.stderr).strip()
    return {"enforced": True, "node": name, "user": node["user"],
            "how": f"worker nodes run as OS user {node['user']!r} (not the head's), each in its own network namespace "
                   f"with its own HOME and temp dir; the head's data is closed to other users (chmod go-rwx) while "
                   "the cluster runs",
            "attempts": attempts, "all_refused": all(v != "READ" for v in attempts.values())}


def sockets(st: dict) -> list[dict]:
    """Every listening TCP socket of every node: address, port, process, and whether it is loopback."""
    out = []
    for name, node in st["nodes"].items():
        r = sh("ip", "netns", "exec", node["ns"], "ss", "-ltnpH", check=False)
        for line in r.stdout.splitlines():
            parts = line.split()
            local, proc = parts[3], (parts[5] if len(parts) > 5 else "")
            host, port = local.rsplit(":", 1)
            out.append({"node": name, "address": host, "port": int(port),
                        "process": proc.split('"')[1] if '"' in proc else proc,
                        "loopback": host.startswith("127.") or host in ("[::1]", "::1")})
    return out


def grant_interpreter(st: dict, user: pwd.struct_passwd) -> None:
    """The node image: the worker user must run the venv's interpreter. A venv links to its base Python, which may
    sit under a home the user cannot enter (pyenv under /root): such directories get o+x (enter, not list) while the
    cluster runs, and `stop` takes it back."""
    st["granted"] = []
    real = Path(os.path.realpath(VENV / "bin" / "python"))
    for d in reversed(real.parents):
        mode = d.stat().st_mode & 0o777
        if not mode & 0o001:
            d.chmod(mode | 0o001)
            st["granted"].append([str(d), mode])
            print(f"note: {d} made enterable by other users (o+x, not readable) so that {user.pw_name!r} can run "
                  f"{real}; restored by stop", file=sys.stderr)


def lock_private(st: dict) -> None:
    """Close the head's data to other users. What does not exist yet is made now, closed (a directory, or an empty
    sqlite file): made later by the head's processes with the usual umask it would be readable by the workers' user
    (seen: a test running alongside made .cache after the start). `unlock_private` takes back what is still empty."""
    st["modes"], st["made"] = {}, []
    for path in PRIVATE:
        if not path.exists():
            if path.suffix == ".db":
                path.touch(mode=0o600)
            else:
                path.mkdir(mode=0o700)
            st["made"].append(str(path))
        st["modes"][str(path)] = path.stat().st_mode & 0o777
        path.chmod(path.stat().st_mode & 0o700)


def unlock_private(st: dict) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for made in st.get("made", []):
        path = Path(made)
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif path.is_file() and path.stat().st_size == 0:
            path.unlink()
        elif path.exists():  # used while the cluster ran: the mode it would have had
            st["modes"][made] = (0o777 if path.is_dir() else 0o666) & ~umask
    for path, mode in [*st.get("modes", {}).items(), *st.get("granted", [])]:
        if os.path.exists(path):
            os.chmod(path, mode)
