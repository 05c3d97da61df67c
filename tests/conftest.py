"""Shared fixtures: small deployments of real worker processes on gloo."""

from __future__ import annotations

import contextlib
import logging
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


#: half of ``eplb.algorithm.warm_up``'s compiled kernels (about 13 s of one core's compile on an empty
#: numba cache), compiled by a helper process while this one compiles the other half
_HALF_OF_THE_KERNELS = """
import numpy as np
from eplb import _compiled
load = np.array([[4.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
counts = np.array([[2, 2, 1, 1, 1, 1]])
_compiled.bfd_pack(load, 2, 4, np.ones(1), 1, 1.0)
_compiled.replica_counts(load, 8, 2)
_compiled.repair_counts(load, counts.copy(), np.ones(1), 2, 1)
_compiled.add_replicas(load, counts, np.ones(1, dtype=np.int64), load > 0, 2)
p2l = np.array([[0, 1, 2, 0, 3, 4, 5, 1]])
_compiled.logical_to_physical(p2l, counts, 3)
_compiled.balancedness(p2l, load, 2)
_compiled.on_draws(p2l, load[None], 2)
z = np.zeros((8, 1, 6), np.float32)
z.flags.writeable = False  # as eplb.algorithm._normals gives them
_compiled.gate_draws(load, z, 2.0)
"""


def compile_kernels_on_two_cores() -> None:
    """Fill numba's on-disk cache of the placement kernels with both cores, then load them all here.

    On a fresh checkout (CI) the cache is empty: compiling every kernel takes about 28 s of one
    core, and the forkserver (which warms up too) and this process each paid it, at the same time.
    Now a helper process compiles half while this one compiles the other half; ``warm_up`` then
    loads the helper's half from the cache (and compiles whatever the split misses), and the
    forkserver started after this finds everything cached. With a warm cache this costs ~1 s."""
    import subprocess
    import sys

    import numpy as np

    from eplb import _compiled
    from eplb.algorithm import _fill_pack, warm_up

    helper = subprocess.Popen([sys.executable, "-c", _HALF_OF_THE_KERNELS])
    try:
        load = np.array([[4.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
        counts = np.array([[2, 2, 1, 1, 1, 1]])
        slot_load, slot_expert = _fill_pack(load, counts, 2)
        _compiled.swap_refine(slot_load, slot_expert, 1, np.ones(1))
        _compiled.take_counts(slot_expert, load, counts)
        _compiled.improve(slot_expert.copy(), load, np.array([0.0]), np.array([2]), 4, 8, counts, 0.2, np.zeros((1, 0, 2)))
        helper.wait(timeout=300)
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()
    warm_up()


@pytest.fixture(autouse=True)
def serve_logging_undone(monkeypatch):
    """A test that runs ``serve``'s command in this process configures the root logger (its handlers
    replaced by one on that command's stderr, at INFO): put back what was there after the test, or
    a later test's log lines (httpx's, at INFO) go to that closed stream, and its error into
    another command's output (``placement export``'s JSON on stdout, under ``pytest -n 2``)."""
    import elastic.service.server as server

    real, root, before = server.configure_logging, logging.getLogger(), []

    def configure(*args, **kwargs):
        before.append((root.handlers[:], root.level))
        real(*args, **kwargs)

    monkeypatch.setattr(server, "configure_logging", configure)
    yield
    if before:
        handlers, level = before[0]
        ours = [h for h in root.handlers if h not in handlers and not type(h).__module__.startswith("_pytest")]
        for handler in ours:
            root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers and not type(handler).__module__.startswith("_pytest"):
                root.addHandler(handler)
        root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def one_forkserver_for_every_model_kind(request, tmp_path_factory):
    """One forkserver for the whole session, loaded for every model kind the tests deploy.

    A process has one forkserver, and it reads its preload list once, at its start: left to the
    first test, a reference-model test would start it without transformers, and every Hugging Face
    worker after it would import transformers itself (2-3 s of CPU each, on two cores). Workers
    write to the forkserver's stderr: ``workers.log`` in the session's base temporary directory,
    not the terminal (a test that needs a worker's output reads its reports)."""
    items = request.session.items
    if any(item.get_closest_marker("multiprocess") or item.path.name == "test_algorithm.py" for item in items):
        compile_kernels_on_two_cores()
    if not any(item.get_closest_marker("multiprocess") for item in items):
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
