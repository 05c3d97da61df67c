"""Shared fixtures: small deployments of real worker processes on gloo."""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


#: half the wall time, not the deployment default's tenth: a tiny model's prepared scale is mostly its
#: set-up, and ten times that per scale up adds up over the suite (tests of the pacing set their own)
TEST_SCALING = {"prestage_share": 0.5}


def small_config(**overrides):
    """A tiny deployment that starts in about two seconds on two cores."""
    from elastic.core.config import TimeoutsConfig
    from elastic.deployment import DeploymentConfig, TracePhase
    from eplb.config import EPLBConfig
    from eplb.model import ModelShape
    from eplb.trace import TraceConfig

    eplb = dict(num_redundant_experts=4, window_size=8, step_interval=8, use_async=True, transfer_timeout_s=20)
    eplb.update(overrides.pop("eplb", {}))
    model = dict(num_layers=4, num_experts=8, hidden_size=32, intermediate_size=64)
    model.update(overrides.pop("model", {}))
    trace = overrides.pop("trace", dict(kind="zipf", tokens_per_step=32, zipf_exponent=(1.0, 1.4)))
    timeouts = dict(draining=30, suppressed=20, rescaling=60, resuming=30, worker_start=60, collective=20, heartbeat=25)
    timeouts.update(overrides.pop("timeouts", {}))
    scaling = dict(TEST_SCALING)
    scaling.update(overrides.pop("scaling", {}))
    base = dict(scaling=scaling, model=ModelShape(**model), eplb=EPLBConfig(**eplb), trace=[TracePhase(trace=TraceConfig(**trace))],
                ep_size=2, max_ep_size=4, timeouts=TimeoutsConfig(**timeouts), heartbeat_s=0.05)
    base.update(overrides)
    return DeploymentConfig(**base)


@contextlib.contextmanager
def running(config, faults=()):
    from elastic.control.coordinator import Coordinator

    coordinator = Coordinator(config, faults=tuple(faults))
    coordinator.start()
    try:
        yield coordinator
    finally:
        coordinator.shutdown()


@pytest.fixture
def make_config():
    return small_config
