"""The deployment a coordinator runs: model shape, EPLB, load trace, EP size, timeouts."""

from __future__ import annotations

import json
import os
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from elastic.core.config import ScalingConfig, ServingConfig, TimeoutsConfig
from eplb.config import EPLBConfig
from eplb.models.config import HFModelConfig, ModelSpec, tiny_config
from eplb.models.serving import ModelSizes, model_info
from eplb.placement import Placement
from eplb.placement_file import PlacementFileError, read_placement_file
from eplb.trace import TraceConfig


class TracePhase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    start_step: int = Field(0, ge=0)
    trace: TraceConfig = TraceConfig()


class CommandHost(BaseModel):
    """One host of a ``command`` launcher."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="what {host} in the command template becomes (an ssh host, a netns...)")
    slots: int | None = Field(None, ge=1, description="most workers on this host (default: no limit)")
    env: dict[str, str] = Field(default_factory=dict, description="environment of the workers on this host "
                                "(e.g. GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), on top of the launcher's env")


#: the bind addresses that listen on every interface
ALL_INTERFACES = frozenset({"", "0.0.0.0", "::", "*"})

_RAY_ONLY = ("address", "namespace", "num_cpus_per_worker", "num_gpus_per_worker")
_COMMAND_ONLY = ("template", "hosts")


class LauncherConfig(BaseModel):
    """How workers are started, and where the coordinator's ``TCPStore`` listens and is reached.

    ``local``: processes on this machine. ``ray``: Ray actors, placed by Ray. ``command``: a
    process per worker from a command template (``ssh {host} ... python -m elastic.launch.remote_worker
    --store {store} --worker-id {worker_id}``), hosts filled evenly, ranks of a host contiguous.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["local", "ray", "command"] = "local"
    store_port: int = Field(0, ge=0, le=65535, description="port of the coordinator's TCPStore (0: any free port)")
    bind_host: str | None = Field(None, description="address the TCPStore listens on; '0.0.0.0' or '::' for every "
                                  "address (default: store_host)")
    advertise_host: str | None = Field(None, description="address the workers reach the TCPStore at (default: store_host)")
    allow_all_interfaces: bool = Field(False, description="let the TCPStore listen on every interface (0.0.0.0, ::); "
                                       "it carries pickles, so it is refused unless set")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables of every worker (ray, command)")
    # ray
    address: str | None = Field(None, description="ray: the cluster to join ('auto', 'ray://...', None: the "
                                "initialized one, or a new local one)")
    namespace: str = Field("elastic-ep", min_length=1, description="ray: namespace of the worker actors")
    num_cpus_per_worker: float = Field(1.0, ge=0, description="ray: CPUs each worker actor reserves")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="ray: GPUs each worker actor reserves (1 with nccl)")
    # command
    template: list[str] = Field(default_factory=list, description="command: argv of one worker, with {host}, "
                                "{store}, {store_host}, {store_port}, {worker_id}, {python}")
    hosts: list[CommandHost] = Field(default_factory=list, description="command: the hosts, in rank order")

    @model_validator(mode="after")
    def _check(self) -> LauncherConfig:
        set_fields = self.model_fields_set
        if self.kind != "ray":
            wrong = [name for name in _RAY_ONLY if name in set_fields]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: only for kind 'ray' (this launcher is {self.kind!r})")
        if self.kind != "command":
            wrong = [name for name in _COMMAND_ONLY if name in set_fields]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: only for kind 'command' (this launcher is {self.kind!r})")
        if self.kind == "local" and "env" in set_fields:
            raise ValueError("env applies to kinds 'ray' and 'command'; local workers inherit this process's environment")
        if self.kind == "command":
            if not self.template:
                raise ValueError("kind 'command' needs a template (argv of one worker)")
            if not self.hosts:
                raise ValueError("kind 'command' needs at least one host")
            text = " ".join(self.template)
            for needed in ("{store}", "{worker_id}"):
                if needed not in text and not (needed == "{store}" and "{store_host}" in text and "{store_port}" in text):
                    raise ValueError(f"the command template must pass {needed} to elastic.launch.remote_worker, got {self.template}")
            names = [h.name for h in self.hosts]
            if len(set(names)) != len(names):
                raise ValueError(f"host names must be distinct, got {names}")
            try:
                for arg in self.template:
                    arg.format(host="h", store="s:1", store_host="s", store_port=1, worker_id=1, python="python")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"the command template has an unknown or malformed placeholder: {exc}") from None
        return self

    @property
    def capacity(self) -> int | None:
        """Most workers the hosts hold (command launcher with slots on every host), else None."""
        if self.kind == "command" and self.hosts and all(h.slots for h in self.hosts):
            return sum(h.slots or 0 for h in self.hosts)  # all() above: every host has slots, "or 0" only narrows
        return None


