"""The sweep's flags are checked before anything starts: a bad value is one line naming the flag and its bound,
with no Ray cluster, MLflow store or cache made (they used to surface after minutes of encoding and teacher
training, inside every trial, or never: `--limit -5` sliced all but five pairs)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sweeps.flags import add_sweep_args, check_settings

ROOT = Path(__file__).resolve().parents[1]
FIXED = {"loss": "cosent", "batch_size": 128, "control": "none", "hidden": 128, "alpha0": 0.5}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_sweep_args(parser, default_samples=32)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (("--num-samples", "0"), "argument --num-samples: 0 is below 1; give 1 or more"),
    (("--max-concurrent", "0"), "argument --max-concurrent: 0 is below 1; give 1 or more"),
    (("--seeds", "-3"), "argument --seeds: -3 is below 1; give 1 or more"),
    (("--limit", "-5"), "argument --limit: -5 is below 1; give 1 or more"),
    (("--epochs", "0"), "argument --epochs: 0 is below 1; give 1 or more"),
    (("--encode-workers", "-2"), "argument --encode-workers: -2 is below 0; give 0 or more"),
    (("--cpus-per-trial", "0"), "argument --cpus-per-trial: 0 is out of range; give a number > 0"),
    (("--cpus-per-trial", "inf"), "argument --cpus-per-trial: inf is out of range; give a number > 0"),
    (("--gpus-per-trial", "-0.5"), "argument --gpus-per-trial: -0.5 is out of range; give a number >= 0"),
    (("--transfer-tolerance", "-1"), "argument --transfer-tolerance: -1 is out of range; give a number >= 0"),
    (("--num-samples", "many"), "argument --num-samples: 'many' is not an integer"),
])
def test_a_flag_out_of_its_range_is_refused_by_the_parser(argv, message):
    with pytest.raises(argparse.ArgumentError) as err:
        _parse(*argv)
    assert str(err.value) == message


def test_the_edges_of_each_range_are_accepted():
    args = _parse("--num-samples", "1", "--max-concurrent", "1", "--seeds", "1", "--limit", "1", "--epochs", "1",
                  "--encode-workers", "0", "--cpus-per-trial", "0.25", "--gpus-per-trial", "0",
                  "--transfer-tolerance", "0")
    assert (args.num_samples, args.seeds, args.limit, args.encode_workers) == (1, 1, 1, 0)
    assert (args.cpus_per_trial, args.gpus_per_trial, args.transfer_tolerance) == (0.25, 0.0, 0.0)
    check_settings(args, FIXED)  # the defaults and the edges make valid configs


@pytest.mark.parametrize("argv, message", [
    (("--seeds", "500"), r"AdapterConfig.n_seeds=500; allowed 1..100"),
    (("--epochs", "5000"), r"AdapterConfig.epochs=5000; allowed 1..1000"),
    (("--teacher-folds", "1"), r"TeacherConfig.folds=1; allowed 2..20"),
    (("--teacher-preset", "nope"), r"--teacher-preset 'nope': unknown preset 'nope'"),
    (("--transfer", "bogus"), r"--transfer: unknown task\(s\) \['bogus'\]"),
    (("--transfer", "qqp,stsb"), r"--transfer qqp,stsb: 'stsb' is the sweep's own task, no transfer check; give other "
                                 r"tasks, 'others' or 'none'"),
    (("--tau-attn-values", "1,x"), r"--tau-attn-values '1,x': expected numbers separated by commas"),
    (("--tau-attn-values", "0"), r"EncoderConfig.tau_attn=0.0 is out of range"),
    (("--search", "grid"), r"--search grid needs values: give --grid KEY=V1,V2"),
    (("--grid", "gamma"), r"--grid / --grid-file give the values of --search grid, and this sweep searches with "
                          r"optuna: add --search grid, or drop them"),
    (("--grid-file", "g.json"), r"--grid / --grid-file give the values of --search grid"),
    # ignored before: a grid runs each point once whatever --num-samples says
    (("--search", "grid", "--grid", "gamma=0.1", "--num-samples", "4"), r"^--num-samples steer the configurations "
                                                                        r"Optuna proposes, and --search grid runs each "
                                                                        r"point of its grid once: drop them"),
    (("--search", "grid", "--grid", "gamma=0.1", "--seed", "0", "--no-start-points"), r"^--seed, --no-start-points "
                                                                                      r"steer the configurations"),
    (("--encoder", "/no/such/encoder"), r"Could not load encoder '/no/such/encoder': no such file or directory"),
    (("--teacher", "./no/such/ce"), r"Could not load cross-encoder './no/such/ce': no such file or directory"),
    (("--search", "grid", "--grid", "tau=0.1,-1"), r"--grid point \{'tau': -1\}: AdapterConfig.tau=-1 is out of range"),
    (("--search", "grid", "--grid", "adapter=pair_gated", "--grid", "target=ce_margin,bogus"),
     r"--grid point \{'adapter': 'pair_gated', 'target': 'bogus'\}: Unknown difficulty target 'bogus'"),
    (("--search", "grid", "--grid", "gamma=0.1", "--grid", "control=shuffled"),
     r"--grid varies \['control'\], which this sweep holds fixed \(control='none'\): drop them from the grid"),
    (("--search", "grid", "--grid", "epochs=4,8", "--epochs", "6"), r"--grid varies \['epochs'\]"),
    (("--device", "cuda:1"), r"--device 'cuda:1': a sweep's encoders and teacher run in Ray workers, each on the GPU "
                             r"Ray gives it; give cpu, cuda, or leave it unset"),
    (("--device", "mps"), r"--device 'mps': a sweep's encoders and teacher run in Ray workers"),
])
def test_every_config_the_flags_make_is_built_before_anything_starts(argv, message):
    args = _parse("--task", "stsb", *argv)
    with pytest.raises(ValueError, match=message):
        check_settings(args, FIXED)


def test_a_grid_file_is_read_and_checked(tmp_path):
    good, bad, broken = tmp_path / "good.json", tmp_path / "bad.json", tmp_path / "broken.json"
    good.write_text(json.dumps({"gamma": [0.1, 0.2], "tau": [0.5]}))
    bad.write_text(json.dumps({"gamma": []}))
    broken.write_text("gamma: [0.1]")
    check_settings(_parse("--search", "grid", "--grid-file", str(good)), FIXED)
    with pytest.raises(ValueError, match=r"each list non-empty"):
        check_settings(_parse("--search", "grid", "--grid-file", str(bad)), FIXED)
    with pytest.raises(ValueError, match=r"not JSON .* expected \{key: \[values\]\}"):
        check_settings(_parse("--search", "grid", "--grid-file", str(broken)), FIXED)
    with pytest.raises(ValueError, match=rf"--grid-file {tmp_path}/none.json: No such file or directory"):
        check_settings(_parse("--search", "grid", "--grid-file", str(tmp_path / "none.json")), FIXED)


def test_the_entry_script_stops_in_one_line_and_makes_nothing(tmp_path):
    """Through the entry script a user runs: exit 2, one line, no MLflow store, no cache, no Ray session."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(tmp_path / "ray"),
           "EMBED_CACHE_DIR": str(tmp_path / "cache")}
    store = tmp_path / "mlflow.db"
    for argv, line in [
        (["--seeds", "500"], "error: AdapterConfig.n_seeds=500; allowed 1..100."),
        (["--limit", "-5"], "argument --limit: -5 is below 1; give 1 or more"),
        # a traceback after Ray had started and MLflow had made the store
        (["--resume", "--name", "nope", "--storage-path", str(tmp_path / "tune")],
         f"error: --resume: no sweep named 'nope' under {tmp_path}/tune; run without --resume first."),
    ]:
        proc = subprocess.run([sys.executable, str(ROOT / "sweeps" / "pair_residual.py"), "--task", "stsb",
                               "--tracking-uri", f"sqlite:///{store}", *argv], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].endswith(line), proc.stderr
    assert not store.exists() and not (tmp_path / "cache").exists() and not (tmp_path / "ray").exists()


