"""The replay's report: expectations, ``report.json``, ``report.png``, the live display and tables.

Everything here works on the recording a :class:`~elastic.replay.runner.Replayer` made, or on the JSON
report itself (``plot_report`` and ``render_summary`` read only the report dict, so a saved
``report.json`` can be plotted again).
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from elastic.core.phases import OPERATION_PHASES
from elastic.core.phases import Phase as P

if TYPE_CHECKING:
    from rich.console import JustifyMethod
    from rich.progress import TaskID

    from elastic.replay.scenario import Scenario


class Recording(Protocol):
    """What a report is built from: the replayer's recording (``elastic.replay.runner.Replayer``
    satisfies it; this module does not import the runner, which imports this one)."""

    scenario: Scenario
    coordinator: Any
    autoscaler: Any
    recorder: Any
    events: list[Any]
    errors: list[Any]
    verifications: list[Any]

__all__ = ["build_report", "evaluate", "report_json", "write_report", "plot_report", "render_summary", "LiveDisplay", "STATE_COLORS"]

STATE_COLORS: dict[str, str | None] = {
    P.RUNNING: None,
    P.DRAINING: "#f6c85f",
    P.SUPPRESSED: "#f28e2b",
    P.RESCALING: "#e15759",
    P.RESUMING: "#4e79a7",
    P.FAILED: "#6b2d2d",
}
STATE_STYLE: dict[str, str] = {P.RUNNING: "green", P.DRAINING: "yellow", P.SUPPRESSED: "dark_orange", P.RESCALING: "red",
               P.RESUMING: "blue", P.FAILED: "bold red"}
PHASES = tuple(str(phase) for phase in OPERATION_PHASES)


# ---------------------------------------------------------------------------------------------
# building the report

class _StepClock:
    """Maps a replay time to the step decoded by then (from the samples)."""

    def __init__(self, samples: list[dict[str, Any]]):
        pairs = sorted((s["time"], s["step"]) for s in samples)
        self.times: list[float] = []
        self.steps: list[int] = []
        best = 0
        for t, step in pairs:
            best = max(best, step)
            self.times.append(t)
            self.steps.append(best)

    def __call__(self, t: float) -> int:
        i = bisect.bisect_right(self.times, t)
        return self.steps[i - 1] if i > 0 else 0


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rebalances(events: list[dict[str, Any]], samples: list[dict[str, Any]], transitions: list[dict[str, Any]],
                window: int) -> list[dict[str, Any]]:
    """Pair the workers' rebalance events into rebalances (one per start step) with balancedness around them."""
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    breaks = sorted(t["t"] for t in transitions if t["dest"] in (P.RESCALING, P.FAILED))

    def close(r: dict[str, Any], how: str) -> None:
        r.setdefault("outcome", how)
        out.append(r)

    for e in sorted(events, key=lambda e: e["t"]):
        if current is not None and any(current["t_start"] < b <= e["t"] for b in breaks):
            close(current, "aborted")
            current = None
        kind = e.get("kind")
        if kind == "rebalance_started":
            if current is None or current["start_step"] != e["step"]:
                if current is not None:
                    close(current, "unfinished")
                current = {"start_step": e["step"], "t_start": e["t"], "mode": "async", "ranks": {e["rank"]},
                           "finished": set(), "layers": set(), "bytes": 0, "end_step": None, "t_end": None,
                           "drained": False}
            else:
                current["ranks"].add(e["rank"])
        elif kind == "layer_committed" and current is not None:
            current["layers"].add(e.get("layer"))
            current["bytes"] += int(e.get("bytes", 0) or 0)
        elif kind in ("rebalance_finished", "rebalance_failed"):
            if e.get("mode") == "sync":
                out.append({"start_step": e["step"], "t_start": e["t"], "end_step": e["step"], "t_end": e["t"],
                            "mode": "sync", "outcome": "finished", "seconds": e.get("seconds"), "ranks": {e["rank"]},
                            "finished": {e["rank"]}, "layers": set(), "bytes": 0, "drained": False})
                continue
            if current is None:
                continue
            current["finished"].add(e["rank"])
            current["end_step"] = max(current["end_step"] or 0, e["step"])
            current["t_end"] = e["t"]
            current["drained"] = current["drained"] or bool(e.get("drained"))
            if kind == "rebalance_failed":
                current["outcome"] = "failed"
                current["error"] = e.get("error")
            if current["finished"] >= current["ranks"]:
                close(current, "finished")
                current = None
    if current is not None:
        close(current, "unfinished")
    return _around(_merge_sync(out), samples, window)


