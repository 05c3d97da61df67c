"""Scale hooks: run something before and after every scale operation.

A hook is a Python callable or a shell command, each with a timeout:

- **before** a scale: runs on the operation's thread after the request was accepted (the API
  has already answered 202) and before the state machine moves. A hook that fails (raises,
  returns ``False``, exits non-zero, or overruns its timeout) **vetoes** the scale: the
  operation ends ``failed`` with a :class:`ScaleVetoed` message naming the hook and why,
  and the machine stays ``running`` (nothing to recover).
- **after** a scale: runs on a background thread once the operation has finished
  (``succeeded`` or ``failed``, not vetoed). A failure is logged and recorded, never raised.

Callables are called with the operation as a JSON-ready dict (``Operation.to_dict()`` plus
``"hook": "before" | "after"``). Commands get the same JSON on stdin and in
``$ELASTIC_EP_OPERATION``, plus ``$ELASTIC_EP_HOOK``, ``$ELASTIC_EP_OPERATION_ID``,
``$ELASTIC_EP_FROM_SIZE``, ``$ELASTIC_EP_TARGET_SIZE`` and ``$ELASTIC_EP_STATUS``. A string
command runs under ``/bin/sh -c``; a list is executed directly. A command that overruns is
killed with its whole process group.

Config (the ``hooks:`` section of a serve config)::

    hooks:
      before_scale:
        - command: "./bin/check-capacity.sh"
          timeout_s: 10
      after_scale:
        - callable: "mypkg.notify:scaled"

Python::

    ScaleHooks(before=[my_check], after=["logger -t ep scaled"]).install(coordinator)
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elastic.control.plane import ControlPlane
from elastic.core.clock import Clock, RealClock
from elastic.core.errors import ElasticError

__all__ = ["HookResult", "HookSpec", "HooksConfig", "ScaleHooks", "ScaleVetoed", "resolve_import_path"]

log = logging.getLogger("elastic.service.hooks")

When = Literal["before", "after"]


def resolve_import_path(path: str, *, what: str = "object") -> Any:
    """``"pkg.module:attr"`` -> the attribute, with a clear ``ValueError`` when it is not there."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"{what} import path must look like 'package.module:Name', got {path!r}")
    module_name, attr = path.split(":")
    if not module_name or not attr or not all(part.isidentifier() for part in module_name.split(".")):
        raise ValueError(f"{what} import path must look like 'package.module:Name', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for {what} {path!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {what} {path!r})") from None
    return obj


class ScaleVetoed(ElasticError):
    """A before-scale hook refused the scale: ``hook`` names it, ``reason`` says why."""

    code = "scale_vetoed"

    def __init__(self, hook: str, reason: str, *, operation_id: str | None = None):
        super().__init__(f"scale vetoed by before-scale hook {hook}: {reason}", hook=hook, reason=reason,
                         operation_id=operation_id)


