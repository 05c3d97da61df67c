"""``python -m tests.ssh_like CMD...``: run CMD the way ``ssh host CMD`` does, for tests.

CMD does not descend from the caller (it is double-forked into a session of its own), and this
process stands for the ssh client: it lives while CMD runs and exits with it, but killing it
leaves CMD running, as killing an ssh client whose connection is cut leaves the remote command.
"""

from __future__ import annotations

import os
import select
import sys


def main(argv: list[str]) -> int:
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        os.setsid()
        grandchild = os.fork()
        if grandchild:
            os.write(w, str(grandchild).encode())
            os._exit(0)
        os.close(w)
        os.execvp(argv[0], argv)
    os.close(w)
    os.waitpid(child, 0)
    pid = int(os.read(r, 32) or b"0")
    if not pid:
        return 255
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return 0
    select.select([fd], [], [])  # until CMD has exited
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
