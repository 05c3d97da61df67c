"""The step watch (elastic.worker.liveness): a step waiting on its peers keeps reporting, but
only up to its bound, so a stuck step still falls silent. Time is driven by the test."""

from __future__ import annotations

import threading
import time

import pytest

from elastic.worker.liveness import StepWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_beat_is_due_only_inside_a_step_between_one_interval_and_the_bound():
    clock = Clock()
    watch = StepWatch(lambda waited: None, interval_s=0.1, bound_s=3.5, clock=clock)
    assert watch.due() is None  # between steps: the step's own heartbeat speaks
    with watch.step():
        assert watch.due() is None  # a step that just began is not waiting yet
        clock.now += 0.05
        assert watch.due() is None  # the decode loop's own heartbeat is not late yet
        clock.now += 0.1
        assert watch.due() == pytest.approx(0.15)
        clock.now += 3.25
        assert watch.due() == pytest.approx(3.4)
        clock.now += 0.2
        assert watch.due() is None  # stuck past the bound: silence, the coordinator will see it
    assert watch.due() is None


def test_the_thread_reports_a_waiting_step_and_stops_at_the_bound():
    beats: list[float] = []
    watch = StepWatch(beats.append, interval_s=0.02, bound_s=0.2).start()
    try:
        with watch.step():
            time.sleep(0.5)
        assert beats, "a step waiting 0.5 s was never reported"
        assert max(beats) <= 0.2, beats  # nothing past the bound
        assert all(b2 > b1 for b1, b2 in zip(beats, beats[1:])), beats
        count = len(beats)
        time.sleep(0.1)
        assert len(beats) == count  # between steps the watch is quiet
    finally:
        watch.stop()
    assert not any(t.name == "step-watch" and t.is_alive() for t in threading.enumerate())


def test_a_report_that_fails_does_not_end_the_watch():
    calls: list[float] = []

    def beat(waited: float) -> None:
        calls.append(waited)
        if len(calls) == 1:
            raise RuntimeError("the outbox is closed")

    watch = StepWatch(beat, interval_s=0.02, bound_s=1.0).start()
    try:
        with watch.step():
            time.sleep(0.2)
    finally:
        watch.stop()
    assert len(calls) >= 3, calls  # it went on reporting after the first one failed


def test_a_watch_needs_a_positive_interval_and_bound():
    with pytest.raises(ValueError, match="interval_s and bound_s"):
        StepWatch(lambda waited: None, interval_s=0, bound_s=1)
