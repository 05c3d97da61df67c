"""An in-process fake transport for the coordinator: threads and queues instead of processes and gloo.

:class:`FakeLauncher` implements the :class:`elastic.launch.launchers.Launcher` protocol. Each worker
it launches is a thread (:class:`FakeWorker`) that answers the coordinator's commands the way
:mod:`elastic.worker.process` does, quickly and with pure-Python state:

- a placement (``physical_to_logical``) and the contents of its local slots
  (``contents[layer][slot] = expert id``: the "weights");
- ``eplb_thread_running`` (the async EPLB thread) and ``transfer_in_flight`` (a fake rebalance).

Expert moves use the real planner (:func:`eplb.plan.plan_layer`, :func:`eplb.plan.holders_from_mapping`)
over a shared in-memory "fabric": a receiver copies the slot content of the sender's snapshot, a
lost rank's contents are gone, a reload yields the canonical expert id. New placements come from
the real policy (:func:`eplb.algorithm.compute_placement`) on a fixed pseudo-random load, so every
rank computes the same one.

What the real system promises and the fake checks, recording a *violation* (never raising in
the coordinator's face): no ``Suppress`` or ``Rescale`` reaches a rank with a transfer in flight,
no ``Rescale`` reaches a rank whose EPLB thread runs, and the surviving ranks of a rescale agree
on the placement they start from. ``kill(rank)`` is the fault: the worker dies (``is_alive()``
False, no more answers) and the group of its generation breaks; its peers report the broken
group as the real workers do and wait for a recovery ``Rescale`` or ``Shutdown``.
"""

from __future__ import annotations

import hashlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.core import protocol as p
from eplb.algorithm import compute_placement
from eplb.placement import Placement
from eplb.plan import holders_from_mapping, plan_layer

Contents = list[list[int]]  # [layer][local slot] -> expert id


def digest(placement: Placement) -> str:
    """Same digest as :func:`elastic.worker.reports.placement_digest`."""
    return hashlib.blake2b(placement.physical_to_logical.numpy().tobytes(), digest_size=8).hexdigest()


