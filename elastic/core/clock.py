"""The control plane's one clock, injected: liveness, waits, deadlines and phase timings read it.

A part of the control plane never calls ``time.monotonic()`` or ``time.time()`` itself: it is
given a :class:`Clock` (the real one by default), so a test that drives the clock moves every
deadline together (the machine's phases, a worker's silence, an operation's wait) without a
sleep. Waits on a condition still poll in real time (a short slice), and re-read the clock
after every slice, so a driven clock that jumps past a deadline ends the wait at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FuncClock", "ManualClock", "RealClock", "as_clock"]


@runtime_checkable
class Clock(Protocol):
    """Seconds: ``monotonic()`` for intervals and deadlines, ``wall()`` for times a person reads."""

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """The process's clocks (the default)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


class FuncClock:
    """A clock from a ``() -> seconds`` function (the older ``clock=`` argument): ``wall()`` is
    the real wall time moved by as much as the function runs ahead of the real monotonic clock."""

    def __init__(self, monotonic: Callable[[], float]):
        self._monotonic = monotonic

    def monotonic(self) -> float:
        return float(self._monotonic())

    def wall(self) -> float:
        return time.time() + (self.monotonic() - time.monotonic())

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when told (:meth:`advance`); ``sleep`` advances it instead of sleeping."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1.7e9):
        self._lock = threading.Lock()
        self._now = float(start)
        self._wall_offset = float(wall_start) - float(start)

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def wall(self) -> float:
        with self._lock:
            return self._now + self._wall_offset

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a clock never runs back (advance by {seconds})")
        with self._lock:
            self._now += seconds
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def __call__(self) -> float:  # usable where a ``() -> seconds`` function is asked for
        return self.monotonic()


def as_clock(clock: Clock | Callable[[], float] | None) -> Clock:
    """The :class:`Clock` for ``clock``: itself, a :class:`FuncClock` around a function, or the real one."""
    if clock is None:
        return RealClock()
    if isinstance(clock, Clock):
        return clock
    return FuncClock(clock)
