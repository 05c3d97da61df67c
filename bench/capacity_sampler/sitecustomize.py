"""A stack sampler for ``bench_capacity --profile``: on this directory's path (``PYTHONPATH``), Python
imports it at start-up in the server and in the forkserver, and it starts a sampler in every process
forked from them (the ranks) too.

While ``$ELASTIC_EP_SAMPLE_DIR/on`` exists, a daemon thread records every ``SAMPLE_S`` seconds the
Python stack of every other thread (``file:function`` frames, outermost first) and writes the counts
to ``$ELASTIC_EP_SAMPLE_DIR/<pid>.json`` about once a second (atomically). Wall-clock samples: a
thread waiting in a collective shows its caller. Nothing happens without the variable.
"""

from __future__ import annotations

import os
from typing import Any

SAMPLE_S = 0.005


def _loop(out_dir: str) -> None:
    import collections
    import sys
    import threading
    import time

    on, me, pid = os.path.join(out_dir, "on"), threading.get_ident(), os.getpid()
    counts: collections.Counter = collections.Counter()
    last_dump, dirty = time.monotonic(), False
    while True:
        if not os.path.exists(on):
            if dirty:
                _dump(out_dir, pid, counts)
                dirty = False
            time.sleep(0.1)
            continue
        time.sleep(SAMPLE_S)
        dirty = True
        names = {t.ident: t.name for t in threading.enumerate()}
        for tid, top in sys._current_frames().items():
            if tid == me:
                continue
            stack: list[str] = []
            frame: Any = top
            while frame is not None and len(stack) < 80:
                stack.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
                frame = frame.f_back
            counts[(names.get(tid, "?"), tuple(reversed(stack)))] += 1
        if time.monotonic() - last_dump > 1.0:
            last_dump = time.monotonic()
            _dump(out_dir, pid, counts)


def _dump(out_dir: str, pid: int, counts: dict) -> None:
    import json

    tmp = os.path.join(out_dir, f".{pid}.json")
    with open(tmp, "w") as f:
        json.dump([[name, list(stack), n] for (name, stack), n in counts.items()], f)
    os.replace(tmp, os.path.join(out_dir, f"{pid}.json"))


def _start() -> None:
    import threading

    out_dir = os.environ.get("ELASTIC_EP_SAMPLE_DIR")
    if out_dir:
        threading.Thread(target=_loop, args=(out_dir,), name="bench-sampler", daemon=True).start()


_start()
os.register_at_fork(after_in_child=_start)
