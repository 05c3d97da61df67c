"""``python -m elastic.remote_worker``: the entry point a launcher's command template names (kept
at this path so existing templates keep working); the code lives in :mod:`elastic.launch.remote_worker`."""

import sys

from elastic.launch.remote_worker import main

if __name__ == "__main__":
    sys.exit(main())
