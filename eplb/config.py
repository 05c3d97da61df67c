"""EPLB configuration. Names and defaults follow vLLM's ``EPLBConfig`` where they overlap."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EPLBConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    num_redundant_experts: int = Field(
        0, ge=0, description="redundant physical slots beyond one per logical expert, at the initial EP size")
    window_size: int = Field(1000, ge=1, description="steps of load kept in the sliding window")
    load_smoothing: float = Field(
        0.3, gt=0.0, le=1.0,
        description="weight of the last window in the load a rebalance fits (eplb.estimate.smoothed_load: an "
                    "exponential average over the windows seen at each rebalance, raised per layer to 1 where the "
                    "load moved beyond sampling noise); 1.0: the last window alone, as vLLM does. Chosen on the "
                    "placement bench's tune seeds (docs/design.md)")
    step_interval: int = Field(3000, ge=1, description="steps between rebalances")
    use_async: bool = Field(False, description="compute and transfer on a background thread, commit one layer per step")
    policy: str = Field("default", description="name of a policy in eplb.algorithm.POLICIES")
    policy_options: dict[str, Any] = Field(default_factory=dict)
    async_layer_interval: int = Field(
        1, ge=1, description="async: decode steps from one layer's commit to the next layer's transfer (pacing)")
    layers_per_step: int = Field(
        1, ge=1, description="async: layers staged, then committed together at one agreed step (a staging "
                             "buffer of one layer each)")
    min_balancedness: float = Field(
        1.0, ge=0.0, le=1.0,
        description="skip a scheduled rebalance while the window's balancedness (mean over layers of mean rank "
                    "load / max rank load under the current placement) is above this; 1.0: never skip")
    log_balancedness: bool = False
    transfer_timeout_s: float = Field(30.0, gt=0, description="deadline of every transfer wait")
    max_ops_per_batch: int = Field(64, ge=2, description="p2p ops in one batch_isend_irecv call")
    enable_migration_batching: bool = Field(
        False, description="post a layer's transfers in migration rounds, in each of which every rank sends to at "
                           "most one peer and receives from at most one (as few rounds as the busiest rank has "
                           "transfers; a round is still cut at max_ops_per_batch; NIXL: a receiver reads one round "
                           "at a time). Off: the transfer list is cut into chunks of max_ops_per_batch, where a rank "
                           "may exchange with every peer at once. Must be equal on every rank")
    watchdog_s: float = Field(10.0, gt=0, description="an async handshake that has not moved this long is flagged as a stall")
    verify_transfers: bool = Field(False, description="check every staged layer against the model's own check before committing it")
    initial_placement: str | None = Field(
        None, description="a placement file (JSON, eplb.placement_file; GET /placement writes one) to start from "
                          "instead of the static placement; relative to the working directory. Checked against the "
                          "model before any worker starts; made for another EP size, it is recomputed from the "
                          "file's load window")
    communicator: Literal["auto", "gloo", "nccl", "nixl"] = Field(
        "auto", description="how expert weights move (eplb.communicator): auto = NIXL when installed, "
                            "then NCCL on an NCCL deployment, then gloo")

    @field_validator("load_smoothing", mode="before")
    @classmethod
    def _smoothing_is_a_number(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"load_smoothing must be a number in (0, 1] (1: the last window alone), got {value!r}")
        return value
