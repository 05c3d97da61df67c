"""Moved to :mod:`elastic.core.logs` (the worker logs with it too, and must not import the service layer)."""

from elastic.core.logs import ENV_FORMAT, JsonFormatter, configure

__all__ = ["ENV_FORMAT", "JsonFormatter", "configure"]
