"""Connection limits of the API server: idle or slow clients cannot hold its file descriptors.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but only once a
response was sent: a connection that sends a partial request (or nothing) and waits was kept
for good. About a thousand such connections used up a 1024-descriptor process, and the next
scale failed to start its workers (``EMFILE``). uvicorn's ``limit_concurrency`` answers 503
beyond its count but still accepts every connection.

:class:`GuardedH11Protocol` is uvicorn's h11 protocol with two guards:

- **a request deadline**: from a connection's start, and again from the end of each response, the
  next request (its headers and its body) must arrive within ``request_timeout_s``, or the
  connection is closed. A request being answered is never cut (a long rebalance keeps its
  connection); the keep-alive wait between requests is uvicorn's ``timeout_keep_alive``;
- **a connection cap**: beyond ``max_connections`` open connections, a new one first closes the
  oldest *idle* connection, one that holds no whole request and has no bytes waiting to be read
  (a socket that connected and stays silent, half-sent headers or body, a keep-alive connection
  between requests), so a crowd of silent or trickling sockets cannot lock real clients out.
  Only when no connection under the cap is idle is the server full (every one is being answered,
  or a burst of new ones has their requests in flight): a new connection whose request arrives
  within ``OVER_CAP_GRACE_S`` is then answered 503 (``Connection: close``, uvicorn's
  ``limit_concurrency`` answer; clients such as ``openai`` retry it after a back-off), except on
  the control and health routes (``served_over_cap``: ``/healthz``, ``/state``, ``/scale``, ...),
  which are answered as usual with ``Connection: close``; one that sends nothing by then is
  closed. At most ``max_connections`` (at least 8) are over the cap at once; beyond them a new
  connection is closed as soon as it is accepted, so a crowd holds about twice the cap of
  descriptors, not its own number;
- **a write deadline**: a connection whose answer stops draining (the client reads none of it, the
  socket's buffers full) for ``write_timeout_s`` is closed. Such a client held its connection for
  good, and, being answered, it was never idle: a few hundred of them filled the cap, and the
  server answered every new client 503. A client that reads, however slowly, resets the deadline.

:class:`HttpLimits` holds the numbers; :meth:`HttpLimits.uvicorn_options` gives the keyword
arguments of ``uvicorn.Config`` that apply them.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import resource
import struct
import termios
from dataclasses import dataclass, field
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "HttpLimits", "default_max_connections"]

log = logging.getLogger("elastic.service.http")

# an over-cap connection's request must arrive within this to be answered 503 (a client sends it
# right after connecting); a silent one is closed then. A reconnecting crowd of silent sockets
# holds about this long times the accept rate of descriptors beyond the cap (the crowd test)
OVER_CAP_GRACE_S = 0.2

# over the cap, how many of the oldest idle connections are looked at for one to close
EVICTION_SCAN = 32

# the routes a full server still answers (by path prefix): liveness and readiness probes, the
# state and metrics an operator reads, and the control calls that relieve the load (a scale up).
# The data routes (/v1/..., /tokenize) get 503 there
SERVED_OVER_CAP = ("/healthz", "/health", "/ping", "/state", "/metrics", "/scale", "/operations", "/recover",
                   "/rebalance", "/placement", "/timeline", "/autoscaler")


def default_max_connections() -> int:
    """A quarter of this process's descriptor limit (the rest is for workers' pipes, the store and
    the group), between 32 and 4096: 256 under the common default of 1024."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 16384
    return max(32, min(4096, soft // 4))


@dataclass(frozen=True)
class HttpLimits:
    request_timeout_s: float = 10.0  # a request's headers and body must arrive within this
    keep_alive_s: int = 5  # an idle connection between requests is closed after this
    max_connections: int = field(default_factory=default_max_connections)
    served_over_cap: tuple[str, ...] = SERVED_OVER_CAP  # path prefixes a full server still answers
    write_timeout_s: float = 60.0  # an answer that does not drain (the client reads none of it) for this is cut

    def __post_init__(self) -> None:
        if (self.request_timeout_s <= 0 or self.keep_alive_s < 1 or self.max_connections < 1
                or self.write_timeout_s <= 0):
            raise ValueError(f"HTTP limits must be positive (keep_alive_s at least 1), got {self}")

    def uvicorn_options(self) -> dict[str, Any]:
        limits = self

        class Protocol(GuardedH11Protocol):
            request_timeout_s = limits.request_timeout_s
            max_connections = limits.max_connections
            served_over_cap = limits.served_over_cap
            write_timeout_s = limits.write_timeout_s
            idle: ClassVar[dict[GuardedH11Protocol, None]] = {}  # this server's own, oldest first

        # the listen backlog is also how many connections asyncio accepts per wake-up of the
        # listening socket, each holding a descriptor until its connection_made closes it: at
        # uvicorn's 2048 a reconnecting crowd kept a process at its descriptor limit (EMFILE on
        # accept for 19 s of 30 at `ulimit -n 256`, the control API unanswered), the cap above
        # notwithstanding. A quarter of the cap (at least 64) bounds those to about the cap
        return {"http": Protocol, "timeout_keep_alive": self.keep_alive_s, "backlog": self.backlog}

    @property
    def backlog(self) -> int:
        return max(64, self.max_connections // 4)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request deadline and a connection cap (module docstring)."""

    request_timeout_s: float = 10.0
    max_connections: int = 256
    served_over_cap: tuple[str, ...] = SERVED_OVER_CAP
    write_timeout_s: float = 60.0
    in_grace = 0  # over-cap connections waiting out OVER_CAP_GRACE_S (a count per server's class)
    # connections that are not being answered, in the order they became idle (a dict per server's
    # class, kept in order: a connection moves to the end when an answer completes)
    idle: ClassVar[dict[GuardedH11Protocol, None]] = {}

    _deadline: asyncio.TimerHandle | None = None
    _write_stall: asyncio.TimerHandle | None = None
    _graced = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cls = type(self)
        if len(self.connections) > self.max_connections:
            victim = self._oldest_idle()
            if victim is not None:
                log.info("over %d open connections: closing an idle one from %s for a new one from %s",
                         self.max_connections, victim.client, self.client)
                victim.transport.abort()  # its connection_lost drops it from the counts
            elif cls.in_grace >= max(8, self.max_connections):
                log.warning("over %d open connections, all answering: closing a new one from %s",
                            self.max_connections, self.client)
                transport.abort()
                return
            else:
                log.warning("over %d open connections, all answering: a new one from %s gets 503",
                            self.max_connections, self.client)
                cls.in_grace += 1
                self._graced = True
                self.app = _OverCap(self.app, self.served_over_cap)
                self._arm(OVER_CAP_GRACE_S)  # or closes it, silent, after the grace
                return
        cls.idle[self] = None
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if (self.cycle is not None and not self.cycle.response_complete
                and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY)):
            type(self).idle.pop(self, None)  # a whole request is here and being answered: not idle

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request (handle_events above)
        if self._graced:
            self.transport.close()  # one answer beyond the cap (its 503 says Connection: close)
            return
        if self.cycle is None or self.cycle.response_complete:
            idle = type(self).idle
            idle.pop(self, None)
            idle[self] = None  # the newest idle one
        self._arm()  # the next request on this connection has the same deadline

    def pause_writing(self) -> None:
        super().pause_writing()  # the transport's buffer is full: the client is not reading
        if self._write_stall is None and not self.transport.is_closing():
            self._write_stall = self.loop.call_later(self.write_timeout_s, self._write_overdue)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_stall()

    def _cancel_write_stall(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def _write_overdue(self) -> None:
        self._write_stall = None
        if not self.transport.is_closing():
            log.info("closing a connection from %s: its answer did not drain for %.0fs (the client reads none of it)",
                     self.client, self.write_timeout_s)
            self.transport.abort()  # connection_lost tells the answer its client is gone

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._cancel_write_stall()
        type(self).idle.pop(self, None)
        if self._graced:
            self._graced = False
            type(self).in_grace -= 1
        super().connection_lost(exc)

    def _oldest_idle(self) -> GuardedH11Protocol | None:
        """The oldest idle connection whose next bytes are not already waiting to be read (in a
        burst of new connections, those accepted first have their requests in the socket buffer:
        they are not idle). Only the oldest ``EVICTION_SCAN`` are looked at, so an accept beyond a
        large cap costs a few system calls, not one per connection."""
        looked = 0
        for conn in type(self).idle:
            if conn is self or conn.transport.is_closing():
                continue
            if not _unread_bytes(conn.transport):
                return conn
            looked += 1
            if looked >= EVICTION_SCAN:
                break
        return None

    def _arm(self, timeout_s: float | None = None) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.request_timeout_s if timeout_s is None else timeout_s,
                                                  self._request_overdue)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _request_overdue(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        answering = self.cycle is not None and not self.cycle.response_complete
        incomplete = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
        if incomplete and not (answering and self.conn.their_state is h11.IDLE):
            # headers not all here, or a body still arriving: a slow or idle client, not a slow answer
            log.info("closing a connection from %s: no complete request within %.0fs", self.client,
                     self.request_timeout_s)
            self.transport.abort()


class _OverCap:
    """The app of a connection beyond the cap: the routes in ``served`` as usual, 503 for the rest."""

    def __init__(self, app: Any, served: tuple[str, ...]):
        self.app, self.served = app, served

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if not any(path == p or path.startswith(p + "/") for p in self.served):
            if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
                await _openai_unavailable(send)  # the openai client shows it, and retries after Retry-After
            else:
                await service_unavailable(scope, receive, send)
            return

        async def send_and_close(message: Any) -> None:
            if message["type"] == "http.response.start":  # one answer beyond the cap, then closed: say so
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_and_close)


async def _openai_unavailable(send: Any) -> None:
    """503 in OpenAI's shape with ``Retry-After`` and ``Connection: close``: a serving route beyond
    the cap (it was uvicorn's plain-text "Service Unavailable", which the openai client showed as
    'Error code: 503' and nothing else)."""
    body = json.dumps({"error": {
        "message": "the server is at its connection cap and every connection is being answered; retry",
        "type": "service_unavailable", "param": None, "code": "server_full"}}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes that arrived on ``transport``'s socket and are not read yet (0 where unknown)."""
    sock = transport.get_extra_info("socket")
    try:
        got = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (AttributeError, OSError, ValueError):
        return 0
    return int(struct.unpack("i", got)[0])
