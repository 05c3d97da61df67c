"""The control plane's pure decisions (elastic.control.plans): no process, no clock."""

from __future__ import annotations

import pytest

from elastic.control.plans import Attempt, LiveWorker, plan_recovery
from elastic.core.errors import InvalidScaleRequest


def workers(*triples):
    return [LiveWorker(pid, rank, generation) for pid, rank, generation in triples]


def test_recovery_keeps_the_living_ranks_of_the_serving_generation_and_names_the_lost_ones():
    plan = plan_recovery(workers((10, 0, 3), (12, 2, 3)), {}, generation=3, size=3)
    assert (plan.generation, plan.base_size, plan.survivors, plan.lost_ranks, plan.retire) == (3, 3, (10, 12), (1,), ())
    assert plan.new_size == 2


def test_recovery_prefers_an_attempt_adopted_by_more_living_workers_and_retires_the_rest():
    live = workers((10, 0, 3), (20, 0, 4), (21, 1, 4), (22, 2, 4))
    plan = plan_recovery(live, {4: Attempt(size=4, adopted=frozenset({20, 21, 22}))}, generation=3, size=2)
    assert (plan.generation, plan.base_size, plan.survivors, plan.lost_ranks) == (4, 4, (20, 21, 22), (3,))
    assert plan.retire == (10,)


def test_on_a_tie_the_last_consistent_generation_wins():
    live = workers((10, 0, 3), (11, 1, 3), (20, 0, 4), (21, 1, 4))
    plan = plan_recovery(live, {4: Attempt(size=4, adopted=frozenset({20, 21}))}, generation=3, size=2)
    assert plan.generation == 3 and plan.survivors == (10, 11) and plan.retire == (20, 21)


def test_only_workers_that_reported_adopting_an_attempt_count_for_it():
    live = workers((10, 0, 3), (20, 0, 4), (21, 1, 4))
    plan = plan_recovery(live, {4: Attempt(size=2, adopted=frozenset({20}))}, generation=3, size=1)
    assert plan.generation == 3 and plan.survivors == (10,) and set(plan.retire) == {20, 21}


def test_older_attempts_than_the_serving_generation_are_ignored():
    live = workers((10, 0, 3), (5, 0, 2), (6, 1, 2))
    plan = plan_recovery(live, {2: Attempt(size=2, adopted=frozenset({5, 6}))}, generation=3, size=2)
    assert plan.generation == 3 and plan.lost_ranks == (1,)


def test_recovery_with_no_survivor_is_refused():
    with pytest.raises(InvalidScaleRequest, match="no worker of the last consistent generation"):
        plan_recovery(workers((5, 0, 2)), {}, generation=3, size=2)


# -- operations as data: plan_scale / RecoveryPlan.operation build, print and interpret without a process --

def snap(size=2, **kw):
    from elastic.control.plans import ScaleSnapshot

    return ScaleSnapshot(operation_id="op-1", size=size, generation=5, **kw)


def done(pid, rank, result, seq=9):
    from elastic.core import protocol as p

    return p.PhaseDone(rank=rank, generation=5, pid=pid, at=0.0, seq=seq, result=result)


def test_a_scale_is_a_table_of_typed_steps_each_building_its_command():
    from elastic.control.plans import AdmitJoiners, JoinerWait, OnFailure, Recipients, RecordAttempt, plan_scale
    from elastic.core import protocol as p
    from elastic.core.phases import OperationKind, Phase, Trigger

    plan = plan_scale(snap(size=2), 3)
    assert plan.kind is OperationKind.SCALE and plan.joining == (2,) and plan.generation == 5
    assert [(s.phase, s.command, s.expects, s.trigger) for s in plan.steps] == [
        (Phase.DRAINING, p.Drain, p.DrainDone, Trigger.DRAINED),
        (Phase.SUPPRESSED, p.Suppress, p.SuppressDone, Trigger.SUPPRESSED),
        (Phase.RESCALING, p.Rescale, p.RescaleDone, Trigger.RESCALED),
        (Phase.RESUMING, p.Resume, p.ResumeDone, Trigger.RESUMED)]
    drain, suppress, rescale, resume = plan.steps
    assert drain.joiners is JoinerWait.AFTER_SEND and resume.recipients is Recipients.LIVE
    assert rescale.at_send == (RecordAttempt(5, 3), AdmitJoiners()) and rescale.on_failure is OnFailure.ABANDON_GENERATION
    spec = p.RescaleSpec(generation=5, new_size=3, mapping=(0, 1), lost=(), execute_on="new", keep_requests=True)
    assert plan.spec == spec and rescale.build(7, 0.0) == p.Rescale(seq=7, operation_id="op-1", spec=spec, prepared=False)
    assert suppress.build(6, 0.0) == p.Suppress(seq=6, operation_id="op-1")  # a scale up announces nothing


def test_an_unprepared_scale_down_announces_its_layout_and_moves_over_the_old_group():
    from elastic.control.plans import plan_scale
    from elastic.core import protocol as p

    plan = plan_scale(snap(size=3), 2)
    _, suppress, rescale, _ = plan.steps
    assert suppress.build(4, 0.0) == p.Suppress(seq=4, operation_id="op-1", announced=plan.spec)
    command = rescale.build(5, 0.0)
    assert isinstance(command, p.Rescale) and command.spec == plan.spec and plan.joining == ()
    assert plan.spec.execute_on == "old" and plan.spec.mapping == (0, 1, -1)


