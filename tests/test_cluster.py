"""cluster/: every manifest parses, has what its tool needs, and agrees with the one source of versions."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"


def ray_pin() -> str:
    (pin,) = re.findall(r'"ray\[tune,serve\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    return pin


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_ray_up_configs(name):
    cfg = load(name)
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in cfg, f"{name} lacks {key}"
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types and types[cfg["head_node_type"]]["resources"] == {"CPU": 0}
    gpu = types["gpu_worker"]
    assert gpu["min_workers"] == 0 and gpu["max_workers"] >= 1  # autoscaling from zero
    node = json.dumps(gpu["node_config"])
    assert "g5." in node or "guestAccelerators" in node
    starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token" in c for c in starts)
    assert "--dashboard-host=127.0.0.1" in " ".join(cfg["head_start_ray_commands"])
    # a stopped job's driver has the time to stop its trials and close its MLflow runs (sweeps/interrupt.py)
    assert "RAY_JOB_STOP_WAIT_TIME_S=30 ray start --head" in " ".join(cfg["head_start_ray_commands"])
    # no shared disk: the head runs the cluster's MLflow server (token, proxied artifacts) and every node names it
    (server,) = [c for c in cfg["head_start_ray_commands"] if "mlflow-server" in c]
    assert "cluster/nodes.py mlflow-server --host $(hostname -I" in server
    assert all("MLFLOW_TRACKING_URI=http://" in c and "MLFLOW_TRACKING_PASSWORD=$(cat ~/.ray/auth_token)" in c
               for c in starts)


def test_kuberay_manifests_have_required_fields():
    cluster, job = load("kuberay/raycluster.yaml"), load("kuberay/rayjob.yaml")
    service = load("kuberay/rayservice.yaml")
    for m, kind in ((cluster, "RayCluster"), (job, "RayJob"), (service, "RayService")):
        assert m["apiVersion"] == "ray.io/v1" and m["kind"] == kind and m["metadata"]["name"]
    assert job["spec"]["entrypoint"].startswith("python sweeps/pair_residual.py")
    assert cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    gpu = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == "1"
    for head in (cluster["spec"]["headGroupSpec"], job["spec"]["rayClusterSpec"]["headGroupSpec"]):
        env = {e["name"]: e.get("value") for e in head["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_JOB_STOP_WAIT_TIME_S"] == "30"  # a stopped sweep closes its runs (sweeps/interrupt.py)


def test_one_source_of_versions():
    pin = ray_pin()
    for path in [*CLUSTER.glob("*.yaml"), *CLUSTER.glob("kuberay/*.yaml")]:
        text = path.read_text()
        for tag in re.findall(r"rayproject/ray:([\w.\-]+)", text):
            assert tag.split("-")[0] == pin, f"{path.name}: image rayproject/ray:{tag} != pyproject ray {pin}"
            assert "-py311" in tag, f"{path.name}: image {tag} is not the project's Python (3.11)"
        for v in re.findall(r'rayVersion:\s*"?([0-9.]+)"?', text):
            assert v == pin, f"{path.name}: rayVersion {v} != {pin}"
        for v in re.findall(r"ray\[tune,serve\]==([0-9.]+)", text):
            assert v == pin, f"{path.name}: pip pin {v} != {pin}"


def test_rayservice_is_generated_from_serving_config():
    check = subprocess.run([sys.executable, str(CLUSTER / "gen_rayservice.py"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    embedded = yaml.safe_load(load("kuberay/rayservice.yaml")["spec"]["serveConfigV2"])
    source = yaml.safe_load((ROOT / "serving" / "config.yaml").read_text())
    assert embedded["http_options"].pop("host") == "0.0.0.0" and source["http_options"].pop("host") == "127.0.0.1"
    assert embedded == source


def test_serving_config_is_valid_for_the_app_builder():
    from serving.args import AppArgs

    (app,) = yaml.safe_load((ROOT / "serving" / "config.yaml").read_text())["applications"]
    assert app["import_path"] == "serving.app:build_app"
    args = AppArgs.model_validate(app["args"])
    assert args.encoder.num_cpus < 1 and args.ingress.num_cpus < 1  # fractional CPUs on small machines


def test_local_script_and_runtime_env():
    assert subprocess.run(["bash", "-n", str(CLUSTER / "local.sh")]).returncode == 0
    excludes = json.loads((CLUSTER / "runtime_env.json").read_text())["excludes"]
    assert {".venv", ".git", ".cache", "results"} <= set(excludes)
    text = (CLUSTER / "local.sh").read_text()
    assert "ray stop" not in text.replace("never `ray stop`", "")  # stops its own process group only
    assert "--dashboard-host=127.0.0.1" in text and "RAY_AUTH_MODE=token" in text


def test_a_start_option_or_command_the_script_cannot_run_is_refused_before_anything_starts(tmp_path):
    """`start --bogus` used to start a one-node cluster that ignored it; `--nodes abc` died on 'unbound variable'."""
    env = {**os.environ, "EMBED_RAY_DIR": str(tmp_path / "ray")}
    for argv, line in [
        (["start", "--bogus"], "start: unknown option '--bogus'; one node is plain 'start', several 'start --nodes N"),
        (["start", "--nodes", "abc"], "--nodes 'abc': give the number of nodes, head included (2 or more"),
        (["start", "--nodes"], "--nodes '': give the number of nodes"),
        (["start", "--nodes", "0"], "--nodes '0': give the number of nodes"),
        (["start", "--nodes", "1"], "--nodes 1: a one-node cluster is plain 'start'"),
        (["start", "--nodes", "3", "--workers-per-node", "2"], "unrecognized arguments: --workers-per-node 2"),
        (["start", "--nodes", "3", "--cpus-per-worker", "0"],
         "argument --cpus-per-worker: 0 is out of range; give a number > 0"),
        (["submit", "--"], "submit: no command; e.g. cluster/local.sh submit -- python sweeps/pair_residual.py"),
        # these two used to end in realpath's line and in a traceback of Ray's token loader
        (["serve", str(tmp_path / "none.yaml")], f"serve: no Serve config at {tmp_path}/none.yaml (e.g. serving/"),
        (["submit", "--", "python", "x.py"], f"submit: local Ray is not running ({tmp_path}/ray): cluster/local.sh "
                                             "start first"),
        # arguments of the served application (cluster/serve_config.py), checked before the cluster is looked at
        (["serve", str(CLUSTER.parent / "serving" / "config.yaml"), "max_pair=3"],
         "serve: 'max_pair=3': give KEY=VALUE with KEY an argument of the serving application, one of ['access_log'"),
        (["serve", "max_pairs=0"], "serve: max_pairs: Input should be greater than or equal to 1 (application "
                                   "'pair-scorer')."),
    ]:
        proc = subprocess.run(["bash", str(CLUSTER / "local.sh"), *argv], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == (1 if argv[-1] == "x.py" else 2), (argv, proc.stdout, proc.stderr)
        assert line in proc.stderr.strip().splitlines()[-1], (argv, proc.stderr)
    assert not (tmp_path / "ray").exists()  # no state dir: nothing was started


def test_start_names_a_port_another_process_holds_and_starts_nothing(tmp_path):
    """Another process on one of the cluster's ports (often another Ray cluster on Ray's default dashboard port 8265)
    left `start` half started: it waited 120 s for a dashboard it could not bind, then failed with the cluster's
    processes still running. Now it names the port, its holder and the fix before anything starts."""
    import socket

    from tests.conftest import free_ports

    names = ("RAY_PORT", "RAY_DASHBOARD_PORT", "RAY_CLIENT_PORT", "RAY_AGENT_PORT", "DASHBOARD_METRIC_PORT",
             "AUTOSCALER_METRIC_PORT")
    ports = dict(zip(names, map(str, free_ports(len(names)))))
    holder = socket.socket()
    holder.bind(("127.0.0.1", int(ports["RAY_DASHBOARD_PORT"])))
    holder.listen()
    try:
        proc = subprocess.run(["bash", str(CLUSTER / "local.sh"), "start"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "EMBED_RAY_DIR": str(tmp_path / "ray"), **ports})
    finally:
        holder.close()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(rf"start: port\(s\) in use: RAY_DASHBOARD_PORT={ports['RAY_DASHBOARD_PORT']} \(\S+, pid "
                     rf"{os.getpid()}\)\. Another Ray cluster\? Give this one other ports", proc.stderr), proc.stderr
    assert not (tmp_path / "ray").exists()  # no state dir: nothing was started


def test_serve_arguments_from_the_command_line_set_every_application_and_keep_the_rest(tmp_path, monkeypatch):
    """`cluster/local.sh serve CONFIG KEY=VALUE ...` (`make serve TASK=qqp`, SERVE_ARGS): values read as YAML, set in
    every application of a copy of the config, the config itself untouched."""
    serve_config = _script("serve_config")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the store: below
    monkeypatch.setattr(serve_config, "pinned_models", lambda args: "versions")  # resolved: test_serving.py
    source = CLUSTER.parent / "serving" / "config_cascade.yaml"
    before = source.read_text()
    config = yaml.safe_load(before)
    config["applications"].append({**config["applications"][0], "name": "second"})
    out = serve_config.overridden(config, ["model_uri=models:/pair-residual-qqp@champion", "max_pairs=8",
                                           "warm_corpus=null", "encoder={min: 1, max: 1, num_cpus: 0.25}"])
    for app in out["applications"]:
        assert app["args"]["model_uri"] == "models:/pair-residual-qqp@champion"
        assert app["args"]["max_pairs"] == 8 and app["args"]["warm_corpus"] is None
        assert app["args"]["encoder"] == {"min": 1, "max": 1, "num_cpus": 0.25}
        assert app["args"]["cross_encoder"] == "models:/cross-encoder-stsb@current"  # not named: as it was
    assert source.read_text() == before
    with pytest.raises(ValueError, match=r"^cascade_budget: Input should be less than or equal to 1 \(application "
                                         r"'pair-scorer'\)"):
        serve_config.overridden(yaml.safe_load(before), ["cascade_budget=2"])
    # a validator's own message as it wrote it: a rule of the whole application (no field before it), or of one field
    with pytest.raises(ValueError, match=r"^rerank_budget=0.1 routes documents to a cross-encoder, and none is "
                                         r"configured: give cross_encoder=.*\(application 'pair-scorer'\)\.$"):
        serve_config.overridden(yaml.safe_load(before), ["rerank_budget=0.1", "cross_encoder=null"])
    with pytest.raises(ValueError, match=r"^encoder: min=3 is above max=2; give min <= max \(application "):
        serve_config.overridden(yaml.safe_load(before), ["encoder={min: 3, max: 2}"])
    assert serve_config.overridden(yaml.safe_load(before), ["rerank_budget=0.1"])["applications"][0]["args"][
        "rerank_budget"] == 0.1
    with pytest.raises(ValueError, match="the config lists no application"):
        serve_config.overridden({}, ["max_pairs=8"])
    # http_options.port / .host (`make serve SERVE_PORT=8001`): the config's own HTTP options, checked
    moved = serve_config.overridden(yaml.safe_load(before), ["http_options.port=8001", "max_pairs=8"])
    assert moved["http_options"] == {**config["http_options"], "port": 8001}
    assert all(app["args"]["max_pairs"] == 8 and "http_options.port" not in app["args"]
               for app in moved["applications"])
    for bad, field in (("http_options.port=x", "http_options.port='x': give a TCP port"),
                       ("http_options.port=70000", "an integer from 1 to 65535"),
                       ("http_options.host=", "http_options.host='': give an address")):
        with pytest.raises(ValueError, match=re.escape(field)):
            serve_config.overridden(yaml.safe_load(before), [bad])
    assert serve_config.main([str(source), "-", "http_options.port=0"]) == 2
    # --loopback (`local.sh serve` on its loopback-only cluster): a config without a host is served on 127.0.0.1
    bare = {"http_options": {"port": 8123}, "applications": []}
    note = serve_config.loopback_by_default(bare, "c.yaml")
    assert bare["http_options"] == {"port": 8123, "host": "127.0.0.1"} and note.startswith("serve: c.yaml sets no ")
    for given in ({"http_options": {"host": "0.0.0.0"}}, {"http_options": "junk"}):
        assert serve_config.loopback_by_default(given, "c.yaml") is None and "127.0.0.1" not in str(given)
    assert serve_config.loopback_by_default(none := {"http_options": None}, "c") and none["http_options"]["host"]
    copy = tmp_path / "copy.yaml"
    assert serve_config.main(["--loopback", str(source), str(copy)]) == 0
    copied = yaml.safe_load(copy.read_text())  # it gives a host: the same config, with what its replicas run
    assert [a.pop("runtime_env") for a in copied["applications"]] == [
        {"env_vars": {"EMBED_SERVE_CODE": serve_config.code_fingerprint(), "EMBED_SERVE_MODELS": "versions"}}]
    assert copied == yaml.safe_load(before)
    # OUT "-": what `make serve SERVE_ARGS=...` runs before it starts a cluster (a check; nothing written)
    assert serve_config.main([str(source), "-", "max_pairs=8"]) == 0
    assert serve_config.main([str(source), "-", "max_pairs=0"]) == 2
    assert not (CLUSTER.parent / "-").exists()
    # a model read from a local store that does not exist (a clone before its first `make run`): one line, before a
    # cluster starts, instead of the application builder's traceback after it
    none = f"sqlite:///{tmp_path / 'none.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", none)
    assert serve_config.missing_store(yaml.safe_load(before)) == (
        f"models:/pair-residual-stsb@champion (application 'pair-scorer') is read from the MLflow store {none}, which "
        "does not exist yet: `make run` (with the same TASK) trains and registers a champion there first; or name "
        "another store (MLFLOW_TRACKING_URI, or tracking_uri=...).")
    assert serve_config.main([str(source), "-"]) == 2 and not (tmp_path / "none.db").exists()
    assert serve_config.missing_store(serve_config.overridden(yaml.safe_load(before), [
        "model_uri=/models/adapter", "cross_encoder=null"])) is None  # a folder: no store read
    (tmp_path / "none.db").touch()
    assert serve_config.missing_store(yaml.safe_load(before)) is None and serve_config.main([str(source), "-"]) == 0
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")  # a server: not asked here
    assert serve_config.missing_store(yaml.safe_load(before)) is None


def test_a_serve_config_copy_names_the_code_and_the_model_versions_its_replicas_run(tmp_path, monkeypatch):
    """Serve keeps the replicas of a deploy whose config did not change (and runs no builder, which resolves an
    alias), and they run the code they imported when they started: the copy `local.sh serve` deploys names the code
    (serving/ and embed_lib/) and the versions the model aliases point at, so an edit or a moved alias is a new
    config. The fingerprint moves with any .py file there, not with other files; an application's own runtime_env
    is kept. (A moved alias redeployed through local.sh: tests/test_serving.py.)"""
    import shutil

    serve_config = _script("serve_config")
    root = tmp_path / "clone"
    for d in ("serving", "embed_lib"):
        shutil.copytree(CLUSTER.parent / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    first = serve_config.code_fingerprint(root)
    assert first == serve_config.code_fingerprint(CLUSTER.parent) and len(first) == 16
    (root / "serving" / "notes.txt").write_text("not code")
    assert serve_config.code_fingerprint(root) == first
    with open(root / "embed_lib" / "data" / "custom_tasks.py", "a") as fh:
        fh.write("\n# an edit\n")
    assert serve_config.code_fingerprint(root) != first
    config = {"applications": [{"name": "a"}, {"name": "b", "runtime_env": {"env_vars": {"X": "1"}, "pip": ["p"]}},
                               {"name": "c", "runtime_env": None}, {"name": "d", "runtime_env": "junk"}]}
    stamp = {"EMBED_SERVE_CODE": "f0", "EMBED_SERVE_MODELS": "m"}
    assert serve_config.stamped(config, "f0", lambda args: "m")["applications"] == [
        {"name": "a", "runtime_env": {"env_vars": stamp}},
        {"name": "b", "runtime_env": {"env_vars": {"X": "1", **stamp}, "pip": ["p"]}},
        {"name": "c", "runtime_env": {"env_vars": stamp}},
        {"name": "d", "runtime_env": "junk"}]  # not a mapping: left for Serve's own validation to name
    # only models:/NAME@ALIAS arguments are resolved (a version or a folder is in the config already); one that
    # cannot be resolved adds nothing, and the builder names the problem
    assert serve_config.pinned_models({"model_uri": "models:/m/3", "cross_encoder": "/models/ce"}, environ={}) == ""
    assert serve_config.pinned_models({"model_uri": "models:/m@champion",
                                       "tracking_uri": f"sqlite:///{tmp_path / 'none.db'}"}) == ""
    assert not (tmp_path / "none.db").exists()
    # a server is asked once, for at most 10 s (MLflow's client retried one that does not answer for 4 minutes),
    # and the process's own MLflow settings are back afterwards
    import serving.model

    seen = []
    monkeypatch.setattr(serving.model, "pinned_uri", lambda uri, store: seen.append(
        (store, os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES"), os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT")))
        or "models:/m/4")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    assert serve_config.pinned_models({"model_uri": "models:/m@champion", "tracking_uri": "http://h:5000"}) == \
        "models:/m/4"
    assert seen == [("http://h:5000", "0", "10")]
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "120" and "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ


def test_a_model_the_store_does_not_have_is_named_before_the_deploy(tmp_path, monkeypatch, capsys):
    """`make serve TASK=qqp` before `make run TASK=qqp` (the store exists, the model does not) deployed, and ended in
    the application builder's traceback; now `serve_config.py` names it in one line (exit 2) and writes no config.
    The same for a version or an alias the store lacks; what it has is stamped as before (aliases only)."""
    import mlflow

    serve_config = _script("serve_config")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(store, registry_uri=store)
    client.create_registered_model("m")
    client.create_model_version("m", source=str(tmp_path))
    client.set_registered_model_alias("m", "champion", "1")
    assert serve_config.pinned_models({"model_uri": "models:/m@champion", "tracking_uri": store}) == "models:/m/1"
    assert serve_config.pinned_models({"model_uri": "models:/m/1", "tracking_uri": store}) == ""
    for uri, why in (("models:/qqp@champion", "Registered Model with name=qqp not found"),
                     ("models:/m@best", "Registered model alias best not found"),
                     ("models:/m/7", r"Model Version \(name=m, version=7\) not found")):
        with pytest.raises(ValueError, match=rf"Cannot load '{uri}' from MLflow \({store}\): {why}"):
            serve_config.pinned_models({"model_uri": uri, "tracking_uri": store})
    config, out = tmp_path / "config.yaml", tmp_path / "out" / "config.yaml"
    config.write_text("applications:\n- name: pair-scorer\n  import_path: serving.app:build_app\n  args: {}\n")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    capsys.readouterr()  # MLflow's lines of making the store
    assert serve_config.main([str(config), str(out), "model_uri=models:/qqp@champion"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("serve: Cannot load 'models:/qqp@champion'") and err.count("\n") == 1
    assert "`make run TASK=<task>` registers" in err and not out.exists()
    assert serve_config.main([str(config), str(out), "model_uri=models:/m@champion"]) == 0
    written = yaml.safe_load(out.read_text())["applications"][0]["runtime_env"]["env_vars"]
    assert written["EMBED_SERVE_MODELS"] == "models:/m/1"


def _make_serve_args(target: str, task: str) -> str:
    """The KEY=VALUE arguments `make <target> TASK=<task>` deploys with (`make -n`: printed, nothing run)."""
    out = subprocess.run(["make", "-n", target, f"TASK={task}"], cwd=CLUSTER.parent, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    line = next(ln for ln in out.splitlines() if "local.sh serve" in ln)
    return line.split("local.sh serve ", 1)[1].split(" ||")[0]


def test_make_serve_serves_the_champion_of_the_task_it_is_given(tmp_path):
    """`make serve TASK=...`: STS-B the config's own; a built-in task its champion, warmed with its sentences; a
    task of your own (a name, a pair file, hf:<id>) the model its sweep registered, pair-residual-<slug> (it served
    STS-B's champion before, without a word); serve-cascade that task's served cross-encoder."""
    pairs = tmp_path / "My-Pairs.v2.csv"
    pairs.write_text("a,b,score\n")
    assert _make_serve_args("serve", "stsb").split() == ["serving/config.yaml"]
    assert _make_serve_args("serve", "qqp").split() == [
        "serving/config.yaml", "model_uri=models:/pair-residual-qqp@champion", "warm_corpus=task:qqp"]
    assert _make_serve_args("serve", "foo").split() == [
        "serving/config.yaml", "model_uri=models:/pair-residual-foo@champion", "warm_corpus=null"]
    assert _make_serve_args("serve", str(pairs)).split()[1:] == [
        "model_uri=models:/pair-residual-my-pairs_v2@champion", f"warm_corpus={pairs}"]
    assert _make_serve_args("serve", "hf:org/Set:cfg").split()[1] == "model_uri=models:/pair-residual-set_cfg@champion"
    assert "cross_encoder=models:/cross-encoder-foo@current" in _make_serve_args("serve-cascade", "foo")


def test_make_run_checks_a_task_other_than_the_default_before_a_cluster_starts(tmp_path):
    """`make run TASK=<unknown>` ends in the sweep's own check (`--check-flags`), not in a job on a cluster it
    started for nothing (it did: ~20 s to the same line)."""
    env = dict(os.environ, EMBED_RAY_DIR=str(tmp_path / "ray"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/m.db")
    run = subprocess.run(["make", "run", "TASK=no_such_task"], cwd=CLUSTER.parent, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "--task 'no_such_task' is unknown" in run.stderr + run.stdout, run.stderr[-2000:]
    assert "local Ray up" not in run.stdout and not (tmp_path / "ray").exists()


def _container_env(manifest: dict) -> list[dict[str, str]]:
    """{name: value} of each container's env in a RayCluster / RayService manifest."""
    spec = manifest["spec"].get("rayClusterConfig", manifest["spec"])
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [{e["name"]: e.get("value") for e in c.get("env", [])}
            for g in groups for c in g["template"]["spec"]["containers"]]


def test_serve_settings_have_one_source_and_reach_every_serving_node(tmp_path):
    from serving.serve_env import apply_serve_env, multi_node_serve_env, serve_env

    settings = serve_env()
    assert settings["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
    assert settings["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert settings["RAY_SERVE_ENABLE_HA_PROXY"] == "1"  # one node: HAProxy
    settings = multi_node_serve_env()  # several nodes: the same, with Serve's proxy
    assert settings["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    for name in ("kuberay/rayservice.yaml", "kuberay/raycluster.yaml"):
        for env in _container_env(load(name)):
            assert {k: env.get(k) for k in settings} == settings, name
    for name in ("aws.yaml", "gcp.yaml"):
        cfg = load(name)
        for cmd in [*cfg["head_start_ray_commands"], *cfg["worker_start_ray_commands"]]:
            if "ray start" in cmd:
                assert all(f"{k}={v} " in cmd for k, v in settings.items()), (name, cmd)
    # the environment wins over the file; what is unset is filled in
    environ = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0"}
    in_force = apply_serve_env(environ, tmp_path)
    assert in_force["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "0" and environ["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "0"
    assert environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == settings["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"]


def test_serve_env_file_errors_name_the_line(tmp_path):
    from serving.serve_env import serve_env

    bad = tmp_path / "serve.env"
    bad.write_text("# comment\n\nRAY_SERVE_X=1\nnot a setting\n")
    with pytest.raises(ValueError, match=r"serve.env:4: expected KEY=VALUE"):
        serve_env(bad)


def _script(name: str):
    """cluster/<name>.py, a script of local.sh (cluster/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, CLUSTER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dashboard():
    return _script("dashboard")


def _serve_verdict(config_path: Path, answer) -> str:
    """The verdict on a Serve REST answer: "" stands for no answer, a dict for the listed applications."""
    return _dashboard().verdict(yaml.safe_load(config_path.read_text()),
                                None if answer == "" else {"applications": answer})


def test_local_serve_waits_for_the_configs_applications_and_stops_at_a_failure(tmp_path):
    """`local.sh serve`'s verdict on the dashboard's Serve REST answer: running only when every application
    of the config is RUNNING with healthy deployments; a failure of one of them ends the wait, with its
    message; other applications on the cluster do not count."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"http_options": {"port": 8123}, "applications": [{"name": "pair-scorer"}]}))
    healthy = {"Ingress": {"status": "HEALTHY"}, "Encoder": {"status": "HEALTHY"}}

    def app(status, deployments=healthy, message=""):
        return {"status": status, "message": message, "deployments": deployments}

    assert _serve_verdict(config, "").startswith("waiting")  # the dashboard did not answer
    assert _serve_verdict(config, {}) == "waiting pair-scorer: not listed"
    assert _serve_verdict(config, {"pair-scorer": app("DEPLOYING")}) == "waiting pair-scorer: DEPLOYING"
    assert _serve_verdict(config, {"pair-scorer": app("RUNNING", {**healthy, "Encoder": {"status": "UPDATING"}})
                                   }).startswith("waiting")
    assert _serve_verdict(config, {"pair-scorer": app("RUNNING"), "other": app("UNHEALTHY")}) == "running 8123"
    failed = _serve_verdict(config, {"pair-scorer": app("DEPLOY_FAILED", message="ImportError: no module x")})
    assert failed.startswith("failed pair-scorer: DEPLOY_FAILED") and "ImportError: no module x" in failed
    unhealthy = _serve_verdict(config, {"pair-scorer": app("RUNNING", {**healthy, "Encoder": {"status": "UNHEALTHY"}})
                                        })
    assert unhealthy.startswith("failed pair-scorer") and "Encoder" in unhealthy
    config.write_text(yaml.safe_dump({"applications": []}))
    assert _serve_verdict(config, {}) == "failed the config lists no application"


def test_the_job_follower_prints_a_growing_log_once_and_the_rest_after_the_end():
    """cluster/dashboard.py follow-job against a stand-in of the dashboard's job API: the log as it grows, every
    character once, the part written just before the job ended fetched after the end, a refused read retried,
    the token sent, and the job's final status returned."""
    import io
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    dashboard = _dashboard()
    # per status read: (status, the log so far); the 3rd status read fails once with a 503
    script = [("PENDING", ""), ("RUNNING", "line 1\n"), (None, None), ("RUNNING", "line 1\nline 2\n"),
              ("FAILED", "line 1\nline 2\nlast words\n")]
    state = {"i": -1, "auth": set()}

    class Api(BaseHTTPRequestHandler):
        def do_GET(self):
            state["auth"].add(self.headers.get("Authorization"))
            if self.path == "/api/jobs/j1":
                state["i"] = min(state["i"] + 1, len(script) - 1)
            status, logs = script[max(state["i"], 0)]
            if status is None:
                self.send_response(503)
                self.end_headers()
                return
            body = json.dumps({"status": status} if self.path == "/api/jobs/j1" else {"logs": logs}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = io.StringIO()
        status = dashboard.follow(f"http://127.0.0.1:{server.server_address[1]}", "j1", "tok", out=out)
    finally:
        server.shutdown()
    assert status == "FAILED"
    assert out.getvalue() == "line 1\nline 2\nlast words\n"
    assert state["auth"] == {"Bearer tok"}


def test_ctrl_c_under_the_job_follower_stops_the_job_and_follows_it_to_its_end(monkeypatch, capsys):
    """`local.sh submit` (what `make run` runs): a first Ctrl-C stops the job through the API (POST .../stop) and
    goes on printing its log to its end, the driver's last lines included (a stopped sweep says it registered
    nothing); a second Ctrl-C stops following. `stop-job` stops a job and waits for its end. Before, Ctrl-C left the
    sweep running and printed a `ray job stop` that fails from a shell (no venv on PATH, no token)."""
    import io
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    dashboard = _dashboard()
    state = {"stopped": False, "posts": [], "auth": set()}

    class Api(BaseHTTPRequestHandler):
        def _answer(self, body: dict) -> None:
            state["auth"].add(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def do_GET(self):
            logs = "started\n" + ("sweep interrupted: nothing registered\n" if state["stopped"] else "")
            self._answer({"status": "STOPPED" if state["stopped"] else "RUNNING"} if self.path.endswith("/j1")
                         else {"logs": logs})

        def do_POST(self):
            state["posts"].append(self.path)
            state["stopped"] = True
            self._answer({"stopped": True})

        def log_message(self, *args):
            pass

    class CtrlC(io.StringIO):  # the terminal's Ctrl-C, arriving as the follower prints the first line
        presses = 1

        def write(self, text):
            if text and self.presses:
                self.presses -= 1
                raise KeyboardInterrupt
            return super().write(text)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        out = CtrlC()
        assert dashboard.follow(address, "j1", "tok", out=out, interrupt_stops=True) == "STOPPED"
        assert state["posts"] == ["/api/jobs/j1/stop"] and state["auth"] == {"Bearer tok"}
        assert out.getvalue() == "started\nsweep interrupted: nothing registered\n"  # every line once, the last too
        state.update(stopped=False, posts=[])
        out = CtrlC()
        out.presses = 2  # Ctrl-C twice: the second leaves the job and stops following
        with pytest.raises(KeyboardInterrupt):
            dashboard.follow(address, "j1", "tok", out=out, interrupt_stops=True)
        assert state["posts"] == ["/api/jobs/j1/stop"]
        with pytest.raises(KeyboardInterrupt):  # without interrupt_stops (what other callers get): as before
            dashboard.follow(address, "j1", "tok", out=CtrlC())
        state.update(stopped=False, posts=[])
        assert dashboard.stop_job(address, "j1", "tok") == "STOPPED" and state["posts"] == ["/api/jobs/j1/stop"]
        # a Ctrl-C that came while `follow-job` started (kept by its handler, not a traceback): the job is stopped
        state.update(stopped=False, posts=[])
        monkeypatch.setattr(dashboard, "EARLY_CTRL_C", [1])
        assert dashboard.follow(address, "j1", "tok", out=io.StringIO(), interrupt_stops=True) == "STOPPED"
        assert state["posts"] == ["/api/jobs/j1/stop"]
        monkeypatch.setattr(dashboard, "EARLY_CTRL_C", [])
    finally:
        server.shutdown()
        server.server_close()
    # `stop-job` when the API does not answer: exit 1, saying so (3 is kept for "no such job": local.sh submit's
    # Ctrl-C says NOT SUBMITTED only then, tests/test_sweeps.py)
    assert dashboard.main(["stop-job", address, "j1"]) == 1
    assert f"stop-job: could not stop job 'j1' at {address}: " in capsys.readouterr().err
    # the API gone when Ctrl-C comes: the job could not be stopped; following stops, and says why
    def gone(url, token, method="GET"):
        if method == "POST":
            raise OSError("connection refused")
        return {"status": "RUNNING", "logs": "x"}

    monkeypatch.setattr(dashboard, "_api", gone)
    with pytest.raises(KeyboardInterrupt):
        dashboard.follow(address, "j1", "tok", out=CtrlC(), interrupt_stops=True)
    assert "Could not stop job 'j1': " in capsys.readouterr().err


def test_ctrl_c_while_make_serve_waits_for_its_deploy_is_one_line(tmp_path, monkeypatch, capsys):
    """Was a traceback of dashboard.py; now one line and exit 130, so that `make serve` stops the cluster it started
    (a cluster already there keeps the deploy going)."""
    dashboard = _dashboard()

    def pressed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(dashboard, "wait_serve", pressed)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "pair-scorer"}]}))
    assert dashboard.main(["wait-serve", "http://127.0.0.1:1", str(config)]) == 130
    assert capsys.readouterr().err == "\nStopped waiting for the Serve deploy (Ctrl-C).\n"


def test_release_sees_the_other_work_a_cluster_holds():
    """`local.sh release` (the end of `make run` on a cluster it started) stops the cluster only when the dashboard
    lists no job that has not ended and no Serve application: another `make run`'s job or `make serve`'s service
    keeps it. An API that does not answer holds nothing (the cluster is stopped, as before)."""
    dashboard = _dashboard()
    ended = [{"submission_id": "a", "status": "SUCCEEDED"}, {"submission_id": "b", "status": "FAILED"},
             {"submission_id": "c", "status": "STOPPED"}]
    assert dashboard.other_work(ended, {"applications": {}}) == []
    assert dashboard.other_work(None, None) == []
    jobs = ended + [{"submission_id": "d", "status": "PENDING"}, {"submission_id": None, "job_id": "05000000",
                                                                  "status": "RUNNING", "type": "DRIVER"}]
    serve = {"applications": {"pair-scorer": {"status": "RUNNING"}}}
    assert dashboard.other_work(jobs, serve) == ["job d PENDING", "job 05000000 RUNNING",
                                                 "Serve application pair-scorer RUNNING"]
    from tests.conftest import free_ports

    assert dashboard.busy(f"http://127.0.0.1:{free_ports(1)[0]}", "tok") == []


def test_serve_names_a_port_another_process_holds_before_it_deploys(tmp_path):
    """`local.sh serve` asks `dashboard.py serve-port` first: where Serve has not started on the cluster and another
    process listens on the config's HTTP port (on that address or on every address), the answer names the port, the
    config and the holder; a Serve already running holds its port itself (a redeploy), and no answer from the
    dashboard leaves the deploy to say what it finds."""
    import socket

    dashboard = _dashboard()
    no_serve = {"controller_info": {}, "proxies": {}, "applications": {}, "target_capacity": None}
    for bind_host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as held:
            held.bind((bind_host, 0))
            held.listen()
            port = held.getsockname()[1]
            config = {"http_options": {"host": "127.0.0.1", "port": port}}
            problem = dashboard.serve_port_problem(config, no_serve, "serving/config.yaml")
            assert problem.startswith(f"serve: 127.0.0.1:{port} (http_options of serving/config.yaml) is in use by ")
            assert f"pid {os.getpid()}" in problem and "make serve SERVE_PORT=8001" in problem
            assert dashboard.serve_port_problem(config, {**no_serve, "controller_info": {"node_id": "n"}}, "c") is None
            assert dashboard.serve_port_problem(config, None, "c") is None
    assert dashboard.serve_port_problem(config, no_serve, "c") is None  # closed: free again
    # a running Serve keeps its HTTP options: a deploy asking for others is refused, naming both
    running = {**no_serve, "controller_info": {"node_id": "n"}, "http_options": {"host": "127.0.0.1", "port": 8000}}
    assert dashboard.serve_port_problem({"http_options": {"host": "127.0.0.1", "port": 8000}}, running, "c") is None
    other = dashboard.serve_port_problem({"http_options": {"host": "127.0.0.1", "port": 8001}}, running, "c.yaml")
    assert other.startswith("serve: Serve already runs on this cluster on 127.0.0.1:8000; c.yaml asks for "
                            "127.0.0.1:8001") and "make cluster-stop" in other


def test_mlflow_ui_names_a_port_another_process_holds():
    """`make mlflow-ui` on a taken port: MLflow's server said only "[Errno 98] Address already in use"; now one line
    names the port, its holder and MLFLOW_PORT, before the server starts."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run(["make", "-s", "mlflow-ui", f"MLFLOW_PORT={port}"], cwd=CLUSTER.parent,
                             capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.startswith(f"mlflow-ui: 127.0.0.1:{port} is in use by ") and f"pid {os.getpid()}" in out.stderr
    assert "give another port: make mlflow-ui MLFLOW_PORT=5001" in out.stderr and "mlflow server" not in out.stdout
    assert _dashboard().main(["port-free", "127.0.0.1", str(port), "x", "y"]) == 0  # closed: free again


@pytest.mark.integration
def test_the_local_cluster_listens_on_loopback_only_and_stop_closes_every_port():
    """A cluster of its own: every socket its processes listen on is on loopback (nothing is on an
    allowlist: Ray, the dashboard, the agents and the metrics servers all bind 127.0.0.1); a driver started
    by hand after `eval "$(cluster/local.sh env)"` reaches it; `release` keeps it while a job runs on it, and stops
    it (`stop`) once nothing is left; and `stop` returns once every one of those ports is closed."""
    import shlex
    import shutil
    import subprocess
    import tempfile
    import time

    from tests.conftest import LOOPBACK, REPO, free_ports, listening_sockets

    names = ("RAY_PORT", "RAY_DASHBOARD_PORT", "RAY_CLIENT_PORT", "RAY_AGENT_PORT", "DASHBOARD_METRIC_PORT",
             "AUTOSCALER_METRIC_PORT")
    state = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, EMBED_RAY_DIR=str(state), RAY_NUM_CPUS="1",
               VENV=str(Path(sys.executable).parents[1]), **{k: str(p) for k, p in zip(names, free_ports(len(names)))})
    script = str(REPO / "cluster" / "local.sh")
    sockets = []
    try:
        subprocess.run([script, "start"], env=env, check=True, timeout=180)
        session = int((state / "head.pid").read_text())
        deadline = time.time() + 60
        while True:  # the dashboard answers first; raylet and agents come up after it
            sockets = listening_sockets(session)
            started = {name for _, _, name in sockets}
            if {"gcs_server", "raylet", "ray::DashboardA"} <= started or time.time() > deadline:
                break
            time.sleep(0.5)
        assert {"gcs_server", "raylet", "ray::DashboardA"} <= started, sockets
        exposed = [s for s in sockets if s[0] not in LOOPBACK]
        assert not exposed, exposed
        # a driver run by hand in a shell that took `local.sh env` (no Ray setting of this process) connects;
        # the shell keeps what the cluster was started with (its state dir, port and token file)
        shell = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        shell.update({k: env[k] for k in ("EMBED_RAY_DIR", "RAY_PORT", "RAY_AUTH_TOKEN_PATH") if k in env})
        code = "import ray; ray.init(log_to_driver=False); print(int(ray.cluster_resources()['CPU']))"
        line = f'eval "$({shlex.quote(script)} env)" && exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}'
        driver = subprocess.run(["bash", "-c", line], env=shell, capture_output=True, text=True, timeout=120)
        assert driver.returncode == 0 and driver.stdout.split()[-1] == "1", driver.stdout[-2000:] + driver.stderr[-2000:]
        # `serve` on a port another process holds: refused before the deploy, naming it; nothing is deployed
        import socket

        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            config = Path(state) / "held.yaml"
            serving = yaml.safe_load((REPO / "serving" / "config.yaml").read_text())
            serving["applications"][0]["args"]["model_uri"] = str(state / "adapter")  # no store to be read first
            config.write_text(yaml.safe_dump({**serving, "http_options": {"port": port}}))
            t0 = time.time()
            refused = subprocess.run([script, "serve", str(config)], env=env, capture_output=True, text=True,
                                     timeout=120)
        # the config gives no host: served on loopback (Ray's default behind HAProxy is every interface), said so
        assert f"serve: {config} sets no http_options.host: serving on 127.0.0.1" in refused.stdout, refused.stdout
        assert refused.returncode == 1 and f"serve: 127.0.0.1:{port} (http_options of {config}) is in use by " \
            in refused.stderr, refused.stdout + refused.stderr
        assert time.time() - t0 < 30 and "Serve application" not in subprocess.run(
            [sys.executable, str(REPO / "cluster" / "dashboard.py"), "busy", f"http://127.0.0.1:{env['RAY_DASHBOARD_PORT']}"],
            env=dict(env, RAY_AUTH_TOKEN_PATH=env.get("RAY_AUTH_TOKEN_PATH") or str(state / "auth_token")),
            capture_output=True, text=True).stdout
        # `release --if-left` (the end of a `make run` that did not start it) leaves a cluster alone that no release
        # left running; `release` (the end of a `make run` that started it) leaves it running while another job is on
        # it; then the end of the other run (`release --if-left`) stops it once the job has ended
        assert subprocess.run([script, "release", "--if-left"], env=env, timeout=60).returncode == 0
        assert subprocess.run([script, "status"], env=env, capture_output=True).returncode == 0
        import signal

        # in a session of its own with SIGINT as a terminal gives it: Ctrl-C below goes to its process group
        job = subprocess.Popen([script, "submit", "--", "python", "-c", "import time; time.sleep(60)"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        busy = [sys.executable, str(REPO / "cluster" / "dashboard.py"), "busy",
                f"http://127.0.0.1:{env['RAY_DASHBOARD_PORT']}"]
        busy_env = dict(env, RAY_AUTH_TOKEN_PATH=env.get("RAY_AUTH_TOKEN_PATH") or str(state / "auth_token"))
        deadline = time.time() + 120
        while "RUNNING" not in subprocess.run(busy, env=busy_env, capture_output=True, text=True).stdout:
            ended = job.poll() is not None
            assert time.time() < deadline and not ended, job.communicate()[0][-2000:] if ended else "not RUNNING"
            time.sleep(0.5)
        release = subprocess.run([script, "release"], env=env, capture_output=True, text=True, timeout=120)
        assert release.returncode == 0 and "left running, it holds other work: job embed-" in release.stdout, \
            release.stdout + release.stderr
        assert subprocess.run([script, "status"], env=env, capture_output=True).returncode == 0
        job_id = release.stdout.split("other work: job ")[1].split()[0]
        os.killpg(job.pid, signal.SIGINT)  # Ctrl-C where `make run` follows its job: the job is stopped
        followed = job.communicate(timeout=120)[0]
        assert f"Ctrl-C: stopping job '{job_id}'" in followed, followed[-2000:]
        assert followed.rstrip().endswith(f"Job '{job_id}' STOPPED"), followed[-2000:]
        last = subprocess.run([script, "release", "--if-left"], env=env, capture_output=True, text=True, timeout=120)
        assert last.returncode == 0 and "local Ray stopped" in last.stdout, last.stdout + last.stderr
        assert subprocess.run([script, "status"], env=env, capture_output=True).returncode == 1
    finally:
        t0 = time.perf_counter()
        stop = subprocess.run([script, "stop"], env=env, capture_output=True, text=True, timeout=120)
        seconds = time.perf_counter() - t0
        shutil.rmtree(state, ignore_errors=True)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    still = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    open_ports = [p for _, p, _ in sockets if f":{p} " in still]
    assert not open_ports, (open_ports, f"stop took {seconds:.1f} s")


def test_the_haproxy_wrapper_puts_stats_and_metrics_on_loopback_and_leaves_the_rest(tmp_path):
    """cluster/haproxy-loopback rewrites exactly the two binds Ray renders on every interface (stats page and
    Prometheus frontend) and runs the real binary with Ray's arguments unchanged."""
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text("frontend prometheus\n    bind :19101\n    mode http\n"
                   "frontend http_frontend\n    bind 127.0.0.1:18000\n"
                   "frontend grpc_frontend\n    bind *:19000 proto h2\n"
                   "listen stats\n  bind *:18404\n  stats enable\n")
    fake = tmp_path / "haproxy"  # stands for the real binary: records its arguments
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n')
    fake.chmod(0o755)
    env = dict(os.environ, EMBED_HAPROXY_BINARY=str(fake), RAY_SERVE_HAPROXY_STATS_PORT="18404",
               RAY_SERVE_HAPROXY_METRICS_PORT="19101")
    subprocess.run([str(CLUSTER / "haproxy-loopback"), "-db", "-f", str(cfg), "-dR", "-sf", "123"], env=env, check=True)
    assert cfg.read_text() == ("frontend prometheus\n    bind 127.0.0.1:19101\n    mode http\n"
                               "frontend http_frontend\n    bind 127.0.0.1:18000\n"
                               "frontend grpc_frontend\n    bind *:19000 proto h2\n"  # not ours to move: its host is Serve's
                               "listen stats\n  bind 127.0.0.1:18404\n  stats enable\n")
    assert (tmp_path / "args").read_text().split() == ["-db", "-f", str(cfg), "-dR", "-sf", "123"]
    # without the real binary named, it says what is missing
    env.pop("EMBED_HAPROXY_BINARY")
    out = subprocess.run([str(CLUSTER / "haproxy-loopback"), "-f", str(cfg)], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "EMBED_HAPROXY_BINARY" in out.stderr


# skipped only where util-linux's setpriv is missing (not Linux): the wrapper then cannot tie HAProxy to its parent
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no util-linux setpriv here: HAProxy then outlives a "
                    "killed parent, as without the wrapper")
def test_haproxy_dies_with_the_process_that_started_it(tmp_path):
    """Ray's HAProxyManager starts HAProxy; when that actor's process dies (killed, its driver killed), HAProxy must
    not live on holding the Serve port. The wrapper's child (a stand-in binary that sleeps) goes with its parent."""
    fake = tmp_path / "haproxy"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    env = dict(os.environ, EMBED_HAPROXY_BINARY=str(fake))
    starter = ("import subprocess, sys, time; p = subprocess.Popen([sys.argv[1], '-db', '-f', '/nonexistent']); "
               "print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", starter, str(CLUSTER / "haproxy-loopback")], env=env,
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.5)  # the wrapper has exec'd the binary
    assert Path(f"/proc/{child}").exists()
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "HAProxy (its stand-in) outlived the process that started it"


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_two_clusters_get_their_own_haproxy_ports_and_files(tmp_path):
    import tempfile

    from serving.serve_env import HAPROXY_WRAPPER, apply_serve_env, ingress

    one, two = {}, {}
    apply_serve_env(one, tmp_path / "one")
    apply_serve_env(two, tmp_path / "two")
    assert ingress(one) == ingress(two) == "haproxy"
    for key in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
                "RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE",
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"):
        assert one[key] != two[key], key
    assert one["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"].startswith(str(tmp_path / "one"))
    assert one["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(HAPROXY_WRAPPER) and os.access(one["EMBED_HAPROXY_BINARY"], os.X_OK)
    assert one["RAY_SERVE_HAPROXY_METRICS_ENABLED"] == "0"  # per-request metrics: only when asked for
    asked = {"EMBED_RAY_METRICS": "1", "RAY_SERVE_HAPROXY_STATS_PORT": "18404"}
    apply_serve_env(asked, tmp_path / "three")
    assert asked["RAY_SERVE_HAPROXY_METRICS_ENABLED"] == "1" and asked["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    # Serve's proxy one setting away: no HAProxy settings at all
    proxy = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    apply_serve_env(proxy, tmp_path / "four")
    assert ingress(proxy) == "proxy" and not any(k.startswith("RAY_SERVE_HAPROXY") for k in proxy)
    # a process that names no dir (the benchmarks' local clusters) gets a temporary one, gone when it exits
    code = ("from serving.serve_env import apply_serve_env; import os; "
            "d = apply_serve_env({})['RAY_SERVE_HAPROXY_SERVER_STATE_BASE']; print(d, os.path.isdir(d))")
    made = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    where, existed = made.stdout.split()
    assert existed == "True" and where.startswith(tempfile.gettempdir()) and not os.path.exists(where), made.stderr


def test_a_port_chosen_at_start_and_bound_later_lies_outside_the_ports_the_kernel_and_ray_hand_out(tmp_path,
                                                                                                 monkeypatch):
    """HAProxy's ports are chosen when a cluster starts and bound when Serve starts: a port of the kernel's ephemeral
    range could meanwhile be the source port of any connection (the suite saw HAProxy's metrics frontend refused,
    "Address already in use"). They come from between Ray's worker ports and that range, free when chosen; a port
    taken is passed over, and a machine with no such gap gets the kernel's choice."""
    import socket

    from serving import serve_env

    low = serve_env._ephemeral_low()
    ports = [serve_env.free_port() for _ in range(50)]
    assert all(serve_env.RAY_WORKER_PORTS.stop <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 40  # drawn, not the same one each time
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[0]))
        draws = iter([ports[0], ports[1]])
        monkeypatch.setattr("random.SystemRandom.randrange", lambda self, a, b: next(draws))
        assert serve_env.free_port() == ports[1]  # the held one is passed over
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t65535\n")
    assert serve_env._ephemeral_low(str(ranges)) == 1024 and serve_env._ephemeral_low(str(tmp_path / "none")) == 32768
    monkeypatch.setattr(serve_env, "_ephemeral_low", lambda: 1024)
    assert serve_env.free_port() >= low  # no gap: the kernel's choice, from its ephemeral range