#: what ``elastic-ep serve`` runs without a file: two local ranks of a tiny reference model (4 layers of 16
#: experts, 64 KiB each) with async EPLB, room to scale to 4. ``--ep-size`` and friends override it.
DEFAULT_DEPLOYMENT: dict[str, Any] = {
    "ep_size": 2,
    "max_ep_size": 4,
    "model": {"num_layers": 4, "num_experts": 16, "hidden_size": 64, "intermediate_size": 128},
    "eplb": {"num_redundant_experts": 4, "use_async": True, "window_size": 100, "step_interval": 100},
}


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelSpec = Field(default_factory=lambda: {"kind": "reference"},
                             description="the reference MoE (kind: reference, the default) or a Hugging Face MoE "
                             "(kind: hf, path: DIR | architecture: NAME)", validate_default=True)
    eplb: EPLBConfig = EPLBConfig()
    trace: list[TracePhase] = Field(default_factory=lambda: [TracePhase()])
    ep_size: int = Field(2, ge=1, description="EP ranks at start")
    max_ep_size: int = Field(8, ge=1, description="the launcher's capacity: no scale beyond it")
    seed: int = 0
    timeouts: TimeoutsConfig = TimeoutsConfig()
    scaling: ScalingConfig = Field(ScalingConfig(), description="what a scale does ahead of its pause: the standby "
                                   "group and the pre-transfer (prepare, prestage_max_bytes, prestage_share)")
    serving: ServingConfig = Field(ServingConfig(), description="completion requests (a real model, kind: hf): batch, "
                                   "queue and limits")
    heartbeat_s: float = Field(0.1, gt=0, description="how often each worker reports")
    step_delay_s: float = Field(0.0, ge=0, description="sleep after each decode step (pacing a replay)")
    auto_recover: bool = Field(False, description="after a failure, recover with the living workers without waiting for an operator")
    max_auto_recoveries: int = Field(3, ge=0, description="auto-recovery attempts per incident (a success resets the count)")
    replace_lost: bool = Field(False, description="after a recovery that shrank the group, scale back to the size "
                               "it had (when the launcher has capacity)")
    operation_history: int = Field(100, ge=1, le=100_000, description="finished operations (and per-command "
                                   "reports, worker errors) the coordinator keeps; older ones are forgotten")
    idempotency_ttl_s: float = Field(3600.0, gt=0, description="an idempotency key names its operation this long "
                                     "at most (and never longer than the operation is kept)")
    store_host: str = Field("127.0.0.1", description="the coordinator's address for its TCPStore (default bind and "
                            "advertise address; see launcher)")
    backend: str = Field("gloo", pattern="^(gloo|nccl)$", description="gloo on CPU hosts, nccl on GPU hosts")
    launcher: LauncherConfig = LauncherConfig()
    max_memory: ByteSize | None = Field(None, description="memory one worker may use, in bytes or with a unit "
                                        "('8GiB', '512MB'); checked against an estimate before any worker starts "
                                        "(default: this machine's available memory divided by its local ranks)")

    @model_validator(mode="after")
    def _check(self) -> DeploymentConfig:
        problem = self._model_problem()
        if problem:
            raise ValueError(problem)
        physical = self.num_physical
        if physical % self.ep_size:
            raise ValueError(
                f"{self.sizes.num_logical_experts} experts + {self.eplb.num_redundant_experts} redundant = {physical} "
                f"physical slots do not divide over ep_size={self.ep_size}")
        if self.store_bind_host in ALL_INTERFACES and not self.launcher.allow_all_interfaces:
            where = "launcher.bind_host" if self.launcher.bind_host else "store_host"
            raise ValueError(
                f"{where}: {self.store_bind_host!r} would let the TCPStore listen on every interface of this host; "
                "the store carries pickles, so anyone who reaches it can run code in the coordinator and the workers. "
                "Bind it to the private address the workers reach (e.g. launcher.bind_host: 10.0.0.5), or set "
                "launcher.allow_all_interfaces: true on a network you trust")
        if self.ep_size > self.max_ep_size:
            raise ValueError(f"ep_size={self.ep_size} exceeds max_ep_size={self.max_ep_size}")
        if self.timeouts.heartbeat <= self.timeouts.collective:
            raise ValueError(
                f"timeouts.heartbeat ({self.timeouts.heartbeat}s) must exceed timeouts.collective "
                f"({self.timeouts.collective}s): a rank blocked on a dead peer reports the failure within the "
                "collective timeout, and only a rank silent beyond that is declared lost")
        capacity = self.launcher.capacity
        if capacity is not None and self.max_ep_size > capacity:
            raise ValueError(f"max_ep_size={self.max_ep_size} exceeds the {capacity} slots of the launcher's hosts")
        starts = [phase.start_step for phase in self.trace]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"trace phases must start at step 0 and increase strictly, got starts {starts}")
        for phase in self.trace:
            if phase.trace.top_k > self.sizes.num_logical_experts:
                raise ValueError(f"trace top_k={phase.trace.top_k} exceeds num_experts={self.sizes.num_logical_experts}")
        if self.eplb.initial_placement is not None:  # last: every cheaper check of the sizes holds
            try:
                self.initial_placement  # noqa: B018 - read, checked and kept (cached) before any worker starts
            except PlacementFileError as exc:
                raise ValueError(f"eplb.initial_placement: {self.eplb.initial_placement}: {exc}") from None
        return self

    def _model_problem(self) -> str | None:
        """Why the model's MoE layout cannot be read (a checkpoint directory that is missing, incomplete
        or not a MoE model), in one line; None when :attr:`sizes` reads it. Reading it raised whatever
        transformers or safetensors raise (OSError, IndexError, SafetensorError...): a traceback."""
        path = getattr(self.model, "path", None)
        if isinstance(path, str):
            from eplb.models.checkpoint_files import checkpoint_problems

            problems = checkpoint_problems(path)
            if problems:
                return "; ".join(f"model.path: {message}" for message in problems)
        try:
            self.sizes  # noqa: B018 - read and kept (cached) before any worker starts
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever reading a foreign model raises becomes one line
            where = f"model.path: {path}" if isinstance(path, str) else \
                f"model.architecture: {getattr(self.model, 'architecture', None)}"
            return (f"{where}: cannot read the model's MoE layers ({type(exc).__name__}: {' '.join(str(exc).split())}); "
                    "expected a Mixture-of-Experts model of a supported architecture, as save_pretrained writes it")
        top_k, experts = self._model_top_k(), self.sizes.num_logical_experts
        if top_k is not None and not 1 <= top_k <= experts:  # transformers builds it; its router fails on every token
            where = f"model.path: {path}: config.json" if isinstance(path, str) else "model.config"
            return f"{where}: num_experts_per_tok={top_k}, expected 1 to the model's {experts} experts per MoE layer"
        return None

    def _model_top_k(self) -> int | None:
        """A Hugging Face model's experts per token (``num_experts_per_tok``, the name every supported
        architecture uses), when its config gives one."""
        if not isinstance(self.model, HFModelConfig):
            return None
        if self.model.path is not None:
            with open(os.path.join(self.model.path, "config.json"), encoding="utf-8") as f:  # checked: a JSON object
                config = json.load(f)
        else:
            assert self.model.architecture is not None  # HFModelConfig: a path or an architecture
            config = tiny_config(self.model.architecture, self.model.config)
        value = config.get("num_experts_per_tok")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def store_bind_host(self) -> str:
        return self.launcher.bind_host or self.store_host

    @property
    def store_advertise_host(self) -> str:
        return self.launcher.advertise_host or self.store_host

    @property
    def num_physical(self) -> int:
        return self.sizes.num_logical_experts + self.eplb.num_redundant_experts

    @cached_property
    def sizes(self) -> ModelSizes:
        """Layer and expert counts of the model (a Hugging Face model's from its config, no weights)."""
        return model_info(self.model)

    @cached_property
    def initial_placement(self) -> tuple[Placement, str] | None:
        """The placement of ``eplb.initial_placement`` for this model at ``ep_size`` and how it was
        obtained (as saved, or recomputed from the file's load window); None without the option.
        Raises :class:`~eplb.placement_file.PlacementFileError` naming what is wrong with the file."""
        if self.eplb.initial_placement is None:
            return None
        saved = read_placement_file(self.eplb.initial_placement)
        return saved.placement_for(num_moe_layers=self.sizes.num_moe_layers,
                                   num_logical_experts=self.sizes.num_logical_experts, ep_size=self.ep_size,
                                   num_physical=self.num_physical, policy=self.eplb.policy,
                                   policy_options=dict(self.eplb.policy_options))

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def size_problem(self, ep_size: int) -> str | None:
        """Why ``ep_size`` cannot hold this model, or None when it can."""
        if ep_size < 1:
            return f"ep_size must be at least 1, got {ep_size}"
        if ep_size > self.max_ep_size:
            return f"ep_size={ep_size} exceeds the launcher's capacity of {self.max_ep_size} workers"
        if self.slots_per_rank * ep_size < self.sizes.num_logical_experts:
            return (f"ep_size={ep_size} gives {self.slots_per_rank * ep_size} physical slots "
                    f"({self.slots_per_rank} per rank), fewer than the {self.sizes.num_logical_experts} logical experts")
        return None
