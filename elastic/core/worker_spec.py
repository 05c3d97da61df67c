"""What a worker process needs to start: a frozen, picklable record the launchers ship.

It lives in ``core`` so the control plane and the launchers build it without importing the
worker's module (:mod:`elastic.worker.process` re-exports it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from elastic.core.config import ServingConfig
from eplb.config import EPLBConfig
from eplb.model import ModelShape
from eplb.models.config import HFModelConfig
from eplb.trace import TraceConfig

__all__ = ["WorkerSpec"]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start (picklable)."""

    rank: int
    size: int
    generation: int
    store_host: str
    store_port: int
    shape: ModelShape | HFModelConfig  # the model: the reference MoE or a Hugging Face MoE
    eplb: EPLBConfig
    trace: tuple[tuple[int, TraceConfig], ...]
    seed: int = 0
    num_physical: int = 0  # physical slots at this generation
    backend: str = "gloo"
    collective_timeout_s: float = 30.0
    join_timeout_s: float = 60.0
    heartbeat_s: float = 0.1
    step_delay_s: float = 0.0  # optional pacing of the decode loop (replays at a readable speed)
    # a rank launched ahead of a scale-up: it prepares its weights while the old group still
    # decodes and waits (at most standby_timeout_s) for its Rescale, the first command it runs
    joining: bool = False
    standby_timeout_s: float = 120.0
    standby_seq: int = 0  # the seq its "ready" report carries (PhaseDone, phase "Standby")
    faults: tuple[Any, ...] = field(default_factory=tuple)  # fault injections (tests, scenarios)
    serving: ServingConfig = field(default_factory=ServingConfig)  # the request batch (a real model)
    # the first group's placement, [layers][slots] (eplb.initial_placement); None: the static one
    initial_placement: tuple[tuple[int, ...], ...] | None = None
    # the process that built the spec, i.e. the coordinator (the launcher pickles the spec as it is):
    # a worker that descends from it exits when it dies (elastic.worker.lifetime)
    coordinator_pid: int = field(default_factory=os.getpid)
