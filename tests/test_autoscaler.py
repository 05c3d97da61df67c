"""The autoscaler (policy protocol, threshold policy, runner) and the scale hooks.

Policy and runner tests are pure: a fake clock and fake snapshots or a fake coordinator.
One integration test lets the autoscaler trigger a real scale of real worker processes.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from elastic.core.clock import RealClock
from elastic.core.errors import InvalidScaleRequest, ScaleConflict
from elastic.service.autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    AutoscalerPolicy,
    MetricsSnapshot,
    ScaleDecision,
    ThresholdPolicy,
    build_policy,
)
from elastic.service.hooks import HooksConfig, HookSpec, ScaleHooks, ScaleVetoed

# -- helpers ------------------------------------------------------------------------------------

def cfg(**kw) -> AutoscalerConfig:
    base = dict(up_threshold=100.0, down_threshold=20.0, up_after_s=10.0, down_after_s=30.0, cooldown_s=60.0)
    base.update(kw)
    return AutoscalerConfig(**base)


def snap(now: float, load: float, *, size: int = 2, generation: int = 0, state: str = "running",
         operation_id: str | None = None, min_size: int = 1, max_size: int = 8, **kw) -> MetricsSnapshot:
    return MetricsSnapshot(now=now, state=state, generation=generation, current_size=size, min_size=min_size,
                           max_size=max_size, load_per_rank=(load,) * size, operation_id=operation_id, **kw)


class FixedPolicy:
    """A custom policy loadable by import path (``tests.test_autoscaler:FixedPolicy``)."""

    def __init__(self, target: int = 3):
        self.target = target

    def decide(self, snapshot: MetricsSnapshot) -> ScaleDecision:
        return ScaleDecision(target=self.target, reason="fixed")


class NoDecide:
    pass


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeCoordinator:
    """What the runner uses of a Coordinator: snapshot, live_workers, scale, config."""

    def __init__(self, size: int = 2, load: float = 0.0, capacity: int = 4):
        self.size, self.generation, self.state, self.load = size, 0, "running", load
        self.clock = RealClock()
        self.config = SimpleNamespace(max_ep_size=capacity, heartbeat_s=0.1,
                                      size_problem=lambda n: None if 1 <= n <= capacity else f"bad size {n}")
        self.calls: list[dict] = []
        self.refuse: Exception | None = None

    def snapshot(self) -> dict:
        return {"state": self.state, "generation": self.generation, "ep_size": self.size, "balancedness": 0.9,
                "operation": None}

    def live_workers(self) -> list:
        return [SimpleNamespace(heartbeat=SimpleNamespace(rank=r, rank_load=self.load, step_seconds=0.01, tokens=10))
                for r in range(self.size)]

    def scale(self, n, *, expected_generation=None, idempotency_key=None, wait=True):
        self.calls.append({"n": n, "expected_generation": expected_generation, "wait": wait})
        if self.refuse is not None:
            raise self.refuse
        return SimpleNamespace(id=f"op-{len(self.calls)}")


# -- config -------------------------------------------------------------------------------------

def test_config_validation_names_the_problem():
    with pytest.raises(ValidationError, match="must be below up_threshold"):
        cfg(up_threshold=10, down_threshold=10)
    with pytest.raises(ValidationError, match="needs up_threshold and down_threshold"):
        AutoscalerConfig()
    with pytest.raises(ValidationError, match="max_size=1 is below min_size=2"):
        cfg(min_size=2, max_size=1)
    with pytest.raises(ValidationError, match="policy_options are for an import-path policy"):
        cfg(policy_options={"x": 1})
    with pytest.raises(ValidationError, match="extra"):
        cfg(bogus=1)
    with pytest.raises(ValidationError, match="greater than 0"):
        cfg(interval_s=0)


@pytest.mark.parametrize("path, message", [
    ("no_colon_here", "must look like 'package.module:Name'"),
    ("a b:C", "must look like 'package.module:Name'"),
    ("surely_not_a_module_xyz:Policy", "cannot import module 'surely_not_a_module_xyz'"),
    ("tests.test_autoscaler:Missing", "has no attribute 'Missing'"),
    ("tests.test_autoscaler:NoDecide", "has no decide"),
])
def test_bad_policy_import_path_is_a_clear_error(path, message):
    with pytest.raises(ValidationError, match=message):
        AutoscalerConfig(policy=path)


def test_custom_policy_by_import_path():
    config = AutoscalerConfig(policy="tests.test_autoscaler:FixedPolicy", policy_options={"target": 4})
    policy = build_policy(config)
    assert isinstance(policy, FixedPolicy) and isinstance(policy, AutoscalerPolicy)
    assert policy.decide(snap(0, 0)).target == 4
    with pytest.raises(ValueError, match="rejected policy_options"):
        build_policy(AutoscalerConfig(policy="tests.test_autoscaler:FixedPolicy", policy_options={"nope": 1}))


# -- the threshold policy -----------------------------------------------------------------------

def test_scales_up_only_after_sustained_load():
    p = ThresholdPolicy(cfg())
    assert p.decide(snap(0, 150)).target is None
    assert p.decide(snap(9.9, 150)).target is None
    d = p.decide(snap(10.0, 150))
    assert d.target == 3 and "scale up 2 -> 3" in d.reason


def test_a_dip_into_the_band_resets_the_timer():
    p = ThresholdPolicy(cfg())
    p.decide(snap(0, 150))
    assert p.decide(snap(5, 50)).target is None  # inside [down, up]: both timers reset
    assert p.decide(snap(12, 150)).target is None
    assert p.decide(snap(21.9, 150)).target is None
    assert p.decide(snap(22, 150)).target == 3


def test_scales_down_when_idle_and_respects_bounds_and_step():
    p = ThresholdPolicy(cfg(step=2, min_size=2))
    assert p.decide(snap(0, 1, size=5)).target is None
    assert p.decide(snap(30, 1, size=5)).target == 3
    p = ThresholdPolicy(cfg(step=2, min_size=2))
    p.decide(snap(0, 1, size=3))
    assert p.decide(snap(30, 1, size=3)).target == 2  # clamped to min_size
    p = ThresholdPolicy(cfg(min_size=2))
    p.decide(snap(0, 1, size=2))
    d = p.decide(snap(100, 1, size=2))
    assert d.target is None and "min_size" in d.reason
    p = ThresholdPolicy(cfg(step=3))
    p.decide(snap(0, 500, size=7, max_size=8))
    assert p.decide(snap(10, 500, size=7, max_size=8)).target == 8  # clamped to max_size
    p = ThresholdPolicy(cfg())
    p.decide(snap(0, 500, size=8))
    d = p.decide(snap(10, 500, size=8))
    assert d.target is None and "max_size" in d.reason


def test_no_flapping_inside_the_cooldown():
    p = ThresholdPolicy(cfg(cooldown_s=60))
    p.decide(snap(0, 150))
    assert p.decide(snap(10, 150)).target == 3
    # the scale runs, then load drops right away: no scale down until the cooldown ends
    assert p.decide(snap(11, 150, state="draining", operation_id="op-1")).target is None
    assert p.decide(snap(12, 5, size=3, generation=1)).target is None
    for t in range(13, 72):
        d = p.decide(snap(t, 5, size=3, generation=1))
        assert d.target is None, (t, d)
    assert "cooldown" in p.decide(snap(71.5, 5, size=3, generation=1)).reason
    assert p.decide(snap(72.5, 5, size=3, generation=1)).target == 2


def test_a_scale_by_someone_else_starts_the_cooldown():
    p = ThresholdPolicy(cfg(cooldown_s=60, down_after_s=0))
    assert p.decide(snap(0, 50, generation=0)).target is None
    # an operator scaled to 4 through the API; the load is low, but the cooldown applies
    assert p.decide(snap(1, 5, size=4, generation=1)).target is None
    assert p.decide(snap(60.5, 5, size=4, generation=1)).target is None
    assert p.decide(snap(61.5, 5, size=4, generation=1)).target == 3


def test_holds_while_an_operation_runs_or_without_readings():
    p = ThresholdPolicy(cfg(up_after_s=0, cooldown_s=0))
    assert p.decide(snap(0, 999, state="rescaling", operation_id="op-1")).target is None
    assert p.decide(snap(1, 999, operation_id="op-1")).target is None  # pending (before-hooks)
    assert "no load_per_rank" in p.decide(MetricsSnapshot(now=2, current_size=2, max_size=8)).reason
    assert p.decide(snap(3, 999)).target == 3


@pytest.mark.parametrize("metric, field, value", [
    ("step_time", "step_time_s", 0.5),
    ("queue_depth", "queue_depth", 500.0),
    ("token_rate_per_rank", "token_rate", 2000.0),  # 2000 over 2 ranks = 1000 per rank
    ("max_rank_load", "load_per_rank", (1.0, 500.0)),
])
def test_other_metrics(metric, field, value):
    p = ThresholdPolicy(cfg(metric=metric, up_threshold=0.2 if metric == "step_time" else 100, down_threshold=0.01,
                            up_after_s=0))
    s = MetricsSnapshot(now=0, current_size=2, max_size=8, **{field: value})
    assert p.decide(s).target == 3


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(st.sampled_from([0.0, 5.0, 50.0, 150.0, 1000.0]), min_size=1, max_size=120),
       dt=st.sampled_from([1.0, 3.0, 7.0]))
def test_decisions_are_never_closer_than_the_cooldown(loads, dt):
    """Whatever the load does, two decisions are at least cooldown_s apart, and all stay in bounds."""
    config = cfg(up_after_s=5, down_after_s=5, cooldown_s=30, min_size=1, max_size=4)
    p = ThresholdPolicy(config)
    size, generation, last = 2, 0, None
    for i, load in enumerate(loads):
        now = i * dt
        d = p.decide(snap(now, load, size=size, generation=generation, max_size=4))
        if d.target is not None:
            assert 1 <= d.target <= 4 and d.target != size
            assert last is None or now - last >= config.cooldown_s
            last, size, generation = now, d.target, generation + 1


# -- the runner ---------------------------------------------------------------------------------

def test_runner_submits_through_the_operation_path():
    coord, clock = FakeCoordinator(load=500), FakeClock()
    scaler = Autoscaler(coord, cfg(up_after_s=10, max_size=None), clock=clock)
    assert scaler.max_size == 4  # from the deployment's capacity
    assert scaler.tick()["action"] == "hold"
    clock.t += 10
    record = scaler.tick()
    assert record["action"] == "submitted" and record["operation_id"] == "op-1"
    assert coord.calls == [{"n": 3, "expected_generation": 0, "wait": False}]
    assert scaler.status()["counts"]["submitted"] == 1


def test_refused_decisions_are_logged_not_raised(caplog):
    coord, clock = FakeCoordinator(load=500), FakeClock()
    coord.refuse = ScaleConflict("op-other", "draining", ())
    scaler = Autoscaler(coord, cfg(up_after_s=0, cooldown_s=0), clock=clock)
    with caplog.at_level("WARNING", logger="elastic.service.autoscaler"):
        record = scaler.tick()
    assert record["action"] == "refused" and record["error"]["error"] == "scale_conflict"
    assert record["error"]["operation_id"] == "op-other"
    assert "refused" in caplog.text
    coord.refuse = InvalidScaleRequest("ep_size", "too big", value=3)
    clock.t += 1
    assert scaler.tick()["error"]["error"] == "invalid_scale_request"


def test_observe_only_changes_nothing(caplog):
    coord, clock = FakeCoordinator(load=500), FakeClock()
    scaler = Autoscaler(coord, cfg(up_after_s=0, cooldown_s=0, observe_only=True), clock=clock)
    with caplog.at_level("INFO", logger="elastic.service.autoscaler"):
        for _ in range(5):
            record = scaler.tick()
            clock.t += 1
    assert coord.calls == []
    assert record["action"] == "observed" and record["target"] == 3
    assert "would scale 2 -> 3" in caplog.text
    assert scaler.status()["counts"]["observed"] == 5


def test_enable_disable_and_the_thread():
    coord = FakeCoordinator(load=500)
    scaler = Autoscaler(coord, cfg(up_after_s=0, cooldown_s=0, enabled=False, interval_s=0.01))
    assert scaler.tick() is None and coord.calls == []
    scaler.enable()
    assert scaler.tick()["action"] == "submitted"
    scaler.start()
    try:
        deadline = time.monotonic() + 5
        while len(coord.calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(coord.calls) >= 3 and scaler.running
        scaler.disable()
        time.sleep(0.05)
        n = len(coord.calls)
        time.sleep(0.1)
        assert len(coord.calls) == n
    finally:
        scaler.stop()
    assert not scaler.running


def test_a_broken_policy_is_recorded_not_raised():
    class Broken:
        def decide(self, snapshot):
            raise RuntimeError("boom")

    scaler = Autoscaler(FakeCoordinator(), cfg(), policy=Broken())
    record = scaler.tick()
    assert record["action"] == "error" and "boom" in record["error"]


def test_runner_checks_bounds_against_the_deployment():
    with pytest.raises(ValueError, match="exceeds the deployment's max_ep_size=4"):
        Autoscaler(FakeCoordinator(capacity=4), cfg(max_size=8))
    deployment = SimpleNamespace(max_ep_size=8, size_problem=lambda n: "too few slots" if n < 2 else None)
    with pytest.raises(ValueError, match="min_size=1 cannot hold the model: too few slots"):
        Autoscaler(SimpleNamespace(config=deployment, clock=RealClock()), cfg(min_size=1, max_size=4))
    # left unset, min_size is the smallest size that holds the model
    assert Autoscaler(SimpleNamespace(config=deployment, clock=RealClock()), cfg(max_size=4)).min_size == 2


def test_metrics_fn_adds_readings():
    coord = FakeCoordinator(load=1)
    scaler = Autoscaler(coord, cfg(metric="queue_depth", up_after_s=0, cooldown_s=0),
                        metrics_fn=lambda: {"queue_depth": 1000.0})
    s = scaler.snapshot()
    assert s.queue_depth == 1000.0 and s.load_per_rank == (1.0, 1.0) and s.token_rate == pytest.approx(200.0)
    assert scaler.tick()["target"] == 3


# -- hooks --------------------------------------------------------------------------------------

OP = {"id": "op-test", "kind": "scale", "status": "running", "from_size": 2, "target_size": 3}


def test_callable_hooks_pass_veto_and_time_out():
    seen = []
    ScaleHooks(before=[lambda op: seen.append(op)]).run_before(OP)
    assert seen[0]["id"] == "op-test" and seen[0]["hook"] == "before"

    def no(op):
        raise RuntimeError("not enough GPUs")

    with pytest.raises(ScaleVetoed, match="not enough GPUs") as info:
        ScaleHooks(before=[no]).run_before(OP)
    assert info.value.to_dict()["error"] == "scale_vetoed"
    with pytest.raises(ScaleVetoed, match="returned False"):
        ScaleHooks(before=[lambda op: False]).run_before(OP)
    release = threading.Event()
    slow = ScaleHooks(before=[lambda op: release.wait(5)], default_timeout_s=0.1)
    started = time.monotonic()
    with pytest.raises(ScaleVetoed, match="did not return within its timeout of 0.1s"):
        slow.run_before(OP)
    assert time.monotonic() - started < 2
    release.set()


def test_command_hooks_get_the_operation_as_json(tmp_path):
    out = tmp_path / "seen.json"
    script = f'cat > {out}; test "$ELASTIC_EP_TARGET_SIZE" = 3 && test "$ELASTIC_EP_HOOK" = before'
    hooks = ScaleHooks(before=[script])
    hooks.run_before(OP)
    assert json.loads(out.read_text())["id"] == "op-test"
    assert hooks.results("op-test")[0]["ok"] is True
    argv = [sys.executable, "-c", "import json,os,sys; d=json.load(sys.stdin); "
            "assert json.loads(os.environ['ELASTIC_EP_OPERATION'])==d; sys.exit(0 if d['from_size']==2 else 5)"]
    ScaleHooks(before=[argv]).run_before(OP)


def test_failing_and_slow_commands_veto_with_a_clear_error():
    with pytest.raises(ScaleVetoed, match=r"exited with status 3: no capacity in zone b"):
        ScaleHooks(before=["echo 'no capacity in zone b' >&2; exit 3"]).run_before(OP)
    with pytest.raises(ScaleVetoed, match="could not start"):
        ScaleHooks(before=[["/nonexistent/hook-binary"]]).run_before(OP)
    started = time.monotonic()
    with pytest.raises(ScaleVetoed, match=r"did not finish within its timeout of 0.3s \(killed\)"):
        ScaleHooks(before=[{"command": "sleep 30; true", "timeout_s": 0.3}]).run_before(OP)
    assert time.monotonic() - started < 5  # the shell's children are killed too, nothing holds the pipes


def test_after_hooks_run_in_the_background_and_failures_are_logged(caplog):
    ran = []

    def fails(op):
        raise RuntimeError("pager down")

    hooks = ScaleHooks(after=[fails, lambda op: ran.append(op["status"])])
    with caplog.at_level("WARNING", logger="elastic.service.hooks"):
        hooks._on_event("operation", {**OP, "status": "running"})  # not finished: nothing
        hooks._on_event("operation", {**OP, "status": "succeeded"})
        hooks._on_event("operation", {**OP, "status": "succeeded"})  # once per operation
        assert hooks.wait_idle(5)
    assert ran == ["succeeded"]
    assert "pager down" in caplog.text
    assert [r["ok"] for r in hooks.results("op-test")] == [False, True]
    # a vetoed operation gets no after-hooks
    vetoing = ScaleHooks(before=[lambda op: False], after=[lambda op: ran.append("after-veto")])
    with pytest.raises(ScaleVetoed):
        vetoing.run_before({**OP, "id": "op-v"})
    vetoing._on_event("operation", {**OP, "id": "op-v", "status": "failed"})
    assert vetoing.wait_idle(5) and "after-veto" not in ran


def test_hook_config_validation():
    with pytest.raises(ValidationError, match="exactly one of 'command' or 'callable'"):
        HookSpec()
    with pytest.raises(ValidationError, match="exactly one of 'command' or 'callable'"):
        HookSpec(command="true", callable="os:getcwd")
    with pytest.raises(ValidationError, match="cannot import module"):
        HookSpec(callable="no_such_module_abc:f")
    with pytest.raises(ValidationError, match="must not be empty"):
        HookSpec(command=" ")
    config = HooksConfig.model_validate({"before_scale": [{"callable": "os:getcwd", "timeout_s": 1}],
                                         "after_scale": [{"command": ["true"]}]})
    hooks = ScaleHooks.from_config(config)
    assert len(hooks.before) == 1 and len(hooks.after) == 1


# -- with real workers --------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_autoscaler_triggers_a_real_scale():
    from elastic.control.coordinator import Coordinator
    from tests.test_api import tiny_deployment

    clock = FakeClock()
    coordinator = Coordinator(tiny_deployment())
    with coordinator:
        hooks = ScaleHooks(after=[lambda op: None]).install(coordinator)
        scaler = Autoscaler(coordinator, cfg(up_threshold=1.0, down_threshold=0.5, up_after_s=10, cooldown_s=60,
                                             max_size=3), clock=clock)
        coordinator.wait_for_step(5, timeout=60)
        assert scaler.tick()["action"] == "hold"  # load is above the threshold, but not for long enough yet
        clock.t += 10
        record = scaler.tick()
        assert record["action"] == "submitted", record
        op = coordinator.operations[record["operation_id"]]
        assert op.done.wait(60) and op.status == "succeeded", op.error
        assert list(op.phases) == ["draining", "suppressed", "rescaling", "resuming"]  # after-hooks only: no before phase
        assert coordinator.size == 3 and coordinator.machine.generation == 1
        # inside the cooldown (and at max_size) nothing more happens
        clock.t += 30
        assert scaler.tick()["target"] is None and len(coordinator.operations) == 1
        assert hooks.wait_idle(10)
        assert hooks.results(op.id)[0]["ok"]
        coordinator.wait_for_step(coordinator.snapshot()["step"] + 5, timeout=60)
        assert all(not v["mismatched"] for v in coordinator.verify().values())
