"""The launcher a deployment names (``launcher.kind``). Apart from the launchers themselves, so
that the Ray launcher (which builds on the store-channel launcher) and the local and command
launchers do not import each other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic.launch.launchers import CommandLauncher, LocalLauncher, forkserver_preload

if TYPE_CHECKING:
    from elastic.deployment import DeploymentConfig

__all__ = ["make_launcher"]


def make_launcher(config: DeploymentConfig) -> Any:
    """The launcher ``config.launcher`` names, with capacity ``max_ep_size``."""
    options = config.launcher
    if options.kind == "local":
        return LocalLauncher(capacity=config.max_ep_size, preload=forkserver_preload(config.model.kind))
    if options.kind == "command":
        return CommandLauncher(options, capacity=config.max_ep_size)
    if options.kind == "ray":
        try:
            from elastic.launch.ray import RayLauncher
        except ImportError as exc:
            raise RuntimeError(f"launcher kind 'ray' needs Ray: pip install 'elastic-ep[ray]' ({exc})") from exc
        return RayLauncher(options, capacity=config.max_ep_size)
    raise ValueError(f"unknown launcher kind {options.kind!r}")