@pytest.mark.parametrize("script", ["pair_residual.py", "per_sentence.py"])
def test_an_entry_script_under_a_python_without_the_stack_names_it_and_the_fix(tmp_path, script):
    """What `ray job submit -- python sweeps/...` meets on a cluster started outside the venv: one line naming the
    interpreter, what it lacks and how to run it, instead of a traceback ending in `import mlflow` (-S: this Python
    without its site-packages, the project found through PYTHONPATH as a job's working dir is)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": str(tmp_path / "ray")}
    proc = subprocess.run([sys.executable, "-S", f"sweeps/{script}", "--task", "stsb", "--tracking-uri",
                           f"sqlite:///{tmp_path / 'mlflow.db'}"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: sweeps/{script} runs under {sys.executable}, which lacks numpy, torch, ray, "
                           "mlflow, optuna, sentence_transformers: run it with the project's venv"), line
    assert "cluster/local.sh start" in line and "source .venv/bin/activate; ray start --head" in line
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray").exists()


def test_check_flags_checks_and_starts_nothing(tmp_path):
    """`make run SWEEP_ARGS=...` runs this before it starts a cluster: good flags exit 0 with no Ray session and no
    MLflow store; bad ones give the sweep's own line (exit 2)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(tmp_path / "ray")}
    store = tmp_path / "mlflow.db"
    base = [sys.executable, str(ROOT / "sweeps" / "pair_residual.py"), "--task", "stsb", "--tracking-uri",
            f"sqlite:///{store}", "--check-flags"]
    good = subprocess.run([*base, "--num-samples", "4"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert good.returncode == 0 and good.stderr.strip() == "sweep flags, task, store and directories checked", good
    bad = subprocess.run([*base, "--seeds", "500"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: AdapterConfig.n_seeds=500; allowed 1..100."
    assert not store.exists() and not (tmp_path / "ray").exists()


def test_a_gpu_device_on_a_cluster_without_gpus_stops_in_one_line(ray_cluster, tmp_path):
    """--device used to be ignored by the sweep: `cuda` on a CPU cluster ran on the CPUs, `cpu` on a GPU cluster on
    the GPUs. Now `cuda` where no GPU is and no trial asks for one stops before MLflow opens a run."""
    store = tmp_path / "mlflow.db"
    env = {**ray_cluster, "HF_HUB_OFFLINE": "1", "EMBED_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(ROOT / "sweeps" / "pair_residual.py"), "--task", "stsb", "--device",
                           "cuda", "--tracking-uri", f"sqlite:///{store}"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --device cuda, and this Ray cluster has no GPU: give cpu, leave --device unset, or join a GPU node "
        "first (an autoscaling cluster whose GPU nodes start at zero adds one for --gpus-per-trial > 0).")
    assert not store.exists()


def test_a_local_store_on_a_cluster_of_two_nodes_stops_in_one_line_before_mlflow_makes_it(tmp_path):
    """Raised where the parent run opened, after Ray had started: a traceback, and the sqlite store already made.
    The two-node cluster (ray.cluster_utils, for these seconds on the host's address: its nodes do not join on
    loopback) runs in a process of its own, without the loopback-only and token settings of this session's Ray."""
    store = tmp_path / "mlflow.db"
    short = tempfile.mkdtemp(prefix="ray-")  # Ray's socket paths must fit 107 bytes
    code = f"""
import subprocess, sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1, "include_dashboard": False,
                                                        "temp_dir": {short!r}}})
try:
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    proc = subprocess.run([sys.executable, {str(ROOT / "sweeps" / "pair_residual.py")!r}, "--task", "stsb",
                           "--tracking-uri", "sqlite:///{store}", "--storage-path", {str(tmp_path / "tune")!r}],
                          capture_output=True, text=True, timeout=300, env={{**__import__("os").environ,
                                                                            "RAY_ADDRESS": cluster.address}})
finally:
    cluster.shutdown()
print(proc.returncode, proc.stderr.strip().splitlines()[-1])
"""
    # Cluster writes the head's address to <RAY_TMPDIR or /tmp>/ray/ray_current_cluster, a folder it does not make
    # (FileNotFoundError on a machine where no Ray ran yet), and a developer's `ray.init()` would then join this
    # cluster: the file goes inside the cluster's own folder
    os.makedirs(os.path.join(short, "ray"))
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")},
           "RAY_TMPDIR": short}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=400)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert out.stdout.strip() == (
        f"2 error: MLflow store 'sqlite:///{store}' is a local path, and this Ray cluster has 2 nodes, which share no "
        "disk: start an MLflow server on the head (mlflow server --serve-artifacts ...; cluster/nodes.py start does) "
        "and set MLFLOW_TRACKING_URI (or --tracking-uri) to its http:// URL."), out.stderr[-2000:]
    assert not store.exists()


def test_a_trial_no_node_can_hold_is_warned_of_before_tune_waits_for_one():
    from sweeps.flags import unplaceable

    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": True, "Resources": {"CPU": 1.0, "GPU": 1.0}},
             {"Alive": False, "Resources": {"CPU": 16.0, "GPU": 8.0}}]  # a dead node holds nothing
    assert unplaceable(nodes, 2.0, 1.0) == []
    assert unplaceable(nodes, 4.0, 2.0) == [
        "warning: --cpus-per-trial 4, and no node of this cluster has more than 2 CPU now: the trials wait until one "
        "joins (an autoscaling cluster adds it); on a fixed cluster, lower it.",
        "warning: --gpus-per-trial 2, and no node of this cluster has more than 1 GPU now: the trials wait until one "
        "joins (an autoscaling cluster adds it); on a fixed cluster, lower it."]
    assert unplaceable([], 0.5, 0.0)[0].startswith("warning: --cpus-per-trial 0.5, and no node of this cluster has "
                                                    "more than 0 CPU now")


def test_a_sweep_of_a_name_that_is_running_stops_in_one_line(tmp_path):
    """Two sweeps of one name at once (`make run` twice with other SWEEP_ARGS) shared Tune's experiment dir and the
    parent-run marker (--resume reopened the other's run): the second stops, naming the lock and the fix."""
    from sweeps.cli import hold_name

    held = hold_name(tmp_path / "tune", "pair_residual-stsb")
    with pytest.raises(ValueError, match=r"a sweep named 'pair_residual-stsb' is running now \(lock .*"
                                         r"pair_residual-stsb.lock\): give this one another --name, or wait"):
        hold_name(tmp_path / "tune", "pair_residual-stsb")
    hold_name(tmp_path / "tune", "pair_residual-stsb-2").release()  # another name: free
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(tmp_path / "ray"),
           "EMBED_STORAGE_DIR": str(tmp_path / "tune")}
    proc = subprocess.run([sys.executable, str(ROOT / "sweeps" / "pair_residual.py"), "--task", "stsb",
                           "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--check-flags"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "error: a sweep named 'pair_residual-stsb' is running now" in proc.stderr
    held.release()  # ended: the name is free again
    proc = subprocess.run(proc.args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr

