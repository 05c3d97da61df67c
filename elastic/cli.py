"""``elastic-ep``: replay scenarios, validate scenario files, serve the scale API, run the benchmarks.

Exit status: 0 when everything held; 1 when an expectation failed (``replay``); 2 for input the
command cannot run (a file that is unreadable, too large, not UTF-8, not YAML, or invalid: one
line per problem naming the file and the key path; a missing benchmark).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import runpy
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

from elastic.service.preflight import InputError, load_yaml, read_text

if TYPE_CHECKING:
    from elastic.replay.scenario import Scenario

app = typer.Typer(
    name="elastic-ep",
    help="Elastic expert parallelism: replay scenarios on real workers, validate scenario files, serve the "
         "scale API, run benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def _console(stderr: bool = False) -> Console:
    # printed messages are never wrapped: one error, one line (grep-able); tables fit the terminal,
    # or 140 columns when the output goes to a file or a pipe
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 140
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


def _quiet_logging() -> None:
    """The replay shows worker errors and transitions itself; the library's log lines would repeat them."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")


def _load(file: Path) -> Scenario:
    """A scenario file through its pre-flight checks first: a file refused there (unreadable, too
    large, not UTF-8, not YAML, an alias bomb) costs no torch import (2 s and 250 MB of a run)."""
    data = load_yaml(read_text(file), str(file))
    from elastic.replay.scenario import parse_scenario

    return parse_scenario(data, str(file))


def _print_scenario_error(console: Console, exc: InputError) -> None:
    for problem in exc.problems:
        console.print(f"[red]error[/] {escape(problem.line(exc.source))}", highlight=False)


def _unwritable(directory: Path) -> str | None:
    """Why the report cannot be written in ``directory`` (made here if missing), or None."""
    import os

    if directory.exists() and not directory.is_dir():
        return "a file is there, not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make the directory ({exc.strerror or exc})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "cannot write there (permission denied)"
    return None


