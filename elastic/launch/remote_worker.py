"""A worker started on another host: ``python -m elastic.launch.remote_worker --store HOST:PORT --worker-id N``.

The command line carries only where the coordinator's ``TCPStore`` is and the worker's id; the
rest comes through the store, so a launcher's command template stays short and the same for
every worker:

- ``elastic/workers/<id>/launch``: the pickled launch record (the ``WorkerSpec``, extra
  environment variables such as ``GLOO_SOCKET_IFNAME``, the host's name);
- ``elastic/workers/<id>/inbox``: the worker's commands (a :class:`~elastic.launch.channel.StoreQueue`);
- ``elastic/reports``: every worker's reports, tagged with the worker id;
- ``elastic/workers/<id>/kill``: set by the launcher to retire the worker where no signal
  reaches it (``ssh``); a watcher thread exits the process when it appears, or when the store
  has been unreachable for ``orphan_timeout_s`` (the coordinator is gone).

The same :func:`serve` runs inside a Ray actor (:mod:`elastic.launch.ray`).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import threading
import time
from typing import Any

log = logging.getLogger("elastic.launch.remote_worker")

REPORTS_PREFIX = "elastic/reports"


def worker_prefix(worker_id: int) -> str:
    """Every key of one worker starts with this."""
    return f"elastic/workers/{worker_id}/"


def launch_key(worker_id: int) -> str:
    return f"{worker_prefix(worker_id)}launch"


def inbox_prefix(worker_id: int) -> str:
    return f"elastic/workers/{worker_id}/inbox"


def kill_key(worker_id: int) -> str:
    return f"elastic/workers/{worker_id}/kill"


def launch_record(spec: Any, env: dict[str, str], host: str | None) -> bytes:
    return pickle.dumps({"spec": spec, "env": dict(env), "host": host}, protocol=pickle.HIGHEST_PROTOCOL)


def _watch(store_host: str, store_port: int, worker_id: int, orphan_timeout_s: float, stop: threading.Event) -> None:
    """Exit the process when the launcher asks (kill key) or the coordinator's store is gone.

    Two threads: one asks the store, the other only watches the time of the last answer, so a
    store call that never returns (the network to the coordinator is gone without a reset)
    still ends the process after ``orphan_timeout_s``.
    """
    from elastic.launch.channel import connect

    last_answer = [time.monotonic()]

    def ask() -> None:
        store = None
        while not stop.wait(0.2):
            try:
                if store is None:
                    store = connect(store_host, store_port, timeout_s=10.0)
                if store.check([kill_key(worker_id)]):
                    log.warning("worker %d: retired by its launcher", worker_id)
                    os._exit(3)
                last_answer[0] = time.monotonic()
            except Exception:  # noqa: BLE001 - unreachable: reconnect on the next round
                store = None

    threading.Thread(target=ask, name="remote-worker-ask", daemon=True).start()
    while not stop.wait(0.5):
        if time.monotonic() - last_answer[0] > orphan_timeout_s:
            log.warning("worker %d: coordinator store unreachable for %.0fs, exiting", worker_id, orphan_timeout_s)
            os._exit(4)


def _watch_parent(parent: int, stop: threading.Event) -> None:
    """Exit when this process is re-parented: whatever started it (the coordinator on this host, an
    ssh session, a namespace exec) is gone, so nobody will retire it."""
    while not stop.wait(0.5):
        if os.getppid() != parent:
            log.warning("the process that started this worker (pid %d) is gone: exiting", parent)
            os._exit(4)


def serve(store_host: str, store_port: int, worker_id: int, *, connect_timeout_s: float = 60.0,
          orphan_timeout_s: float = 60.0) -> int:
    """Fetch the launch record, then run :func:`elastic.worker.process.worker_main` on store-carried queues.

    Returns the exit code (0 when the worker left on a ``Shutdown`` or was retired).
    """
    from elastic.launch.channel import StoreQueue, TaggedOutbox, connect  # torch: only once the arguments are good

    # the watches start before anything can block (reaching the store, waiting for the launch
    # record): a worker whose coordinator died while it was starting must not linger
    stop = threading.Event()
    threading.Thread(target=_watch_parent, args=(os.getppid(), stop), name="remote-worker-parent", daemon=True).start()
    threading.Thread(target=_watch, args=(store_host, store_port, worker_id, orphan_timeout_s, stop),
                     name="remote-worker-watch", daemon=True).start()
    control = connect(store_host, store_port, connect_timeout_s)
    key = launch_key(worker_id)
    control.wait([key])
    record = pickle.loads(control.get(key))
    os.environ.update(record["env"])
    if record.get("host"):
        # the name the group generation uses to count hosts (elastic.worker.groups.host_identity)
        os.environ["ELASTIC_EP_HOST"] = str(record["host"])
    from elastic.worker.process import worker_main  # after the environment is set: torch reads some of it

    # commands come from one producer, in order: a missing number is waited for, never skipped
    inbox = StoreQueue(connect(store_host, store_port, connect_timeout_s), inbox_prefix(worker_id), hole_timeout_s=None)
    outbox = TaggedOutbox(StoreQueue(connect(store_host, store_port, connect_timeout_s), REPORTS_PREFIX), worker_id)
    try:
        worker_main(record["spec"], inbox, outbox)
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        stop.set()


def probe(store_host: str, store_port: int, timeout_s: float) -> int:
    """0 when the coordinator's store answers a TCP connect from here within ``timeout_s``, else 1.

    A launcher runs its command template with ``--probe`` to see whether a host it lost is back:
    the same command, the same network path as a worker's, and no torch import (a fraction of a
    second)."""
    import socket

    try:
        with socket.create_connection((store_host, store_port), timeout=timeout_s):
            return 0
    except OSError as exc:
        log.warning("probe: the store at %s:%d is unreachable: %s", store_host, store_port, exc)
        return 1


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"--store must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic.launch.remote_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, type=_split_address, help="the coordinator's TCPStore, HOST:PORT")
    parser.add_argument("--worker-id", required=True, type=int, help="the id the launcher gave this worker")
    parser.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to reach the store")
    parser.add_argument("--orphan-timeout", type=float, default=60.0,
                        help="exit when the store has been unreachable this long")
    parser.add_argument("--probe", action="store_true",
                        help="only check that the store is reachable from here (exit 0) and leave")
    args = parser.parse_args(argv)
    host, port = args.store
    if args.probe:
        return probe(host, port, min(args.connect_timeout, 3.0))
    return serve(host, port, args.worker_id, connect_timeout_s=args.connect_timeout,
                 orphan_timeout_s=args.orphan_timeout)


if __name__ == "__main__":
    sys.exit(main())