class HookSpec(BaseModel):
    """One hook: exactly one of ``command`` (shell string or argv list) and ``callable`` (import path)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str | list[str] | None = Field(None, description="shell command (string, run by /bin/sh) or argv list")
    callable: str | None = Field(None, description="'package.module:function', called with the operation dict")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="a hook running longer fails (a before-hook vetoes)")
    name: str | None = Field(None, description="shown in logs and errors (default: the command or path)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for a command")

    @field_validator("command")
    @classmethod
    def _command_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and (not value or (isinstance(value, str) and not value.strip())):
            raise ValueError("command must not be empty")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> HookSpec:
        if (self.command is None) == (self.callable is None):
            raise ValueError("a hook needs exactly one of 'command' or 'callable'")
        if self.callable is not None:
            target = resolve_import_path(self.callable, what="hook")
            if not callable(target):
                raise ValueError(f"hook {self.callable!r} is not callable")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return repr(self.name)
        if self.callable:
            return repr(self.callable)
        shown = self.command if isinstance(self.command, str) else " ".join(self.command or [])
        return repr(shown if len(shown) <= 80 else shown[:77] + "...")


class HooksConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    before_scale: list[HookSpec] = Field(default_factory=list)
    after_scale: list[HookSpec] = Field(default_factory=list)


@dataclass(frozen=True)
class HookResult:
    hook: str
    when: str
    operation_id: str
    ok: bool
    seconds: float
    message: str = ""
    returncode: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Hook:
    """A runnable hook: a callable or a command, with a timeout."""

    def __init__(self, item: Any, default_timeout_s: float):
        self.spec: HookSpec | None  # None: a bare Python callable
        self.fn: Callable[[dict[str, Any]], Any] | None
        self.timeout_s: float
        self.label: str
        if isinstance(item, HookSpec):
            self.spec = item
        elif isinstance(item, dict):
            self.spec = HookSpec.model_validate(item)
        elif isinstance(item, (str, list)):
            self.spec = HookSpec(command=item, timeout_s=default_timeout_s)
        elif callable(item):
            self.spec = None
        else:
            raise ValueError(f"a hook must be a callable, a command (str or list) or a HookSpec, got {item!r}")
        if self.spec is None:
            self.fn = item
            self.timeout_s = default_timeout_s
            self.label = repr(getattr(item, "__qualname__", None) or repr(item))
        else:
            self.fn = resolve_import_path(self.spec.callable, what="hook") if self.spec.callable else None
            self.timeout_s = self.spec.timeout_s
            self.label = self.spec.label

    def run(self, when: str, op: dict[str, Any], clock: Clock) -> HookResult:
        started = clock.monotonic()
        try:
            ok, message, code = self._call(op) if self.fn is not None else self._command(when, op)
        except Exception as exc:  # noqa: BLE001 - a hook's failure is a result, never a crash
            ok, message, code = False, f"{type(exc).__name__}: {exc}", None
        return HookResult(self.label, when, str(op.get("id")), ok, clock.monotonic() - started, message, code)

    def _call(self, op: dict[str, Any]) -> tuple[bool, str, int | None]:
        box: dict[str, Any] = {}
        fn = self.fn
        assert fn is not None  # run() calls _call only for a callable hook

        def target() -> None:
            try:
                box["value"] = fn(dict(op))
            except BaseException as exc:  # noqa: BLE001
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"hook-{op.get('id')}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            return False, f"did not return within its timeout of {self.timeout_s:g}s", None
        if "error" in box:
            exc = box["error"]
            return False, f"raised {type(exc).__name__}: {exc}", None
        if box.get("value") is False:
            return False, "returned False", None
        return True, "", None

    def _command(self, when: str, op: dict[str, Any]) -> tuple[bool, str, int | None]:
        assert self.spec is not None and self.spec.command is not None
        payload = json.dumps(op, default=str)
        env = {**os.environ, **self.spec.env,
               "ELASTIC_EP_HOOK": when, "ELASTIC_EP_OPERATION": payload,
               "ELASTIC_EP_OPERATION_ID": str(op.get("id", "")),
               "ELASTIC_EP_FROM_SIZE": str(op.get("from_size", "")),
               "ELASTIC_EP_TARGET_SIZE": str(op.get("target_size", "")),
               "ELASTIC_EP_STATUS": str(op.get("status", ""))}
        command = self.spec.command
        try:
            proc = subprocess.Popen(command, shell=isinstance(command, str), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)
        except OSError as exc:
            return False, f"could not start: {exc}", None
        try:
            out, err = proc.communicate(payload, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the shell and anything it started
            except ProcessLookupError:
                pass
            proc.communicate()
            return False, f"did not finish within its timeout of {self.timeout_s:g}s (killed)", None
        if proc.returncode != 0:
            tail = (err or out or "").strip()[-500:]
            return False, f"exited with status {proc.returncode}" + (f": {tail}" if tail else ""), proc.returncode
        return True, (out or "").strip()[-500:], 0


class ScaleHooks:
    """Before- and after-scale hooks, installed on a :class:`~elastic.control.coordinator.Coordinator`."""

    def __init__(self, before: Iterable[Any] = (), after: Iterable[Any] = (), *, default_timeout_s: float = 30.0,
                 keep: int = 256, clock: Clock | None = None):
        self.clock = clock or RealClock()  # install() takes the coordinator's unless one was given
        self._own_clock = clock is not None
        self.before = [_Hook(item, default_timeout_s) for item in before]
        self.after = [_Hook(item, default_timeout_s) for item in after]
        self._results: OrderedDict[str, list[HookResult]] = OrderedDict()
        self._keep = keep
        self._vetoed: set[str] = set()
        self._after_done: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: HooksConfig | dict[str, Any]) -> ScaleHooks:
        config = config if isinstance(config, HooksConfig) else HooksConfig.model_validate(config)
        return cls(config.before_scale, config.after_scale)

    def install(self, coordinator: ControlPlane) -> ScaleHooks:
        """Add the before-hooks to the coordinator's hook point and follow its operations for the after-hooks."""
        if not self._own_clock:
            self.clock = coordinator.clock
        if self.before:  # no before-hooks: scales start at once (no before_hooks phase)
            coordinator.before_scale.append(self.run_before)
        coordinator.subscribe(self._on_event)
        return self

    # -- results ---------------------------------------------------------------------------
    def results(self, operation_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r.to_dict() for r in self._results.get(operation_id, [])]

    def _record(self, result: HookResult) -> None:
        with self._lock:
            self._results.setdefault(result.operation_id, []).append(result)
            while len(self._results) > self._keep:
                self._results.popitem(last=False)

    # -- before ----------------------------------------------------------------------------
    def run_before(self, op: Any) -> None:
        """The coordinator's hook point: raise :class:`ScaleVetoed` at the first failing hook."""
        data = {**(op.to_dict() if hasattr(op, "to_dict") else dict(op)), "hook": "before"}
        for hook in self.before:
            result = hook.run("before", data, self.clock)
            self._record(result)
            if not result.ok:
                with self._lock:
                    self._vetoed.add(result.operation_id)
                log.warning("operation %s vetoed by before-scale hook %s: %s", result.operation_id, hook.label,
                            result.message)
                raise ScaleVetoed(hook.label, result.message, operation_id=result.operation_id)
            log.info("before-scale hook %s passed for %s in %.3fs", hook.label, result.operation_id, result.seconds)

    # -- after -----------------------------------------------------------------------------
    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind != "operation" or not self.after or data.get("kind") != "scale":
            return
        if data.get("status") not in ("succeeded", "failed"):
            return
        op_id = str(data.get("id"))
        with self._lock:
            if op_id in self._vetoed or op_id in self._after_done:
                return
            self._after_done.add(op_id)
            self._threads = [t for t in self._threads if t.is_alive()]
            thread = threading.Thread(target=self.run_after, args=(data,), name=f"after-hooks-{op_id}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def run_after(self, data: dict[str, Any]) -> list[HookResult]:
        """Run every after-hook in order; failures are logged and recorded, never raised."""
        data = {**data, "hook": "after"}
        results = []
        for hook in self.after:
            result = hook.run("after", data, self.clock)
            self._record(result)
            results.append(result)
            if not result.ok:
                log.warning("after-scale hook %s failed for %s: %s", hook.label, result.operation_id, result.message)
        return results

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait for running after-hooks (tests, shutdown); True when none is left."""
        deadline = self.clock.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - self.clock.monotonic()))
        return not any(t.is_alive() for t in threads)