def _merge_sync(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge the sync records that several ranks reported for the same step; in start order."""
    merged: list[dict[str, Any]] = []
    for r in out:
        if merged and r["mode"] == "sync" and merged[-1]["mode"] == "sync" and merged[-1]["start_step"] == r["start_step"]:
            merged[-1]["finished"] |= r["finished"]
            merged[-1]["ranks"] |= r["ranks"]
            continue
        merged.append(r)
    merged.sort(key=lambda r: r["t_start"])
    return merged


def _around(merged: list[dict[str, Any]], samples: list[dict[str, Any]], window: int) -> list[dict[str, Any]]:
    """Each rebalance's balancedness ``window`` steps before it and after it (up to the next one)."""
    by_step = {s["step"]: s for s in samples}
    starts = [r["start_step"] for r in merged]
    for i, r in enumerate(merged):
        before = [by_step[k]["balancedness"] for k in range(r["start_step"] - window, r["start_step"])
                  if k in by_step and by_step[k]["state"] == P.RUNNING]
        r["balancedness_before"] = _mean(before)
        r["balancedness_after"] = None
        if r["outcome"] == "finished" and r["end_step"] is not None:
            stop = min([r["end_step"] + window] + [s for s in starts[i + 1:] if s > r["end_step"]])
            after = [by_step[k]["balancedness"] for k in range(r["end_step"] + 1, stop + 1)
                     if k in by_step and by_step[k]["state"] == P.RUNNING]
            r["balancedness_after"] = _mean(after) if len(after) >= 2 else None
        r["index"] = i
        r["layers"] = sorted(x for x in r["layers"] if x is not None)
        r["ranks"] = sorted(r["ranks"])
        r["finished"] = sorted(r["finished"])
    return merged


def _operations(replayer: Recording, transitions: list[dict[str, Any]], step_at: _StepClock) -> list[dict[str, Any]]:
    ops = []
    coordinator = replayer.coordinator
    records = sorted(coordinator.operations.values(), key=lambda o: o.created_at) if coordinator is not None else []
    for op in records:
        d = op.to_dict()
        d.pop("phases", None)
        own = [t for t in transitions if t.get("operation_id") == op.id]
        phases: dict[str, float | None] = {}
        for a, b in zip(own, own[1:] + [None]):
            if a["dest"] in PHASES:
                end = b["t"] if b is not None else None
                phases[a["dest"]] = round(end - a["t"], 6) if end is not None else None
        d["phase_seconds"] = phases
        d["t_start"] = own[0]["t"] if own else None
        d["t_end"] = own[-1]["t"] if own else None
        d["start_step"] = step_at(d["t_start"]) if own else None
        d["end_step"] = step_at(d["t_end"]) if own else None
        ops.append(d)
    return ops


def build_report(replayer: Recording, *, final: dict[str, Any], started_wall: float, duration_s: float) -> dict[str, Any]:
    s = replayer.scenario
    rec = replayer.recorder
    samples = rec.samples()
    step_at = _StepClock(samples)
    with rec.lock:
        transitions = [dict(t) for t in rec.transitions]
        worker_events = [dict(e) for e in rec.worker_events]
        worker_errors = [dict(e) for e in rec.worker_errors]
    for t in transitions:
        t["step"] = step_at(t["t"])
    window = max(3, min(20, s.deployment.eplb.step_interval // 2))
    rebalances = _rebalances(worker_events, samples, transitions, window)
    operations = _operations(replayer, transitions, step_at)
    autoscaler = replayer.autoscaler.status() if replayer.autoscaler is not None else None
    by_autoscaler = {d.get("operation_id") for d in (replayer.autoscaler.decisions if replayer.autoscaler else ())}
    by_timeline = {e.get("operation_id") for e in replayer.events}
    for op in operations:
        op["origin"] = ("timeline" if op["id"] in by_timeline else "autoscaler" if op["id"] in by_autoscaler
                        else "auto-recover" if op["kind"] == "recover" else "other")
    report: dict[str, Any] = {
        "scenario": {"name": s.name, "description": s.description, "file": None, "config": s.model_dump(mode="json")},
        "started_at": started_wall,
        "duration_s": round(duration_s, 3),
        "final": {k: v for k, v in final.items() if k != "history"},
        "samples": [{"step": x["step"], "time": round(x["time"], 4), "balancedness": x["balancedness"],
                     "step_time": x["step_time"], "state": x["state"], "ep_size": x["ep_size"]} for x in samples],
        "transitions": [{k: t[k] for k in ("seq", "t", "step", "source", "dest", "trigger", "generation", "reason",
                                           "operation_id") if k in t} for t in transitions],
        "operations": operations,
        "events": replayer.events,
        "rebalances": rebalances,
        "rebalance_window_steps": window,
        "verifications": replayer.verifications,
        "autoscaler": autoscaler,
        "worker_events": worker_events,
        "worker_errors": worker_errors,
        "errors": list(replayer.errors),
    }
    report["expectations"] = evaluate(s, report)
    report["passed"] = all(e["passed"] for e in report["expectations"])
    return report


# ---------------------------------------------------------------------------------------------
# expectations

def evaluate(s: Scenario, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every expectation the scenario sets, with what the run measured and whether it held."""
    x = s.expect
    final = report["final"]
    out: list[dict[str, Any]] = []

    def check(name: str, expected: Any, measured: Any, passed: bool, detail: str = "") -> None:
        out.append({"name": name, "expected": expected, "measured": measured, "passed": bool(passed), "detail": detail})

    if report["errors"]:
        check("replay_completed", True, False, False, "; ".join(report["errors"]))
    if x.final_state is not None:
        check("final_state", x.final_state, final.get("state"), final.get("state") == x.final_state,
              final.get("failure_reason") or "")
    if x.final_ep_size is not None:
        check("final_ep_size", x.final_ep_size, final.get("ep_size"), final.get("ep_size") == x.final_ep_size)
    min_steps = x.min_steps if x.min_steps is not None else (s.steps if x.final_state not in (P.FAILED,) else None)
    if min_steps is not None:
        check("steps", min_steps, final.get("step"), (final.get("step") or 0) >= min_steps)
    if x.events_ok and s.timeline:
        bad = [e for e in report["events"] if not e.get("ok")]
        done = len(report["events"])
        missing = len(s.timeline) - done
        detail = "; ".join(f"timeline[{e['index']}] {e['label']}: {e.get('detail', '')}" for e in bad)
        if missing:
            detail = (detail + "; " if detail else "") + f"{missing} event(s) never ran"
        check("events_ok", True, f"{done - len(bad)}/{len(s.timeline)} ok", not bad and not missing, detail)
    # a verification the timeline's own fault broke (the group lost the rank while it ran) is not counted
    excused = [v for v in report["verifications"] if v.get("excused")]
    verifications = [v for v in report["verifications"] if not v.get("excused")]
    not_counted = "; ".join(f"not counted: after {v['after']}: {v['excused']}" for v in excused)
    ended_failed = final.get("state") == P.FAILED
    if not verifications and ended_failed and (x.no_lost_expert or x.all_slots_verified):
        # a broken group answers no Verify: nothing was verified, and nothing could be
        for name in ("no_lost_expert", "all_slots_verified"):
            if getattr(x, name):
                check(name, True, None, True, "not checked: the group ended failed, so no rank could verify")
        _rest(x, report, check)
        return out
    if x.identical_output:
        probed = [v for v in verifications if "output_identical" in v]
        same = [v for v in probed if v["output_identical"]]
        check("identical_output", "every probe bitwise equal to the unsharded model", f"{len(same)}/{len(probed)} identical",
              bool(probed) and len(same) == len(probed) == len([v for v in verifications if v.get("ranks")]),
              "; ".join(f"after {v['after']}: {v.get('output_error') or 'digests ' + str(v.get('output_digests'))}"
                        for v in probed if not v["output_identical"]))
    if x.no_lost_expert:
        answered = [v for v in verifications if v.get("ranks")]
        silent = [v for v in verifications if not v.get("ranks")]
        lowest = min((v.get("replica_min", 0) for v in answered), default=None)
        # measured names what failed: a replica count, or verifications that gave none (never "1" against ">= 1")
        measured: Any = lowest if not silent else f"{len(silent)}/{len(verifications)} gave no replica count"
        detail = "; ".join([f"{len(verifications)} verification(s)" if verifications else "nothing was verified",
                            *(f"after {v['after']}: {v.get('error') or 'no rank answered'}" for v in silent),
                            *([not_counted] if not_counted else [])])
        check("no_lost_expert", "replica_min >= 1 in every verification", measured,
              lowest is not None and lowest >= 1 and not silent, detail)
    if x.all_slots_verified:
        bad = [v for v in verifications if not v.get("ok")]
        detail = "; ".join(
            f"after {v['after']}: " + (v.get("error") or f"{v.get('mismatched')} mismatched slot(s), digests agree: "
                                       f"{v.get('digests_agree')}, all ranks answered: {v.get('all_ranks')}")
            for v in bad) or f"{len(verifications)} verification(s), every slot bit-exact, digests agree"
        detail = detail if verifications else "nothing was verified"
        check("all_slots_verified", True, f"{len(verifications) - len(bad)}/{len(verifications)} ok",
              bool(verifications) and not bad, f"{detail}; {not_counted}" if not_counted else detail)
    _rest(x, report, check)
    return out


def _rest(x: Any, report: dict[str, Any], check: Any) -> None:
    """The expectations after the verifications (they need no verification)."""
    if x.max_pause_s is not None:
        pauses = [(o["paused_seconds"], o["id"]) for o in report["operations"]
                  if o["status"] == "succeeded" and o["paused_seconds"] is not None]
        worst = max(pauses) if pauses else (None, None)
        check("max_pause_s", x.max_pause_s, None if worst[0] is None else round(worst[0], 4),
              worst[0] is None or worst[0] <= x.max_pause_s, f"longest: {worst[1]}" if worst[1] else "no pause")
    if x.min_autoscaler_operations is not None:
        ops = [o for o in report["operations"] if o.get("origin") == "autoscaler" and o["status"] == "succeeded"]
        decisions = (report.get("autoscaler") or {}).get("counts", {})
        check("min_autoscaler_operations", x.min_autoscaler_operations, len(ops), len(ops) >= x.min_autoscaler_operations,
              ", ".join(f"{o['from_size']}→{o['target_size']}" for o in ops) + (f" (decisions: {decisions})" if decisions else ""))
    if x.min_rebalances is not None:
        done = [r for r in report["rebalances"] if r["outcome"] == "finished"]
        check("min_rebalances", x.min_rebalances, len(done), len(done) >= x.min_rebalances)
    if x.min_balancedness_after_rebalance is not None:
        measured = [(r["balancedness_after"], r["index"], r["start_step"]) for r in report["rebalances"]
                    if r["outcome"] == "finished" and not r["drained"] and r["balancedness_after"] is not None]
        lowest = min(measured) if measured else None
        check("min_balancedness_after_rebalance", x.min_balancedness_after_rebalance,
              None if lowest is None else round(lowest[0], 4),
              lowest is not None and lowest[0] >= x.min_balancedness_after_rebalance,
              (f"worst: rebalance #{lowest[1]} from step {lowest[2]}, over {len(measured)} rebalance(s), "
               f"mean of the {report['rebalance_window_steps']} steps after each")
              if lowest else "no rebalance completed with steps after it")
    if x.drain_committed_in_flight:
        results = _drain_checks(report)
        with_flight = [r for r in results if r["in_flight"]]
        ok = bool(with_flight) and all(r["committed_ranks"] >= r["from_size"] and not r["failed"] for r in with_flight)
        detail = "; ".join(f"{r['operation_id']}: {r['committed_ranks']}/{r['from_size']} rank(s) committed "
                           f"{r['layers']} layer(s) while draining ({1000 * r['draining_s']:.0f} ms)"
                           + (", a rebalance failed" if r["failed"] else "") for r in with_flight) \
            or "no scale started while a layer transfer was in flight"
        check("drain_committed_in_flight", True, f"{sum(1 for r in with_flight if r['committed_ranks'] >= r['from_size'])}"
              f"/{len(with_flight)} scale(s)", ok, detail)


def _drain_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per scale: was a transfer in flight when it began, and did every rank commit during the drain."""
    results = []
    in_flight = {e.get("operation_id"): e.get("transfer_in_flight", False) for e in report["events"] if e["action"] == "scale"}
    for op in report["operations"]:
        if op["kind"] != "scale" or op["status"] == "noop":
            continue
        own = [t for t in report["transitions"] if t.get("operation_id") == op["id"]]
        start = next((t["t"] for t in own if t["dest"] == P.DRAINING), None)
        end = next((t["t"] for t in own if t["source"] == P.DRAINING), None)
        if start is None or end is None:
            continue
        window = [e for e in report["worker_events"] if start <= e["t"] <= end]
        committed = {e["rank"] for e in window if e.get("kind") == "layer_committed"}
        results.append({"operation_id": op["id"], "in_flight": bool(in_flight.get(op["id"])),
                        "from_size": op["from_size"], "committed_ranks": len(committed),
                        "layers": len({e.get("layer") for e in window if e.get("kind") == "layer_committed"}),
                        "failed": any(e.get("kind") == "rebalance_failed" for e in window),
                        "draining_s": end - start})
    return results


# ---------------------------------------------------------------------------------------------
# files

def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
        return value.value
    return value


def report_json(report: dict[str, Any], indent: int | None = None) -> str:
    return json.dumps(_jsonable(report), indent=indent)


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(report_json(report, indent=1))
    return path


def _rolling(values: list[float], n: int) -> list[float]:
    """Centred moving average over ``n`` samples (shorter at the ends)."""
    half = n // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(len(values)):
        a, b = max(0, i - half), min(len(values), i + n - half)
        out.append((prefix[b] - prefix[a]) / (b - a))
    return out


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Balancedness and step time over steps, state bands shaded, timeline events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    samples = report["samples"]
    steps = [x["step"] for x in samples]
    total = max([report["scenario"]["config"]["steps"]] + steps + [1])
    fig, (ax_bal, ax_time, ax_size) = plt.subplots(3, 1, figsize=(12, 7.5), sharex=True,
                                                   gridspec_kw={"height_ratios": [3, 2.2, 1]})
    name = report["scenario"]["name"]
    verdict = "all expectations held" if report["passed"] else \
        "FAILED: " + ", ".join(e["name"] for e in report["expectations"] if not e["passed"])
    fig.suptitle(f"{name} — {verdict}", fontsize=12, color="black" if report["passed"] else "#b00020", x=0.01,
                 ha="left", fontweight="bold")
    axes = (ax_bal, ax_time, ax_size)
    bands = _plot_state_bands(report, steps, total, axes)
    _plot_balancedness(report, samples, steps, ax_bal)
    _plot_step_time(samples, steps, ax_time)
    _plot_size(samples, steps, total, ax_size)
    n_rows = _plot_marks(_place_marks(_timeline_marks(report), total), axes)
    handles = [Patch(color=c, alpha=0.5, label=s) for s, c in STATE_COLORS.items()
               if c is not None and any(b[0] == s for b in bands)]
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.99, 0.995), title=None)
    top = 1.0 - (0.38 + (10 + 17 * n_rows) / 72) / fig.get_figheight()  # the title line, then the label rows
    fig.subplots_adjust(left=0.075, right=0.975, bottom=0.075, top=top, hspace=0.12)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_state_bands(report: dict[str, Any], steps: list[int], total: int,
                      axes: tuple[Any, Any, Any]) -> list[tuple[str, float, float]]:
    """The state bands (zero-step phases such as rescaling get a minimum visible width)."""
    ax_bal = axes[0]
    min_width = max(0.6, total * 0.004)
    bands: list[tuple[str, float, float]] = []
    state: str = P.RUNNING
    since = 0.0
    for t in report["transitions"]:
        if state != P.RUNNING:
            bands.append((state, since, t["step"]))
        state, since = t["dest"], t["step"]
    final_step = max(steps + [report["final"].get("step") or 0])
    if state != P.RUNNING:  # the run ended in this state: nothing more was decoded
        bands.append((state, since, total if state == P.FAILED else max(final_step, since)))
        if state == P.FAILED and total - since > total * 0.15:
            reason = (report["final"].get("failure_reason") or "").split(";")[0]
            ax_bal.text((since + total) / 2, 0.5, "failed\n" + (reason[:60] + ("…" if len(reason) > 60 else "")),
                        transform=ax_bal.get_xaxis_transform(), ha="center", va="center", fontsize=9,
                        color=STATE_COLORS[P.FAILED], zorder=5)
    for state, a, b in bands:
        if b - a < min_width:
            mid = (a + b) / 2
            a, b = mid - min_width / 2, mid + min_width / 2
        for ax in axes:
            ax.axvspan(a, b, color=STATE_COLORS.get(state) or "#cccccc", alpha=0.35, lw=0, zorder=0)
    return bands


def _plot_balancedness(report: dict[str, Any], samples: list[dict[str, Any]], steps: list[int], ax_bal: Any) -> None:
    x_expect = report["scenario"]["config"]["expect"].get("min_balancedness_after_rebalance")
    if samples:
        bal = [x["balancedness"] for x in samples]
        ax_bal.plot(steps, bal, color="#9aa5b1", lw=0.8, label="per step")
        ax_bal.plot(steps, _rolling(bal, 10), color="#1f3b73", lw=2.0, label="mean of 10 steps")
    shades = ("#59a14f", "#a0cf8c")  # alternate, so back-to-back rebalances stay apart
    drained = False
    for i, r in enumerate(report["rebalances"]):
        if r["end_step"] is not None and r["outcome"] == "finished":
            color = "#f28e2b" if r.get("drained") else shades[i % 2]
            drained = drained or bool(r.get("drained"))
            ax_bal.axvspan(r["start_step"], max(r["end_step"], r["start_step"] + 0.3), ymin=0.965, ymax=1.0,
                           color=color, lw=0, zorder=3)
    ax_bal.plot([], [], color="#59a14f", lw=6, label="EPLB rebalance (start→last commit)")
    if drained:
        ax_bal.plot([], [], color="#f28e2b", lw=6, label="rebalance cut short by a drain")
    probes = [v for v in report["verifications"] if "output_identical" in v]  # a real model's output check
    for ok in (True, False):
        at = [v["step"] for v in probes if bool(v["output_identical"]) is ok]
        if at:
            ax_bal.scatter(at, [1.0] * len(at), marker="D" if ok else "X", s=40 if ok else 70, zorder=6,
                           color="#2e7d32" if ok else "#b00020",
                           label="output identical to the unsharded model" if ok else "output CHANGED")
    lo = min([x["balancedness"] for x in samples] + [0.5] + ([x_expect] if x_expect else []))
    ax_bal.set_ylim(max(0.0, lo - 0.05), 1.04)
    ax_bal.set_ylabel("balancedness\n(mean / max rank load)")
    ax_bal.grid(alpha=0.3)
    ax_bal.legend(loc="lower right", fontsize=8, ncol=4, framealpha=0.9)
    if x_expect:
        ax_bal.axhline(x_expect, color="#59a14f", ls=":", lw=1)
        ax_bal.text(0.005, x_expect, f"expected after a rebalance ≥ {x_expect}", fontsize=7, va="bottom",
                    color="#3c6e35", transform=ax_bal.get_yaxis_transform())


def _plot_step_time(samples: list[dict[str, Any]], steps: list[int], ax_time: Any) -> None:
    if samples:
        ms = [1000 * x["step_time"] for x in samples]
        ax_time.plot(steps, ms, color="#e8a29a", lw=0.8, label="per step (slowest rank)")
        ax_time.plot(steps, _rolling(ms, 10), color="#a8322d", lw=2.0, label="mean of 10 steps")
        ordered = sorted(ms)
        top = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 1
        ax_time.set_ylim(0, max(top * 1.25, 1e-3))
        ax_time.legend(loc="upper right", fontsize=8, ncol=2, framealpha=0.9)
    ax_time.set_ylabel("step time (ms)")
    ax_time.grid(alpha=0.3)


def _plot_size(samples: list[dict[str, Any]], steps: list[int], total: int, ax_size: Any) -> None:
    if samples:
        ax_size.step(steps, [x["ep_size"] for x in samples], where="post", color="#333333", lw=1.8)
        sizes = [x["ep_size"] for x in samples if x["ep_size"] is not None]
        if sizes:
            ax_size.set_ylim(min(sizes) - 0.6, max(sizes) + 0.6)
            ax_size.set_yticks(range(min(sizes), max(sizes) + 1))
    ax_size.set_ylabel("EP size")
    ax_size.set_xlabel("decode step")
    ax_size.grid(alpha=0.3)
    ax_size.set_xlim(0, total)


MARK_COLORS = {"scale": "#1f3b73", "kill": "#b00020", "recover": "#2e7d32", "rebalance": "#6a3d9a",
               "autoscaler": "#555555"}


def _pause(op: dict[str, Any]) -> str:
    return f", pause {1000 * op['paused_seconds']:.0f} ms" if op.get("paused_seconds") is not None else ""


def _timeline_marks(report: dict[str, Any]) -> list[tuple[float, str, str, bool]]:
    """(step, label, color, ok) of every timeline event, and of the operations nobody on the timeline asked for."""
    ops = {o["id"]: o for o in report["operations"]}
    marks = []
    for e in report["events"]:
        step = e.get("step", e["at_step"])
        op = ops.get(e.get("operation_id") or "")
        if op is not None and op.get("start_step") is not None:
            step = op["start_step"]
        label = e["label"]
        if e["action"] in ("scale", "recover") and op is not None:
            label = f"{e['action']} {op['from_size']}→{op['target_size']}{_pause(op)}"
        elif e["action"] == "kill":
            label = f"kill rank {e['event']['rank']}"
        if not e.get("ok"):
            label += " ✗ " + (e.get("status") or "failed")
        marks.append((step, label, MARK_COLORS.get(e["action"], "#333333"), e.get("ok", False)))
    for op in report["operations"]:
        if op.get("origin") in ("autoscaler", "auto-recover") and op.get("start_step") is not None:
            origin = "autoscale" if op["origin"] == "autoscaler" else "auto-recover"
            label = f"{origin} {op['from_size']}→{op['target_size']}{_pause(op)}"
            ok = op["status"] == "succeeded"
            marks.append((op["start_step"], label if ok else label + f" ✗ {op['status']}",
                          MARK_COLORS["autoscaler" if op["origin"] == "autoscaler" else "recover"], ok))
    return marks


def _place_marks(marks: list[tuple[float, str, str, bool]], total: int) -> list[tuple[float, str, str, bool, int]]:
    """Each label's row: labels that would overlap go on further rows."""
    rows: list[tuple[float, float, int]] = []  # (x from, x to, row) of the labels placed
    placed = []
    for step, label, color, ok in sorted(marks, key=lambda m: m[0]):
        width = total * (0.012 + 0.0049 * len(label))  # a character of 8 pt is about 0.5% of the axis
        row = 0
        while any(r == row and not (step + width < a or step > b) for a, b, r in rows):
            row += 1
        rows.append((step, step + width, row))
        placed.append((step, label, color, ok, row))
    return placed


def _plot_marks(placed: list[tuple[float, str, str, bool, int]], axes: tuple[Any, Any, Any]) -> int:
    """A vertical line through every panel and a label above the top panel; returns the rows used."""
    for step, label, color, ok, row in placed:
        for ax in axes:
            ax.axvline(step, color=color, ls="-" if ok else "--", lw=1.3, alpha=0.9, zorder=4)
        note = axes[0].annotate(label, xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 5 + 17 * row),
                                textcoords="offset points", fontsize=8, color=color, va="bottom", ha="left",
                                bbox=dict(boxstyle="round,pad=0.25", fc="white", ec=color, lw=0.7),
                                arrowprops=dict(arrowstyle="-", color=color, lw=1.0, shrinkA=0, shrinkB=0), zorder=5,
                                annotation_clip=False)
        note.set_in_layout(False)  # the space above the top panel is reserved below
    return 1 + max((p[4] for p in placed), default=-1)


# ---------------------------------------------------------------------------------------------
# the terminal

def _esc(text: Any) -> str:
    from rich.markup import escape

    return escape(str(text)) if text is not None else ""


def _fmt_ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{1000 * seconds:.0f} ms"


def _fmt_bal(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


class LiveDisplay:
    """A progress bar (step, state, EP size, balancedness) with transitions printed above it."""

    def __init__(self, scenario: Scenario, console: Any = None, bar: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.scenario = scenario
        self.console = console or Console()
        self.bar = bar
        self.progress_bar = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=30),
            TextColumn("step {task.completed:>5.0f}/{task.total:.0f}"), TextColumn("{task.fields[state]}"),
            TextColumn("EP [bold]{task.fields[ep]}[/]"), TextColumn("bal {task.fields[bal]}"),
            TimeElapsedColumn(), console=self.console, transient=False, disable=not bar)
        self.task: TaskID | None = None
        self.last: dict[str, Any] | None = None

    def __enter__(self) -> LiveDisplay:
        self.progress_bar.start()
        self.task = self.progress_bar.add_task(self.scenario.name, total=self.scenario.steps, state="[dim]starting[/]",
                                               ep=self.scenario.deployment.ep_size, bal="—")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress_bar.stop()

    def _print(self, text: str) -> None:
        self.progress_bar.console.print(text, highlight=False)

    def transition(self, t: dict[str, Any]) -> None:
        style = STATE_STYLE.get(t["dest"], "white")
        reason = f" [dim]{_esc(t['reason'])}[/]" if t.get("reason") else ""
        self._print(f"[dim]{t['t']:7.2f}s step {t.get('step', 0):>5}[/]  {t['source']} → [{style}]{t['dest']}[/] "
                    f"[dim]({t['trigger']}, gen {t['generation']})[/]{reason}")

    def event(self, e: dict[str, Any]) -> None:
        mark = "[green]✓[/]" if e.get("ok") else "[red]✗[/]"
        self._print(f"[dim]{e['t']:7.2f}s step {e.get('step', 0):>5}[/]  {mark} [bold]timeline[{e['index']}][/] "
                    f"{_esc(e['label'])} (at step {e['at_step']}): {_esc(e.get('detail', ''))}")

    def worker_error(self, e: dict[str, Any]) -> None:
        text = str(e.get("error", "")).splitlines()[0] if e.get("error") else ""
        if len(text) > 160:
            text = text[:157] + "..."
        self._print(f"[dim]{e['t']:7.2f}s step {e.get('step', 0):>5}[/]  [red]rank {e.get('rank')} error[/] {_esc(text)}")

    def progress(self, p: dict[str, Any]) -> None:
        if self.task is None:
            return
        self.last = p
        style = STATE_STYLE.get(p["state"], "white")
        self.progress_bar.update(self.task, completed=min(p["step"], p["total"]), state=f"[{style}]{p['state']:<10}[/]",
                                 ep=p["ep_size"], bal=_fmt_bal(p["balancedness"]))


def render_summary(report: dict[str, Any], console: Any) -> None:
    """The end-of-run tables: timeline, operations, rebalances, verifications, expectations."""
    for table in (_timeline_table, _operations_table, _rebalances_table, _verifications_table, _expectations_table):
        rendered = table(report)
        if rendered is not None:
            console.print(rendered)


def _timeline_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    timeline = Table(title="Timeline", title_justify="left", header_style="bold")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("t (s)", "right"), ("step", "right"), ("what", "left"), ("lasted", "right"), ("detail", "left"))
    for col, just in columns:
        timeline.add_column(col, justify=just, overflow="fold")
    rows: list[tuple[float, int, str, str, str]] = []
    trans = report["transitions"]
    for i, t in enumerate(trans):
        nxt = trans[i + 1]["t"] if i + 1 < len(trans) else None
        lasted = _fmt_ms(nxt - t["t"]) if nxt is not None and t["dest"] != P.RUNNING else ""
        style = STATE_STYLE.get(t["dest"], "white")
        rows.append((t["t"], t["step"], f"{t['source']} → [{style}]{t['dest']}[/]", lasted,
                     f"{t['trigger']}, gen {t['generation']}: {_esc(t.get('reason', ''))}"))
    for e in report["events"]:
        mark = "[green]✓[/]" if e.get("ok") else "[red]✗[/]"
        rows.append((e["t"], e.get("step", 0), f"{mark} [bold]{_esc(e['label'])}[/] (at step {e['at_step']})",
                     _fmt_ms(e["t_end"] - e["t"]), _esc(e.get("detail", ""))))
    for t, step, what, lasted, detail in sorted(rows, key=lambda r: r[0]):
        timeline.add_row(f"{t:.2f}", str(step), what, lasted, detail)
    return timeline


def _operations_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    if report["operations"]:
        ops = Table(title="Operations (phase durations, decoding pause)", title_justify="left", header_style="bold")
        for col in ("operation", "kind", "by", "ranks", "status", *PHASES, "pause", "moved"):
            ops.add_column(col, justify="right" if col not in ("operation", "kind", "by", "status") else "left")
        for o in report["operations"]:
            status = o["status"]
            style = {"succeeded": "green", "failed": "red"}.get(status, "white")
            ops.add_row(o["id"], o["kind"], o.get("origin", ""), f"{o['from_size']} → {o['target_size']}", f"[{style}]{status}[/]",
                        *(_fmt_ms(o["phase_seconds"].get(ph)) if ph in o["phase_seconds"] else "—" for ph in PHASES),
                        _fmt_ms(o["paused_seconds"]), f"{o['bytes_moved'] / 2**20:.1f} MiB")
        return ops
    return None


def _rebalances_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    if report["rebalances"]:
        rb = Table(title=f"EPLB rebalances (balancedness: mean of {report['rebalance_window_steps']} steps before / after)",
                   title_justify="left", header_style="bold")
        for col in ("#", "mode", "steps", "layers", "outcome", "before", "after"):
            rb.add_column(col, justify="right" if col not in ("mode", "outcome") else "left")
        for r in report["rebalances"]:
            outcome = r["outcome"] + (" (drained)" if r.get("drained") else "")
            steps = f"{r['start_step']}–{r['end_step']}" if r["end_step"] is not None else f"{r['start_step']}–"
            before, after = r["balancedness_before"], r["balancedness_after"]
            arrow = ""
            if before is not None and after is not None:
                arrow = " [green]▲[/]" if after > before + 0.005 else (" [red]▼[/]" if after < before - 0.005 else "")
            rb.add_row(str(r["index"]), r["mode"], steps, str(len(r["layers"])), outcome, _fmt_bal(before),
                       _fmt_bal(after) + arrow)
        return rb
    return None


