"""Reliability defects found by outside probes (issue 28), each on real processes.

- the auto-recovery budget is per incident: it comes back after a recovery succeeds;
- a launch that fails for lack of a resource (the forkserver gone) leaves the group serving;
- a remote worker cut off by a partition leaves once it heals (its kill key outlives its record);
- a lost host gets no replacement rank until it is seen again;
- the HTTP server drops idle and half-sent connections and caps their number;
- ``/healthz`` and ``/state`` answer while every control slot is blocked.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import running, small_config
from tests.helpers import assert_consistent

FAST_LOSS = dict(collective=4, heartbeat=6)


def _wait_running_at(c, size: int, after_generation: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (c.machine.state.value == "running" and c.machine.generation > after_generation and c.size == size
                and (c._current is None or c._current.terminal)):
            return
        time.sleep(0.05)
    raise AssertionError(f"state {c.machine.state.value} size {c.size}; "
                         f"history {[t.sentence() for t in c.machine.history()]}")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_auto_recovery_budget_is_per_incident_and_comes_back_after_a_success():
    """Budget 1: each of two separate rank losses is recovered (the second was refused when the
    budget counted the deployment's whole life)."""
    config = small_config(ep_size=3, model=dict(num_layers=2, num_experts=4), eplb=dict(num_redundant_experts=2),
                          auto_recover=True, max_auto_recoveries=1, timeouts=FAST_LOSS)
    with running(config) as c:
        c.wait_for_step(5)
        generation = c.machine.generation
        c.live_workers()[-1].handle.kill()  # incident 1: 3 -> 2 (the survivors hold every expert)
        _wait_running_at(c, 2, generation, 60)
        assert c.auto_recoveries == 1
        generation = c.machine.generation
        c.live_workers()[-1].handle.kill()  # incident 2: 1 survivor, a fresh rank joins: 2 again
        _wait_running_at(c, 2, generation, 60)
        assert c.auto_recoveries == 2
        c.wait_for_step(c.snapshot()["step"] + 5)
        assert_consistent(c, 2)


def _forkserver_pid() -> int | None:
    import multiprocessing.forkserver as forkserver

    return forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def _exhaust_fds() -> list[int]:
    """Open /dev/null until this process has no descriptor left; returns them (close to give back)."""
    import os

    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return held


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_launch_that_runs_out_of_descriptors_or_breaks_the_forkserver_leaves_the_group_serving():
    """1. A scale whose launch fails with EMFILE is a failed operation; the group lives on, and
    (recovered if the failure failed it) scales afterwards.
    2. A request cut off between the forkserver's connect and its send (what EMFILE inside
    ``Process.start`` does) makes the forkserver exit. The workers used to die with it (a
    parent-death signal); ``recover`` then had nobody to recover with. Now they serve on, and the
    next scale starts a new forkserver."""
    import multiprocessing.forkserver as forkserver
    import os
    import socket

    # draining 90 s: the last scale starts a new forkserver, which loads torch and the models before
    # the joiner can prepare (over 30 s on two cores busy with another test process)
    config = small_config(timeouts=dict(FAST_LOSS, draining=90))
    with running(config) as c:
        c.wait_for_step(5)
        workers = [w.handle for w in c.live_workers()]
        held = _exhaust_fds()
        try:
            op = c.scale(3, timeout=30)
        finally:
            for fd in held:
                os.close(fd)
        assert op.status == "failed" and "Too many open files" in (op.error or ""), (op.status, op.error)
        if c.machine.state.value == "failed":
            recovery = c.recover(timeout=60)
            assert recovery.status == "succeeded", recovery.error
        assert all(w.is_alive() for w in workers), "a worker died of the failed launch"
        before = _forkserver_pid()
        assert before is not None
        with socket.socket(socket.AF_UNIX) as broken:  # connect, then nothing: the forkserver's EOFError
            broken.connect(forkserver._forkserver._forkserver_address)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60  # one restarted by a launch above may still be loading torch
        while _running(before):
            assert time.monotonic() < deadline, "the forkserver survived a broken request: the test cannot tell"
            time.sleep(0.05)
        time.sleep(1.0)  # a parent-death signal or a watch of the ancestry would have ended them by now
        assert all(w.is_alive() for w in workers), "the workers died with the forkserver"
        assert c.machine.state.value == "running", c.machine.failure_reason
        step = c.snapshot()["step"]
        c.wait_for_step(step + 5, timeout=20)
        op = c.scale(3, timeout=120)
        assert op.status == "succeeded", op.error
        assert _forkserver_pid() not in (None, before)
        assert_consistent(c, 3)


# -- hosts in network namespaces (the fixture of tests/test_scaleout.py) -------------------------

from tests.test_scaleout import NETNS, STORE_IP, _ip, two_hosts  # noqa: E402,F401 - the fixture

# the worker as ``ssh host CMD`` runs it: no descendant of the coordinator, left running when the
# coordinator kills its handle (the "ssh client")
ORPHAN_S = 25.0
SSH_LIKE = ["ip", "netns", "exec", "{host}", "{python}", "-m", "tests.ssh_like", "{python}", "-m",
            "elastic.launch.remote_worker", "--store", "{store}", "--worker-id", "{worker_id}",
            "--orphan-timeout", str(ORPHAN_S)]


def _pid_of_worker(worker_id: int, host: str) -> int:
    """The remote worker process of ``worker_id`` in network namespace ``host`` (another test
    process, ``pytest -n``, may run remote workers with the same ids, outside the namespaces)."""
    import os

    inside = f"net:[{os.stat(f'/run/netns/{host}').st_ino}]"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            namespace = os.readlink(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if namespace == inside and b"elastic.launch.remote_worker" in argv and b"tests.ssh_like" not in argv \
                and argv[argv.index(b"--worker-id") + 1] == str(worker_id).encode():
            return int(entry)
    raise AssertionError(f"no process of worker {worker_id} on {host}")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def _host_config(hosts, template, **overrides):
    from elastic.deployment import LauncherConfig

    return small_config(launcher=LauncherConfig(kind="command", template=template, hosts=hosts),
                        store_host=STORE_IP, **overrides)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_worker_cut_off_by_a_partition_leaves_once_it_heals(two_hosts):  # noqa: F811 - the fixture
    """Host 1 is cut off; the coordinator recovers without it and forgets its worker; the
    partition heals before the worker's orphan timeout. The worker must then leave at once (its
    kill key is still there): with the key deleted by ``forget`` it ran on for good."""
    import os
    import signal

    hosts = [{"name": ns, "env": {"GLOO_SOCKET_IFNAME": inside}} for ns, (inside, _) in two_hosts.items()]
    # one rank holds every expert: the recovery needs no fresh rank
    config = _host_config(hosts, SSH_LIKE, model=dict(num_layers=2, num_experts=4), auto_recover=True,
                          timeouts=dict(collective=2, heartbeat=3))
    with running(config) as c:
        c.wait_for_step(5)
        victim = c.live_workers()[1].handle
        assert victim.host == NETNS[1]
        pid = _pid_of_worker(victim.worker_id, victim.host)
        try:
            generation = c.machine.generation
            cut = time.monotonic()
            _ip("link", "set", NETNS[1], "down")  # the host's side of its link: nothing crosses
            _wait_running_at(c, 1, generation, 60)
            deadline = time.monotonic() + 20
            while victim in c.launcher._workers:  # recovered and forgotten (its record dropped)
                assert time.monotonic() < deadline, "the lost worker was never forgotten"
                time.sleep(0.1)
            assert _running(pid), "the worker left during the partition: the test cannot tell"
            _ip("link", "set", NETNS[1], "up")
            healed = time.monotonic()
            assert healed - cut < ORPHAN_S - 8, f"the partition lasted {healed - cut:.0f}s: too close to the orphan timeout"
            while _running(pid) and time.monotonic() < cut + ORPHAN_S:
                time.sleep(0.1)
            assert not _running(pid), f"the worker still runs {time.monotonic() - healed:.1f}s after the heal"
        finally:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


REMOTE = ["ip", "netns", "exec", "{host}", "{python}", "-m", "elastic.launch.remote_worker", "--store", "{store}",
          "--worker-id", "{worker_id}"]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_recovery_places_the_fresh_rank_on_a_live_host_and_the_lost_host_comes_back(two_hosts):  # noqa: F811
    """Two hosts, a rank on each, and one rank alone cannot hold the model. Host 1 is cut off:
    the recovery's fresh rank must go to host 0 (it went back to host 1 by the fixed layout, and
    every attempt waited out the worker start and failed). Once host 1 answers a probe again, a
    scale up places a rank there again."""
    hosts = [{"name": ns, "env": {"GLOO_SOCKET_IFNAME": inside}} for ns, (inside, _) in two_hosts.items()]
    config = _host_config(hosts, REMOTE, auto_recover=True, max_auto_recoveries=1,
                          timeouts=dict(collective=5, heartbeat=6, worker_start=40, draining=60))
    with running(config) as c:
        c.wait_for_step(5)
        assert [w.handle.host for w in c.live_workers()] == list(NETNS)
        generation = c.machine.generation
        _ip("link", "set", NETNS[1], "down")
        try:
            _wait_running_at(c, 2, generation, 60)
            assert [w.handle.host for w in c.live_workers()] == [NETNS[0], NETNS[0]]
            assert c.launcher.lost == {NETNS[1]}
        finally:
            _ip("link", "set", NETNS[1], "up")
        deadline = time.monotonic() + 30
        while not c.launcher._probe(next(h for h in c.launcher.options.hosts if h.name == NETNS[1])):
            assert time.monotonic() < deadline, "host 1 never answered a probe after the heal"
            time.sleep(0.5)
        c.launcher._probed.clear()  # the next layout probes host 1 at once (else within PROBE_EVERY_S)
        op = c.scale(3, timeout=90)
        assert op.status == "succeeded", op.error
        assert c.launcher.lost == set()
        assert sorted(w.handle.host for w in c.live_workers()) == [NETNS[0], NETNS[0], NETNS[1]]
        assert_consistent(c, 3)


# -- the HTTP server ------------------------------------------------------------------------------

def _closed_by_server(sock, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (EOF or a reset)."""

    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(60)
def test_idle_and_half_sent_connections_are_closed_and_their_number_capped():
    """Clients that send half a request, or nothing, or stay idle after an answer, are closed
    after the request deadline or the keep-alive; beyond the cap a new connection closes the
    oldest idle one, so the count stays at the cap and a client that sends its request is served.
    Without the guard all of them stayed open, and ~1000 of them used up a 1024-fd process."""
    import socket

    import httpx
    from fastapi import FastAPI

    from elastic.service.server import BackgroundServer, HttpLimits

    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"ok": True}

    limits = HttpLimits(request_timeout_s=1.0, keep_alive_s=1, max_connections=20)
    with BackgroundServer(app, limits=limits) as server:
        address = ("127.0.0.1", server.port)
        # twenty up to the cap, silent
        opened = [socket.create_connection(address) for _ in range(20)]
        deadline = time.monotonic() + 5
        while len(server.server.server_state.connections) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            # one beyond the cap that sends its request is served, and the oldest silent one closed
            late = socket.create_connection(address)
            late.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert late.recv(4096).startswith(b"HTTP/1.1 200"), "a client was locked out by silent sockets"
            assert _closed_by_server(opened[0], 1.0), "the oldest idle connection was kept over the cap"
            late.close()
            while len(server.server.server_state.connections) > 19 and time.monotonic() < deadline + 5:
                time.sleep(0.01)
            # ten more: the first fills the cap, the nine beyond it close the nine oldest silent ones
            opened += [socket.create_connection(address) for _ in range(10)]
            time.sleep(0.3)
            assert [_closed_by_server(s, 0.1) for s in opened[1:11]] == [True] * 9 + [False]
            open_now = len(server.server.server_state.connections)
            assert open_now <= 20, f"{open_now} connections held, the cap is 20"
            for sock in opened[11:21]:
                sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            # the half-sent and the silent ones alike are closed by the request deadline
            started = time.monotonic()
            assert all(_closed_by_server(s, 3.0) for s in opened[11:]), "a half-sent or silent connection stayed open"
            assert time.monotonic() - started < 2.5
            # an idle keep-alive connection after a full answer goes after keep_alive_s
            keep = socket.create_connection(address)
            keep.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200 OK" in keep.recv(4096)
            assert _closed_by_server(keep, 3.0)
            keep.close()
            assert httpx.get(f"{server.url}/ping", timeout=5).json() == {"ok": True}
        finally:
            for sock in opened:
                sock.close()


def _guarded_app():
    """A small app behind the connection guard: control routes (``/healthz``, ``/state``), a data
    route (``/v1/models``) and ``POST /v1/completions``, which reads its whole body."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()
    app.add_route("/healthz", lambda request: JSONResponse({"live": True}))
    app.add_route("/state", lambda request: JSONResponse({"state": "running"}))
    app.add_route("/v1/models", lambda request: JSONResponse({"data": []}))

    async def completions(request):  # a plain Starlette endpoint
        return JSONResponse({"bytes": len(await request.body())})

    app.add_route("/v1/completions", completions, methods=["POST"])
    return app


@contextlib.contextmanager
def full_server(cap: int = 8) -> Iterator[tuple[Any, tuple[str, int], list[Any], threading.Event]]:
    """A guarded app (:func:`_guarded_app`) served with ``cap`` connections, every one of them held by a
    slow request being answered: yields the server, its address, the held sockets and the event that
    lets the slow requests end (set, and the sockets closed, on the way out)."""
    import socket

    from elastic.service.server import BackgroundServer, HttpLimits

    app = _guarded_app()
    release = threading.Event()

    @app.get("/slow")
    def slow() -> dict:
        release.wait(20)
        return {"ok": True}

    with BackgroundServer(app, limits=HttpLimits(request_timeout_s=5.0, keep_alive_s=5, max_connections=cap)) as server:
        address = ("127.0.0.1", server.port)
        busy = [socket.create_connection(address) for _ in range(cap)]
        try:
            for sock in busy:
                sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            deadline = time.monotonic() + 5
            while len(server.server.server_state.connections) < cap and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # their requests are being answered
            yield server, address, busy, release
        finally:
            release.set()
            for sock in busy:
                sock.close()


@pytest.mark.timeout(60)
def test_a_full_server_answers_its_control_routes_and_503_on_the_others():
    """Every connection under the cap is being answered (slow requests): a new one asking a data
    route gets 503 with ``Connection: close``, one asking ``/healthz`` or ``/state`` is answered as
    usual and then closed, and a silent one is closed after the short grace."""
    import socket

    import httpx

    with full_server() as (server, address, busy, release):
        data = socket.create_connection(address)
        data.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = data.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"connection: close" in answer.lower(), answer
        assert _closed_by_server(data, 1.0)
        for path in ("/healthz", "/state"):
            probe = httpx.get(f"{server.url}{path}", timeout=5)
            assert probe.status_code == 200, (path, probe.status_code, probe.text)
            assert probe.headers["connection"] == "close"  # one answer beyond the cap, and it says so
        silent = socket.create_connection(address)
        assert _closed_by_server(silent, 1.0), "a silent connection over the cap was kept"
        release.set()
        for sock in busy:  # the slow ones were not cut for the others
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 200


@pytest.mark.timeout(60)
def test_a_client_that_reads_none_of_its_answer_is_cut_and_one_that_reads_gets_it_whole():
    """A client that sends its request and then reads nothing holds an answer that cannot drain: it is
    cut after the write deadline (it held its connection for good, and, being answered, it was never
    idle: a few hundred such clients filled the cap). A client that reads gets the whole answer."""
    import socket

    from fastapi.responses import Response

    from elastic.service.server import BackgroundServer, HttpLimits

    app = _guarded_app()
    body = b"x" * (32 << 20)  # far past both sockets' buffers

    @app.get("/big")
    def big() -> Response:
        return Response(body, media_type="application/octet-stream")

    limits = HttpLimits(request_timeout_s=5.0, keep_alive_s=5, max_connections=8, write_timeout_s=1.0)
    with BackgroundServer(app, limits=limits) as server:
        address = ("127.0.0.1", server.port)
        stalled = socket.create_connection(address)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        connections = server.server.server_state.connections
        deadline = time.monotonic() + 5
        while not connections and time.monotonic() < deadline:  # accepted
            time.sleep(0.01)
        assert connections, "the connection was not accepted"
        deadline = time.monotonic() + 15
        while connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not connections, "a client that reads nothing still holds its connection"
        stalled.close()
        with socket.create_connection(address) as reader:
            reader.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reader.settimeout(10)
            answer = bytearray()
            while chunk := reader.recv(1 << 20):
                answer += chunk
        head, _, rest = bytes(answer).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and len(rest) == len(body)


@pytest.mark.timeout(60)
def test_a_burst_beyond_the_cap_is_answered_and_a_trickling_body_does_not_hold_a_slot():
    """Twice the cap of clients connect and send at once: every one gets an answer (200 on a
    control route; 200 or 503 on a data route), none is closed unanswered (the later ones closed
    the earlier ones while their requests sat unread: 86 of 150 closed). Then connections that
    trickle a request body are idle like half-sent headers: a new client is served, not 503."""
    import socket

    from elastic.service.server import BackgroundServer, HttpLimits

    app = _guarded_app()
    limits = HttpLimits(request_timeout_s=10.0, keep_alive_s=5, max_connections=16)
    with BackgroundServer(app, limits=limits) as server:
        address = ("127.0.0.1", server.port)
        for path, allowed in (("/state", {b"200"}), ("/v1/models", {b"200", b"503"})):
            burst = []
            for _ in range(32):
                sock = socket.create_connection(address)
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                burst.append(sock)
            codes = []
            for sock in burst:
                sock.settimeout(5)
                try:
                    codes.append(sock.recv(4096)[9:12] or b"closed")
                except ConnectionResetError:
                    codes.append(b"reset")
                sock.close()
            assert set(codes) <= allowed, (path, codes)
            assert codes.count(b"200") >= 16, (path, codes)
        trickling = [socket.create_connection(address) for _ in range(16)]
        try:
            for sock in trickling:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nx")
            time.sleep(0.3)
            user = socket.create_connection(address)
            user.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            user.settimeout(5)
            assert user.recv(4096).startswith(b"HTTP/1.1 200"), "a trickling body held its slot"
            user.close()
            assert _closed_by_server(trickling[0], 1.0), "the oldest trickling connection was kept"
        finally:
            for sock in trickling:
                sock.close()


@pytest.mark.timeout(60)
def test_a_reconnecting_crowd_of_silent_sockets_at_the_cap_does_not_lock_out_the_control_api():
    """As many silent sockets as the cap, each reconnecting as soon as the server closes it: every
    /state probe is still answered 200 (2 of 50 were, the rest got 503, while under-cap silent
    connections kept their whole request deadline)."""
    import socket
    import threading

    import httpx

    from elastic.service.server import BackgroundServer, HttpLimits

    app = _guarded_app()
    limits = HttpLimits(request_timeout_s=10.0, keep_alive_s=5, max_connections=16)
    with BackgroundServer(app, limits=limits) as server:
        address = ("127.0.0.1", server.port)
        stop = threading.Event()

        def crowd() -> None:
            held: list[socket.socket] = []
            while not stop.is_set():
                while len(held) < 16:
                    s = socket.socket()
                    s.setblocking(False)
                    s.connect_ex(address)
                    held.append(s)
                for s in list(held):
                    try:
                        if s.recv(1) == b"":
                            raise ConnectionResetError
                    except BlockingIOError:
                        continue
                    except OSError:
                        held.remove(s)
                        s.close()
                time.sleep(0.005)
            for s in held:
                s.close()

        thread = threading.Thread(target=crowd)
        thread.start()
        try:
            time.sleep(0.5)
            codes = []
            for _ in range(30):
                with httpx.Client(timeout=5) as client:  # a new connection each time
                    codes.append(client.get(f"{server.url}/state").status_code)
            assert codes == [200] * 30, codes
        finally:
            stop.set()
            thread.join(10)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_healthz_and_state_answer_while_every_control_thread_waits_on_a_stalled_rank():
    """One rank stalled, 50 concurrent rebalances that wait for it: /healthz and /state still
    answer at once (they took ~20 s when the control calls filled the server's shared pool), and
    the rebalances beyond the control pool get 429 at once."""
    import os
    import signal
    import threading

    import httpx

    from elastic.service.api import CONTROL_THREADS, create_app
    from elastic.service.server import BackgroundServer

    with running(small_config()) as c, BackgroundServer(create_app(c)) as server:
        c.wait_for_step(3)
        stalled = c.live_workers()[1].handle
        stalled.stall()
        codes: list[int] = []

        def rebalance() -> None:
            try:
                with httpx.Client(timeout=30) as client:
                    codes.append(client.post(f"{server.url}/rebalance", params={"timeout_s": 12}).status_code)
            except Exception as exc:  # noqa: BLE001 - counted below
                codes.append(-1)
                print("caller failed:", repr(exc))

        callers = [threading.Thread(target=rebalance) for _ in range(50)]
        try:
            started = time.monotonic()
            for t in callers:
                t.start()
            deadline = time.monotonic() + 20
            while len(server.server.server_state.tasks) + len(codes) < 48:  # every caller is in
                assert time.monotonic() < deadline, \
                    f"the callers did not all reach the server: {len(server.server.server_state.tasks)} in, {codes}"
                time.sleep(0.05)
            with httpx.Client(timeout=30) as client:
                for path in ("/healthz", "/state", "/healthz"):
                    asked = time.monotonic()
                    assert client.get(f"{server.url}{path}").status_code == 200
                    waited = time.monotonic() - asked
                    assert waited < 2.0, f"{path} took {waited:.1f}s behind the control calls"
            # the refusals are immediate, but on a loaded machine some may still be on their way back: count
            # them for up to 8 s, inside the 12 s the admitted rebalances wait (a fresh install's suite, run
            # beside two other jobs at a load of 12, had counted 39 of the 46)
            while sum(code == 429 for code in codes) < 50 - CONTROL_THREADS and time.monotonic() < started + 8:
                time.sleep(0.05)
            refused = sum(code == 429 for code in codes)
            assert refused >= 50 - CONTROL_THREADS, f"only {refused} of 50 refused at once: {sorted(codes)}"
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
            for t in callers:
                t.join(30)


# -- NIXL: one connection per peer, whatever the number of generations ---------------------------

def _sockets() -> int:
    import os

    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return count


def body_nixl_generations(rank: int, world_size: int, generations: int) -> list[int]:
    """One moving layer per group generation on the same NIXL agent; this rank's sockets after each."""
    from eplb.communicator import NixlCommunicator
    from eplb.plan import plan_layer
    from eplb.transfer import execute_layer
    from tests.test_communicators import _test_store
    from tests.test_transfer import expert_weights, garbage, make_case, slot_weights

    comm = NixlCommunicator()
    case = next(c for c in (make_case(layer, 99) for layer in range(40)) if c[0] == "rebalance")
    _kind, old_row, new_row, s_old, s_new, old_holder, new_holder, max_ops = case
    plan = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder)
    rp = plan.for_rank(rank)
    old = slot_weights(0, old_row[rp.old_rank * s_old:(rp.old_rank + 1) * s_old])
    staging = garbage(s_new)
    comm.set_weights([old])
    comm.add_buffer(staging)
    counts = []
    for generation in range(generations):
        comm.bind(generation, _test_store(f"nixl-generations-{generation}"))
        execute_layer(plan, rank, old, staging, timeout=20.0, max_ops_per_batch=max_ops, layer=0,
                      reload_fn=lambda e: expert_weights(0, e), communicator=comm)
        counts.append(_sockets())
    comm.close()
    return counts


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_nixl_ranks_keep_one_connection_per_peer_across_generations():
    """Six generations of the same ranks, a moving layer each: a rank's sockets stay flat after the
    first (NIXL's remove_remote_agent left each generation's UCX socket open: +1 per peer per
    generation, the 38 -> 99 fds of a worker over 20 scale cycles)."""
    from eplb.communicator import nixl_available
    from tests.distributed import run_distributed
    from tests.test_transfer import WORLD

    if not nixl_available():
        pytest.skip("NIXL is not installed (pip install '.[nixl]')")
    results = run_distributed(body_nixl_generations, WORLD, args=(6,), timeout=80)
    for rank, counts in enumerate(results):
        assert counts[-1] <= counts[1], f"rank {rank}'s sockets grew over the generations: {counts}"


def _server_sockets(port: int) -> int:
    """Sockets of this machine whose local port is ``port`` and that a process holds (accepted,
    inode set), listening one excluded: the server's connection descriptors."""
    held = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A" and fields[9] != "0":
                held += 1
    return held


@pytest.mark.timeout(60)
def test_a_reconnecting_crowd_holds_about_the_cap_of_descriptors_not_the_listen_backlog():
    """Beyond the cap a connection is closed as soon as it is accepted, but asyncio accepts a
    whole listen backlog per wake-up (uvicorn's 2048), each holding a descriptor until then: a
    crowd that reconnected at once kept ``elastic-ep serve`` at its descriptor limit (EMFILE on
    accept for 19 s of 30 under ``ulimit -n 256``, /state and /scale unanswered). The backlog is
    now a quarter of the cap (at least 64), and the server's descriptors stay near the cap
    (386 held at once here before)."""
    import socket
    import threading

    from fastapi import FastAPI

    from elastic.service.server import BackgroundServer, HttpLimits

    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"ok": True}

    limits = HttpLimits(request_timeout_s=5.0, keep_alive_s=5, max_connections=20)
    backlog = limits.uvicorn_options()["backlog"]
    assert backlog == 64
    with BackgroundServer(app, limits=limits) as server:
        address = ("127.0.0.1", server.port)
        peak, stop = [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _server_sockets(server.port))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        crowd: list[socket.socket] = []
        try:
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                while len(crowd) < 400:
                    s = socket.socket()
                    s.setblocking(False)
                    s.connect_ex(address)
                    crowd.append(s)
                for s in list(crowd):  # the ones the server closed come back at once
                    try:
                        if s.recv(1) == b"":
                            raise ConnectionResetError
                    except (BlockingIOError, OSError) as exc:
                        if isinstance(exc, BlockingIOError):
                            continue
                        crowd.remove(s)
                        s.close()
                time.sleep(0.005)
        finally:
            stop.set()
            sampler.join()
            for s in crowd:
                s.close()
        # 84-133 measured (the cap, a backlog or two in flight); 386 with uvicorn's backlog of 2048
        assert peak[0] <= limits.max_connections + 3 * backlog, f"the server held {peak[0]} connections (cap 20)"
