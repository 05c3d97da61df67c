"""The packages read top-down: every import goes down a floor or stays on its own, and no module
imports another in a circle, lazy imports (inside functions) included.

Floors, top first: cli -> replay -> service -> control -> launch -> worker -> core -> eplb.
The public facade modules sit on the floor of what they re-export or hold.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("cli", "replay", "service", "control", "launch", "worker", "core", "eplb")

# The public modules at the top of `elastic`, and the floor each stands on.
FACADES = {
    "elastic": "core",
    "elastic.cli": "cli",
    "elastic.coordinator": "control",
    "elastic.deployment": "core",
    "elastic.faults": "core",
    "elastic.remote_worker": "launch",
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in ("elastic", "eplb"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def floor_of(module: str) -> str:
    if module in FACADES:
        return FACADES[module]
    parts = module.split(".")
    if parts[0] == "eplb":
        return "eplb"
    return parts[1]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> dict[str, int]:
    """The project modules ``module`` imports (at any depth of its code), each with a line."""
    path = MODULES[module]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            # `from package import submodule` imports the submodule; `from module import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


def test_every_module_stands_on_a_known_floor():
    unknown = sorted(m for m in MODULES if floor_of(m) not in FLOORS)
    assert not unknown, f"modules outside the floors {FLOORS}: {unknown}"


def test_no_import_runs_up_a_floor():
    upward = []
    for module in MODULES:
        mine = FLOORS.index(floor_of(module))
        for target, line in imports_of(module).items():
            if FLOORS.index(floor_of(target)) < mine:
                upward.append(f"{MODULES[module].relative_to(ROOT)}:{line} ({floor_of(module)}) imports {target} "
                              f"({floor_of(target)})")
    assert not upward, "imports that run back up a floor:\n" + "\n".join(upward)


def test_no_module_imports_another_in_a_circle():
    graph = {module: set(imports_of(module)) - {module} for module in MODULES}
    # a package's __init__ importing its own submodules is not a circle of the code's design
    for module in graph:
        graph[module] = {t for t in graph[module] if not t.startswith(module + ".")}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"an import circle: {' -> '.join(exc.args[1])}")


def test_the_checker_sees_an_upward_import():
    """The checks above would catch the kind of import they forbid (the worker once imported the service's logs)."""
    tree = ast.parse("from elastic.service import logs\n")
    node = tree.body[0]
    assert isinstance(node, ast.ImportFrom)
    target = _resolve("elastic.worker.process", MODULES["elastic.worker.process"] if "elastic.worker.process" in MODULES
                      else ROOT / "elastic/worker/process.py", node)
    assert FLOORS.index(floor_of(target)) < FLOORS.index(floor_of("elastic.worker.process"))