def _verifications_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    if report["verifications"]:
        vt = Table(title="Verifications (every slot bit-exact on every rank)", title_justify="left", header_style="bold")
        probed = any("output_identical" in v for v in report["verifications"])
        for col in ("after", "step", "ranks", "mismatched", "replica min", "digests", *(("output",) if probed else ())):
            vt.add_column(col, justify="left" if col == "after" else "right")
        for v in report["verifications"]:
            if v.get("excused"):  # the timeline's own fault broke the group while it ran: not counted
                vt.add_row(_esc(v["after"]), str(v["step"]), "—", "—", "—", f"[yellow]not counted: {_esc(v['excused'])}[/]")
                continue
            if v.get("error"):
                vt.add_row(_esc(v["after"]), str(v["step"]), "—", "—", "—", f"[red]{_esc(v['error'])}[/]")
                continue
            output = () if not probed else (
                ("[green]identical[/]" if v["output_identical"] else "[red]CHANGED[/]") if "output_identical" in v else "—",)
            vt.add_row(_esc(v["after"]), str(v["step"]), str(len(v["ranks"])),
                       f"[{'green' if v['mismatched'] == 0 else 'red'}]{v['mismatched']}[/]", str(v["replica_min"]),
                       "[green]agree[/]" if v["digests_agree"] else "[red]differ[/]", *output)
        return vt
    return None


def _expectations_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    ex = Table(title="Expectations", title_justify="left", header_style="bold")
    for col in ("", "expectation", "expected", "measured", "detail"):
        ex.add_column(col, overflow="fold")
    for e in report["expectations"]:
        ex.add_row("[green]✓[/]" if e["passed"] else "[red]✗[/]", e["name"], _esc(str(e["expected"])),
                   _esc(str(e["measured"])), _esc(e.get("detail", "")))
    return ex
