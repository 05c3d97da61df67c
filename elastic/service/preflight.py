"""Pre-flight checks: every file the project reads, and every deployment, before anything starts.

Bad input must cost one clear line, never a traceback, a hang or a minute of work. So before a
file is parsed, and before any worker process starts:

- **reading** (:func:`read_text`): the path is a regular file (a FIFO would block the open), at
  most :data:`MAX_FILE_BYTES`, and UTF-8 text;
- **YAML** (:func:`load_yaml`): a bounded loader refuses nesting deeper than :data:`MAX_YAML_DEPTH`
  (the composer recurses) and documents that expand to more than :data:`MAX_YAML_NODES` nodes
  once aliases are followed (a "billion laughs" file is tiny but expands geometrically, and
  everything after the parser, validation included, walks the expanded tree);
- **numbers** (:func:`bound_problems`): the upper bounds of :data:`LIMITS`, each with its reason,
  every integer within int64 (torch keeps counts and seeds as int64) and every float finite;
- **memory** (:func:`memory_problems`): an estimate of one worker's memory (weights, staging,
  load window, activations, the runtime) against a budget: ``max_memory`` of the deployment,
  or this machine's available memory divided by the ranks that start on it;
- **checkpoints** (:func:`checkpoint_problems`): a ``save_pretrained`` directory has a readable
  ``config.json``, and every safetensors file it names is there, inside it and complete;
- **hooks** (:func:`hook_problems`): a hook command's program exists and is executable;
- **HTTP bodies** (:class:`BodyLimit`): at most :data:`MAX_BODY_BYTES`, refused before they are read.

Every problem is an :class:`InputProblem` (a key path and a message that says what to do), and a
file's problems are raised together as one :class:`InputError`; the CLI prints one line per
problem and exits 2, the HTTP API answers 422.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

if TYPE_CHECKING:  # deployment imports nothing from here at run time, so no cycle
    from elastic.deployment import DeploymentConfig
    from elastic.service.hooks import HooksConfig

__all__ = [
    "LIMITS", "MAX_BODY_BYTES", "MAX_FILE_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_NODES", "BodyLimit",
    "BodyTooLarge", "InputError", "InputProblem", "Limit", "MemoryEstimate", "Refusal", "available_memory",
    "bound_problems", "checkpoint_problems", "estimate_worker_memory", "format_bytes", "hook_problems", "host_problems",
    "invalid_body",
    "load_yaml", "memory_budget", "memory_problems", "one_line", "policy_problems", "read_text", "read_yaml",
    "unparsable_body",
]

#: config files (scenarios, deployments) are a few KiB; a larger one is a mistake (a log, a checkpoint)
MAX_FILE_BYTES = 1 << 20
#: nesting of a scenario or deployment is below 10; PyYAML's composer recurses once per level
MAX_YAML_DEPTH = 64
#: values after alias expansion: a 1000-event timeline is about 10 000; 50 000 parse in about 0.3 s
MAX_YAML_NODES = 50_000
#: what one worker process costs before any tensor: the interpreter with torch imported (RSS measured
#: here: 223 MiB), gloo and the decode loop's buffers
RUNTIME_BYTES = 256 << 20

INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------------------------------------
# errors

def one_line(text: str) -> str:
    """Control characters (a newline in a key, a NUL in a value) escaped, so one problem stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass(frozen=True)
class InputProblem:
    """One thing wrong with an input: where (a key path, empty for the whole file) and what to do."""

    path: str
    message: str

    def line(self, source: str) -> str:
        return one_line(f"{source}: {self.path}: {self.message}" if self.path else f"{source}: {self.message}")

    def model_dump(self) -> dict[str, str]:  # the same shape as ScenarioProblem's, for to_dict()
        return {"path": self.path, "message": self.message}


class InputError(ValueError):
    """An input that cannot be used; ``problems`` lists every problem found, one line each."""

    def __init__(self, source: str, problems: Iterable[Any]):
        self.source = source
        self.problems = list(problems)
        super().__init__("\n".join(p.line(source) for p in self.problems))

    def lines(self) -> list[str]:
        return [p.line(self.source) for p in self.problems]

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.source, "problems": [p.model_dump() for p in self.problems]}