def test_a_prepared_scale_adds_the_prepare_row_paced_to_what_is_left_of_draining():
    from elastic.control.plans import Prepared, Reason, plan_scale
    from elastic.core import protocol as p
    from elastic.core.phases import Trigger

    plan = plan_scale(snap(size=3, prepare=True, draining_s=10.0), 2)
    drain, prepare, suppress, rescale, _ = plan.steps
    assert drain.trigger is None and prepare.trigger is Trigger.DRAINED and prepare.command is p.Prepare
    command = prepare.build(3, 4.0)
    assert isinstance(command, p.Prepare) and command.paced_for_s == pytest.approx(0.8 * 6.0)
    assert command.spec == plan.spec
    assert suppress.build(4, 0.0) == p.Suppress(seq=4, operation_id="op-1")  # the prepare computed the placement
    assert rescale.build(5, 0.0).prepared is True  # type: ignore[attr-defined]
    outcomes = prepare.interpret({10: done(10, 0, p.PrepareDone(layers=2, layers_total=4, bytes_received=8)),
                                  11: done(11, 1, p.PrepareDone(layers=2, layers_total=4, bytes_received=4))})
    summary = dict(next(o for o in outcomes if isinstance(o, Prepared)).summary)
    assert summary["bytes_received"] == 12 and summary["layers"] == 2
    assert any(isinstance(o, Reason) and "2 of 4 changed layers" in o.text for o in outcomes)


def test_the_rescale_results_become_retire_adopt_and_pause_outcomes_or_a_refusal():
    from elastic.control.plans import AdoptSize, MeasurePause, Refuse, Retire, plan_scale
    from elastic.core import protocol as p

    rescale = plan_scale(snap(size=3, retire_grace_s=2.5), 2).steps[2]
    reports = {10: done(10, 0, p.RescaleDone(digest="d", seconds=0.2, bytes_received=5, num_physical=8)),
               11: done(11, 1, p.RescaleDone(digest="d", seconds=0.3, diverged_layers=(4,))),
               12: done(12, 2, p.RescaleDone(retired=True, seconds=0.9, bytes_received=1))}
    outcomes = rescale.interpret(reports)
    assert MeasurePause(paused_seconds=0.3, bytes_moved=6, diverged_layers=(4,)) in outcomes  # not the leaver's 0.9
    assert Retire(pids=(12,), ranks=(2,), grace_s=2.5) in outcomes and AdoptSize(2, 8) in outcomes
    torn = dict(reports)
    torn[11] = done(11, 1, p.RescaleDone(digest="other"))
    assert [type(o) for o in rescale.interpret(torn)] == [Refuse]


def test_a_layout_that_does_not_fit_the_scale_is_refused():
    from elastic.control.plans import plan_scale
    from elastic.core.mapping import RankMapping

    with pytest.raises(InvalidScaleRequest, match="not 2 -> 3"):
        plan_scale(snap(size=2, layout=RankMapping.for_resize(2, 4)), 3)


def test_recovery_retires_every_other_worker_once_and_rescales_the_survivors_without_their_requests():
    from elastic.control.plans import JoinerWait
    from elastic.core import protocol as p
    from elastic.core.phases import OperationKind, Trigger

    plan = plan_recovery(workers((10, 0, 3), (12, 2, 3), (20, 0, 4)), {}, generation=3, size=3, others=(30, 10))
    assert plan.retire == (20, 30)  # a living worker of another generation, and one already lost
    operation = plan.operation("op-2", generation=6, target=3)  # one fresh rank: the survivors cannot hold it all
    assert operation.kind is OperationKind.RECOVER and operation.joining == (2,) and operation.lost == (1,)
    rescale, resume = operation.steps
    assert rescale.joiners is JoinerWait.BEFORE_SEND and (rescale.trigger, resume.trigger) == (Trigger.RESCALED,
                                                                                             Trigger.RESUMED)
    spec = p.RescaleSpec(generation=6, new_size=3, mapping=(0, -1, 1), lost=(1,), execute_on="new", keep_requests=True)
    assert rescale.build(8, 0.0) == p.Rescale(seq=8, operation_id="op-2", spec=spec, prepared=False)
    with pytest.raises(InvalidScaleRequest):
        plan.operation("op-2", generation=6, target=1)


def test_design_md_prints_the_step_tables_the_plans_build():
    """docs/design.md's tables of a scale (with the prepare row) and a recovery are the data's rendering."""
    from pathlib import Path

    from elastic.control.plans import plan_scale

    design = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    scale = plan_scale(snap(size=2, prepare=True), 3).table()
    recovery = plan_recovery(workers((10, 0, 3), (12, 2, 3)), {}, 3, 3).operation("op-2", 4, 2).table()
    assert scale in design, "docs/design.md's scale table differs from render_steps(plan_scale(...)); print it again"
    assert recovery in design, "docs/design.md's recovery table differs from the recovery plan's; print it again"
