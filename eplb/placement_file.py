"""Static placement files: a deployment's placement and load window, saved to start another from.

The counterpart of SGLang's ``--init-expert-location`` and vllm-ascend's ``expert_map_path``.
``GET /placement`` (``elastic-ep placement export``) writes one; ``eplb.initial_placement: FILE``
starts a deployment from one. The format is JSON, version 1::

    {
      "format": "elastic-ep placement",
      "version": 1,
      "model": {"num_moe_layers": 4, "num_logical_experts": 8},
      "ep_size": 2,                  # the EP size the placement was made for
      "slots_per_rank": 6,
      "num_physical": 12,            # ep_size * slots_per_rank
      "physical_to_logical": [[0, 1, ...], ...],         # [num_moe_layers][num_physical]
      "load_window": {"steps": 8,                        # decode steps the window held
                      "logical_load": [[31, 4, ...], ...]}  # [num_moe_layers][num_logical_experts]
    }

``physical_to_logical[layer][slot]`` is the logical expert physical slot ``slot`` holds; slots
are rank-major (rank ``r`` holds ``[r * slots_per_rank, (r + 1) * slots_per_rank)``).
``logical_load`` is the window's total of tokens routed to each logical expert (the load the
EPLB algorithm balances). Other keys (``generation``, ``step``, ``digest``, ``exported_at``)
are informational and ignored on reading.

A file made for the same EP size and slot count is used as it is. For another EP size (or
slot count) the placement is recomputed with the configured policy from the file's load
window; a file whose window is empty cannot be, and is refused. This module is pure: no
``torch.distributed``, and the only I/O is :func:`read_placement_file`.
"""

from __future__ import annotations

import json
import math
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eplb.placement import Placement, PlacementError, validate_physical_to_logical

__all__ = [
    "FORMAT",
    "VERSION",
    "PlacementFile",
    "PlacementFileError",
    "parse_placement",
    "placement_document",
    "read_placement_file",
]

FORMAT = "elastic-ep placement"
VERSION = 1
MAX_BYTES = 64 * 1024 * 1024  # a file past this is refused before it is read
INT64_MAX = (1 << 63) - 1  # counts are kept as int64 (torch)


class PlacementFileError(ValueError):
    """A placement file that cannot start this deployment; the message names what is wrong."""


@dataclass(frozen=True)
class PlacementFile:
    """A parsed, internally consistent placement file (see the module's docstring)."""

    num_moe_layers: int
    num_logical_experts: int
    ep_size: int
    slots_per_rank: int
    physical_to_logical: torch.Tensor  # [layers, ep_size * slots_per_rank] int64, valid
    logical_load: torch.Tensor  # [layers, num_logical_experts] float64, finite, >= 0
    window_steps: int

    @property
    def num_physical(self) -> int:
        return self.ep_size * self.slots_per_rank

    def placement_for(self, *, num_moe_layers: int, num_logical_experts: int, ep_size: int, num_physical: int,
                      policy: str = "default", policy_options: dict[str, Any] | None = None) -> tuple[Placement, str]:
        """The placement a deployment of this shape starts with, and how it was obtained.

        The model must match (layers and logical experts); the same ``ep_size`` and
        ``num_physical`` take the file's placement as it is; another layout is recomputed
        from the load window with ``policy`` (``policy_options`` may carry ``num_groups``
        and ``num_nodes``). Raises :class:`PlacementFileError` naming the mismatch.
        """
        if (self.num_moe_layers, self.num_logical_experts) != (num_moe_layers, num_logical_experts):
            raise PlacementFileError(
                f"made for a model of {self.num_moe_layers} MoE layers x {self.num_logical_experts} logical experts; "
                f"this deployment's model has {num_moe_layers} x {num_logical_experts}")
        if (self.ep_size, self.num_physical) == (ep_size, num_physical):
            return Placement.from_physical_to_logical(self.physical_to_logical, num_logical_experts), "as saved"
        sizes = (f"the file is for ep_size {self.ep_size} ({self.num_physical} slots), this deployment starts "
                 f"ep_size {ep_size} ({num_physical} slots)")
        if not bool((self.logical_load > 0).any()):
            raise PlacementFileError(f"{sizes}, and the file's load window is empty, so the placement cannot be "
                                     f"recomputed; export it after some decode steps, or start at ep_size {self.ep_size}")
        from eplb.algorithm import AlgorithmError, compute_placement

        opts = dict(policy_options or {})
        try:
            placement = compute_placement(self.logical_load, num_physical, ep_size, num_groups=opts.pop("num_groups", 1),
                                          num_nodes=opts.pop("num_nodes", 1), policy=policy, **opts)
        except AlgorithmError as exc:
            raise PlacementFileError(f"{sizes}; recomputing it from the load window failed: {exc}") from None
        return placement, f"recomputed from the load window ({self.window_steps} steps): {sizes}"


