"""Fault detection and recovery: how long until a fault is seen, how long until serving again, what was lost.

    python -m bench.bench_faults [--json bench-faults.json] [--only NAME,...]

Each case is a small deployment (2-3 ranks, 3 layers, 8 experts + 4 redundant slots, CPU/gloo)
replayed as a scenario (``elastic.replay.runner``) with ``auto_recover: true`` and short deadlines
(collective 3 s, heartbeat 4 s), with one fault: a rank killed while running, or in one of a
scale's phases (draining, suppressed, rescaling after one layer moved, resuming), a long stall,
dropped heartbeats, a corrupted received layer (verify_transfers on), slow transfers.

Measured, on the coordinator's monotonic clock:

- **fault time**: for a phase kill, the ``at`` of the transition *into* that phase (the command
  that kills the rank is sent right after it); for a step fault (kill/stall/drop at step ``s``),
  the arrival of the first heartbeat reporting step ``s`` (workers report every 10 ms and run in
  lockstep through the step all-reduce, so this is within a step or two of the moment the faulty
  rank reached step ``s`` and fired);
- **detect**: fault time -> the ``fail`` transition; for a corrupt buffer, which never fails the
  group, the rebalance's start -> the rank refusing the layer (``rebalance_failed``, local);
- **recover**: ``fail`` -> the next transition back to ``running`` (the auto-recovery's resume);
- **lost**: the verification right after the recovery and the one at the end of the run:
  mismatched slots (bit-exact check on every rank), the minimum replicas of any expert
  (``replica_min``, >= 1 means no expert lost), digests agreeing; ``moved`` is the recovery's
  bytes moved (the elastic layer does not report reloads vs copies separately);
- the final EP size and state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

BASE: dict[str, Any] = {
    "deployment": {
        "model": {"num_layers": 3, "num_experts": 8, "hidden_size": 32, "intermediate_size": 64},
        "eplb": {"num_redundant_experts": 4, "use_async": True, "window_size": 10, "step_interval": 10},
        "timeouts": {"collective": 3, "heartbeat": 4},
        "auto_recover": True,
        "ep_size": 3,
        "max_ep_size": 3,
    },
    "trace": [{"at_step": 0, "kind": "zipf", "zipf_exponent": [1.0, 1.4], "tokens_per_step": 32}],
    "run_timeout_s": 90,
    "steps": 60,
}
TIMEOUTS = BASE["deployment"]["timeouts"]

AT = 25  # the step faults fire at / the scale starts at


def _phase_kill(phase: str, rank: int, start: int, to: int, **extra: Any) -> dict[str, Any]:
    return {"deployment": {"ep_size": start},
            "timeline": [{"at_step": AT, "action": "kill", "rank": rank, "in_phase": phase, **extra},
                         {"at_step": AT, "action": "scale", "to": to}]}


CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("kill_running", "kill rank 1 at step 25 (running)",
     {"timeline": [{"at_step": AT, "action": "kill", "rank": 1}]}),
    ("kill_replace_lost", "kill rank 1 at step 25, replace_lost",
     {"timeline": [{"at_step": AT, "action": "kill", "rank": 1}], "steps": 400,
      "deployment": {"replace_lost": True}}),
    ("kill_draining", "kill rank 1 in draining of 3 -> 2", _phase_kill("draining", 1, 3, 2)),
    ("kill_suppressed", "kill rank 1 in suppressed of 3 -> 2", _phase_kill("suppressed", 1, 3, 2)),
    ("kill_mid_rescale", "kill new rank 2 after 1 layer, 2 -> 3", _phase_kill("rescaling", 2, 2, 3, after_layers=1)),
    ("kill_resuming", "kill rank 1 in resuming of 2 -> 3", _phase_kill("resuming", 1, 2, 3)),
    ("stall", "stall rank 2 for 8 s at step 25",
     {"timeline": [{"at_step": AT, "action": "stall", "rank": 2, "seconds": 8}]}),
    ("dropped_heartbeats", "rank 1 stops reporting at step 25",
     {"timeline": [{"at_step": AT, "action": "drop_heartbeats", "rank": 1}],
      # any report is a sign of life (EPLB events too): no rebalance, so rank 1 sends nothing at all
      "deployment": {"eplb": {"step_interval": 100000}}}),
    ("torn_commit", "rank 1 breaks before its 2nd commit; rank 0 commits",
     {"deployment": {"ep_size": 2},
      "trace": [{"at_step": 0, "kind": "drift", "drift_period": 20, "zipf_exponent": [1.0, 1.4], "tokens_per_step": 32}],
      "faults": [{"kind": "torn_commit", "rank": 1, "at_commit": 2, "generation": 0}]}),
    ("corrupt_buffer", "rank 0 corrupts its first received layer",
     {"deployment": {"ep_size": 2, "auto_recover": False, "eplb": {"verify_transfers": True}},
      "trace": [{"at_step": 0, "kind": "drift", "drift_period": 20, "zipf_exponent": [1.0, 1.4], "tokens_per_step": 32}],
      "faults": [{"kind": "corrupt_buffer", "rank": 0, "times": 1}]}),
    ("slow_transfer", "200 ms per layer on every rank",
     {"deployment": {"ep_size": 2, "auto_recover": False},
      "trace": [{"at_step": 0, "kind": "drift", "drift_period": 20, "zipf_exponent": [1.0, 1.4], "tokens_per_step": 32}],
      "faults": [{"kind": "delay_transfer", "rank": r, "seconds": 0.2} for r in range(2)]}),
]


def _scenario(name: str, change: dict[str, Any]):
    from elastic.replay.scenario import parse_scenario

    deployment = {**BASE["deployment"], **change.get("deployment", {})}
    deployment["eplb"] = {**BASE["deployment"]["eplb"], **change.get("deployment", {}).get("eplb", {})}
    data = {**BASE, **change, "deployment": deployment, "name": f"bench_{name}"}
    return parse_scenario(data, source=f"bench_faults:{name}")


def measure(name: str, label: str, change: dict[str, Any]) -> dict[str, Any]:
    from elastic.replay.runner import replay

    scenario = _scenario(name, change)
    started = time.monotonic()
    result = replay(scenario, source=f"bench_faults:{name}")
    wall = time.monotonic() - started
    r = result.report
    transitions = r["transitions"]
    row: dict[str, Any] = {"case": name, "fault": label, "passed": result.passed, "wall_s": round(wall, 2),
                           "final_state": r["final"].get("state"), "final_ep_size": r["final"].get("ep_size"),
                           "failures": sum(1 for t in transitions if t["dest"] == "failed"),
                           "failed_expectations": [e["name"] for e in result.failed]}
    fault_t = _fault_time(scenario, r, row)
    _note_failure(row, scenario, r, fault_t)
    _note_refusal(row, r)
    row["rebalances_finished"] = sum(1 for x in r["rebalances"] if x["outcome"] == "finished")
    # what was lost: the verification after the recovery and the last one
    checks = [v for v in r["verifications"] if not v.get("excused")]  # not those a timeline fault broke
    after = next((v for v in checks if "recover" in v["after"]), None)
    for key, v in (("after_recovery", after), ("end", checks[-1] if checks else None)):
        if v is not None:
            row[key] = {"ok": v.get("ok"), "mismatched": v.get("mismatched"), "replica_min": v.get("replica_min"),
                        "digests_agree": v.get("digests_agree"), "ep_size": v.get("ep_size")}
    row["nothing_lost"] = bool(checks) and all(v.get("ok") for v in checks)
    return row


def _fault_time(scenario: Any, r: dict[str, Any], row: dict[str, Any]) -> float | None:
    """When the case's fault struck, on the report's clock (and from what, in ``row``)."""
    fault_t = None
    transitions, samples = r["transitions"], r["samples"]
    kill = next((e for e in scenario.timeline if getattr(e, "in_phase", None)), None)
    stepped = next((e for e in scenario.timeline if e.action in ("kill", "stall", "drop_heartbeats")
                    and getattr(e, "in_phase", None) is None), None)
    torn = next((x for x in scenario.faults if x.kind == "torn_commit"), None)
    if torn is not None:  # the moment the other ranks committed the layer the torn rank did not
        commits = [e["t"] for e in r["worker_events"] if e.get("kind") == "layer_committed" and e["rank"] != torn.rank]
        fault_t = commits[torn.at_commit - 1] if len(commits) >= torn.at_commit else None
        row["fault_time_from"] = f"the others' commit {torn.at_commit}"
    elif kill is not None:
        fault_t = next((t["t"] for t in transitions if t["dest"] == kill.in_phase), None)
        row["fault_time_from"] = f"entry into {kill.in_phase}"
    elif stepped is not None:
        fault_t = next((s["time"] for s in samples if s["step"] >= stepped.at_step), None)
        row["fault_time_from"] = f"first heartbeat at step {stepped.at_step}"
    return fault_t


def _note_failure(row: dict[str, Any], scenario: Any, r: dict[str, Any], fault_t: float | None) -> None:
    """The failure the fault caused: its reason, how long to detect it, recover, and restore the size."""
    transitions = r["transitions"]
    fail = next((t for t in transitions if t["dest"] == "failed" and (fault_t is None or t["t"] >= fault_t - 0.5)), None)
    if fail is not None:
        row["failure_reason"] = fail.get("reason")
        if fault_t is not None:
            row["detect_s"] = round(fail["t"] - fault_t, 3)
        backs = [t for t in transitions if t["t"] >= fail["t"] and t["dest"] == "running"]
        if backs:
            row["recover_s"] = round(backs[0]["t"] - fail["t"], 3)
        if scenario.deployment.replace_lost and len(backs) >= 2:  # the scale back to the size it had
            row["restored_s"] = round(backs[1]["t"] - fail["t"], 3)
        rec = next((o for o in r["operations"] if o["kind"] == "recover"), None)
        if rec is not None:
            row["recovery_bytes_moved"] = rec.get("bytes_moved")
            row["recovery_paused_s"] = rec.get("paused_seconds")


def _note_refusal(row: dict[str, Any], r: dict[str, Any]) -> None:
    """A corrupt buffer is caught by the rank itself: rebalance start -> the refusal -> the next commit."""
    refused = [e for e in r["worker_events"] if e.get("kind") == "rebalance_failed" and e.get("local")]
    row["refused_layers"] = len(refused)
    if refused:
        first = refused[0]
        start = max((e["t"] for e in r["worker_events"] if e.get("kind") == "rebalance_started"
                     and e["rank"] == first["rank"] and e["t"] <= first["t"]), default=None)
        if start is not None:
            row["detect_s"] = round(first["t"] - start, 3)
            row["fault_time_from"] = "rebalance start (layer refused)"
        nxt = next((e for e in r["worker_events"] if e.get("kind") == "rebalance_finished" and e["t"] > first["t"]), None)
        if nxt is not None:
            row["recover_s"] = round(nxt["t"] - first["t"], 3)  # until the next rebalance commits


def _fmt(v: Any, unit: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{unit}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    ap.add_argument("--only", default=None, help="comma-separated case names: " + ", ".join(c[0] for c in CASES))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    console = Console() if sys.stdout.isatty() else Console(width=170)
    unknown = sorted(set(args.only.split(",")) - {c[0] for c in CASES}) if args.only else []
    if unknown:
        ap.error(f"--only: no case named {', '.join(unknown)} (the cases: {', '.join(c[0] for c in CASES)})")
    cases = [c for c in CASES if args.only is None or c[0] in args.only.split(",")]
    console.print(f"[bold]bench_faults[/bold]: {len(cases)} case(s), 3 layers x (8 experts + 4 redundant), "
                  f"collective deadline {TIMEOUTS['collective']} s, heartbeat {TIMEOUTS['heartbeat']} s, "
                  "auto_recover")
    rows = []
    t0 = time.monotonic()
    for name, label, change in cases:
        row = measure(name, label, change)
        rows.append(row)
        console.print(f"  {name}: {'ok' if row['passed'] else 'FAILED ' + ', '.join(row['failed_expectations'])} "
                      f"in {row['wall_s']:.1f}s")
    table = Table(title="fault detection and recovery (auto_recover, collective 3 s / heartbeat 4 s)")
    for col in ("case", "fault", "fault time from", "detect", "recover", "size restored", "verify after recovery",
                "lost", "final"):
        table.add_column(col, justify="right" if col in ("detect", "recover", "size restored") else "left")
    for row in rows:
        after = row.get("after_recovery") or row.get("end") or {}
        verify = (f"{after.get('mismatched')} mismatched, replica_min {after.get('replica_min')}"
                  if after else "not verified")
        table.add_row(row["case"], row["fault"], row.get("fault_time_from", "-"), _fmt(row.get("detect_s"), " s"),
                      _fmt(row.get("recover_s"), " s"), _fmt(row.get("restored_s"), " s"), verify,
                      "nothing" if row["nothing_lost"] else "[red]SOMETHING[/red]",
                      f"{row['final_state']}, {row['final_ep_size']} ranks"
                      + (f", {row['refused_layers']} refused" if row["refused_layers"] else "")
                      + (f", {row['rebalances_finished']} rebalances" if not row["failures"] else ""))
    console.print(table)
    console.print(f"total {time.monotonic() - t0:.1f}s; detect for a corrupt buffer = rebalance start -> layer refused, "
                  "its recover = refusal -> next rebalance committed (the group never fails)")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({"cases": rows, "config": BASE}, fh, indent=2, default=str)
        console.print(f"wrote {args.json_path}")
    return 0 if all(r["passed"] and r["nothing_lost"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
