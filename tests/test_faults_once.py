"""Which generation a fault applies in (``elastic.faults``): a fault that happens once to one process
(kill, stall, dropped heartbeats) and names no generation fires once, in the generation it first
fires in; ``from_generation`` is a lower bound. In process, with a shared fake store standing for
the coordinator's (the multi-process check is in test_faults.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from elastic import faults as f
from elastic.worker import injector as inj
from elastic.worker.injector import BOUND_KEY, FaultInjector


class FakeStore:
    """``TCPStore.compare_set`` as the workers use it: the first writer of a key wins."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if key not in self.data and expected == "":
            self.data[key] = desired.encode()
        return self.data.get(key, expected.encode())


class Process:
    """One worker process: its rank and generation change as the group is renumbered."""

    def __init__(self, faults: tuple, store: FakeStore, rank: int, generation: int):
        self.rank, self.generation = rank, generation
        self.faults = FaultInjector(faults, lambda: (self.rank, self.generation), store=store)


def test_dropped_heartbeats_without_a_generation_silence_one_process_not_every_later_rank_1():
    store = FakeStore()
    faults = (f.DropHeartbeats(rank=1, from_step=30),)
    silenced, renumbered = Process(faults, store, 1, 0), Process(faults, store, 2, 0)
    assert not silenced.faults.drops_heartbeat(29)
    assert silenced.faults.drops_heartbeat(30) and silenced.faults.drops_heartbeat(31)
    assert store.data == {BOUND_KEY.format(index=0): b"0"}  # bound to the generation it fired in
    assert not renumbered.faults.drops_heartbeat(31)  # rank 2: not its rank
    # rank 1 is lost; the recovery renumbers the survivor: rank 2 of generation 0 is rank 1 of generation 1
    renumbered.rank, renumbered.generation = 1, 1
    assert not renumbered.faults.drops_heartbeat(400)
    fresh = Process(faults, store, 1, 2)  # a fresh worker given rank 1 (replace_lost)
    assert not fresh.faults.drops_heartbeat(900)


def test_a_kill_or_stall_without_a_generation_fires_once_across_renumbered_processes(monkeypatch):
    class Exited(Exception):
        pass

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(inj.os, "_exit", exit_)
    slept: list[float] = []
    monkeypatch.setattr(inj.time, "sleep", slept.append)
    store = FakeStore()
    faults = (f.KillRank(rank=1, at_step=20), f.StallRank(rank=0, at_step=10, seconds=5.0),
              f.KillRank(rank=1, in_phase="rescaling"))
    first, second = Process(faults, store, 1, 0), Process(faults, store, 0, 0)
    first.faults.at_step(19)
    second.faults.at_step(19)
    assert slept == [5.0]  # rank 0's stall fired in generation 0
    first.faults.at_step(20, steady=False)  # inside an operation: a step kill waits for the rank to serve
    with pytest.raises(Exited):
        first.faults.at_step(20)
    # rank 1 died; the survivor is renumbered rank 1 of generation 1: neither fault fires again
    second.rank, second.generation = 1, 1
    second.faults.at_step(50)
    third = Process(faults, store, 0, 1)
    third.faults.at_step(50)
    assert slept == [5.0]
    # the phase kill has not fired yet: the next rescaling command reaching rank 1 fires it, once
    rescale = type("Rescale", (), {})()  # the command's class name is what names the phase
    with pytest.raises(Exited):
        second.faults.at_command(rescale)
    later = Process(faults, store, 1, 3)
    later.faults.at_command(rescale)  # bound to generation 1: not again


def test_a_pinned_generation_and_a_lower_bound():
    store = FakeStore()
    exact = (f.DropHeartbeats(rank=1, from_step=5, generation=1),)
    p = Process(exact, store, 1, 0)
    assert not p.faults.drops_heartbeat(10)
    p.generation = 1
    assert p.faults.drops_heartbeat(10)
    p.generation = 2
    assert not p.faults.drops_heartbeat(10)
    assert store.data == {}  # a pinned fault needs no binding
    lower = (f.DropHeartbeats(rank=1, from_step=5, from_generation=1),)
    q = Process(lower, store, 1, 0)
    assert not q.faults.drops_heartbeat(10)  # before its generation
    q.generation = 2  # the plan predicted 1; a recovery took two: it fires in the first one it reaches
    assert q.faults.drops_heartbeat(10)
    assert store.data == {BOUND_KEY.format(index=0): b"2"}
    # a fault that keeps applying (a slow link) is never bound
    slow = (f.DelayTransfer(rank=0, seconds=0.1),)
    r = Process(slow, store, 0, 0)
    assert r.faults.active(f.DelayTransfer)
    r.generation = 4
    assert r.faults.active(f.DelayTransfer) and len(store.data) == 1


def test_generation_and_from_generation_together_are_refused_with_both_values():
    with pytest.raises(ValidationError, match="expected generation .* or from_generation .*not both: got "
                                              "generation 1 and from_generation 2"):
        f.DropHeartbeats(rank=1, generation=1, from_generation=2)
    assert f.fires_once(f.KillRank(rank=0, at_step=1)) and not f.fires_once(f.KillRank(rank=0, at_step=1, generation=0))
    assert not f.fires_once(f.CorruptBuffer(rank=0))


def test_dropped_heartbeats_from_step_0_let_the_start_through_and_silence_the_rank_once_it_serves():
    """``drop_heartbeats`` at step 0 silenced the start too (the busy heartbeats and the ``Started``
    result), so the coordinator gave up on a start that had worked ("sent no report within
    worker_start ... hung while starting") instead of losing the rank at its heartbeat deadline."""
    from elastic.core import protocol as p
    from elastic.worker.context import RankContext

    sent: list[object] = []

    class Outbox:
        def put(self, report: object) -> None:
            sent.append(report)

    process = Process((f.DropHeartbeats(rank=1, from_step=0),), FakeStore(), 1, 0)
    ctx = RankContext(spec=None, outbox=Outbox(), store=None, comm=None, faults=process.faults, sizes=None,
                      rank=1, size=3, generation=0)
    ctx.report(p.Heartbeat, step=0, state=p.WorkerMode.STARTING)  # busy heartbeat while it joins its group
    ctx.mode = p.WorkerMode.DECODING
    ctx.report(p.PhaseDone, seq=0, step=0, result=p.Started(num_physical=4))  # the start completes
    assert [type(r).__name__ for r in sent] == ["Heartbeat", "PhaseDone"]
    ctx.report(p.Heartbeat, step=0)  # serving at step 0: silenced from here on
    ctx.report(p.WorkerEvent, step=1, kind="rebalance_started", data={})
    assert len(sent) == 2