def _refuse(source: str, message: str, path: str = "") -> InputError:
    return InputError(source, [InputProblem(path, message)])


# ---------------------------------------------------------------------------------------------
# reading

def read_text(path: str | Path, *, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of ``path``; :class:`InputError` when it is missing, not a regular file, too large or not UTF-8."""
    path = Path(path)
    source = str(path)
    try:
        info = path.stat()
    except OSError as exc:
        raise _refuse(source, f"cannot read the file: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        # opening a FIFO blocks until a writer comes; a directory or a device is never a config
        raise _refuse(source, "not a regular file; give the path of a YAML file")
    if info.st_size > max_bytes:
        raise _refuse(source, f"the file is {format_bytes(info.st_size)}, more than the {format_bytes(max_bytes)} "
                      "a config file may have; is it the right file?")
    try:
        with path.open("rb") as fh:
            data = fh.read(max_bytes + 1)  # the file may have grown since stat
    except OSError as exc:
        raise _refuse(source, f"cannot read the file: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise _refuse(source, f"the file is more than the {format_bytes(max_bytes)} a config file may have; "
                      "is it the right file?")
    try:
        return data.decode("utf-8-sig")  # an editor's byte-order mark is harmless
    except UnicodeDecodeError as exc:
        raise _refuse(source, f"not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}); "
                      "give a YAML file saved as UTF-8") from None


class _TooBig(yaml.YAMLError):
    """The bounded loader stops composing (depth, alias expansion)."""


class _Bounds:
    """A composer that counts nodes as if every alias were expanded, and bounds nesting.

    An alias costs what its anchor's subtree costs; an alias to an anchor still being composed
    (a recursive document) is refused, since validation would recurse forever on it.
    """

    max_depth = MAX_YAML_DEPTH
    max_nodes = MAX_YAML_NODES

    def _start_bounds(self) -> None:
        self._depth = 0
        self._expanded = 0
        self._aliases = 0
        self._sizes: dict[str, int] = {}
        self._open: set[str] = set()

    def _count(self, nodes: int) -> None:
        self._expanded += nodes
        if self._expanded > self.max_nodes:
            if self._aliases:
                raise _TooBig(f"the document expands to more than {self.max_nodes} values once its aliases (*name) "
                              "are followed; write the values out or use fewer aliases")
            raise _TooBig(f"the document has more than {self.max_nodes} values; is it the right file?")

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A key given twice in one mapping is refused: YAML loaders keep the last silently (a second
        ``timeline:`` dropped the first's events). Checked before merge keys (``<<``) are laid in, so
        a key that overrides a merged one is fine."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                first = seen.setdefault((key_node.tag, key_node.value), key_node.start_mark)
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} is given twice (first on line {first.line + 1}); "
                        "YAML would keep only the last: remove one", key_node.start_mark)
        return super().construct_mapping(node, deep)  # type: ignore[misc]

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):  # type: ignore[attr-defined]
            anchor = self.peek_event().anchor  # type: ignore[attr-defined]
            if anchor in self._open:
                raise _TooBig(f"alias *{anchor} refers to a node that contains it (a recursive document)")
            self._aliases += 1
            self._count(self._sizes.get(anchor, 0))  # an unknown anchor: the composer's own error follows
            return super().compose_node(parent, index)  # type: ignore[misc]
        anchor = self.peek_event().anchor  # type: ignore[attr-defined]
        self._depth += 1
        if self._depth > self.max_depth:
            raise _TooBig(f"nesting deeper than {self.max_depth} levels")
        start = self._expanded
        self._count(1)
        if anchor is not None:
            self._open.add(anchor)
        node = super().compose_node(parent, index)  # type: ignore[misc]
        if anchor is not None:
            self._open.discard(anchor)
            self._sizes[anchor] = self._expanded - start
        self._depth -= 1
        return node


if getattr(yaml, "__with_libyaml__", False):
    from yaml._yaml import CParser

    class BoundedLoader(_Bounds, Composer, CParser, SafeConstructor, Resolver):
        """libyaml's parser (C, about 6x faster) under PyYAML's composer, which :class:`_Bounds` hooks."""

        def __init__(self, stream: Any):
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            self._start_bounds()
else:  # pragma: no cover - PyYAML built without libyaml
    class BoundedLoader(_Bounds, yaml.SafeLoader):  # type: ignore[no-redef]
        def __init__(self, stream: Any):
            yaml.SafeLoader.__init__(self, stream)
            self._start_bounds()


def load_yaml(text: str, source: str, *, max_nodes: int = MAX_YAML_NODES, max_depth: int = MAX_YAML_DEPTH) -> Any:
    """Parse one YAML document with :class:`BoundedLoader`; :class:`InputError` naming line and column."""
    loader = BoundedLoader(text)
    loader.max_nodes, loader.max_depth = max_nodes, max_depth
    try:
        return loader.get_single_data()
    except yaml.reader.ReaderError as exc:  # its str() spans two lines
        raise _refuse(source, f"not valid YAML: {exc.reason} at character {exc.position}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or " ".join(str(exc).split())
        context = getattr(exc, "context", None)  # "while parsing a flow sequence", "expected a single document"
        if context and getattr(exc, "problem", None):
            what = f"{context}, {what}"
        raise _refuse(source, f"not valid YAML: {where}{what}") from None
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        # PyYAML's constructors raise these for well-formed but impossible scalars
        # ("2001-13-45", "!!int 0x", "!!timestamp 1")
        raise _refuse(source, f"not valid YAML: a value cannot be read ({type(exc).__name__}: {exc}); "
                      "quote it if it is meant as text") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path, **limits: int) -> Any:
    """:func:`read_text` then :func:`load_yaml`."""
    max_bytes = limits.pop("max_bytes", MAX_FILE_BYTES)
    return load_yaml(read_text(path, max_bytes=max_bytes), str(path), **limits)


# ---------------------------------------------------------------------------------------------
# numeric bounds

@dataclass(frozen=True)
class Limit:
    """An upper bound and why it is there (printed with the refusal, listed in the README)."""

    maximum: float
    reason: str


MAX_STEPS = 10_000_000
MAX_RANKS = 4096
MAX_SECONDS = 7 * 24 * 3600.0

_STEPS = Limit(MAX_STEPS, "a replay decodes one step at a time: 10 ms per step at the default pace makes "
               "10 000 000 steps more than a day")
_RANKS = Limit(MAX_RANKS, "one worker process per rank, and every rank all-reduces at every decode step")
_SECONDS = Limit(MAX_SECONDS, "a wait or a pace of more than a week is a typo")

#: ``Class.field`` (or ``Class.*``: every number of that class) -> its bound. Sizes of tensors
#: (experts, redundant slots, hidden sizes, window, tokens) have no bound of their own here:
#: the memory estimate judges them together, against the memory there is.
LIMITS: dict[str, Limit] = {
    "Scenario.steps": _STEPS,
    "ScaleEvent.to": _RANKS,
    "DeploymentConfig.ep_size": _RANKS, "DeploymentConfig.max_ep_size": _RANKS,
    "AutoscalerConfig.max_size": _RANKS, "AutoscalerConfig.min_size": _RANKS,
    "TimeoutsConfig.*": _SECONDS,
    "Scenario.run_timeout_s": _SECONDS,
    "DeploymentConfig.heartbeat_s": _SECONDS, "DeploymentConfig.step_delay_s": _SECONDS,
    "EPLBConfig.transfer_timeout_s": _SECONDS, "EPLBConfig.watchdog_s": _SECONDS,
    "ScaleEvent.transfer_wait_s": _SECONDS, "StallEvent.seconds": _SECONDS,
    "StallRank.seconds": _SECONDS, "DelayTransfer.seconds": _SECONDS, "SlowPrepare.seconds": _SECONDS,
    "AutoscalerConfig.up_after_s": _SECONDS, "AutoscalerConfig.down_after_s": _SECONDS,
    "AutoscalerConfig.cooldown_s": _SECONDS,
}


def _limit_for(cls: type, name: str) -> Limit | None:
    for klass in cls.__mro__:
        found = LIMITS.get(f"{klass.__name__}.{name}") or LIMITS.get(f"{klass.__name__}.*")
        if found is not None:
            return found
    return None


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else part


def _number_problems(value: Any, path: str, limit: Limit | None) -> list[InputProblem]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return []
    if isinstance(value, float) and not math.isfinite(value):
        return [InputProblem(path, f"expected a finite number, got {value}")]
    if limit is not None and value > limit.maximum:  # the tighter bound, with its reason, first
        shown = f"{limit.maximum:g}" if isinstance(limit.maximum, float) else str(limit.maximum)
        return [InputProblem(path, f"expected at most {shown} ({limit.reason}), got {value}")]
    if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        return [InputProblem(path, f"expected an integer within int64 (at most {INT64_MAX}), got {value}; "
                             "counts, steps and seeds are kept as 64-bit integers")]
    return []


def bound_problems(obj: Any, path: str = "") -> list[InputProblem]:
    """Every number of a validated model (recursively) out of :data:`LIMITS`, int64 or finiteness."""
    problems: list[InputProblem] = []
    if isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            value = getattr(obj, name)
            where = _join(path, name)
            problems += _number_problems(value, where, _limit_for(type(obj), name))
            problems += bound_problems(value, where)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            problems += _number_problems(item, _join(path, i), None)
            problems += bound_problems(item, _join(path, i))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            problems += _number_problems(item, _join(path, str(key)), None)
            problems += bound_problems(item, _join(path, str(key)))
    return problems


# ---------------------------------------------------------------------------------------------
# memory

def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover - the loop returns


@dataclass(frozen=True)
class MemoryEstimate:
    """One worker's memory at its peak, part by part, and the key path of the knob behind each part."""

    parts: dict[str, int]
    knobs: dict[str, str]
    detail: dict[str, str]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def largest(self) -> str:
        return max(self.parts, key=lambda k: self.parts[k])

    def describe(self) -> str:
        out = []
        for name, size in sorted(self.parts.items(), key=lambda kv: -kv[1]):
            extra = f" ({self.detail[name]})" if name in self.detail else ""
            out.append(f"{name} {format_bytes(size)}{extra}")
        return ", ".join(out)


def estimate_worker_memory(config: DeploymentConfig) -> MemoryEstimate | None:
    """One worker's peak: its slots of every layer, a one-layer staging buffer, the load window,
    activations, and the experts a scale pre-transfers into spare memory.

    The reference model holds no KV cache; the load window (``[window, layers, experts]`` int64 on
    every rank) is the part that grows with traffic history instead. A rescale writes through
    the same one-layer staging buffer. With ``scaling.prepare``, a surviving rank holds the layers
    it changes, whole, until the switch: at most ``scaling.prestage_max_bytes``, and never more
    than its own weights.
    """
    from eplb.model import ModelShape  # torch: loaded already by the config's model

    shape = config.model
    if not isinstance(shape, ModelShape):
        return None  # a model described by a checkpoint (not a reference shape): its size is read at load time
    slots = config.slots_per_rank
    expert = shape.expert_bytes
    element = expert // (2 * shape.hidden_size * shape.intermediate_size)
    tokens = max(p.trace.tokens_per_step * p.trace.top_k for p in config.trace)
    busiest = max(range(len(config.trace)), key=lambda i: config.trace[i].trace.tokens_per_step * config.trace[i].trace.top_k)
    parts = {
        "weights": slots * shape.num_layers * expert,
        "staging": slots * expert,
        "load window": config.eplb.window_size * shape.num_layers * shape.num_experts * 8,
        # x, the hidden activations and the output of every routed token, in the model's dtype
        "activations": tokens * (2 * shape.hidden_size + shape.intermediate_size) * element,
        "runtime": RUNTIME_BYTES,
    }
    if config.scaling.prepare:
        # a survivor stages at most every layer it holds, whole
        parts["pre-transfer"] = min(int(config.scaling.prestage_max_bytes), parts["weights"])
    redundant = config.eplb.num_redundant_experts
    knobs = {
        "weights": "eplb.num_redundant_experts" if redundant > shape.num_experts else "model",
        "staging": "eplb.num_redundant_experts" if redundant > shape.num_experts else "model",
        "load window": "eplb.window_size",
        "activations": f"trace[{busiest}].trace.tokens_per_step",
        "runtime": "ep_size",
        "pre-transfer": "scaling.prestage_max_bytes",
    }
    detail = {
        "weights": f"{slots} slots x {shape.num_layers} layers x {format_bytes(expert)}",
        "staging": "one layer of slots",
        "pre-transfer": "the layers a surviving rank stages ahead of a scale's pause",
        "load window": f"{config.eplb.window_size} steps x {shape.num_layers} layers x {shape.num_experts} experts",
    }
    return MemoryEstimate(parts, knobs, detail)


def _cgroup_room() -> int | None:
    """Memory left under this process's cgroup limit (v2, then v1), None when unlimited or unknown."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


def available_memory() -> int | None:
    """Memory this machine can still give (``MemAvailable``, within the cgroup's limit), None if unknown."""
    found: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        found = None
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            found = None
    room = _cgroup_room()
    if room is not None:
        found = room if found is None else min(found, room)
    return found


@dataclass(frozen=True)
class MemoryBudget:
    per_worker: int
    explanation: str


def memory_budget(config: DeploymentConfig, *, available: Callable[[], int | None] = available_memory,
                  key: str = "max_memory") -> MemoryBudget | None:
    """What one worker may use: ``max_memory`` (spelled ``key`` in the file), else (local workers only)
    this machine's share."""
    if config.max_memory is not None:
        return MemoryBudget(int(config.max_memory), f"{key} allows {format_bytes(int(config.max_memory))}")
    if config.launcher.kind != "local":
        return None  # the workers' machines are elsewhere: only max_memory can say what they hold
    free = available()
    if free is None:
        return None
    ranks = config.ep_size
    return MemoryBudget(free // ranks, f"this machine has {format_bytes(free)} available for {ranks} local "
                        f"rank(s), {format_bytes(free // ranks)} each")


def host_problems(config: DeploymentConfig, *, rename: Callable[[str], str] = lambda p: p) -> list[InputProblem]:
    """What cannot work for the deployment, before any worker starts: a store address that is no
    address at all (a name that does not resolve was a ``gaierror`` traceback once the coordinator
    started; an address of another machine is left alone, as a deployment file may be checked away
    from the machine it runs on), and, for local workers, ``backend: nccl`` without NCCL and a GPU
    here (every worker failed at its start)."""
    import socket

    problems = []
    host = config.store_bind_host
    key = rename("launcher.bind_host" if config.launcher.bind_host else "store_host")
    if host not in ("", "*"):
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            problems.append(InputProblem(key, f"the coordinator's store cannot listen on {host!r}, which is not an "
                                         f"address ({getattr(exc, 'strerror', None) or exc}); give an address of "
                                         "this machine"))
    if config.backend == "nccl" and config.launcher.kind == "local":
        import torch
        import torch.distributed as dist

        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            problems.append(InputProblem(rename("backend"), "nccl needs NCCL and a GPU, and this machine's torch has "
                                         f"{'no GPU' if dist.is_nccl_available() else 'no NCCL (a CPU build)'}; "
                                         "local workers on CPU use backend: gloo"))
    return problems


def memory_problems(config: DeploymentConfig, *, rename: Callable[[str], str] = lambda p: p,
                    available: Callable[[], int | None] = available_memory) -> list[InputProblem]:
    """The deployment's worker does not fit its budget: one problem naming the knob of the largest part."""
    budget = memory_budget(config, available=available, key=rename("max_memory"))
    if budget is None:
        return []
    estimate = estimate_worker_memory(config)
    if estimate is None or estimate.total <= budget.per_worker:
        return []
    largest = estimate.largest
    need = format_bytes(estimate.total)
    budget_key = rename("max_memory")
    if largest == "runtime":  # no tensor is the problem: the budget is below what any worker costs
        if config.max_memory is not None:
            knob, fix = budget_key, f"a {budget_key} of at least {need}"
        else:
            knob, fix = rename("ep_size"), (f"fewer ranks on this machine (each needs {format_bytes(RUNTIME_BYTES)} "
                                            "before any tensor), or a machine with more memory available")
    else:
        knob = rename(estimate.knobs[largest])
        what = ("a smaller model (layers, experts, hidden and intermediate sizes) or more ranks"
                if estimate.knobs[largest] == "model" else f"a smaller {knob}")
        fix = f"{what}, or a {budget_key} of at least {need} on a machine that has it"
    return [InputProblem(knob, f"a worker would need {need} ({estimate.describe()}), but {budget.explanation}; "
                         f"fix: {fix}")]


def policy_problems(config: DeploymentConfig, path: str = "eplb.policy") -> list[InputProblem]:
    """``EPLBConfig.policy`` takes any name and ``policy_options`` any keys; a name the workers
    cannot find, or an option the policy does not take, fails every rebalance."""
    from eplb.algorithm import POLICIES, policy_option_names  # torch: imported only when a deployment is checked

    policy = config.eplb.policy
    if policy not in POLICIES:
        return [InputProblem(path, f"expected one of {', '.join(repr(p) for p in sorted(POLICIES))}, got {policy!r}")]
    accepted = policy_option_names(policy)
    if accepted is None:
        return []  # the policy takes any option (**kwargs)
    accepted |= {"num_groups", "num_nodes"}  # the hierarchy, passed to every policy (eplb.state.placement_for)
    options_path = path.removesuffix("policy") + "policy_options"
    return [InputProblem(f"{options_path}.{name}", f"policy {policy!r} takes no option {name!r}; it takes: "
                         f"{', '.join(sorted(accepted))}")
            for name in sorted(set(config.eplb.policy_options) - accepted)]


# ---------------------------------------------------------------------------------------------
# checkpoint directories (save_pretrained: config.json and safetensors)

def checkpoint_problems(directory: str | Path, key: str = "model.path") -> list[InputProblem]:
    """What stops a ``save_pretrained`` directory from loading, before any worker opens it, under
    ``key`` (:func:`eplb.models.checkpoint_files.checkpoint_problems`: the checks live beside the
    loader, so that a config can run them as it is read, below this floor)."""
    from eplb.models.checkpoint_files import checkpoint_problems as problems_of

    return [InputProblem(key, message) for message in problems_of(directory)]


# ---------------------------------------------------------------------------------------------
# hooks

def _program_problem(program: str) -> str | None:
    if "/" in program:
        target = Path(program)
        if not target.exists():
            return f"{program} does not exist"
        if not target.is_file() or not os.access(target, os.X_OK):
            return f"{program} is not an executable file (chmod +x?)"
        return None
    if shutil.which(program) is None:
        return f"{program!r} is not on PATH"
    return None


def hook_problems(hooks: HooksConfig, path: str = "hooks") -> list[InputProblem]:
    """A hook command whose program is missing would veto every scale: say so before the server starts.

    A string command runs under ``/bin/sh``; only its first word is checked, and only when it is a
    plain word (a shell construct such as ``VAR=1 cmd`` or ``cd x && y`` is left to the shell).
    """
    problems = []
    for when in ("before_scale", "after_scale"):
        for i, spec in enumerate(getattr(hooks, when)):
            if spec.command is None:
                continue
            if isinstance(spec.command, list):
                program = spec.command[0]
            else:
                try:
                    words = shlex.split(spec.command)
                except ValueError:
                    continue
                if not words or "=" in words[0] or any(c in spec.command for c in "|&;<>()$`"):
                    continue
                program = words[0]
            why = _program_problem(program)
            if why:
                problems.append(InputProblem(f"{path}.{when}[{i}].command",
                                             f"{why}; fix the command, or the hook fails (a before hook vetoes) every scale"))
    return problems


# ---------------------------------------------------------------------------------------------
# HTTP request bodies

#: a scale request is under 200 bytes; the limit keeps a runaway client from making the server
#: read and parse megabytes before the schema refuses them
MAX_BODY_BYTES = 64 << 10


class BodyTooLarge(ValueError):
    """A streamed (chunked) request body passed the limit; FastAPI chains it to its 400, the API says 422."""


def unparsable_body(cause: BaseException | None, detail: str) -> str:
    """What was wrong with a body FastAPI could not parse (its 400 "There was an error parsing the
    body", raised ``from`` the cause): a chunked body past the limit, JSON nested too deeply, bytes
    that are not UTF-8."""
    if isinstance(cause, BodyTooLarge):
        return str(cause)
    if isinstance(cause, RecursionError):
        return "body: JSON nested too deeply; send a flat object"
    if isinstance(cause, UnicodeDecodeError):
        return f"body: not UTF-8 text (byte {cause.start}); send JSON in UTF-8"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):  # Python's 4300-digit limit
        return "body: a number of more than 4300 digits; send numbers within their field's range"
    return f"body: {detail}"


def invalid_body(error: dict[str, Any]) -> str | None:
    """A clearer message for a validation error about the body as a whole (``loc`` ``("body", ...)``):
    JSON that does not parse (FastAPI's "JSON decode error" at a character position), no body, or a
    body that is not a JSON object (e.g. sent without ``Content-Type: application/json``); None for
    an error about one field."""
    loc = tuple(error.get("loc") or ())
    kind = error.get("type")
    if kind == "json_invalid":
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        why = (error.get("ctx") or {}).get("error")
        return f"body: not valid JSON{where}" + (f" ({why})" if why else "")
    if loc == ("body",) and kind == "missing":
        return "body: empty; send the request as a JSON object"
    if loc == ("body",) and kind in ("model_attributes_type", "dict_type"):
        return f"body: a JSON object is expected, sent with Content-Type: application/json ({error.get('msg')})"
    return None


#: how a path's refusal of an oversized body reads: ``message -> (status, JSON body)``
Refusal = Callable[[str], tuple[int, dict[str, Any]]]


def _api_refusal(message: str) -> tuple[int, dict[str, Any]]:
    return 422, {"error": "invalid_request", "message": message, "errors": []}


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 422 before it is read (Content-Length)
    or as soon as the streamed part passes the limit (chunked), in the API's error shape (or, under
    a prefix of ``refusals``, in that prefix's: the OpenAI routes answer 400 in OpenAI's shape)."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES, prefixes: dict[str, int] | None = None,
                 refusals: dict[str, Refusal] | None = None):
        self.app = app
        self.default = limit
        self.prefixes = prefixes if prefixes is not None else {}  # path prefix -> its own limit (read per request)
        self.refusals = refusals if refusals is not None else {}  # path prefix -> its refusal (read per request)
        self.limit = limit  # the default (the message names it)

    def limit_for(self, path: str) -> int:
        return next((v for k, v in self.prefixes.items() if path.startswith(k)), self.default)

    def message(self, limit: int | None = None) -> str:
        return (f"body: larger than the {format_bytes(limit or self.limit)} a request may have; send the fields of the "
                "request only")

    async def _refuse(self, send: Any, limit: int | None = None, path: str = "") -> None:
        import json

        refusal = next((v for k, v in self.refusals.items() if path.startswith(k)), _api_refusal)
        status, answer = refusal(self.message(limit))
        body = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        path = scope.get("path", "")
        limit = self.limit_for(path)
        if length is not None and (not length.isdigit() or int(length) > limit):
            await self._refuse(send, limit, path)
            return
        received = 0
        started = False

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(self.message(limit))
            return message

        async def watched_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyTooLarge:  # raised before FastAPI read the body (it converts those into a 400 itself)
            if not started:
                await self._refuse(send, limit, path)
