"""Liveness while a decode step waits on its peers.

The coordinator calls a worker lost when it has heard nothing for ``timeouts.heartbeat``. The
decode loop reports once per step, so a step blocked in a collective is silent for as long as
the collective waits: up to ``timeouts.collective`` when a peer died or stalled, and then the
time to raise and report the failure. On a loaded machine that outlasted the one-second
margin between the two timeouts that most fault scenarios use, and the coordinator declared
*every* survivor lost together with the dead rank, so recovery found no one to recover with.

:class:`StepWatch` closes that gap without hiding a stuck worker: while a step runs, a thread
reports for it, but only until the step has run ``bound_s`` (the collective timeout plus a
margin: by then any collective of the step has returned or failed). A step stuck past that
falls silent, and so does a frozen process (all its threads stop). What the heartbeat says is
built by the worker (``beat``); the watch only decides when. Its heartbeats say only "alive"
(``Heartbeat.waiting``): the coordinator refreshes the worker's last report from them and
nothing else, so they never hide a busy phase's state or read as a step without tokens.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("elastic.worker.liveness")

#: how long past the collective timeout a step is still reported for; the coordinator waits this
#: much longer before it calls a broken group one with no worker lost (a stuck culprit goes
#: silent only then)
WATCH_MARGIN_S = 1.0


class StepWatch:
    """Reports ``beat(waited_s)`` every ``interval_s`` while a step is inside :meth:`step` for
    longer than ``interval_s`` and at most ``bound_s``. ``clock`` is injectable for tests."""

    def __init__(self, beat: Callable[[float], None], interval_s: float, bound_s: float,
                 clock: Callable[[], float] = time.monotonic):
        if interval_s <= 0 or bound_s <= 0:
            raise ValueError(f"interval_s and bound_s must be > 0, got {interval_s} and {bound_s}")
        self._beat, self.interval_s, self.bound_s, self._clock = beat, interval_s, bound_s, clock
        self._since: float | None = None  # when the current step began; None between steps
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StepWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="step-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The body is one step: reported for while it waits, up to ``bound_s``."""
        self._since = self._clock()
        try:
            yield
        finally:
            self._since = None

    def due(self) -> float | None:
        """How long the current step has waited, when a beat is due for it now; else None."""
        since = self._since
        if since is None:
            return None
        waited = self._clock() - since
        return waited if self.interval_s <= waited <= self.bound_s else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            waited = self.due()
            if waited is None:
                continue
            try:
                self._beat(waited)
            except Exception:  # noqa: BLE001 - one failed report must not end the watch for good
                log.exception("the step watch could not report")
