"""The seam the outer ring depends on: what the HTTP routes, the metrics, the autoscaler, the hooks
and the test fakes use of the control plane (``Coordinator`` is the one implementation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from elastic.core.clock import Clock
from elastic.core.machine import ScaleMachine

if TYPE_CHECKING:  # types only: the protocol imports no implementation
    from elastic.control.operations import Operation
    from elastic.control.registry import WorkerRecord
    from elastic.control.requests import RequestEngine
    from elastic.deployment import DeploymentConfig

__all__ = ["ControlPlane"]


class ControlPlane(Protocol):
    """Read the deployment, start and follow operations, subscribe to what happens."""

    config: DeploymentConfig
    machine: ScaleMachine
    clock: Clock
    requests: RequestEngine | None
    before_scale: list[Callable[[Operation], None]]

    def snapshot(self) -> dict[str, Any]: ...

    def live_workers(self) -> list[WorkerRecord]: ...

    def scale(self, ep_size: int, *, expected_generation: int | None = None, idempotency_key: str | None = None,
              wait: bool = True, timeout: float | None = None) -> Operation: ...

    def recover(self, *, wait: bool = True, timeout: float | None = None) -> Operation: ...

    def rebalance(self, timeout: float = 30.0) -> bool: ...

    def verify(self, timeout: float = 60.0) -> dict[int, dict[str, Any]]: ...

    def export_placement(self, timeout: float = 30.0) -> dict[str, Any]: ...

    def get_operation(self, operation_id: str) -> dict[str, Any] | None: ...

    def list_operations(self, limit: int | None = None) -> list[dict[str, Any]]: ...

    def timeline_windows(self) -> list[dict[str, Any]]: ...

    def subscribe(self, callback: Callable[[str, dict[str, Any]], None]) -> None: ...
