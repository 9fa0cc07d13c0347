from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("EMBED_DATA_DIR", REPO.parent / "shared" / "data")).absolute()
DATA_SOURCES = ("mirror", "hub", "made")
#: temporary directories this session made (removed when it ends)
_OWN_TEMP_DIRS: list[Path] = []


def _hub_reachable() -> bool:
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


def _data_source() -> str:
    """Where the tests read pair data: the mirror when it is there, else the Hub when it answers, else a small
    set the tests make (tests/made_data.py). EMBED_TEST_DATA=mirror|hub|made forces one."""
    forced = os.environ.get("EMBED_TEST_DATA")
    if forced:
        if forced not in DATA_SOURCES:
            raise ValueError(f"EMBED_TEST_DATA={forced!r}: use one of {DATA_SOURCES}.")
        return forced
    if (DATA_DIR / "stsb" / "train.parquet").is_file():
        return "mirror"
    return "hub" if _hub_reachable() else "made"


DATA_SOURCE = _data_source()
# decided once, in the process that starts the session: pytest-xdist's workers inherit the decision (and the made
# set's directory), never re-derive it from a path. A worker that looked at the made set's EMBED_DATA_DIR would take
# it for the mirror and hold it to the mirror's published figures
os.environ["EMBED_TEST_DATA"] = DATA_SOURCE
if DATA_SOURCE == "mirror":  # offline, as CI runs
    os.environ["EMBED_DATA_DIR"] = str(DATA_DIR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
elif DATA_SOURCE == "made":  # offline as well: the files are the tests' own
    if os.environ.get("EMBED_TEST_MADE_DIR"):  # an xdist worker: the set the controller made
        DATA_DIR = Path(os.environ["EMBED_TEST_MADE_DIR"])
    else:
        from tests.made_data import write_mirror

        DATA_DIR = write_mirror(Path(tempfile.mkdtemp(prefix="embed-made-data-")))
        _OWN_TEMP_DIRS.append(DATA_DIR)
        os.environ["EMBED_TEST_MADE_DIR"] = str(DATA_DIR)
    os.environ.update(EMBED_DATA_DIR=str(DATA_DIR), HF_HUB_OFFLINE="1")
else:
    os.environ.pop("EMBED_DATA_DIR", None)
# Ray token authentication for the tests' own cluster: decided before anything imports ray, because Ray
# reads RAY_AUTH_MODE once per process (the file itself is written when the cluster starts)
os.environ.setdefault("RAY_AUTH_MODE", "token")
# a single-node Ray takes 127.0.0.1 as its node address and binds every port to loopback (cluster/local.sh
# sets the same for the cluster; a driver connecting to it needs it as well, read when ray is imported)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
if "RAY_AUTH_TOKEN_PATH" not in os.environ:
    _OWN_TEMP_DIRS.append(Path(tempfile.mkdtemp(prefix="embed-ray-")))
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(_OWN_TEMP_DIRS[-1] / "auth_token")
# several xdist workers on few cores: each worker's torch and OpenMP threads (ONNX Runtime follows torch's count),
# and the processes it starts (Ray's, a sweep's driver: EMBED_DRIVER_THREADS), get its share of the cores. Unset,
# every worker takes them all and the spinning OpenMP threads of two workers fight: the two thread-safety tests of
# tests/test_batching.py side by side took 175 s on 2 cores, 29 s at one thread each
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = str(max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
                     // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _SHARE)
    os.environ.setdefault("EMBED_DRIVER_THREADS", _SHARE)
# the project's own MLflow store is never the tests' (`make` exports it, and its artifact root, for the commands
# it runs): a test that names no store logs to one of this session's, and every store keeps its artifacts beside it
_OWN_TEMP_DIRS.append(Path(tempfile.mkdtemp(prefix="embed-mlflow-")))
SESSION_TRACKING_URI = os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_OWN_TEMP_DIRS[-1] / 'mlflow.db'}"
os.environ.pop("MLFLOW_ARTIFACT_ROOT", None)
# nor is its Tune state (a sweep holds its name there while it runs: a developer's `make run` beside `make test`)
os.environ["EMBED_STORAGE_DIR"] = str(_OWN_TEMP_DIRS[-1] / "ray_results")
# tests share one embedding cache (the encodes are the slow part); Makefile sets the same default
CACHE_DIR = Path(os.environ.setdefault("EMBED_CACHE_DIR", str(REPO / ".cache" / "embed_lib")))


def pytest_unconfigure(config) -> None:
    import shutil

    from embed_lib.cli.args import skip_exit_collection

    for d in _OWN_TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    skip_exit_collection()  # each worker ends without a last walk over everything the tests imported


#: the modules that take longest run first: `make test` gives each worker a whole module at a time, in this order
#: (xdist's own reordering, by number of tests, is off), so the short modules fill whichever worker finishes its
#: long ones first instead of one long module running alone at the end
LONGEST_FIRST = ("test_multinode.py", "test_serving.py", "test_sweeps.py", "test_sweeps_registry.py",
                 "test_tracking_store.py", "test_mlflow_cut.py", "test_distributed.py",
                 "test_cluster.py", "test_cross_encoder.py", "test_train.py", "test_onnx_backend.py",
                 "test_teacher.py")


def pytest_collection_modifyitems(config, items) -> None:
    """Stable: each module keeps its own order (reversed too under --reverse, which pytest-reverse applies first)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order is kept


def pytest_report_header(config) -> str:
    where = {"mirror": f"the local mirror {DATA_DIR}", "hub": "the Hugging Face Hub",
             "made": f"the small set the tests made (tests/made_data.py) at {DATA_DIR}"}[DATA_SOURCE]
    return f"data: {where}"


def pytest_terminal_summary(terminalreporter) -> None:  # the header is hidden under -q; this line is not
    terminalreporter.write_line(pytest_report_header(None))


#: MLflow's process-wide state: (module, attribute) its setters write, and the variables they also export
_MLFLOW_GLOBALS = (("mlflow.tracking._tracking_service.utils", "_tracking_uri"),
                   ("mlflow.tracking.fluent", "_active_experiment_id"))
_MLFLOW_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")


def _mlflow_state() -> tuple[dict, dict]:
    return ({(m, a): getattr(sys.modules[m], a, None) if m in sys.modules else None for m, a in _MLFLOW_GLOBALS},
            {k: os.environ.get(k) for k in _MLFLOW_VARIABLES})


def _restore_mlflow_state(before: tuple[dict, dict]) -> None:
    for (module, attribute), value in before[0].items():
        if module in sys.modules:  # imported since: its start value, None
            setattr(sys.modules[module], attribute, value)
    for key, value in before[1].items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(autouse=True)
def _own_mlflow_state():
    """Each test starts where the last one started: `mlflow.set_tracking_uri` and `mlflow.set_experiment` (the library
    calls them for a store it is given) also export MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_ID in this process, and
    a test after them in the same worker read the last test's store (CI failed a test on it: a store that exists
    answers differently from one that does not) and passed its experiment id to the subprocesses it started."""
    before = _mlflow_state()
    yield
    _restore_mlflow_state(before)


@pytest.fixture(autouse=True, scope="module")
def _own_mlflow_state_per_module():
    """The same around a module: what its module-scoped fixtures set (a served champion's store) ends with it."""
    before = _mlflow_state()
    yield
    _restore_mlflow_state(before)


@pytest.fixture(scope="session")
def data_dir() -> Path | None:
    """The mirror-layout directory the tests read (the mirror or the made set), or None: the Hub."""
    return None if DATA_SOURCE == "hub" else DATA_DIR


@pytest.fixture(scope="session")
def data_source() -> str:
    """"mirror", "hub" or "made" (see `_data_source`)."""
    return DATA_SOURCE


@pytest.fixture
def mirror_figures():
    """For tests that check published figures of the real data (row counts, the encoder's 0.820): they hold on
    the mirror only, and say so in the report when the tests run on another source."""
    if DATA_SOURCE != "mirror":
        # justified skip: the expected numbers are properties of the mirror's files (published row counts, the
        # encoder's published 0.820); on the Hub or the made set they are not the right answer, and every other
        # test still runs there. The reason is printed (-rs), so the skip is never silent.
        pytest.skip(f"figures of the data mirror; this run reads {DATA_SOURCE!r} data")


@pytest.fixture(scope="session")
def encoder():
    from embed_lib.encoding.encoders import FrozenEncoder

    return FrozenEncoder()


@pytest.fixture(scope="session")
def stsb_embedded(data_dir):
    """STS-B, all splits, through the shared cache (encodes once per machine)."""
    from embed_lib.encoding.cache import EmbeddingCache, embed_task
    from embed_lib.pipeline.prepare import LazyEncoder
    from embed_lib.config import EncoderConfig
    from embed_lib.data.tasks import load_splits

    lazy = LazyEncoder(EncoderConfig())
    cache = EmbeddingCache(lazy.manifest(CACHE_DIR), CACHE_DIR)
    return embed_task(load_splits("stsb", data_dir=data_dir), cache, lazy)


def listening_sockets(session: int) -> list[tuple[str, int, str]]:
    """(address, port, process) of every TCP socket listening in a process session (`ss -ltnp`)."""
    import re
    import subprocess

    pids = {int(p) for p, s in (line.split() for line in subprocess.run(
        ["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout.splitlines()) if int(s) == session}
    out = []
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines():
        local, users = line.split()[3], line.split(maxsplit=5)[-1]
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', users):
            if int(pid) in pids:
                address, _, port = local.rpartition(":")
                out.append((address, int(port), name))
    return sorted(set(out))


LOOPBACK = ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]")


def free_ports(n: int) -> list[int]:
    """n distinct ports free on loopback, outside the kernel's ephemeral range (serving.serve_env.free_port): a port
    handed to a cluster or a server is bound a little later, and no outgoing connection takes it meanwhile."""
    from serving.serve_env import free_port

    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        ports += [] if port in ports else [port]
    return ports


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster of the tests' own (own state dir, ports and token), stopped at the end.

    Yields the environment that clients (`cluster/local.sh submit`, `ray.init`) need to reach it.
    """
    import subprocess

    # short: Ray's socket paths must fit 107 bytes, and pytest-xdist's per-worker base temp is too deep
    state = Path(tempfile.mkdtemp(prefix="ray-"))
    _OWN_TEMP_DIRS.append(state)
    names = ("RAY_PORT", "RAY_DASHBOARD_PORT", "RAY_CLIENT_PORT", "RAY_AGENT_PORT", "RAY_AGENT_GRPC_PORT",
             "RAY_RUNTIME_ENV_AGENT_PORT", "RAY_METRICS_PORT", "DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")
    env = dict(os.environ, EMBED_RAY_DIR=str(state), RAY_NUM_CPUS="2", VENV=str(Path(os.sys.executable).parents[1]),
               **{k: str(p) for k, p in zip(names, free_ports(len(names)))})
    script = REPO / "cluster" / "local.sh"
    subprocess.run([str(script), "start"], env=env, check=True, timeout=180)
    env.update(RAY_ADDRESS=f"127.0.0.1:{env['RAY_PORT']}")
    try:
        yield env
    finally:
        subprocess.run([str(script), "stop"], env=env, timeout=120)


@pytest.fixture()
def sweep_env(ray_cluster, tmp_path, stsb_embedded):
    """The test cluster's environment with an MLflow store and a Tune storage dir of the test's own."""
    env = dict(ray_cluster, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
               EMBED_STORAGE_DIR=str(tmp_path / "ray_results"))
    return env
