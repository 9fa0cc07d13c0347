"""The ingress's autoscaling policy (serving/autoscale.py): Serve's queue-length rule plus the replicas' CPU share,
computed by hand; the CPU meter on injected clocks; Serve taking the policy by value, as its controller gets it."""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving.autoscale import BUSY, TARGET_BUSY, CpuShare, IngressPolicy


def _ctx(replicas=1, requests=0.0, busy=None, target=1, target_ongoing=4):
    config = SimpleNamespace(get_target_ongoing_requests=lambda: target_ongoing)
    return SimpleNamespace(current_num_replicas=replicas, target_num_replicas=target, total_num_requests=requests,
                           aggregated_metrics=None if busy is None else {BUSY: busy}, config=config)


def test_the_policy_takes_the_larger_of_the_queue_rule_and_the_cpu_share():
    assert TARGET_BUSY == 0.5  # the figures below are computed for it
    ingress_policy = IngressPolicy()
    # behind HAProxy Serve counts 0 requests; one replica at 0.9 of a core wants 0.9 / 0.5 = 1.8 (Serve rounds up: 2)
    assert ingress_policy(_ctx(busy={"r1": 0.9}))[0] == pytest.approx(1.8)
    # two replicas at 0.2 and 0.1: 0.6, one replica is enough (Serve scales down after its delay)
    assert ingress_policy(_ctx(replicas=2, busy={"r1": 0.2, "r2": 0.1}))[0] == pytest.approx(0.6)
    # requests counted (Serve's proxy, or requests waiting on the encoder): 12 ongoing / 4 per replica = 3
    assert ingress_policy(_ctx(requests=12.0, busy={"r1": 0.3}))[0] == pytest.approx(3.0)
    # no CPU figures yet (a replica just started): Serve's own rule alone
    assert ingress_policy(_ctx(requests=6.0))[0] == pytest.approx(1.5)
    assert ingress_policy(_ctx(requests=6.0, busy={}))[0] == pytest.approx(1.5)
    # no replica running: Serve's cold-start target, whatever the metrics say
    assert ingress_policy(_ctx(replicas=0, requests=5.0, busy={"r1": 1.0}, target=1))[0] == 1


def test_a_lower_cpu_target_scales_out_sooner_and_a_bad_one_is_refused():
    # a node whose cores other work shares: one replica gets 0.3 of a core; at 0.2 that wants 1.5 (2), at 0.5 0.6 (1)
    assert IngressPolicy(0.2)(_ctx(busy={"r1": 0.3}))[0] == pytest.approx(1.5)
    assert IngressPolicy()(_ctx(busy={"r1": 0.3}))[0] == pytest.approx(0.6)
    assert IngressPolicy(0.2)(_ctx(requests=12.0, busy={"r1": 0.3}))[0] == pytest.approx(3.0)  # the queue rule stays
    for bad in (0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="target_busy must be a share of a core above 0"):
            IngressPolicy(bad)


def test_cpu_share_is_cpu_seconds_over_wall_seconds_between_readings():
    clock = {"wall": 100.0, "cpu": 10.0}
    meter = CpuShare(wall=lambda: clock["wall"], cpu=lambda: clock["cpu"])
    clock.update(wall=104.0, cpu=13.0)  # 3 CPU-seconds in 4 s
    assert meter.read() == pytest.approx(0.75)
    clock.update(wall=106.0, cpu=13.1)  # from the last reading on, not from the start
    assert meter.read() == pytest.approx(0.05)
    clock.update(wall=107.0, cpu=15.0)  # several threads: more than one core
    assert meter.read() == pytest.approx(1.9)
    assert meter.read() == 0.0  # no time passed: no division by zero


def test_the_policy_module_needs_only_the_standard_library():
    """Serve cloudpickles the policy by value into its controller, where this project's code is not installed."""
    tree = ast.parse(Path(sys.modules["serving.autoscale"].__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_serve_takes_the_ingress_options_and_ships_the_policy_by_value():
    """The app's ingress_target_cpu reaches the policy the controller builds: Serve unpickles the class from bytes
    (pickled by value: the controller lacks this project) and builds it once with the policy's keyword arguments."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    from serving.args import AppArgs, Replicas, deployment_options, ingress_autoscaling

    target = AppArgs.parse({"ingress_target_cpu": 0.25}).ingress_target_cpu
    options = deployment_options(Replicas(min=1, max=2), policy=ingress_autoscaling(target))
    config = AutoscalingConfig(**options["autoscaling_config"])
    assert config.max_replicas == 2 and config.upscale_delay_s == 30.0
    policy = _resolve_policy_callable(config.policy)  # what the controller calls on every tick
    assert policy.target_busy == 0.25 and policy(_ctx(busy={"r1": 0.9}))[0] == pytest.approx(3.6)
    assert AppArgs.parse({}).ingress_target_cpu == TARGET_BUSY
