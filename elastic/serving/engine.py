"""Moved: the request engine is :mod:`elastic.control.requests` (the coordinator's side of serving).
This name stays for older imports."""

from elastic.control.requests import Completion, RequestEngine, ServingGate

__all__ = ["Completion", "RequestEngine", "ServingGate"]