def fixed_load(seed: int, num_layers: int, num_experts: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(num_layers, num_experts, generator=generator) * 100 + 1


class WorkerDied(BaseException):
    """Raised inside a fake worker's thread once it was killed: it stops without a word."""


class GroupBroken(RuntimeError):
    pass


@dataclass
class Flight:
    """A fake rebalance of one group (generation): every member publishes a snapshot, then one commit."""

    generation: int
    seq: int
    target: Placement
    complete_at: float
    snapshots: dict[int, Contents] = field(default_factory=dict)  # rank -> contents before
    members: dict[int, FakeWorker] = field(default_factory=dict)


@dataclass
class Round:
    """One Rescale command (by seq): who arrived with what, who has computed its new contents."""

    cmd: p.Rescale
    expected: frozenset[int]  # group ranks of the executing group taking part
    arrived: dict[int, dict[str, Any]] = field(default_factory=dict)
    computed: set[int] = field(default_factory=set)
    barrier: bool | None = None  # decided once for every rank: passed (True) or broken (False)


class FakeHandle:
    def __init__(self, worker: FakeWorker):
        self._worker = worker
        self.rank = worker.spec.rank
        self.inbox: queue.Queue = worker.inbox
        self.host = "fake"

    @property
    def pid(self) -> int:
        return self._worker.pid

    def is_alive(self) -> bool:
        return self._worker.thread.is_alive() and not self._worker.killed.is_set()

    def join(self, timeout: float) -> bool:
        self._worker.thread.join(timeout)
        return not self.is_alive()

    def kill(self) -> None:
        self._worker.launcher._kill_worker(self._worker)
        self._worker.thread.join(5)


class FakeLauncher:
    """The Launcher protocol in-process. ``violations`` lists every broken invariant the workers saw."""

    def __init__(self, capacity: int = 4, *, tick_s: float = 0.003, transfer_s: float = 0.15,
                 linger_s: float = 0.3):
        self.capacity = capacity
        self.tick_s = tick_s
        self.transfer_s = transfer_s  # a rebalance commits this long after it started (or at the next Drain)
        self.linger_s = linger_s  # a leaving worker's thread stays alive this long (process teardown)
        self.lock = threading.RLock()
        self.violations: list[str] = []
        self.workers: list[FakeWorker] = []
        self.dead: set[tuple[int, int]] = set()  # (generation, rank) of killed workers
        self.flights: dict[int, Flight] = {}  # generation -> the group's rebalance in flight
        self.decisions: dict[tuple[int, int], bool] = {}
        self.rounds: dict[int, Round] = {}
        self.rescales = 0
        self._reports: queue.Queue = queue.Queue()
        self._pids = itertools.count(100_001)

    # -- the Launcher protocol ---------------------------------------------------------------
    def reports(self) -> queue.Queue:
        return self._reports

    def launch(self, spec: Any) -> FakeHandle:
        worker = FakeWorker(self, spec, next(self._pids))
        with self.lock:
            self.workers.append(worker)
        worker.thread.start()
        return worker.handle

    def shutdown(self) -> None:
        for worker in list(self.workers):
            worker.stop.set()
        for worker in list(self.workers):
            worker.thread.join(5)

    # -- faults and inspection -----------------------------------------------------------------
    def live(self) -> list[FakeWorker]:
        with self.lock:
            return [w for w in self.workers if w.thread.is_alive() and not w.killed.is_set() and not w.leaving]

    def kill(self, rank: int | None = None, *, worker: FakeWorker | None = None) -> FakeWorker | None:
        """Kill a live worker (by rank: the newest generation's); returns it, or None if none matched."""
        if worker is None:
            candidates = [w for w in self.live() if rank is None or w.rank == rank]
            if not candidates:
                return None
            worker = max(candidates, key=lambda w: (w.generation, w.pid))
        self._kill_worker(worker)
        worker.thread.join(5)
        return worker

    def _kill_worker(self, worker: FakeWorker) -> None:
        with self.lock:
            if worker.killed.is_set():
                return
            worker.killed.set()
            self.dead.add((worker.generation, worker.rank))

    def violation(self, text: str) -> None:
        with self.lock:
            self.violations.append(text)

    def group_broken(self, generation: int) -> bool:
        with self.lock:
            return any(g == generation for g, _ in self.dead)

    def members(self, generation: int) -> list[FakeWorker]:
        with self.lock:
            return [w for w in self.workers if w.generation == generation and not w.killed.is_set()
                    and w.thread.is_alive() and not w.leaving and not w.fresh_pending]

    # -- rebalances: one group-wide atomic commit ---------------------------------------------
    def try_commit(self, flight: Flight) -> bool:
        """Commit ``flight`` on every member if every member published its snapshot; True when done."""
        with self.lock:
            if self.flights.get(flight.generation) is not flight:
                return True  # committed (or aborted) already
            size = next(iter(flight.members.values())).size
            if set(flight.snapshots) != set(range(size)):
                return False
            target = flight.target
            per_rank = target.num_physical // size
            new_contents: dict[int, Contents] = {r: [] for r in flight.members}
            for layer in range(target.num_layers):
                old_row = flight.members[0].placement.physical_to_logical[layer]
                plan = plan_layer(old_row, target.physical_to_logical[layer], per_rank, per_rank)
                snaps = {g: flight.snapshots[g][layer] for g in flight.snapshots}
                for r in flight.members:
                    new_contents[r].append(apply_part(plan.for_rank(r), snaps.get(r), snaps))
            for r, worker in flight.members.items():
                worker.placement = target
                worker.contents = new_contents[r]
                worker.transfer_in_flight = None
            del self.flights[flight.generation]
            return True

    def abort(self, generation: int) -> None:
        """The group broke: the rebalance is dropped uncommitted (the old placement still holds)."""
        with self.lock:
            flight = self.flights.pop(generation, None)
            if flight is not None:
                for worker in flight.members.values():
                    worker.transfer_in_flight = None


def apply_part(rank_plan: Any, own_old: list[int] | None, snapshots: dict[int, list[int]]) -> list[int]:
    """A rank's new slot contents of one layer, executing its part of the plan on the fabric."""
    new: list[int | None] = [None] * rank_plan.num_new_slots
    for j in rank_plan.keeps:
        new[j] = own_old[j]
    for i, j in rank_plan.local_copies:
        new[j] = own_old[i]
    for t in rank_plan.recvs:
        value = snapshots[t.src][t.src_slot]  # the sender's weights, as they were
        for j in t.dst_slots:
            new[j] = value
    for reload in rank_plan.reloads:
        for j in reload.slots:
            new[j] = reload.expert  # canonical checkpoint
    if any(v is None for v in new):
        raise RuntimeError(f"plan left slots {[j for j, v in enumerate(new) if v is None]} unwritten")
    return new  # type: ignore[return-value]


class FakeWorker:
    def __init__(self, launcher: FakeLauncher, spec: Any, pid: int):
        self.launcher = launcher
        self.spec = spec
        self.pid = pid
        self.rank = spec.rank
        self.size = spec.size
        self.generation = spec.generation
        self.inbox: queue.Queue = queue.Queue()
        self.killed = threading.Event()
        self.stop = threading.Event()
        self.leaving = False
        self.fresh_pending = spec.joining
        self.step = 0
        self.executed_seq = 0
        self.broken = False
        self.draining = False
        self.mode = "decoding"
        self.eplb_thread_running = False
        self.transfer_in_flight: Flight | None = None
        self.placement: Placement | None = None
        self.contents: Contents = []
        self.last_heartbeat = 0.0
        self.handle = FakeHandle(self)
        self.thread = threading.Thread(target=self._main, name=f"fake-worker-g{spec.generation}-r{spec.rank}", daemon=True)

    # -- reporting -----------------------------------------------------------------------------
    def report(self, cls: type, **fields: Any) -> None:
        if self.killed.is_set():
            raise WorkerDied()
        self.launcher._reports.put(cls(rank=self.rank, generation=self.generation, pid=self.pid, at=time.time(), **fields))

    def done(self, command: p.Command, detail: dict[str, Any]) -> None:
        self.report(p.PhaseDone, seq=command.seq, operation_id=command.operation_id, step=self.step,
                    result=p.RESULT_OF[type(command)](**detail))

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_heartbeat >= self.spec.heartbeat_s:
            self.last_heartbeat = now
            self.report(p.Heartbeat, step=self.step, state="broken" if self.broken else self.mode,
                        in_flight_layer=0 if self.transfer_in_flight is not None else None)

    def wait(self, ready: Any, timeout: float, what: str, broken: Any = lambda: False) -> None:
        """Wait (heartbeating) until ``ready()``; GroupBroken when ``broken()`` or on timeout."""
        deadline = time.monotonic() + timeout

        def check() -> bool:
            with self.launcher.lock:  # the round's sets change under other workers' hands
                return bool(ready())

        while not check():
            if self.killed.is_set():
                raise WorkerDied()
            if broken():
                raise GroupBroken(f"{what}: a peer was lost")
            if time.monotonic() > deadline:
                raise GroupBroken(f"{what}: timed out after {timeout}s")
            self.heartbeat()
            time.sleep(self.launcher.tick_s)

    # -- the thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self.spec.joining:
                command = self._standby()
                if command is None:
                    return
                self.executed_seq = command.seq
                # like the real worker: a fresh rank whose joining rescale fails exits (fatal report)
                self._rescale(command, fresh=True)
            else:
                self._start()
            while not self.stop.is_set() and not self.leaving:
                self._tick()
            if self.leaving:
                time.sleep(self.launcher.linger_s)  # like a process exiting
        except WorkerDied:
            return
        except Exception as exc:  # noqa: BLE001 - like worker_main: the coordinator hears of every death
            try:
                self.report(p.WorkerError, step=self.step, where="worker", error_type=type(exc).__name__,
                            message=str(exc))
            except WorkerDied:
                pass

    def _standby(self) -> p.Rescale | None:
        """Like the real worker: wait (heartbeating) for the Rescale; None after a Shutdown."""
        self.mode = "standby"
        self.report(p.PhaseDone, seq=self.spec.standby_seq, step=self.step, result=p.StandbyReady())
        deadline = time.monotonic() + self.spec.standby_timeout_s
        while time.monotonic() < deadline:
            if self.killed.is_set():
                raise WorkerDied()
            self.heartbeat()
            try:
                command = self.inbox.get(timeout=self.launcher.tick_s)
            except queue.Empty:
                continue
            if isinstance(command, p.Rescale):
                return command
            if isinstance(command, p.Prepare):  # a prepared scale: the joining rank receives, then waits on
                self.done(command, {"layers": 0})
                continue
            if isinstance(command, p.Shutdown):
                self.done(command, {})
                return None
        raise TimeoutError("no Rescale arrived while standing by")

    def _start(self) -> None:
        spec = self.spec
        self.placement = Placement.static(spec.shape.num_layers, spec.shape.num_experts, spec.num_physical)
        per_rank = spec.num_physical // spec.size
        self.contents = [row[self.rank * per_rank:(self.rank + 1) * per_rank]
                         for row in self.placement.physical_to_logical.tolist()]
        self.eplb_thread_running = True
        self.report(p.PhaseDone, seq=0, step=self.step, result=p.Started(num_physical=spec.num_physical))

    def _tick(self) -> None:
        if self.killed.is_set():
            raise WorkerDied()
        if not self.broken and self.launcher.group_broken(self.generation):
            self._enter_broken(GroupBroken(f"step-boundary all-reduce failed at step {self.step}: a peer was lost"))
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            if command.seq <= self.executed_seq:
                continue
            self.executed_seq = command.seq
            self._execute(command)
            if self.leaving or self.stop.is_set():
                return
        flight = self.transfer_in_flight
        if flight is not None and time.monotonic() >= flight.complete_at:
            self.launcher.try_commit(flight)
        if not self.broken and self.mode != "rescaling":
            self.step += 1
        self.heartbeat()
        time.sleep(self.launcher.tick_s)

    def _enter_broken(self, exc: BaseException) -> None:
        self.broken = True
        self.report(p.WorkerError, step=self.step, where="decode", error_type=type(exc).__name__,
                    message=str(exc), seq=self.executed_seq)
        self.launcher.abort(self.generation)  # the EPLB thread's transfer fails with the group
        with self.launcher.lock:
            self.transfer_in_flight = None
            self.eplb_thread_running = False

    def _execute(self, command: p.Command) -> None:
        if self.broken and not isinstance(command, (p.Rescale, p.Shutdown)):
            self.report(p.WorkerError, step=self.step, where="broken", error_type="Refused",
                        message=f"{type(command).__name__} refused: the group is broken, only a rescale or shutdown can follow")
            return
        try:
            self._run(command)
        except GroupBroken as exc:
            self._enter_broken(exc)
        except RuntimeError as exc:  # a failed phase leaves the group unusable, as in the real worker
            self._enter_broken(exc)

    def _run(self, command: p.Command) -> None:
        launcher = self.launcher
        if isinstance(command, p.Drain):
            self.draining = True  # no new rebalance from now on
            self.mode = "draining"
            flight = self.transfer_in_flight
            if flight is not None:
                self.wait(lambda: launcher.try_commit(flight), self.spec.collective_timeout_s, "drain",
                          lambda: launcher.group_broken(self.generation))
            self.done(command, {"layers_committed": 0, "steps_while_draining": 0})
        elif isinstance(command, p.Prepare):  # like the real worker: the drained EPLB stops, then the pre-transfer
            with launcher.lock:
                if self.transfer_in_flight is not None:
                    launcher.violation(f"Prepare on rank {self.rank} (generation {self.generation}) with a transfer in flight")
                    raise RuntimeError("prepare before the drain finished: a transfer is still in flight")
                self.eplb_thread_running = False
            self.done(command, {"layers": 0})
        elif isinstance(command, p.Suppress):
            with launcher.lock:
                if self.transfer_in_flight is not None:
                    launcher.violation(f"Suppress on rank {self.rank} (generation {self.generation}) with a transfer in flight")
                    raise RuntimeError("suppress before the drain finished: a transfer is still in flight")
                self.eplb_thread_running = False
            self.mode = "suppressed"
            self.done(command, {"join_seconds": 0.0, "threads": []})
        elif isinstance(command, p.Rescale):
            self._rescale(command, fresh=False)
        elif isinstance(command, p.Resume):
            self.eplb_thread_running = True
            self.draining = False
            self.mode = "decoding"
            self.done(command, {"seconds": 0.0, "threads": []})
        elif isinstance(command, p.RebalanceNow):
            self._rebalance_now(command)
        elif isinstance(command, p.Verify):
            self.done(command, self._verify())
        elif isinstance(command, p.StopEPLB):  # a failure on a healthy group: decoding goes on, EPLB off
            launcher.abort(self.generation)  # every rank drops the rebalance at the same agreed step
            with launcher.lock:
                self.eplb_thread_running = False
            self.mode = "halted"
            self.done(command, {})
        elif isinstance(command, p.Shutdown):
            self.done(command, {})
            self.leaving = True
        else:
            raise TypeError(f"unknown command {command!r}")

    # -- rebalance -----------------------------------------------------------------------------
    def _rebalance_now(self, command: p.RebalanceNow) -> None:
        launcher = self.launcher
        started = False
        if not self.draining and self.eplb_thread_running:
            previous = self.transfer_in_flight
            if previous is not None:  # the real EPLB starts none while one is in flight; ours finishes it first
                self.wait(lambda: launcher.try_commit(previous), self.spec.collective_timeout_s, "rebalance",
                          lambda: launcher.group_broken(self.generation))
            with launcher.lock:
                flight = launcher.flights.get(self.generation)
                if flight is None or flight.seq != command.seq:
                    if flight is not None:  # cannot happen: every member commits before it starts the next
                        launcher.violation(f"rank {self.rank}: rebalance {command.seq} while {flight.seq} is in flight")
                        flight = None
                    if flight is None:
                        shape = self.spec.shape
                        target = compute_placement(fixed_load(command.seq, shape.num_layers, shape.num_experts),
                                                   self.placement.num_physical, self.size, previous=self.placement)
                        flight = Flight(self.generation, command.seq, target, time.monotonic() + launcher.transfer_s)
                        launcher.flights[self.generation] = flight
                flight.snapshots[self.rank] = [list(row) for row in self.contents]
                flight.members[self.rank] = self
                self.transfer_in_flight = flight
                started = True
        self.done(command, {"started": started})

    # -- verify --------------------------------------------------------------------------------
    def _verify(self) -> dict[str, Any]:
        with self.launcher.lock:
            placement = self.placement
            per_rank = placement.num_physical // self.size
            rows = placement.physical_to_logical.tolist()
            mismatched = tuple((layer, self.rank * per_rank + j) for layer, row in enumerate(rows)
                               for j in range(per_rank) if self.contents[layer][j] != row[self.rank * per_rank + j])
            return {"mismatched": mismatched, "digest": digest(placement),
                    "replica_min": int(placement.replica_count.min()), "num_physical": placement.num_physical,
                    "size": self.size}

    # -- rescale -------------------------------------------------------------------------------
    def _rescale(self, cmd: p.Rescale, *, fresh: bool) -> None:
        launcher = self.launcher
        started = time.perf_counter()
        self.mode = "rescaling"
        with launcher.lock:
            launcher.rescales += 1
            if not fresh and (self.eplb_thread_running or self.transfer_in_flight is not None):
                launcher.violation(
                    f"Rescale {cmd.seq} reached rank {self.rank} (generation {self.generation}) with "
                    f"eplb_thread_running={self.eplb_thread_running} transfer_in_flight={self.transfer_in_flight is not None}")
        new_rank = self.rank if fresh else cmd.spec.mapping[self.rank]
        if cmd.spec.execute_on == "new" and new_rank < 0:  # not in the new group: nothing to send
            self._retire(cmd, started)
            return
        lost = frozenset(cmd.spec.lost)
        old_holder, new_holder = holders_from_mapping(list(cmd.spec.mapping), cmd.spec.new_size, cmd.spec.execute_on, lost)
        me = self.rank if cmd.spec.execute_on == "old" else new_rank  # my rank in the executing group
        with launcher.lock:
            rnd = launcher.rounds.get(cmd.seq)
            if rnd is None:
                rnd = launcher.rounds[cmd.seq] = Round(cmd, frozenset(g for g in old_holder if g >= 0) | frozenset(new_holder))
            rnd.arrived[me] = {"old_rank": None if fresh else self.rank, "generation": self.generation,
                               "contents": None if fresh else [list(r) for r in self.contents],
                               "p2l": None if fresh else self.placement.physical_to_logical.clone()}
        old_gen = None if fresh else self.generation

        def peer_lost() -> bool:  # a participant died: the collective fails
            with launcher.lock:
                gens = {old_gen} if old_gen is not None else {
                    a["generation"] for a in rnd.arrived.values() if a["old_rank"] is not None}
                olds = [r for r in range(len(cmd.spec.mapping))
                        if r not in lost and (cmd.spec.execute_on == "old" or cmd.spec.mapping[r] >= 0)]
                return launcher.group_broken(cmd.spec.generation) or any((g, r) in launcher.dead for g in gens for r in olds)

        timeout = self.spec.collective_timeout_s
        self.wait(lambda: rnd.expected <= rnd.arrived.keys(), timeout, "rendezvous", peer_lost)
        p2l, target, mine, received = self._compute_round(cmd, rnd, me, (old_holder, new_holder))
        self._barrier(rnd, timeout, peer_lost)
        placement_before = p2l.tolist()
        if cmd.spec.execute_on == "old" and new_rank < 0:
            self._retire(cmd, started, received)
            return
        with launcher.lock:
            self.rank, self.size, self.generation = new_rank, cmd.spec.new_size, cmd.spec.generation
            self.placement, self.contents = target, mine
            self.broken, self.draining, self.fresh_pending = False, True, False
            self.eplb_thread_running = False
        self.mode = "resuming"
        self.report(p.PhaseDone, seq=cmd.seq, operation_id=cmd.operation_id, step=self.step, result=p.RescaleDone(
            retired=False, bytes_received=received * 1024, seconds=time.perf_counter() - started,
            digest=digest(target), num_physical=target.num_physical, placement_before=placement_before,
            placement_after=target.physical_to_logical.tolist()))

    def _barrier(self, rnd: Round, timeout: float, peer_lost: Any) -> None:
        """All or nothing: nobody adopts before every rank's transfers are done. Like a real barrier:
        once every rank is in it, the outcome is the same for all of them."""
        launcher = self.launcher

        def barrier_passed() -> bool:
            with launcher.lock:
                if rnd.barrier is None and rnd.expected <= rnd.computed:
                    rnd.barrier = not peer_lost()
                return rnd.barrier is True

        def barrier_broken() -> bool:
            with launcher.lock:
                if rnd.barrier is None and peer_lost():
                    rnd.barrier = False
                return rnd.barrier is False

        self.wait(barrier_passed, timeout, "barrier", barrier_broken)

    def _compute_round(self, cmd: p.Rescale, rnd: Round, me: int,
                       holders: tuple[Any, Any]) -> tuple[torch.Tensor, Placement, Contents, int]:
        """Under the launcher's lock, once every participant arrived: the placement they start from
        (checked to agree), the target, this rank's new contents and how many experts it received."""
        with self.launcher.lock:
            survivors = sorted((g, a) for g, a in rnd.arrived.items() if a["old_rank"] is not None)
            p2l = survivors[0][1]["p2l"]
            if any(not torch.equal(a["p2l"], p2l) for _, a in survivors):
                self.launcher.violation(f"Rescale {cmd.seq}: the surviving ranks disagree on the placement they start from")
            old = Placement.from_physical_to_logical(p2l, self.spec.shape.num_experts)
            per_rank = old.num_physical // len(cmd.spec.mapping)
            shape = self.spec.shape
            target = compute_placement(fixed_load(cmd.spec.generation, shape.num_layers, shape.num_experts),
                                       per_rank * cmd.spec.new_size, cmd.spec.new_size, previous=old)
            snaps = {g: a["contents"] for g, a in rnd.arrived.items() if a["contents"] is not None}
            own = snaps.get(me)
            mine: Contents = []
            received = 0
            for layer in range(old.num_layers):
                plan = plan_layer(old.physical_to_logical[layer], target.physical_to_logical[layer],
                                  per_rank, per_rank, *holders)
                part = plan.for_rank(me)
                received += len(part.recvs)
                if part.new_rank is not None:
                    mine.append(apply_part(part, None if own is None else own[layer], {g: s[layer] for g, s in snaps.items()}))
            rnd.computed.add(me)
        return p2l, target, mine, received

    def _retire(self, cmd: p.Rescale, started: float, received: int = 0) -> None:
        self.leaving = True  # a rank on its way out is no fault target
        self.report(p.PhaseDone, seq=cmd.seq, operation_id=cmd.operation_id, step=self.step, result=p.RescaleDone(
            retired=True, bytes_received=received * 1024, seconds=time.perf_counter() - started))
        self.leaving = True
