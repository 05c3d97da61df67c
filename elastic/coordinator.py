"""The public import path of the coordinator (``from elastic.coordinator import Coordinator``),
as the README's Python API gives it; the code lives in :mod:`elastic.control.coordinator`."""

from elastic.control.coordinator import Coordinator, Operation, OperationFailed, OperationStatus

__all__ = ["Coordinator", "Operation", "OperationFailed", "OperationStatus"]
