"""The output check: moving experts never changes what the model outputs (Hugging Face models).

After every scale, recovery and rebalance, every rank decodes a fixed probe batch and its
digest must equal the unsharded single-process model's, bitwise. A completion request whose
replayed token differs from the one first decoded counts as a mismatch too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from elastic.control.events import Event, OutputChecked
from elastic.control.registry import OperationFailed, WorkerRegistry
from elastic.core import protocol as p
from elastic.core.errors import ElasticError, InvalidScaleRequest, ScaleConflict
from elastic.core.machine import ScaleMachine
from elastic.core.phases import Phase
from eplb.models.config import HFModelConfig, ReferenceModelConfig

__all__ = ["OutputCheck"]

log = logging.getLogger("elastic.control.outputs")


class OutputCheck:
    """The probe (:meth:`probe`), its thread (:meth:`run`), and the counts ``GET /state`` shows."""

    def __init__(self, model: HFModelConfig | ReferenceModelConfig, registry: WorkerRegistry, machine: ScaleMachine,
                 busy: Callable[[], Any], emit: Callable[[Event], None], probe_timeout_s: float):
        self.model = model
        self.registry = registry
        self.machine = machine
        self.busy = busy  # the operation in progress, or None
        self.emit = emit
        self.probe_timeout_s = probe_timeout_s
        self.enabled = isinstance(model, HFModelConfig)
        self.state: dict[str, Any] = {"enabled": self.enabled, "checks": 0, "mismatches": 0, "identical": None,
                                      "last": None}
        self.wanted = threading.Event()
        self._reference: str | None = None

    def reference_digest(self) -> str:
        """The probe digest of the unsharded single-process model (built once, in this process,
        with one intra-op thread like the workers: the bits depend on the thread count)."""
        if self._reference is None:
            import torch

            from eplb.models.hf import reference_probe

            assert isinstance(self.model, HFModelConfig), "only a real model has a probe"
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                self._reference = reference_probe(self.model).digest
            finally:
                torch.set_num_threads(threads)
        return self._reference

    def probe(self, timeout: float = 60.0) -> dict[str, Any]:
        """Every rank decodes the fixed probe batch; the digests must equal the unsharded model's.

        Returns ``{"identical", "digests" (rank -> digest), "reference", "generation", "step"}``
        and records it (a mismatch counts in ``mismatches``).
        """
        if not self.enabled:
            raise InvalidScaleRequest("model", "the probe compares a real model's output (model kind hf); the "
                                      "reference model is checked slot by slot with verify()")
        reference = self.reference_digest()  # built first: it can take a while, the check below must not age
        with self.registry.lock:
            # the probe is a collective of the group: never while an operation is replacing it. One
            # that starts right after this check sends its Drain after the Probe (the bus keeps the
            # order), so every rank still runs the probe in the old group
            current = self.busy()
            if current is not None:
                raise ScaleConflict(current.id, self.machine.state, self.machine.allowed(), trigger="probe")
        seq, pids = self.registry.broadcast(p.Probe)
        if not pids:  # between groups (a rank just died): nothing to compare, and no verdict
            raise OperationFailed("probe", "no live rank to probe")
        reports = self.registry.await_done(seq, pids, "probe", timeout, fail_machine=False)
        digests = {r.rank: r.result.digest for r in reports.values() if isinstance(r.result, p.ProbeDone)}
        identical = bool(digests) and all(d == reference for d in digests.values())
        result = {"identical": identical, "digests": digests, "reference": reference,
                  "generation": self.machine.generation, "step": max((r.step for r in reports.values()), default=0)}
        with self.registry.lock:
            self.state["checks"] += 1
            self.state["mismatches"] += 0 if identical else 1
            self.state["identical"] = identical
            self.state["last"] = result
        if not identical:
            log.error("output changed: probe digests %s differ from the unsharded model's %s", digests, reference)
        self.emit(OutputChecked(result))
        return result

    def run(self, stop: threading.Event) -> None:
        """Probe once the group serves again after a scale, a recovery or a rebalance (``wanted``)."""
        while not stop.is_set():
            if not self.wanted.wait(0.2):
                continue
            if self.busy() is not None or self.machine.state != Phase.RUNNING:
                continue  # checked once the operation ends (its end sets the flag again)
            self.wanted.clear()
            try:
                self.probe(timeout=self.probe_timeout_s)
            except (ElasticError, OperationFailed) as exc:
                log.warning("output check skipped: %s", exc)
            except Exception:  # noqa: BLE001 - the checker thread must outlive one bad probe
                log.exception("output check failed")

    def request_mismatch(self, request_id: str, position: int, expected: int, got: int) -> None:
        """A replayed request's token differed from the one first decoded."""
        with self.registry.lock:
            self.state["mismatches"] += 1
            self.state["identical"] = False
            self.state["last"] = {"identical": False, "request": request_id, "position": position,
                                  "expected": expected, "got": got}
        log.error("output changed: request %s token %d replayed as %d, was %d", request_id, position, got, expected)
