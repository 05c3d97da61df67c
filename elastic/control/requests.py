"""The coordinator's side of serving: a queue, admission into the group's batch, and each request's tokens.

The coordinator is the source of truth for every request; the ranks only decode. A request:

1. is **queued** by :meth:`RequestEngine.submit` (or refused at once: 429 when the batch and the
   queue are full, 503 when the deployment is failed and nothing recovers it);
2. is **admitted** to ONE rank, the least loaded by tokens in flight
   (:func:`~elastic.core.owners.least_loaded` over
   :meth:`~elastic.core.protocol.RequestSpec.in_flight`): an :class:`~elastic.core.protocol.Admit`
   naming that owner reaches every rank at one agreed step, and only the owner holds the request.
   Admission stops while an operation replaces the group (``rescaling``) and while the deployment
   is failed; requests already in a batch keep decoding through ``draining``, ``suppressed`` and
   ``resuming``, and pause only in ``rescaling``;
3. receives its tokens from its rank's :class:`~elastic.core.protocol.TokensOut` reports, each at its
   position: a token at a position already known must be the same token (a replay), a gap waits;
4. **finishes** with the rank's finish reason (``length``, ``stop``), a stop string (then a
   :class:`~elastic.core.protocol.Cancel` frees its slot), a client that went away (cancelled), or
   an error that says to retry.

After every rescale, rank 0 of the new group lists what every rank holds
(:class:`~elastic.core.protocol.RequestsHeld`): the engine learns each request's rank, and a
request no rank holds is admitted again from its prompt. A scale moves no request from its
prompt (a scale down's leaving ranks hand theirs, KV caches included, to survivors); a rank
failure loses that rank's requests only: they are **replayed** on the survivors, and since
decoding is deterministic their tokens come back bit for bit (checked: a different token is
counted as an output mismatch and fails the request), so a streaming client only sees the new
ones. The survivors' own requests go on without a replay.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from elastic.core import protocol as p
from elastic.core.clock import Clock, as_clock
from elastic.core.config import ServingConfig
from elastic.core.errors import InvalidCompletionRequest, Overloaded, RequestNotServed, ServiceUnavailable
from elastic.core.owners import least_loaded

__all__ = ["Completion", "RequestEngine", "ServingGate", "StopSearch"]

log = logging.getLogger("elastic.control.requests")



@dataclass
class StopSearch:
    """Where a request's stop strings end its text, as vLLM's: the first of ``stops`` to appear, and
    none that ends within the text of its first ``min_tokens`` tokens (whose length is decoded once).
    The engine's stop check and the answer's text (``TextView``) each hold one."""

    stops: tuple[str, ...]
    min_tokens: int = 0
    _start: int | None = None  # the text length of the first min_tokens tokens, once known
    _seen: int = -1  # the token count at may_end's last answer

    def may_end(self, tokens: list[int], decode: Callable[[list[int]], str]) -> bool:
        """Whether a stop string can have appeared since the last call, judged on the text of the
        last few tokens only; ``find`` on the whole text then says where. A request's tokens come one
        at a time, and a stop string that appears with the last token lies in the text's last
        characters: decoding the whole output for every token cost ``O(n)`` a token, 16 s of the
        coordinator's CPU for one 8,192-token request with a stop string (0.34 s this way). The tail is at least the
        longest stop string and 8 characters longer than the last token's text (so a tail decoded
        alone, whose first characters may differ from the whole text's: a space or a character's
        bytes cut, holds every stop string that ends in the last token or just before it); True
        after a gap (tokens that came in a batch), on the first call that may count, and when the
        tail is the whole output."""
        if not self.stops or len(tokens) <= self.min_tokens:
            return False
        first = self._seen < 0 or len(tokens) != self._seen + 1
        self._seen = len(tokens)
        if first:
            return True
        need = max(len(stop) for stop in self.stops) + 8 + len(decode(tokens[-1:]))
        width = 2 * need
        while width < len(tokens):
            tail = decode(tokens[-width:])
            if len(tail) >= need:
                return any(stop in tail for stop in self.stops)
            width *= 2
        return True

    def find(self, text: str, tokens: list[int], decode: Callable[[list[int]], str]) -> tuple[int, str] | None:
        """Where in ``text`` (``tokens``' text, as ``decode`` gives it) the first stop string starts,
        and which one; None when none counts yet."""
        if not self.stops or len(tokens) <= self.min_tokens:
            return None
        if self._start is None:
            self._start = len(decode(tokens[: self.min_tokens])) if self.min_tokens else 0
        start = self._start
        hits = [(at, stop) for stop in self.stops if (at := text.find(stop, max(0, start - len(stop) + 1))) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None


@dataclass
class Completion:
    """One request as the coordinator follows it (times are the engine's clock)."""

    spec: p.RequestSpec
    created: float
    stop: tuple[str, ...] = ()
    status: str = "queued"  # queued | running | finished | failed | cancelled
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str | None = None
    error: RequestNotServed | None = None
    replays: int = 0
    stalled_since: float | None = None  # the deployment failed with this request in the batch
    text_end: int | None = None  # a stop string matched: the text is cut here
    rank: int | None = None  # the rank of the group that holds it (None: not admitted yet)
    _ahead: dict[int, p.TokenOut] = field(default_factory=dict)  # tokens past a gap, until it fills
    # the text stop strings are searched in (the routes': with the prompt's last tokens as context,
    # as the answer's text is); None: the engine's detokenize
    text: Callable[[list[int]], str] | None = None

    @functools.cached_property
    def stop_search(self) -> StopSearch:
        return StopSearch(self.stop, self.spec.min_tokens)

    @property
    def id(self) -> str:
        return self.spec.request_id

    @property
    def done(self) -> bool:
        return self.status in ("finished", "failed", "cancelled")


class ServingGate(Protocol):
    """What the engine needs from the coordinator (a protocol, so the engine's logic is testable alone)."""

    def send_serving(self, command: type[p.Command], **fields: Any) -> bool:
        """Send an Admit or Cancel to the group if the group can take it now; False if not."""

    def group_size(self) -> int:
        """The ranks of the group an Admit sent now reaches (its owners are ``0 .. size - 1``)."""

    def serving_health(self) -> str:
        """``"ok"`` (decoding), ``"paused"`` (an operation replaces the group, or a recovery runs),
        ``"failed"`` (failed, and a recovery may still come) or ``"down"`` (failed, none will come)."""


class RequestEngine:
    """Queue, admission and token bookkeeping of completion requests (see the module docstring)."""

    def __init__(self, gate: ServingGate, config: ServingConfig, *, clock: Clock | Callable[[], float] | None = None,
                 on_mismatch: Callable[[Completion, int, int, int], None] | None = None,
                 detokenize: Callable[[list[int]], str] | None = None):
        self.gate = gate
        self.config = config
        self.clock = as_clock(clock)
        self.on_mismatch = on_mismatch
        self.detokenize = detokenize
        self._lock = threading.Lock()
        self._queue: deque[Completion] = deque()
        self._running: dict[str, Completion] = {}  # in the group's batch (or being admitted again)
        self._readmit: deque[Completion] = deque()  # running, but the group lost them: replay first
        self._cancels: list[str] = []
        self._recent: deque[Completion] = deque(maxlen=1000)  # finished ones, for GET by id and tests
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchers: list[Callable[[], None]] = []
        self.counts = {"ok": 0, "failed": 0, "cancelled": 0, "rejected": 0, "replayed": 0, "mismatched": 0}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> RequestEngine:
        self._thread = threading.Thread(target=self._loop, name="serving-admission", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            left = [*self._queue, *self._running.values()]
            for c in left:
                self._fail(c, ServiceUnavailable("the server is shutting down", retry_after_s=self.config.retry_after_s))

    def watch(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (from the engine's threads, maybe under its lock: it must not block or call
        back in) whenever a request got tokens or changed status: waiters need not poll."""
        self._watchers.append(fn)

    def _changed(self) -> None:
        for fn in self._watchers:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a watcher's failure must not break the engine
                log.exception("a serving watcher failed")

    # -- requests --------------------------------------------------------------------------------
    def new_id(self) -> str:
        return f"cmpl-{uuid.uuid4().hex[:20]}"

    def submit(self, spec: p.RequestSpec, *, stop: tuple[str, ...] = ()) -> Completion:
        """Queue a request; raises :class:`Overloaded` (no room) or :class:`ServiceUnavailable`."""
        return self.submit_all([spec], stop=stop)[0]

    def submit_all(self, specs: list[p.RequestSpec], *, stop: tuple[str, ...] = (),
                   texts: list[Callable[[list[int]], str]] | None = None) -> list[Completion]:
        """Queue every request (the choices of one HTTP request), or none: the room for all of them is
        checked at once, so a refusal queues nothing (before, the choices queued ahead of it were
        counted as cancelled, as if their client had left). ``texts``: each one's text for its stop
        strings (:attr:`Completion.text`). Raises as :meth:`submit`."""
        for spec in specs:
            if spec.max_tokens > self.config.max_tokens_limit:
                raise InvalidCompletionRequest("max_tokens", f"at most {self.config.max_tokens_limit} "
                                               "(serving.max_tokens_limit)", value=spec.max_tokens)
        health = self.gate.serving_health()
        with self._lock:
            if health == "down":
                self.counts["rejected"] += 1
                raise ServiceUnavailable("the deployment has failed and no recovery is under way: POST /recover",
                                         retry_after_s=self.config.retry_after_s)
            running = sum(not c.done for c in self._running.values())
            last = len(self._queue) + len(specs) - 1  # the queue as the last of them would find it
            if specs and last >= self.config.max_queue and running + last >= self.config.max_batch:
                self.counts["rejected"] += 1
                more = f" (this request's {len(specs)} choices at once)" if len(specs) > 1 else ""
                raise Overloaded(f"{running} requests decoding and {len(self._queue)} queued{more} "
                                 f"(serving.max_batch {self.config.max_batch}, max_queue {self.config.max_queue})",
                                 retry_after_s=self.config.retry_after_s)
            completions = [Completion(spec, self.clock.monotonic(), stop=stop, text=texts[i] if texts else None)
                           for i, spec in enumerate(specs)]
            self._queue.extend(completions)
        self._wake.set()
        return completions

    def cancel(self, request_id: str) -> None:
        """The client went away: the request leaves the queue, or the batch at the next step."""
        with self._lock:
            for c in list(self._queue):
                if c.id == request_id:
                    self._queue.remove(c)
                    self._finish(c, "cancelled")
                    return
            c2 = self._running.get(request_id)
            if c2 is not None and not c2.done:
                self._finish(c2, "cancelled")
                self._cancels.append(request_id)
        self._wake.set()

    def get(self, request_id: str) -> Completion | None:
        with self._lock:
            for c in itertools.chain(self._running.values(), self._queue, self._recent):
                if c.id == request_id:
                    return c
        return None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"running": sum(not c.done for c in self._running.values()), "queued": len(self._queue), **self.counts,
                    "max_batch": self.config.max_batch, "max_queue": self.config.max_queue}

    # -- reports from the ranks ------------------------------------------------------------------
    def on_tokens(self, report: p.TokensOut) -> None:
        cancel: list[str] = []
        with self._lock:
            for out in report.tokens:
                c = self._running.get(out.request_id)
                if c is None or c.done:
                    continue
                c._ahead[out.position] = out
                while c._ahead and not c.done:
                    if min(c._ahead) < len(c.tokens):
                        self._replayed_token(c, c._ahead.pop(min(c._ahead)))
                    elif len(c.tokens) in c._ahead:
                        if self._append(c, c._ahead.pop(len(c.tokens))):
                            cancel.append(c.id)
                    else:
                        break  # a gap: the missing token is on its way
            self._cancels.extend(cancel)
        if report.tokens:
            self._changed()
        if cancel:
            self._wake.set()

    def _replayed_token(self, c: Completion, out: p.TokenOut) -> None:
        """A token at a position already known (a replay, or a stale report): it must be the same."""
        if c.tokens[out.position] != out.token:
            self.counts["mismatched"] += 1
            if self.on_mismatch is not None:
                self.on_mismatch(c, out.position, c.tokens[out.position], out.token)
            self._fail(c, ServiceUnavailable(
                f"request {c.id}: token {out.position} came back as {out.token} on a replay, not {c.tokens[out.position]}: "
                "the output changed", retry_after_s=self.config.retry_after_s))
            self._cancels.append(c.id)

    def _append(self, c: Completion, out: p.TokenOut) -> bool:
        """Take the next token; True when a stop string ended the request (its slot must be freed)."""
        c.tokens.append(out.token)
        c.logprobs.append(out.logprob)
        c.top_logprobs.append(out.top_logprobs)
        c.stalled_since = None
        decode = c.text if c.text is not None else self.detokenize
        if c.stop and decode is not None and c.stop_search.may_end(c.tokens, decode):  # (else no decode)
            hit = c.stop_search.find(decode(c.tokens), c.tokens, decode)
            if hit is not None:
                c.text_end = hit[0]
                self._finish(c, "finished", "stop")
                return out.finish_reason is None  # the ranks still hold it
        if out.finish_reason is not None:
            self._finish(c, "finished", out.finish_reason)
        return False

    def on_held(self, report: p.RequestsHeld) -> None:
        """After a rescale: what the new group decodes. Requests it lacks are admitted again."""
        held = {rid: rank for rid, _, rank in report.held}
        with self._lock:
            for c in self._running.values():
                c.rank = held.get(c.id, c.rank)
                if c.id not in held and not c.done and c not in self._readmit:
                    c.replays += 1
                    self.counts["replayed"] += 1
                    c._ahead.clear()
                    self._readmit.append(c)
        self._wake.set()

    # -- the admission loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.01)
            self._wake.clear()
            try:
                self._admit_once()
                self._expire()
            except Exception:  # noqa: BLE001 - the admission thread outlives anything it calls
                log.exception("serving admission failed")

    def _admit_once(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, []
            self._forget_done()
            free = self.config.max_batch - len(self._running)
            fresh = [self._queue[i] for i in range(min(max(0, free), len(self._queue)))]
            replays = list(self._readmit)
        if cancels and not self.gate.send_serving(p.Cancel, request_ids=tuple(cancels)):
            with self._lock:
                self._cancels = cancels + self._cancels  # sent once the group can take it
        if not replays and not fresh:
            return
        # the group's size first, outside the engine's lock: the coordinator takes its own lock for
        # it, and its threads call into the engine while holding that one (lock order: coordinator
        # before engine; the other order deadlocked snapshot() against admission)
        size = self.gate.group_size()
        with self._lock:
            batch = self._owned(replays + fresh, size)
        if not self.gate.send_serving(p.Admit, requests=batch):
            return
        with self._lock:
            for c, spec in zip(replays + fresh, batch):
                c.spec, c.rank = spec, spec.owner
            for c in replays:
                if c in self._readmit:
                    self._readmit.remove(c)
            for c in fresh:
                if c in self._queue:
                    self._queue.remove(c)
                if c.done:  # cancelled (or failed) after the Admit was built: it went out, take it back out
                    self._cancels.append(c.id)
                    continue
                c.status = "running"
                self._running[c.id] = c
        self._changed()

    def _owned(self, admitting: list[Completion], size: int) -> tuple[p.RequestSpec, ...]:
        """The specs of ``admitting``, each owned by the least loaded rank of a group of ``size``
        (by tokens in flight: the requests its rank decodes, and those given before it)."""
        loads = [0] * max(1, size)
        for c in self._running.values():
            if not c.done and c.rank is not None and c.rank < len(loads) and c not in admitting:
                loads[c.rank] += c.spec.in_flight(len(c.tokens))
        owners = least_loaded(loads, [c.spec.in_flight(0) for c in admitting])
        return tuple(dataclasses.replace(c.spec, owner=rank) for c, rank in zip(admitting, owners))

    def _forget_done(self) -> None:
        for rid in [rid for rid, c in self._running.items() if c.done]:
            self._recent.append(self._running.pop(rid))

    def _expire(self) -> None:
        """Requests in a failed deployment wait ``failed_grace_s`` for a recovery, then get 503;
        with none possible ("down"), at once."""
        health = self.gate.serving_health()
        now = self.clock.monotonic()
        with self._lock:
            waiting = [*self._running.values(), *self._queue]
            if health in ("ok", "paused"):
                for c in waiting:
                    c.stalled_since = None
                return
            for c in waiting:
                if c.done:
                    continue
                c.stalled_since = c.stalled_since if c.stalled_since is not None else now
                if health == "down":
                    self._fail(c, ServiceUnavailable(
                        f"request {c.id}: the deployment failed and nothing will recover it (no auto_recover, or "
                        "its attempts are spent): POST /recover, then send it again", retry_after_s=self.config.retry_after_s))
                elif now - c.stalled_since >= self.config.failed_grace_s:
                    self._fail(c, ServiceUnavailable(
                        f"request {c.id}: the deployment failed and was not recovered within "
                        f"{self.config.failed_grace_s:g}s (serving.failed_grace_s); send it again",
                        retry_after_s=self.config.retry_after_s))
                    if c.id in self._running:
                        self._cancels.append(c.id)  # a halted group may still decode it: free its slot
            self._queue = deque(c for c in self._queue if not c.done)

    # -- endings -----------------------------------------------------------------------------
    def _finish(self, c: Completion, status: str, reason: str | None = None) -> None:
        c.status = status
        c.finish_reason = reason
        self.counts["ok" if status == "finished" else status] += 1
        self._changed()

    def _fail(self, c: Completion, error: RequestNotServed) -> None:
        if c.done:
            return
        c.error = error
        self._finish(c, "failed")
