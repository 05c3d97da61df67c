"""The next-window load estimate (eplb.estimate), migration_aware's move gate, and the compiled moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from eplb import _compiled, algorithm
from eplb.algorithm import InvalidOptionError, _balancedness, _counts_of, cross_gpu_copies, rebalance_experts
from eplb.estimate import smoothed_load, smoothed_noise

pytestmark = pytest.mark.timeout(120)


def _zipf_counts(rng: np.random.Generator, layers: int, experts: int, tokens: int) -> np.ndarray:
    """``[layers, experts]`` multinomial counts of a Zipf profile (random ranking per layer)."""
    out = np.empty((layers, experts), dtype=np.int64)
    for b in range(layers):
        p = np.arange(1, experts + 1, dtype=np.float64) ** -rng.uniform(0.6, 1.4)
        out[b] = rng.multinomial(tokens, rng.permutation(p / p.sum()))
    return out


# --- the estimate ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), weight=st.floats(0.05, 1.0), adaptive=st.booleans())
def test_the_smoothed_load_lies_between_the_estimate_and_the_window_and_keeps_an_unchanged_load(seed, weight, adaptive):
    rng = np.random.default_rng(seed)
    prev = torch.from_numpy(rng.uniform(0, 500, (3, 12)))
    window = torch.from_numpy(rng.integers(0, 500, (3, 12)))
    est = smoothed_load(prev, window, weight, adaptive=adaptive)
    assert est.dtype == torch.float64 and est.shape == (3, 12)
    lo, hi = torch.minimum(prev, window.double()), torch.maximum(prev, window.double())
    assert bool((est >= lo - 1e-9).all() and (est <= hi + 1e-9).all())
    assert torch.allclose(smoothed_load(window.double(), window, weight, adaptive=adaptive), window.double())
    assert torch.equal(smoothed_load(None, window, weight), window.double())  # the first window: itself


def test_the_smoothed_load_averages_a_stationary_layer_and_follows_one_whose_hot_set_moved():
    rng = np.random.default_rng(7)
    profile = np.arange(1, 257, dtype=np.float64) ** -1.2
    profile /= profile.sum()
    prev = torch.from_numpy(np.stack([20000 * profile, 20000 * profile]))
    window = torch.from_numpy(np.stack([rng.multinomial(20000, profile), rng.multinomial(20000, rng.permutation(profile))]))
    est = smoothed_load(prev, window, 0.3)
    stationary = (est[0] - prev[0]) / (window[0] - prev[0]).double()
    moved = window[1].double() != prev[1]
    weight = stationary[window[0].double() != prev[0]]
    assert torch.allclose(weight, weight[:1]) and 0.3 - 1e-12 <= float(weight[0]) <= 0.45  # one weight per layer, near 0.3
    assert torch.allclose(est[1][moved], window[1].double()[moved])  # weight 1: the hot set moved
    plain = smoothed_load(prev, window, 0.3, adaptive=False)
    assert torch.allclose(plain, 0.3 * window.double() + 0.7 * prev)


def test_the_smoothing_weight_and_noise_are_checked_and_the_noise_of_the_last_window_is_two():
    assert smoothed_noise(1.0) == 2.0 and smoothed_noise(0.5) == pytest.approx(4 / 3)
    for bad in (0.0, -0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="smoothing weight"):
            smoothed_load(None, torch.ones(1, 2), bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="noise"):
        rebalance_experts(torch.ones(1, 4), 8, 1, 1, 2, policy="migration_aware", noise=-1.0)


def test_a_smoothed_estimate_is_closer_to_the_profile_than_the_last_window():
    rng = np.random.default_rng(3)
    profile = 4096 * np.arange(1, 129, dtype=np.float64) ** -1.0 / (np.arange(1, 129) ** -1.0).sum()
    est = None
    errors = []
    for _ in range(12):
        window = torch.from_numpy(rng.poisson(profile)[None, :])
        est = smoothed_load(est, window, 0.3)
        errors.append((float(((window.double() - torch.from_numpy(profile)) ** 2).mean()),
                       float(((est - torch.from_numpy(profile)) ** 2).mean())))
    last, smooth = np.mean(errors[4:], axis=0)
    assert smooth < 0.5 * last  # stationary: a / (2 - a) = 0.18 of a window's noise in expectation


# --- the move gate --------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.sampled_from([4, 8]), noise=st.sampled_from(["counts", 1.0, 1 + 0.3 / 1.7, 2.0]),
       tol=st.sampled_from([0.0, 0.01]), start=st.sampled_from(["default", "static"]))
def test_migration_aware_moves_nothing_on_an_unchanged_load(seed, gpus, noise, tol, start):
    # its previous placement is its own for this load: whatever it started from, a second
    # rebalance on the same load copies nothing, at any noise model and tolerance
    rng = np.random.default_rng(seed)
    load = torch.from_numpy(_zipf_counts(rng, 4, 32, 4000))
    slots = 32 + gpus
    origin = rebalance_experts(load, slots, 1, 1, gpus)[0] if start == "default" else torch.arange(slots).remainder(32).expand(4, slots)
    options = dict(policy="migration_aware", noise=noise, tolerance=tol)
    own = rebalance_experts(load, slots, 1, 1, gpus, previous=origin, **options)[0]
    again = rebalance_experts(load, slots, 1, 1, gpus, previous=own, **options)[0]
    assert int(cross_gpu_copies(own, again, gpus).sum()) == 0


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.sampled_from([500, 4000, 40000]), noise=st.sampled_from(["counts", 4 / 3]))
def test_from_a_far_placement_an_unchanged_load_stops_moving_within_a_few_calls_each_within_the_budget(seed, tokens, noise):
    # a far start (every layer's experts shuffled over the GPUs) is refit at once; the layers left at the noise's
    # level then move under the copy budget, a call at a time, and stop: the unchanged load's fixed point is
    # reached in a few calls (200 seeds of this shape: by the sixth), never a creep without end
    rng = np.random.default_rng(seed)
    layers, experts, gpus = 8, 64, 8
    slots = experts + 2 * gpus
    load = torch.from_numpy(_zipf_counts(rng, layers, experts, tokens))
    prev = torch.stack([torch.from_numpy(rng.permutation(np.arange(slots) % experts)) for _ in range(layers)])
    copies = []
    for _ in range(10):
        new = rebalance_experts(load, slots, 1, 1, gpus, previous=prev, policy="migration_aware", noise=noise)[0]
        copies.append(int(cross_gpu_copies(prev, new, gpus).sum()))
        prev = new
    assert copies[0] > 0
    assert max(copies[1:]) <= int(np.ceil(algorithm._COPY_BUDGET * layers * slots))
    assert copies[-3:] == [0, 0, 0], copies


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.sampled_from([4, 8]), tol=st.sampled_from([0.01, 0.02]))
def test_migration_aware_keeps_default_s_fit_to_an_unchanged_load_at_the_default_gate(seed, gpus, tol):
    # token counts (noise "auto": a window's sampling noise) at the default tolerance or wider: the
    # hedged refit's gain on the drawn windows never beats the gate (0 of 6,000 cases; with an exact
    # estimate, noise 1.0, about 1% of these cases copy 2-4 slots: docs/design.md, the move gate)
    rng = np.random.default_rng(seed)
    load = torch.from_numpy(_zipf_counts(rng, 4, 32, 4000))
    slots = 32 + gpus
    prev = rebalance_experts(load, slots, 1, 1, gpus)[0]
    new = rebalance_experts(load, slots, 1, 1, gpus, policy="migration_aware", previous=prev, tolerance=tol)[0]
    assert int(cross_gpu_copies(prev, new, gpus).sum()) == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.sampled_from([4, 8]), noise=st.sampled_from(["counts", 4 / 3]))
def test_migration_aware_moves_after_a_step_change_in_the_load(seed, gpus, noise):
    # a layer left more than 0.2 behind its refit moves and gains; one 0.1-0.17 behind can sit at the count
    # noise's level (5 spreads: 0.16 at 4 GPUs, 0.22 at 8), where the copy budget holds it back by design:
    # with 0.1 here, 5 of 1,200 seeded cases failed (all with count noise; the code before the noise-level
    # layers moved under the budget: 6), so hypothesis failed a fresh install's suite; with 0.2, none
    _step_change_moves(seed, gpus, noise, far=0.2)


def _noise_layers(monkeypatch) -> list[np.ndarray]:
    """Record, per migration_aware call, the layers that move at a noise-level gap: those its gate let
    through, and those whose refit is better on the load (the budget, not the draws, holds them)."""
    seen: list[np.ndarray] = []
    of = algorithm._MoveGate.of

    def recorded(*args, **kwargs):
        gate = of(*args, **kwargs)
        seen.append(gate.noisy & (gate.move | gate.gain))
        return gate

    monkeypatch.setattr(algorithm._MoveGate, "of", staticmethod(recorded))
    return seen


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.sampled_from([4, 8]), budget=st.sampled_from([0.0, 0.005, 0.01, 0.03]),
       noise=st.sampled_from(["counts", 1 + 0.3 / 1.7]))
def test_migration_aware_holds_noise_level_moves_to_the_copy_budget(seed, gpus, budget, noise):
    # a stationary load, the next window another sample of it: the layers the gate lets through at the
    # noise's level together copy at most the budget's share of the call's slots
    with pytest.MonkeyPatch.context() as monkeypatch:
        _held_to_the_budget(monkeypatch, seed, gpus, budget, noise)


def _held_to_the_budget(monkeypatch, seed, gpus, budget, noise):
    rng = np.random.default_rng(seed)
    layers, experts, slots = 12, 32, 32 + 2 * gpus
    profile = np.arange(1, experts + 1, dtype=np.float64)[None, :] ** -rng.uniform(0.6, 1.4, (layers, 1))
    profile = np.stack([rng.permutation(row / row.sum()) for row in profile])
    first, second = (torch.from_numpy(np.stack([rng.multinomial(3000, row) for row in profile])) for _ in range(2))
    prev = rebalance_experts(first, slots, 1, 1, gpus)[0]
    seen = _noise_layers(monkeypatch)
    monkeypatch.setattr(algorithm, "_COPY_BUDGET", budget)
    new = rebalance_experts(second, slots, 1, 1, gpus, policy="migration_aware", previous=prev, noise=noise)[0]
    copies = cross_gpu_copies(prev, new, gpus).numpy()
    assert int(copies[seen[-1]].sum()) <= budget * layers * slots


def test_the_copy_budget_binds_on_a_noisy_load(monkeypatch):
    # not vacuous: without it, the noise-level moves of this case copy more than 1% of the slots
    rng = np.random.default_rng(11)
    layers, experts, gpus, slots = 12, 32, 8, 48
    profile = np.stack([rng.permutation(np.arange(1, experts + 1, dtype=np.float64) ** -1.0) for _ in range(layers)])
    profile /= profile.sum(axis=1, keepdims=True)
    first, second = (torch.from_numpy(np.stack([rng.multinomial(3000, row) for row in profile])) for _ in range(2))
    prev = rebalance_experts(first, slots, 1, 1, gpus)[0]
    seen = _noise_layers(monkeypatch)
    copies = {}
    for budget in (float("inf"), 0.01):
        monkeypatch.setattr(algorithm, "_COPY_BUDGET", budget)
        new = rebalance_experts(second, slots, 1, 1, gpus, policy="migration_aware", previous=prev)[0]
        copies[budget] = int(cross_gpu_copies(prev, new, gpus).numpy()[seen[-1]].sum())
    assert copies[float("inf")] > 0.01 * layers * slots >= copies[0.01] > 0


def test_a_noise_level_layer_the_drawn_windows_hold_still_moves_towards_its_aim_within_the_budget(monkeypatch):
    # the drawn windows judge a layer poorly (docs/design.md): a noise-level layer they hold still but whose
    # refit is better on the load moves anyway, as far as its aim and the call's budget allow (the code
    # before this copied nothing for it: the gate alone decided)
    rng = np.random.default_rng(3)
    layers, experts, gpus, slots = 12, 32, 8, 48
    profile = np.stack([rng.permutation(np.arange(1, experts + 1, dtype=np.float64) ** -rng.uniform(0.6, 1.4))
                        for _ in range(layers)])
    profile /= profile.sum(axis=1, keepdims=True)
    first, second = (torch.from_numpy(np.stack([rng.multinomial(3000, row) for row in profile])) for _ in range(2))
    prev = rebalance_experts(first, slots, 1, 1, gpus)[0]
    gates: list = []
    of = algorithm._MoveGate.of
    monkeypatch.setattr(algorithm._MoveGate, "of", staticmethod(lambda *a, **k: gates.append(of(*a, **k)) or gates[-1]))
    new = rebalance_experts(second, slots, 1, 1, gpus, policy="migration_aware", previous=prev)[0]
    gate = gates[-1]
    held = gate.noisy & gate.gain & ~gate.move & (gate.balanced_now < gate.aim)  # short of its aim on the load
    assert held.any()
    copies = cross_gpu_copies(prev, new, gpus).numpy()
    assert (copies[held] > 0).all()
    load = second.numpy().astype(np.float64)
    assert (_balancedness(new.numpy(), load, gpus)[held] > _balancedness(prev.numpy(), load, gpus)[held]).all()
    assert copies[gate.noisy & (gate.move | gate.gain)].sum() <= algorithm._COPY_BUDGET * layers * slots


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.sampled_from([4, 8]), noise=st.sampled_from([1.18, 2.0]))
def test_the_moves_hedge_each_expert_by_its_replicas_in_the_placement_they_move(seed, gpus, noise):
    # _own_hedged: the hedge of _hedged with the placement's replica counts instead of the load's greedy
    # ones, scaled to the hedged load's sums; equal to _hedged where the counts are the same
    rng = np.random.default_rng(seed)
    load = _zipf_counts(rng, 6, 32, 4000).astype(np.float64)
    slots = 32 + 2 * gpus
    hedged = algorithm._hedged(load, slots, gpus, noise)
    own = rebalance_experts(torch.from_numpy(hedged), slots, 1, 1, gpus)[0].numpy()
    counts = _counts_of(own, 32)
    out = algorithm._own_hedged(load, hedged, own, gpus, noise)
    np.testing.assert_allclose(out.sum(axis=1), hedged.sum(axis=1), rtol=1e-12)
    h = algorithm._HEDGE / 2 * np.sqrt(noise / (load.sum(axis=1) / gpus))
    weight = out / np.maximum(load, 1e-300)  # per expert: proportional to 1 + h / (its replicas in the placement)
    loaded = load > 0
    ratio = np.where(loaded, weight / (1.0 + h[:, None] / counts), np.nan)
    np.testing.assert_allclose(ratio, np.nanmean(ratio, axis=1, keepdims=True) * np.ones_like(ratio), rtol=1e-9)
    greedy = algorithm._replica_counts(load, slots, gpus)
    same = (counts == greedy).all(axis=1)
    np.testing.assert_allclose(out[same], hedged[same], rtol=1e-12)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.sampled_from([4, 8]), noise=st.sampled_from(["counts", 4 / 3]))
def test_a_step_change_is_not_held_back_by_the_copy_budget(seed, gpus, noise):
    # a budget of nothing: the layers whose hot set moved still move where their gap is far above the
    # noise. A layer 0.15 behind its refit can sit within the gate's 5 spreads of count noise (3 of
    # 1,204 seeded cases; hypothesis found seed 406 at 8 GPUs): the budget holds that one back as
    # noise, by design; 0.2 behind, none of the 1,204 was held back
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(algorithm, "_COPY_BUDGET", 0.0)
        _step_change_moves(seed, gpus, noise, far=0.2)


def _step_change_moves(seed, gpus, noise, far=0.15):
    """The hot set of every layer moves (the same shape of load): the layers left more than ``far`` of
    balance behind a refit copy, and gain at least 0.05."""
    rng = np.random.default_rng(seed)
    before = _zipf_counts(rng, 4, 32, 8000)
    after = np.stack([rng.permutation(row) for row in before])
    slots = 32 + gpus
    prev = rebalance_experts(torch.from_numpy(before), slots, 1, 1, gpus)[0]
    load = torch.from_numpy(after)
    new = rebalance_experts(load, slots, 1, 1, gpus, policy="migration_aware", previous=prev, noise=noise)[0]
    stay = _balancedness(prev.numpy(), after.astype(np.float64), gpus)
    moved = _balancedness(new.numpy(), after.astype(np.float64), gpus)
    shifted = stay < _balancedness(rebalance_experts(load, slots, 1, 1, gpus)[0].numpy(), after.astype(np.float64), gpus) - far
    assert shifted.any()  # the step change left some layer far from a refit
    copies = cross_gpu_copies(prev, new, gpus).numpy()
    assert (copies[shifted] > 0).all() and (moved[shifted] > stay[shifted] + 0.05).all()


# --- the hedged fit -------------------------------------------------------------------------


def test_the_hedged_fit_serves_the_next_window_better_than_the_fit_to_the_load_alone():
    # a GPU's next-window load varies by the sum of its slots' load over their expert's replicas: the
    # placement migration_aware fits (default's packing of the hedged load) peaks less on the windows
    # drawn around the load than default's fit to the load itself, on 64 GPUs where the noise decides
    # which GPU peaks
    rng = np.random.default_rng(1)
    layers, experts, gpus, slots = 16, 256, 64, 320
    expected = np.stack([rng.permutation(p / p.sum()) * 512 * gpus
                         for p in (np.arange(1, experts + 1, dtype=np.float64) ** -rng.uniform(0.8, 1.4) for _ in range(layers))])
    static = torch.arange(slots).remainder(experts).expand(layers, slots)
    hedged = rebalance_experts(torch.from_numpy(expected), slots, 1, 1, gpus, policy="migration_aware", previous=static,
                               noise=1.0)[0].numpy()
    plain = rebalance_experts(torch.from_numpy(expected), slots, 1, 1, gpus)[0].numpy()
    draws = [rng.poisson(expected).astype(np.float64) for _ in range(64)]
    gain = np.mean([_balancedness(hedged, d, gpus) - _balancedness(plain, d, gpus) for d in draws], axis=0)
    assert gain.mean() > 0.002 and (gain > 0).mean() > 0.6
    # without a noise model nothing is hedged: default's placement, its GPUs matched
    same = rebalance_experts(torch.from_numpy(expected), slots, 1, 1, gpus, policy="migration_aware", previous=static,
                             noise="none")[0].numpy()
    assert np.allclose(_balancedness(same, expected, gpus), _balancedness(plain, expected, gpus))


# --- the compiled moves ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.integers(2, 8), per_gpu=st.integers(1, 5), budget=st.integers(0, 12),
       prefer=st.booleans())
def test_the_compiled_moves_never_raise_the_peak_stay_in_budget_and_keep_every_expert(seed, gpus, per_gpu, budget, prefer):
    rng = np.random.default_rng(seed)
    slots = gpus * per_gpu
    n = int(rng.integers(max(1, slots // 2), slots + 1))
    load = rng.pareto(1.3, (2, n)) * 100
    p2l = np.stack([np.concatenate([rng.permutation(n), rng.integers(0, n, slots - n)]) for _ in range(2)])
    se = p2l.reshape(2, gpus, per_gpu).copy()
    pref = _counts_of(p2l, n)[:, ::-1].copy() if prefer else np.zeros((2, 0), np.int64)
    target = load.sum(axis=1) / gpus  # the mean: out of reach, so every layer moves while it can
    made = _compiled.improve(se, load, target, np.full(2, budget, np.int64), 4 * slots, 8, pref, 0.2, np.zeros((2, 0, 2)))
    out = se.reshape(2, slots)
    assert (_counts_of(out, n) >= 1).all()
    assert (made <= budget).all()
    assert (cross_gpu_copies(torch.from_numpy(p2l), torch.from_numpy(out), gpus).numpy() <= made).all()
    peak_before = 1 / np.maximum(_balancedness(p2l, load, gpus), 1e-300)
    peak_after = 1 / np.maximum(_balancedness(out, load, gpus), 1e-300)
    assert (peak_after <= peak_before * (1 + 1e-12)).all()



@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.integers(2, 8), per_gpu=st.integers(1, 5), pick=st.floats(0.0, 1.0))
def test_the_traced_moves_stop_at_a_prefix_of_their_path_for_a_looser_target(seed, gpus, per_gpu, pick):
    # the copy budget reads every aim's copies off one traced run: a looser target (any traced peak)
    # stops the same moves at the first step that reaches it, with the traced copies
    rng = np.random.default_rng(seed)
    slots = gpus * per_gpu
    n = int(rng.integers(max(1, slots // 2), slots + 1))
    load = rng.pareto(1.3, (1, n)) * 100
    p2l = np.concatenate([rng.permutation(n), rng.integers(0, n, slots - n)])[None]
    pref = _counts_of(p2l, n)[:, ::-1].copy()
    target = load.sum(axis=1) / gpus
    trace = np.full((1, 4 * slots + 1, 2), np.inf)
    se = p2l.reshape(1, gpus, per_gpu).copy()
    made = _compiled.improve(se, load, target, np.full(1, 10**6, np.int64), 4 * slots, 8, pref, 0.2, trace)
    steps = int(np.isfinite(trace[0, :, 0]).sum())
    assert steps >= 1 and trace[0, steps - 1, 1] == made[0] and (np.diff(trace[0, :steps, 0]) <= 1e-9 * trace[0, 0, 0]).all()
    j = int(pick * (steps - 1))
    first = int(np.argmax(trace[0, :steps, 0] <= trace[0, j, 0] * (1 + 1e-12)))
    se2 = p2l.reshape(1, gpus, per_gpu).copy()
    made2 = _compiled.improve(se2, load, trace[0, j:j + 1, 0].copy(), np.full(1, 10**6, np.int64), 4 * slots, 8, pref, 0.2,
                              np.zeros((1, 0, 2)))
    assert made2[0] == trace[0, first, 1]
    peak = 1 / np.maximum(_balancedness(se2.reshape(1, slots), load, gpus), 1e-300) * load.sum() / gpus
    assert np.isclose(peak[0], trace[0, first, 0], rtol=1e-9)
    short = np.full((1, 3, 2), np.inf)  # two columns for the moves: the last is where the path ended
    _compiled.improve(p2l.reshape(1, gpus, per_gpu).copy(), load, target, np.full(1, 10**6, np.int64), 4 * slots, 8, pref,
                      0.2, short)
    assert np.array_equal(short[0, :min(steps, 3)], trace[0, [*range(min(steps, 3) - 1), steps - 1]])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.integers(1, 8), per_gpu=st.integers(1, 5))
def test_the_compiled_copy_count_is_the_new_gpu_expert_pairs(seed, gpus, per_gpu):
    rng = np.random.default_rng(seed)
    slots = gpus * per_gpu
    n = int(rng.integers(1, slots + 1))
    carried = rng.integers(-1, n, (3, slots))  # -1: an empty slot (after a scale)
    p2l = rng.integers(0, n, (3, slots))
    old = np.zeros((3, gpus, n), bool)
    new = np.zeros((3, gpus, n), bool)
    for r in range(3):
        for t in range(slots):
            new[r, t // per_gpu, p2l[r, t]] = True
            if carried[r, t] >= 0:
                old[r, t // per_gpu, carried[r, t]] = True
    assert np.array_equal(_compiled.copies_vs(carried, p2l, gpus, n), (new & ~old).sum(axis=(1, 2)))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.integers(1, 8), per_gpu=st.integers(1, 5))
@example(seed=14, gpus=6, per_gpu=5)  # default put two replicas of an idle expert on one GPU: re-seated, one more copy
def test_keep_idle_reseats_idle_experts_without_changing_balance_or_counts_and_never_adds_copies(seed, gpus, per_gpu):
    from eplb.algorithm import _copies_vs, _keep_idle

    rng = np.random.default_rng(seed)
    slots = gpus * per_gpu
    n = int(rng.integers(1, slots + 1))
    load = rng.pareto(1.3, (3, n)) * (rng.random((3, n)) < 0.5)  # about half the experts idle
    p2l = rebalance_experts(torch.from_numpy(load), slots, 1, 1, gpus)[0].numpy()
    carried = rebalance_experts(torch.from_numpy(rng.pareto(1.3, (3, n))), slots, 1, 1, gpus)[0].numpy()
    carried = np.where(rng.random(carried.shape) < 0.1, -1, carried)  # some slots empty (after a scale)
    out = _keep_idle(p2l.copy(), carried, load, gpus)
    assert np.array_equal(_counts_of(out, n), _counts_of(p2l, n))
    assert np.array_equal(np.where(load[np.arange(3)[:, None], out] > 0, out, -1), np.where(load[np.arange(3)[:, None], p2l] > 0, p2l, -1))
    assert np.allclose(_balancedness(out, load, gpus), _balancedness(p2l, load, gpus))
    assert (_copies_vs(carried, out, gpus, n) <= _copies_vs(carried, p2l, gpus, n)).all()



@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.sampled_from([1, 2, 3, 8, 32, 64, 128]), per_gpu=st.integers(1, 20),
       integer=st.booleans())
def test_the_compiled_balancedness_is_numpys_to_the_bit(seed, gpus, per_gpu, integer):
    from eplb.algorithm import _gpu_loads

    rng = np.random.default_rng(seed)
    slots = gpus * per_gpu
    n = int(rng.integers(1, slots + 1))
    load = rng.pareto(1.2, (3, n)) * 100 * (rng.random((3, n)) < 0.8)
    load = np.round(load) if integer else load
    p2l = np.stack([np.concatenate([rng.permutation(n), rng.integers(0, n, slots - n)]) for _ in range(3)])
    loads = _gpu_loads(p2l, load, gpus)  # numpy: sums over a GPU's slots, the mean over GPUs
    peak = loads.max(axis=1)
    want = np.where(peak > 0, loads.mean(axis=1) / np.maximum(peak, 1e-300), 1.0)
    assert np.array_equal(_compiled.balancedness(p2l, load, gpus), want)



@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gpus=st.sampled_from([1, 2, 3, 8, 32, 64]), per_gpu=st.integers(1, 12),
       draws=st.sampled_from([1, 2, 4, 9]))
def test_the_compiled_balance_on_drawn_windows_is_numpys(seed, gpus, per_gpu, draws):
    rng = np.random.default_rng(seed)
    slots = gpus * per_gpu
    n = int(rng.integers(1, slots + 1))
    load = rng.pareto(1.2, (3, n)) * 100 * (rng.random((3, n)) < 0.8)
    drawn = np.maximum(load[None] + rng.standard_normal((draws, 3, n)) * np.sqrt(1.18 * load)[None], 0.0)
    p2l = np.stack([np.concatenate([rng.permutation(n), rng.integers(0, n, slots - n)]) for _ in range(3)])
    rows = np.arange(3)[:, None]
    per_slot = drawn[:, rows, p2l] / np.maximum(_counts_of(p2l, n), 1)[rows, p2l][None]
    loads = per_slot.reshape(draws, 3, gpus, -1).sum(axis=3)
    peak = loads.max(axis=2)
    want = np.where(peak > 0, loads.mean(axis=2) / np.maximum(peak, 1e-300), 1.0).mean(axis=0)
    np.testing.assert_allclose(_compiled.on_draws(p2l, drawn, gpus), want, rtol=1e-12, atol=0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), n=st.integers(1, 300), noise=st.sampled_from([0.0, 1.18, 2.0, 7.5]))
def test_the_compiled_gate_draws_are_numpys_to_the_bit(seed, rows, n, noise):
    # migration_aware's gate draws its next windows compiled (eplb._compiled.gate_draws): the same
    # elementwise arithmetic as the numpy formula, so the same windows, bit for bit (zero loads too)
    from eplb.algorithm import _gate_draws, _normals

    rng = np.random.default_rng(seed)
    load = rng.pareto(1.2, (rows, n)) * 100 * (rng.random((rows, n)) < 0.8)
    want = np.maximum(load[None] + _normals(load.shape) * np.sqrt(noise * load)[None], 0.0)
    got = _gate_draws(load, noise)
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


# --- the deployment knob: eplb.load_smoothing -------------------------------------------------


def _deployment(**eplb):
    from elastic.deployment import DeploymentConfig

    return DeploymentConfig.model_validate({
        "ep_size": 1, "model": {"num_layers": 3, "num_experts": 8, "hidden_size": 8, "intermediate_size": 8},
        "eplb": {"num_redundant_experts": 4, "window_size": 1, "step_interval": 1000, **eplb}})


def _physical_counts(placement, logical: torch.Tensor) -> torch.Tensor:
    """Per-slot counts whose logical sum is ``logical`` (each expert's load on its first slot)."""
    out = torch.zeros(placement.num_layers, placement.num_physical, dtype=torch.int64)
    first = placement.logical_to_physical[:, :, 0]
    out.scatter_(1, first, logical)
    return out


def _spied_rebalances(monkeypatch, smoothing: float, windows: list[torch.Tensor]) -> list[tuple[np.ndarray, dict]]:
    """Windows fed one by one to the EPLB of a one-rank deployment (a real model, sync moves),
    rebalancing after each; what the policy saw (load, options) at each rebalance."""
    import functools

    from elastic.control.spawn import worker_spec
    from elastic.worker.rescale_plan import eplb_config_for
    from eplb.algorithm import POLICIES
    from eplb.model import ReferenceMoE
    from eplb.placement import Placement
    from eplb.state import EPLBState

    spec = worker_spec(_deployment(policy="migration_aware", load_smoothing=smoothing), 0, 1, 0, store_port=1)
    seen: list[tuple[np.ndarray, dict]] = []
    real = POLICIES["migration_aware"]

    @functools.wraps(real)
    def spy(problem, **options):
        seen.append((problem.load.copy(), options))
        return real(problem, **options)

    monkeypatch.setitem(POLICIES, "migration_aware", spy)
    placement = Placement.static(3, 8, 12)
    state = EPLBState(eplb_config_for(spec.eplb, ("localhost",)), ReferenceMoE(spec.shape, placement, 0, 1),
                      placement, 0, 1)
    for window in windows:
        state.record(_physical_counts(state.placement, window))
        assert state.rebalance_now(scheduled=True) is True
    return seen


def test_the_deployment_knob_reaches_the_policy_as_the_smoothed_estimate_and_its_noise(monkeypatch):
    rng = np.random.default_rng(11)
    windows = [torch.from_numpy(_zipf_counts(np.random.default_rng(5), 3, 8, 4000))]
    profile = windows[0].double().numpy() / 4000
    windows += [torch.from_numpy(np.stack([rng.multinomial(4000, row / row.sum()) for row in profile])) for _ in range(2)]
    seen = _spied_rebalances(monkeypatch, 0.5, windows)
    assert len(seen) == 3
    est = None
    for (load, options), window in zip(seen, windows):
        est = smoothed_load(est, window, 0.5)
        np.testing.assert_allclose(load, est.numpy())  # the estimate the config's weight gives, window by window
        assert options["noise"] == pytest.approx(smoothed_noise(0.5))
    assert not np.allclose(seen[-1][0], windows[-1].double().numpy())  # not the last window alone
    last = _spied_rebalances(monkeypatch, 1.0, windows)
    for (load, options), window in zip(last, windows):
        np.testing.assert_array_equal(load, window.double().numpy())  # 1.0: the window total, as vLLM
        assert "noise" not in options  # int64 counts: the policy's own "auto" (two windows' noise)


def test_the_estimate_carries_over_a_rescale_with_the_window():
    from eplb.state import LoadWindow

    window = LoadWindow(2, 3, 8)
    window.record(torch.arange(24).reshape(3, 8))
    first = window.fold(0.3).clone()
    window.record(torch.arange(24).reshape(3, 8).flip(1))
    expected = window.fold(0.3).clone()
    moved = LoadWindow.from_state(window.state())
    assert moved.estimate is not None and torch.equal(moved.estimate, expected)
    assert not torch.equal(first, expected)
    old = window.state()
    del old["estimate"]  # a state sent by a rank from before the estimate
    assert LoadWindow.from_state(old).estimate is None
    assert window.fold(1.0).dtype == torch.int64 and window.estimate is None  # 1.0: the total, estimate restarts


@pytest.mark.parametrize("bad", [0, 0.0, -0.2, 1.5, float("nan"), True, "often"])
def test_a_bad_load_smoothing_is_refused_naming_the_knob(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="load_smoothing"):
        _deployment(load_smoothing=bad)
    assert _deployment().eplb.load_smoothing == 0.3  # the bench's choice (tune seeds) is the default