@app.command()
def replay(
    file: Path = typer.Argument(..., help="the scenario (YAML)", show_default=False),
    report_dir: Path | None = typer.Option(None, "--report-dir", "-o",
                                              help="write report.json and report.png here [default: reports/<name>]"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar (transitions are still printed)"),
    json_only: bool = typer.Option(False, "--json-only", help="print only the JSON report on stdout"),
) -> None:
    """Run a scenario on real worker processes, check its expectations, write a report and a plot.

    Exit 0 when every expectation holds, 1 when one fails (it is named), 2 when the file is invalid.
    """
    err = _console(stderr=True)
    _quiet_logging()
    try:
        scenario = _load(file)
    except InputError as exc:  # a ScenarioError is one too
        _print_scenario_error(err, exc)
        raise typer.Exit(EXIT_INVALID) from None
    from elastic.replay.report import LiveDisplay, render_summary, report_json
    from elastic.replay.runner import replay as run_replay  # after the checks: a refused file imports none of it

    out_dir = report_dir if report_dir is not None else Path("reports") / scenario.name
    problem = _unwritable(out_dir)  # before the run: the report was lost to a traceback once it had run
    if problem is not None:
        what = "--report-dir" if report_dir is not None else "the report directory (reports/<name>; give --report-dir)"
        err.print(f"[red]error[/] {escape(f'{what} {out_dir}: {problem}')}", highlight=False)
        raise typer.Exit(EXIT_INVALID)
    console = _console()
    if json_only:
        result = run_replay(scenario, report_dir=out_dir, source=str(file))
    else:
        console.print(f"[bold]{escape(scenario.name)}[/]: {escape(scenario.description.strip())}"
                      if scenario.description else f"[bold]{escape(scenario.name)}[/]")
        display = LiveDisplay(scenario, console=console, bar=not no_progress)
        with display:
            result = run_replay(scenario, report_dir=out_dir, source=str(file), on_transition=display.transition,
                                on_event=display.event, on_progress=display.progress,
                                on_worker_error=display.worker_error)
    if json_only:
        sys.stdout.write(report_json(result.report) + "\n")
    else:
        render_summary(result.report, console)
        console.print(f"report: {result.report_path}   plot: {result.plot_path}   ({result.duration_s:.1f} s)")
    if result.passed:
        if not json_only:
            console.print("[bold green]PASSED[/]: every expectation held")
        raise typer.Exit(EXIT_OK)
    for e in result.failed:
        what = f"expectation {e['name']}: expected {e['expected']}, measured {e['measured']}"
        err.print("[bold red]FAILED[/] " + escape(what + (f" ({e['detail']})" if e.get("detail") else "")))
    raise typer.Exit(EXIT_FAILED)


@app.command()
def validate(files: list[Path] = typer.Argument(..., help="scenario files (YAML)", show_default=False)) -> None:
    """Check scenario files against the schema and the timeline's plan; run nothing.

    Exit 0 when every file is valid, 2 otherwise (each error names the file, the key path and what was expected).
    """
    console, err = _console(), _console(stderr=True)
    bad = 0
    for file in files:
        try:
            scenario = _load(file)
        except InputError as exc:
            bad += 1
            _print_scenario_error(err, exc)
            continue
        console.print(f"[green]ok[/] {escape(str(file))}: {escape(scenario.name)}, {scenario.steps} steps, "
                      f"{len(scenario.timeline)} event(s), EP {scenario.deployment.ep_size}"
                      f"{' (slow)' if scenario.slow else ''}")
    raise typer.Exit(EXIT_INVALID if bad else EXIT_OK)


# ---------------------------------------------------------------------------------------------
# benchmarks: ``elastic-ep bench NAME [ARGS...]`` runs ``bench/bench_NAME.py``

BENCH_PACKAGE = "bench"  # benchmarks are modules BENCH_PACKAGE.bench_<name>


def _bench_root() -> Path:
    """The directory that holds the ``bench`` package (the repository root of an editable install)."""
    return Path(__file__).resolve().parent.parent


def _ensure_bench_importable() -> None:
    if importlib.util.find_spec(BENCH_PACKAGE) is None:
        root = _bench_root()
        if (root / BENCH_PACKAGE / "__init__.py").exists() and str(root) not in sys.path:
            sys.path.insert(0, str(root))


def available_benchmarks() -> list[str]:
    """Names of the benchmark modules that exist (``bench/bench_<name>.py``)."""
    _ensure_bench_importable()
    spec = importlib.util.find_spec(BENCH_PACKAGE)
    names: set[str] = set()
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        names.update(p.stem[len("bench_"):] for p in Path(location).glob("bench_*.py"))
    return sorted(names)


def run_benchmark(name: str, argv: list[str]) -> int:
    """Run ``bench.bench_<name>``: its ``main(argv)`` when it has one, else the module as ``__main__``."""
    _ensure_bench_importable()
    module_name = f"{BENCH_PACKAGE}.bench_{name}"
    try:
        found = importlib.util.find_spec(module_name)
    except ModuleNotFoundError:
        found = None
    if found is None:
        raise LookupError(f"no benchmark {name!r}: module {module_name} not found "
                          f"(available: {', '.join(available_benchmarks()) or 'none'})")
    module = importlib.import_module(module_name)
    main = getattr(module, "main", None)
    if callable(main):
        code = main(argv)
        return int(code or 0) if not isinstance(code, bool) else int(not code)
    sys.modules.pop(module_name, None)  # runpy executes it afresh as __main__
    saved = sys.argv
    sys.argv = [f"elastic-ep bench {name}", *argv]
    try:
        runpy.run_module(module_name, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
)
def bench(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="which benchmark: bench/bench_NAME.py (see below)", show_default=False),
) -> None:
    """Run a benchmark module of bench/, passing every further argument to it.

    elastic-ep bench NAME --help shows the benchmark's own options.
    """
    try:
        code = run_benchmark(name, list(ctx.args))
    except LookupError as exc:
        _console(stderr=True).print(f"[red]error[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_INVALID) from None
    raise typer.Exit(code)


def _bench_help() -> str:
    names = available_benchmarks()
    listed = ", ".join(names) if names else "none found"
    return (f"Run a benchmark of bench/ (available: {listed}); every argument after NAME goes to it. "
            "`elastic-ep bench NAME --help` shows the benchmark's own options.")


# the list of benchmarks is read when the command is built, so a new bench/bench_<name>.py
# appears in --help without touching this file
for _command in app.registered_commands:
    if _command.callback is bench:
        _command.help = _bench_help()


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
)
def serve(ctx: typer.Context) -> None:
    """Run a deployment with the scale API (without CONFIG: 2 local ranks of a tiny model).

    elastic-ep serve --help shows its options.
    """
    # the command itself is defined with the server (elastic.service.server.register_cli); importing it here
    # would import torch and FastAPI for every command, and validate refuses a bad file without them
    try:
        from elastic.service.server import register_cli
    except ModuleNotFoundError as exc:  # the API's dependencies (fastapi, uvicorn) are not installed
        _console(stderr=True).print(f"[red]error[/] serve needs the API's dependencies: {escape(str(exc))}")
        raise typer.Exit(EXIT_INVALID) from None
    inner = typer.Typer(add_completion=False, rich_markup_mode="rich")
    register_cli(inner)  # its only command, so it runs as the root: elastic-ep serve [CONFIG] [OPTIONS]
    try:
        inner(args=list(ctx.args), prog_name="elastic-ep serve")
    except SystemExit as exc:
        raise typer.Exit(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)) from None


from elastic.service import client as _client  # noqa: E402 - the client commands of a running server (httpx only)

_client.register(app)

from elastic.service import loadgen as _loadgen  # noqa: E402 - elastic-ep loadgen URL (httpx; matplotlib when it plots)

_loadgen.register(app)


def main() -> None:  # pragma: no cover - the console script calls ``app``
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