def _finite(value: int | float) -> bool:
    """Finite as a float64 (the window is one): an integer of 400 digits is not (float() overflows)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(data: dict[str, Any], key: str, where: str = "") -> int:
    if key not in data:
        raise PlacementFileError(f"missing key {where}{key}")
    value = data[key]
    if not _int(value) or value < 1:
        raise PlacementFileError(f"{where}{key} must be a positive integer, got {value!r}")
    return value


def parse_placement(data: Any) -> PlacementFile:
    """Check a decoded placement file and return it; :class:`PlacementFileError` names the first problem.

    Checks: the format and version; the model's layer and expert counts; ``num_physical`` =
    ``ep_size`` x ``slots_per_rank``; ``physical_to_logical`` with one row per layer and one
    integer per slot, each in ``[0, num_logical_experts)``, every expert held at least once per
    layer; ``load_window.logical_load`` with one row per layer and one finite number >= 0 per
    logical expert.
    """
    # 1. the header and the shapes it promises
    if not isinstance(data, dict):
        raise PlacementFileError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format", FORMAT) != FORMAT:
        raise PlacementFileError(f"format must be {FORMAT!r}, got {data['format']!r}")
    if "version" not in data:
        raise PlacementFileError("missing key version")
    if data["version"] != VERSION:
        raise PlacementFileError(f"version {data['version']!r} is not supported (this build reads version {VERSION})")
    model = data.get("model")
    if not isinstance(model, dict):
        raise PlacementFileError("missing key model (an object with num_moe_layers and num_logical_experts)")
    layers = _count(model, "num_moe_layers", "model.")
    experts = _count(model, "num_logical_experts", "model.")
    ep_size = _count(data, "ep_size")
    per_rank = _count(data, "slots_per_rank")
    slots = ep_size * per_rank
    if "num_physical" in data and data["num_physical"] != slots:
        raise PlacementFileError(f"num_physical is {data['num_physical']!r}, but ep_size {ep_size} x slots_per_rank "
                                 f"{per_rank} = {slots}")
    if slots < experts:
        raise PlacementFileError(f"{slots} physical slots (ep_size {ep_size} x {per_rank} per rank) cannot hold the "
                                 f"{experts} logical experts")
    # 2. the placement, 3. the load window
    p2l = _parse_rows(data.get("physical_to_logical"), layers, experts, ep_size, per_rank)
    steps, loads = _parse_window(data.get("load_window"), layers, experts)
    return PlacementFile(layers, experts, ep_size, per_rank, p2l, loads, steps)


def _parse_rows(rows: Any, layers: int, experts: int, ep_size: int, per_rank: int) -> torch.Tensor:
    """``physical_to_logical``: ``[layers, ep_size * per_rank]`` experts in range, each held on every layer."""
    slots = ep_size * per_rank
    if not isinstance(rows, list):
        raise PlacementFileError("missing key physical_to_logical (a list of one list of slots per MoE layer)")
    if len(rows) != layers:
        raise PlacementFileError(f"physical_to_logical has {len(rows)} layers, the model has {layers} MoE layers")
    for layer, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != slots:
            got = f"{len(row)} slots" if isinstance(row, list) else type(row).__name__
            raise PlacementFileError(f"physical_to_logical layer {layer} has {got}, expected {slots} "
                                     f"(ep_size {ep_size} x {per_rank} slots per rank)")
        for slot, expert in enumerate(row):
            if not _int(expert):
                raise PlacementFileError(f"physical_to_logical layer {layer}, slot {slot}: expected an expert number, "
                                         f"got {expert!r}")
            if not 0 <= expert < experts:
                raise PlacementFileError(f"physical_to_logical layer {layer}, slot {slot}: expert {expert} is out of "
                                         f"range [0, {experts})")
    p2l = torch.tensor(rows, dtype=torch.int64)
    try:
        validate_physical_to_logical(p2l, experts)  # every expert at least one replica on every layer
    except PlacementError as exc:
        raise PlacementFileError(f"physical_to_logical {exc}") from None
    return p2l


def _parse_window(window: Any, layers: int, experts: int) -> tuple[int, torch.Tensor]:
    """``load_window``: its step count and ``[layers, experts]`` finite loads >= 0 (float64)."""
    if not isinstance(window, dict):
        raise PlacementFileError("missing key load_window (an object with steps and logical_load)")
    steps = window.get("steps", 0)
    if not _int(steps) or not 0 <= steps <= INT64_MAX:
        raise PlacementFileError(f"load_window.steps must be an integer in [0, {INT64_MAX}], got {steps!r}")
    loads = window.get("logical_load")
    if not isinstance(loads, list) or len(loads) != layers:
        got = f"{len(loads)} layers" if isinstance(loads, list) else repr(type(loads).__name__)
        raise PlacementFileError(f"load_window.logical_load has {got}, the model has {layers} MoE layers")
    for layer, row in enumerate(loads):
        if not isinstance(row, list) or len(row) != experts:
            got = f"{len(row)} experts" if isinstance(row, list) else type(row).__name__
            raise PlacementFileError(f"load_window.logical_load layer {layer} has {got}, expected {experts}")
        for expert, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or value < 0:
                raise PlacementFileError(f"load_window.logical_load layer {layer}, expert {expert}: expected a finite "
                                         f"number >= 0, got {value!r}")
    return steps, torch.tensor(loads, dtype=torch.float64)


def read_placement_file(path: str | Path) -> PlacementFile:
    """Read and check a placement file; :class:`PlacementFileError` names the file's problem."""
    path = Path(path)
    too_large = f"larger than the {MAX_BYTES} bytes a placement file may have"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO blocks the open, a device (/dev/zero) never ends
            raise PlacementFileError("not a regular file; give the path of a placement file (JSON)")
        if info.st_size > MAX_BYTES:
            raise PlacementFileError(f"{info.st_size} bytes, {too_large}")
        with path.open("rb") as fh:
            data = fh.read(MAX_BYTES + 1)  # the file may have grown since stat
        if len(data) > MAX_BYTES:
            raise PlacementFileError(too_large)
        text = data.decode("utf-8")
    except OSError as exc:
        raise PlacementFileError(f"cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PlacementFileError("not UTF-8 text (a placement file is JSON)") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise PlacementFileError(f"not JSON: {exc}") from None
    return parse_placement(data)


def placement_document(physical_to_logical: list[list[int]], logical_load: list[list[float]], *, ep_size: int,
                       window_steps: int, **info: Any) -> dict[str, Any]:
    """A placement file's content (``info``: informational keys such as generation, step, digest)."""
    layers = len(physical_to_logical)
    slots = len(physical_to_logical[0]) if layers else 0
    experts = len(logical_load[0]) if logical_load else 0
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": {"num_moe_layers": layers, "num_logical_experts": experts},
        "ep_size": ep_size,
        "slots_per_rank": slots // ep_size,
        "num_physical": slots,
        "physical_to_logical": physical_to_logical,
        "load_window": {"steps": window_steps, "logical_load": logical_load},
        **info,
    }
