"""Configuration of the elastic control plane (pydantic, ``extra="forbid"``, frozen).

Bad input gets a clear error naming the field and changes nothing.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from elastic.core.phases import OPERATION_PHASES

__all__ = ["ServingConfig", "TimeoutsConfig"]


# --------------------------------------------------------------------------------------
# Timeouts
# --------------------------------------------------------------------------------------

class TimeoutsConfig(BaseModel):
    """Deadlines, all in seconds and all > 0.

    The four phase deadlines bound how long the state machine may stay in that phase;
    the coordinator's watchdog calls ``ScaleMachine.fail_if_overdue`` which moves an
    overrunning phase to ``failed``. The other three bound the waits inside a phase.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    draining: float = Field(60.0, gt=0, description="in-flight EPLB layer transfers finish and commit on every rank")
    suppressed: float = Field(30.0, gt=0, description="the EPLB worker thread is flushed and joined on every rank")
    rescaling: float = Field(300.0, gt=0, description="experts redistributed, group replaced, workers added or retired")
    resuming: float = Field(120.0, gt=0, description="EPLB group rebuilt and async worker restarted on every rank")
    worker_start: float = Field(120.0, gt=0, description="a new worker process starts and joins the rendezvous")
    collective: float = Field(30.0, gt=0, description="any single collective or point-to-point wait")
    heartbeat: float = Field(45.0, gt=0, description="a worker silent this long is considered lost (must exceed collective)")

    @field_validator("*", mode="after")
    @classmethod
    def _finite(cls, value: float, info) -> float:
        if not math.isfinite(value):
            raise ValueError(f"{info.field_name} must be a finite number of seconds, got {value}")
        return value

    def for_phase(self, phase: str) -> float | None:
        """The deadline of state-machine phase ``phase`` (a ``Phase`` or its value), or None if untimed."""
        name = getattr(phase, "value", phase)
        return getattr(self, name) if name in OPERATION_PHASES else None  # running and failed have none


# --------------------------------------------------------------------------------------
# Serving requests (elastic.control.requests, elastic.worker.batch)
# --------------------------------------------------------------------------------------

class ServingConfig(BaseModel):
    """How a deployment of a real model (``model.kind: hf``) serves completion requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch: int = Field(8, ge=1, le=1024, description="requests decoded at once (the batch); more wait in the queue")
    max_queue: int = Field(64, ge=0, le=100_000, description="requests waiting for a batch slot; beyond it: 429")
    max_tokens_limit: int = Field(1024, ge=1, description="the most tokens one request may ask for")
    background_load: bool = Field(False, description="while no request runs, decode seeded synthetic batches so the "
                                  "EPLB has load to balance (demos, scenarios set it); false (the default): a group "
                                  "with no request, command, rebalance or prepare sleeps on its command inbox")
    idle_step_s: float = Field(0.002, ge=0, le=1.0, description="sleep of a decode step with nothing to decode while "
                               "the group is not idle (a rebalance or a prepare under way)")
    failed_grace_s: float = Field(30.0, gt=0, description="requests in flight when the deployment fails wait this long "
                                  "for a recovery (then replay); past it, or with nothing recovering, they get 503")
    retry_after_s: int = Field(1, ge=1, le=3600, description="the Retry-After of a 429 or 503")
    model_name: str | None = Field(None, description="the name /v1/models lists and requests must give "
                                   "(default: the checkpoint directory's name, or the architecture)")


# --------------------------------------------------------------------------------------
# Scaling: what a scale does ahead of its pause (the prepare sub-phase of draining)
# --------------------------------------------------------------------------------------

class ScalingConfig(BaseModel):
    """How a scale prepares while the old group still decodes (see ``Prepare`` in the protocol)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prepare: bool = Field(True, description="form the next group as a standby group and pre-transfer experts in "
                          "draining, so the pause only switches; false: everything happens in the pause (as before)")
    prestage_max_bytes: ByteSize = Field(ByteSize(512 * 2**20), ge=0, description="spare memory a surviving rank may "
                                         "hold ahead of the pause: each layer it changes, whole, swapped in at the switch "
                                         "(bytes, or with a unit: '1GiB'); layers that do not fit move in the pause. A "
                                         "joining rank receives into its fresh weights and needs none")
    @field_validator("prestage_max_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: object) -> object:
        # pydantic's ByteSize reads True as 1 byte and reports -1 as a string it cannot parse
        if isinstance(value, bool):
            raise ValueError(f"expected a number of bytes (or with a unit: '1GiB'), got {value!r}")
        if isinstance(value, (int, float)) and value < 0:
            raise ValueError(f"expected a number of bytes >= 0, got {value!r}")
        return value

    prestage_share: float = Field(0.1, gt=0, le=1.0, description="the most of the wall time the pre-transfer may take "
                                  "from decoding, and of decode throughput (a layer starts only while every rank's time "
                                  "share is below it and its decode steps keep 1 - share of its pace before the scale; "
                                  "the step count may make the prepare at most 3x as long); layers go back "
                                  "to back once holding would no longer let the rest end within 80% of the draining "
                                  "deadline, so a slow link costs throughput, not the scale")
