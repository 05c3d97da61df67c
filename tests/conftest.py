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


@pytest.fixture(scope="session", autouse=True)
def one_forkserver_for_every_model_kind(request, tmp_path_factory):
    """One forkserver for the whole session, loaded for every model kind the tests deploy.

    A process has one forkserver, and it reads its preload list once, at its start: left to the
    first test, a reference-model test would start it without transformers, and every Hugging Face
    worker after it would import transformers itself (2-3 s of CPU each, on two cores). Workers
    write to the forkserver's stderr: ``workers.log`` in the session's base temporary directory,
    not the terminal (a test that needs a worker's output reads its reports)."""
    if not any(item.get_closest_marker("multiprocess") for item in request.session.items):
        return
    import multiprocessing
    import multiprocessing.forkserver

    from elastic.launch.launchers import forkserver_preload, preload_in_forkserver

    preload_in_forkserver(forkserver_preload("hf"))
    with open(tmp_path_factory.getbasetemp() / "workers.log", "ab") as log:
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            multiprocessing.forkserver.ensure_running()
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


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
