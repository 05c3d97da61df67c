"""Log lines as text or as one JSON object per line (``serve --log-format json``).

A JSON line carries the time, level, logger and message, and the deployment's context: the
serving ``generation`` and the running ``operation_id`` in the coordinator, the ``rank`` and its
``generation`` in a worker. The context comes from a callable read at each record, so a line
always says where the deployment was when it was written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ENV_FORMAT", "JsonFormatter", "configure"]

#: set by ``serve --log-format json`` so that workers (which inherit the environment) log JSON too
ENV_FORMAT = "ELASTIC_EP_LOG_FORMAT"
CONTEXT_FIELDS = ("generation", "operation_id", "rank")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _Context(logging.Filter):
    def __init__(self, context: Callable[[], dict[str, Any]]):
        super().__init__()
        self.context = context

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            values = self.context()
        except Exception:  # noqa: BLE001 - a log line never fails for its context
            values = {}
        for name, value in values.items():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


def configure(fmt: str | None = None, level: int | str = logging.INFO,
              context: Callable[[], dict[str, Any]] | None = None) -> None:
    """Log to stderr as ``fmt`` (``text`` or ``json``; default: ``$ELASTIC_EP_LOG_FORMAT`` or text),
    with ``context()`` attached to every record."""
    fmt = fmt or os.environ.get(ENV_FORMAT, "text")
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: expected text or json")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json"
                         else logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    if context is not None:
        handler.addFilter(_Context(context))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
