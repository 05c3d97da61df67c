"""The deployment a coordinator runs: model shape, EPLB, load trace, EP size, timeouts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from elastic.config import TimeoutsConfig
from eplb.config import EPLBConfig
from eplb.model import ModelShape
from eplb.trace import TraceConfig


class TracePhase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    start_step: int = Field(0, ge=0)
    trace: TraceConfig = TraceConfig()


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelShape = ModelShape()
    eplb: EPLBConfig = EPLBConfig()
    trace: list[TracePhase] = Field(default_factory=lambda: [TracePhase()])
    ep_size: int = Field(2, ge=1, description="EP ranks at start")
    max_ep_size: int = Field(8, ge=1, description="the launcher's capacity: no scale beyond it")
    seed: int = 0
    timeouts: TimeoutsConfig = TimeoutsConfig()
    heartbeat_s: float = Field(0.1, gt=0, description="how often each worker reports")
    step_delay_s: float = Field(0.0, ge=0, description="sleep after each decode step (pacing a replay)")
    auto_recover: bool = Field(False, description="after a failure, recover with the living workers without waiting for an operator")
    max_auto_recoveries: int = Field(3, ge=0, description="give up auto-recovery after this many attempts")
    store_host: str = "127.0.0.1"
    backend: str = Field("gloo", pattern="^(gloo|nccl)$")

    @model_validator(mode="after")
    def _check(self) -> "DeploymentConfig":
        physical = self.num_physical
        if physical % self.ep_size:
            raise ValueError(
                f"{self.model.num_experts} experts + {self.eplb.num_redundant_experts} redundant = {physical} "
                f"physical slots do not divide over ep_size={self.ep_size}")
        if self.ep_size > self.max_ep_size:
            raise ValueError(f"ep_size={self.ep_size} exceeds max_ep_size={self.max_ep_size}")
        if self.timeouts.heartbeat <= self.timeouts.collective:
            raise ValueError(
                f"timeouts.heartbeat ({self.timeouts.heartbeat}s) must exceed timeouts.collective "
                f"({self.timeouts.collective}s): a rank blocked on a dead peer reports the failure within the "
                "collective timeout, and only a rank silent beyond that is declared lost")
        starts = [phase.start_step for phase in self.trace]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"trace phases must start at step 0 and increase strictly, got starts {starts}")
        for phase in self.trace:
            if phase.trace.top_k > self.model.num_experts:
                raise ValueError(f"trace top_k={phase.trace.top_k} exceeds num_experts={self.model.num_experts}")
        return self

    @property
    def num_physical(self) -> int:
        return self.model.num_experts + self.eplb.num_redundant_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def size_problem(self, ep_size: int) -> str | None:
        """Why ``ep_size`` cannot hold this model, or None when it can."""
        if ep_size < 1:
            return f"ep_size must be at least 1, got {ep_size}"
        if ep_size > self.max_ep_size:
            return f"ep_size={ep_size} exceeds the launcher's capacity of {self.max_ep_size} workers"
        if self.slots_per_rank * ep_size < self.model.num_experts:
            return (f"ep_size={ep_size} gives {self.slots_per_rank * ep_size} physical slots "
                    f"({self.slots_per_rank} per rank), fewer than the {self.model.num_experts} logical experts")
        return None
