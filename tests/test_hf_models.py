"""eplb.models.hf: Hugging Face MoE architectures under expert parallelism, output bitwise unchanged.

Every architecture runs on 2 real gloo processes through a rebalance (the project's
plan_layer/execute_layer/commit_layer, one layer at a time with decode steps in between), the
loss of a rank's weights (experts nobody else holds are reloaded) and a change of slots per rank;
after each, the greedy tokens and logits of the probe batch must be bitwise those of the
unsharded model in one process. A checkpoint written by plain transformers' save_pretrained
serves a scale-up 1 -> 2 (the joining rank gets its non-expert weights from the peer and its
experts by transfer) and a rank loss reloaded from the directory; a wrong expert put in one slot
on purpose must make the probe trip. One launch runs all architectures (transformers' first
import costs seconds per process).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from eplb.algorithm import compute_placement
from eplb.models.config import (
    ARCHITECTURES,
    HFModelConfig,
    ModelSpec,
    ReferenceModelConfig,
    tiny_config,
)
from eplb.placement import Placement
from eplb.plan import plan_layer
from eplb.transfer import commit_layer, execute_layer, materialize
from tests.distributed import run_distributed

TIMEOUT = 20.0  # every collective and transfer wait in the bodies
ARCHS = list(ARCHITECTURES)
CHECKPOINT_ARCHS = ["deepseek_v3", "gpt_oss", "mixtral"]  # per-expert keys, fused slices, block_sparse_moe keys
L = 8  # experts of every tiny architecture


def swap_rank_blocks(p2l: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """The same per-rank sets on other ranks: every expert must cross the network (a real move)."""
    blocks = p2l.view(p2l.shape[0], num_ranks, -1)
    return blocks.roll(1, dims=1).reshape(p2l.shape)


def move_layer(model, rank: int, layer: int, old_row, new_row, s_old: int, s_new: int, weights_old, weights_new,
               old_holder=None, new_holder=None) -> dict:
    """One layer's move with the project's planner and executor; returns what this rank did."""
    plan = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder)
    rp = plan.for_rank(rank)
    stats = execute_layer(plan, rank, weights_old, weights_new, timeout=TIMEOUT, layer=layer,
                          reload_fn=lambda e: model.canonical_expert(layer, e))
    return {"plan": rp, "transfers": plan.num_transfers, "reloads": stats.num_reloads}


def body_architectures(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    from eplb.models.hf import HFMoE, describe, unsharded

    torch.set_num_threads(1)
    out = {}
    for arch, dtype in cases:
        spec = HFModelConfig(architecture=arch, seed=7, dtype=dtype)
        info = describe(spec)
        layers = info.num_moe_layers
        reference = unsharded(spec)
        ref = reference.probe()
        serve_ids = torch.randint(0, reference.vocab_size, (3, 5), generator=torch.Generator().manual_seed(99))
        ref_tokens, ref_logits = reference.generate(serve_ids, 7)
        del reference
        # the ranks own different requests: rank 0 the first two, rank 1 the third
        own = [0, 1] if rank == 0 else [2]

        s = 6  # 12 slots over 2 ranks: 4 redundant
        placement = Placement.static(layers, L, s * world_size)
        model = HFMoE(spec, placement, rank, world_size, timeout=TIMEOUT)
        checks = {"start": model.probe().compare(ref)}

        # serve a batch; the rebalance commits one layer per decode step, as the async EPLB does
        state = model.prefill(serve_ids[own])
        model.decode_step(state)
        logical, physical = model.take_load()
        balance = model.take_dispatch_balance()
        new = Placement.from_physical_to_logical(
            swap_rank_blocks(compute_placement(logical, s * world_size, world_size).physical_to_logical, world_size), L)
        transfers = _rebalance_while_serving(model, rank, world_size, s, new, state)
        while len(state.tokens) < 6:
            model.decode_step(state)
        # one more step in which rank 1 has no request: it only takes part in the exchanges
        if rank == 0:
            model.decode_step(state)
        else:
            idle = model.forward_batch([])
        serve_tokens, serve_logits = torch.stack(state.tokens, 1), torch.stack(state.logits, 1)
        n = serve_tokens.shape[1]
        checks["rebalance"] = model.probe().compare(ref)

        # rank 1's weights are lost: a fresh placement, experts only rank 1 held are reloaded
        reloads = _lose_rank_1(model, rank, world_size, s)
        checks["recovery"] = model.probe().compare(ref)

        # slots per rank 6 -> 8 (16 slots): new tensors, materialized from the old ones
        _widen(model, rank, world_size, logical, s, 8)
        checks["slots"] = model.probe().compare(ref)

        out[f"{arch}/{dtype}"] = {
            "checks": checks, "verify": model.verify(), "transfers": transfers, "reloads": reloads,
            "serve_equal": torch.equal(serve_tokens, ref_tokens[own, :n]) and torch.equal(serve_logits, ref_logits[own, :n]),
            "served": n, "idle": None if rank == 0 else (tuple(idle[0].shape), idle[1]), "balance": balance,
            # lists: tensors would travel as shared memory, gone when the worker exits
            "load": logical.tolist(), "physical": physical.tolist(),
            "tokens_per_layer": (3 * 5 + 3) * info_top_k(spec),  # prefill + one step
        }
    return out


def _rebalance_while_serving(model: Any, rank: int, world_size: int, s: int, new: Placement, state: Any) -> int:
    """Move to ``new`` one layer per decode step, as the async EPLB does; the transfers made."""
    transfers = 0
    for layer in range(model.num_moe_layers):
        weights = model.expert_weights()[layer]
        staging = [torch.empty_like(t) for t in weights]
        moved = move_layer(model, rank, layer, model.placement.physical_to_logical[layer],
                           new.physical_to_logical[layer], s, s, weights, staging)
        commit_layer(moved["plan"], staging, weights)
        model.install_placement(model.placement.with_layer(layer, new.physical_to_logical[layer]), rank, world_size)
        transfers += moved["transfers"]
        model.decode_step(state)  # a step on a half-moved placement
    return transfers


def _lose_rank_1(model: Any, rank: int, world_size: int, s: int) -> int:
    """Rank 1's weights are lost: a fresh static placement, experts only rank 1 held reloaded; the reloads."""
    layers = model.num_moe_layers
    lost_placement = Placement.static(layers, L, s * world_size)
    reloads = 0
    fresh = model.allocate(s)
    for layer in range(layers):
        old_w = model.expert_weights()[layer]
        if rank == 1:
            moved = move_layer(model, rank, layer, model.placement.physical_to_logical[layer],
                               lost_placement.physical_to_logical[layer], s, s, None, fresh[layer],
                               old_holder=(0, -1), new_holder=(0, 1))
            materialize(moved["plan"], None, fresh[layer])
        else:
            staging = [torch.empty_like(t) for t in old_w]
            moved = move_layer(model, rank, layer, model.placement.physical_to_logical[layer],
                               lost_placement.physical_to_logical[layer], s, s, old_w, staging,
                               old_holder=(0, -1), new_holder=(0, 1))
            commit_layer(moved["plan"], staging, old_w)
        reloads += moved["reloads"]
    if rank == 1:
        model.replace_weights(fresh)
    model.install_placement(lost_placement, rank, world_size)
    return reloads


def _widen(model: Any, rank: int, world_size: int, logical: torch.Tensor, s: int, s_new: int) -> None:
    """Slots per rank ``s`` -> ``s_new``: new tensors, materialized from the old ones."""
    wider = compute_placement(logical, s_new * world_size, world_size)
    new_weights = model.allocate(s_new)
    for layer in range(model.num_moe_layers):
        moved = move_layer(model, rank, layer, model.placement.physical_to_logical[layer],
                           wider.physical_to_logical[layer], s, s_new, model.expert_weights()[layer],
                           new_weights[layer])
        materialize(moved["plan"], model.expert_weights()[layer], new_weights[layer])
    model.replace_weights(new_weights)
    model.install_placement(wider, rank, world_size)


def info_top_k(spec: HFModelConfig) -> int:
    return tiny_config(spec.architecture, spec.config)["num_experts_per_tok"]


BF16_ARCHS = ["deepseek_v3", "gpt_oss"]


@pytest.fixture(scope="module")
def arch_runs():
    cases = [(arch, "float32") for arch in ARCHS] + [(arch, "bfloat16") for arch in BF16_ARCHS]
    return run_distributed(body_architectures, 2, args=(cases,), timeout=200, pg_timeout=TIMEOUT)


pytestmark = pytest.mark.timeout(300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", ARCHS)
def test_identical_output_through_rebalance_recovery_and_slot_change(arch_runs, arch):
    check_case(arch_runs, f"{arch}/float32")


def check_case(arch_runs, case: str) -> None:
    for rank, per_rank in enumerate(arch_runs):
        r = per_rank[case]
        for when, check in r["checks"].items():
            assert check["identical"], (rank, when, check)
        assert r["serve_equal"], f"rank {rank}: tokens or logits served across the rebalance differ"
        # rank 0 decoded one step more, while rank 1 had no request and only exchanged pairs
        assert r["served"] == (7 if rank == 0 else 6)
        assert r["idle"] in (None, ((0, 128), []))
        # both ranks' experts computed pairs; the mean/max of their pairs is the same on both ranks
        assert 0 < r["balance"] <= 1 and r["balance"] == arch_runs[0][case]["balance"]
        assert r["verify"] == [], r["verify"]
        assert r["transfers"] > 0
        # load is the group's: every (token, k) pair of both ranks' prefills and a step, per layer
        load, physical = torch.tensor(r["load"]), torch.tensor(r["physical"])
        assert load.sum(dim=1).tolist() == [r["tokens_per_layer"]] * load.shape[0]
        assert r["load"] == arch_runs[0][case]["load"]  # the group's counts, the same on every rank
        assert torch.equal(physical.sum(dim=1), load.sum(dim=1))
    # the experts only the lost rank held came back from the source (on whichever rank needs them)
    assert sum(per_rank[case]["reloads"] for per_rank in arch_runs) > 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bf16_identical_to_the_same_kernel_in_one_process(arch_runs, arch):
    check_case(arch_runs, f"{arch}/bfloat16")


# -- a checkpoint directory -------------------------------------------------------------------------

def write_checkpoint(arch: str, path: str, seed: int = 11) -> None:
    """A checkpoint the way a user has one: plain transformers, save_pretrained, safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **tiny_config(arch)))
    model.save_pretrained(path)


def body_checkpoint(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    import torch.distributed as dist

    from eplb.models.hf import HFMoE, describe, unsharded

    torch.set_num_threads(1)
    out = {}
    for arch, path in paths.items():
        spec = HFModelConfig(path=path)
        ref = unsharded(spec).probe()
        layers = describe(spec).num_moe_layers
        alone = dist.new_group([0])  # every rank takes part in forming a group
        s = 8
        r: dict = {}
        # EP 1: rank 0 serves alone, having read every expert from the directory
        if rank == 0:
            model = HFMoE(spec, Placement.static(layers, L, s), 0, 1, group=alone, timeout=TIMEOUT)
            r["alone"] = model.probe().compare(ref)
        # scale up 1 -> 2, slots per rank kept: rank 0 keeps 0-5 and two copies, rank 1 alone holds 6 and 7
        row = [0, 1, 2, 3, 4, 5, 0, 1, 6, 7, 2, 3, 4, 5, 6, 7]
        grown = Placement.from_physical_to_logical(torch.tensor([row] * layers), L)
        if rank == 1:
            model = HFMoE(spec, grown, 1, 2, materialize=False, load_non_expert=False, timeout=TIMEOUT)
        r["non_expert"] = model.sync_non_expert(src=0, group=None, timeout=TIMEOUT)
        _join_rank_1(model, rank, grown, s)
        r["joined_read"] = model.source.bytes_read if rank == 1 else None
        r["grown"] = model.probe().compare(ref)

        # rank 1 is lost; its replacement takes its slots: experts 6 and 7 were only there, so they are
        # reloaded from the directory, the others come from rank 0
        _replace_rank_1(model, rank, grown, s, r)
        r["expert_bytes"] = describe(HFModelConfig(path=path)).expert_bytes
        r["layers"] = layers
        r["recovered"] = model.probe().compare(ref)
        r["verify"] = model.verify()

        # a wrong expert in one slot on purpose: the slot of rank 1 the probe batch uses most
        _trip_a_slot(model, rank, grown, s, ref, r)

        # one replicated weight one ulp off on rank 1 (what another thread count or a bad copy does)
        _diverge(model, rank, ref, r)
        out[arch] = r
    return out


def _join_rank_1(model: Any, rank: int, grown: Placement, s: int) -> None:
    """Scale 1 -> 2: rank 0 moves to ``grown`` (keeping its experts), rank 1 receives or reloads its slots."""
    for layer in range(model.num_moe_layers):
        old_row = model.placement.physical_to_logical[layer] if rank == 0 else torch.arange(L)
        if rank == 0:
            weights = model.expert_weights()[layer]
            staging = [torch.empty_like(t) for t in weights]
            moved = move_layer(model, 0, layer, old_row, grown.physical_to_logical[layer], s, s, weights, staging,
                               old_holder=(0,), new_holder=(0, 1))
            commit_layer(moved["plan"], staging, weights)
        else:
            weights = model.expert_weights()[layer]
            moved = move_layer(model, 1, layer, old_row, grown.physical_to_logical[layer], s, s, None, weights,
                               old_holder=(0,), new_holder=(0, 1))
            materialize(moved["plan"], None, weights)
    if rank == 0:
        model.install_placement(grown, 0, 2)
        model.set_group(None)


def _replace_rank_1(model: Any, rank: int, grown: Placement, s: int, r: dict) -> None:
    """Rank 1 is lost; its replacement takes its slots (experts only it held reloaded from the directory)."""
    layers = model.num_moe_layers
    before = model.source.expert_bytes_read
    back = grown
    reloads = 0
    fresh = model.allocate(s)
    for layer in range(layers):
        if rank == 1:
            moved = move_layer(model, 1, layer, grown.physical_to_logical[layer], back.physical_to_logical[layer],
                               s, s, None, fresh[layer], old_holder=(0, -1), new_holder=(0, 1))
            materialize(moved["plan"], None, fresh[layer])
        else:
            weights = model.expert_weights()[layer]
            staging = [torch.empty_like(t) for t in weights]
            moved = move_layer(model, 0, layer, grown.physical_to_logical[layer], back.physical_to_logical[layer],
                               s, s, weights, staging, old_holder=(0, -1), new_holder=(0, 1))
            commit_layer(moved["plan"], staging, weights)
        reloads += moved["reloads"]
    if rank == 1:
        model.replace_weights(fresh)
    model.install_placement(back, rank, 2)
    r["reloads"] = reloads
    r["reload_bytes"] = model.source.expert_bytes_read - before


def _trip_a_slot(model: Any, rank: int, back: Placement, s: int, ref: Any, r: dict) -> None:
    """A wrong expert in rank 1's slot the probe batch uses most: the probe and verify trip, a reload repairs."""
    model.generate(model.probe_batch(), 2)
    physical = model.take_load()[1]
    slot = int(physical[0, s:].argmax()) + s
    if rank == 1:
        expert = int(back.physical_to_logical[0, slot])
        wrong = model.canonical_expert(0, (expert + 1) % L)
        with torch.no_grad():
            for t, w in zip(model.expert_weights()[0], wrong):
                t[slot - s].copy_(w)
    r["wrong_slot"] = (0, slot)
    r["tripped"] = model.probe().compare(ref)
    r["tripped_verify"] = model.verify()
    model.load_canonical()
    r["repaired"] = model.probe().compare(ref)


def _diverge(model: Any, rank: int, ref: Any, r: dict) -> None:
    """Rank 1 one ulp off in a non-expert weight: only its own probe trips (it runs its own
    requests). Rank 1 on another placement of layer 0: both ranks refuse at MoE layer 0."""
    from eplb.models.kernel import ReplicaDivergence

    emb = model.model.get_input_embeddings().weight
    kept = emb.detach().clone()
    if rank == 1:
        with torch.no_grad():
            emb.copy_(torch.nextafter(emb, torch.full_like(emb, float("inf"))))
    r["diverged"] = model.probe().compare(ref)
    with torch.no_grad():
        emb.copy_(kept)
    placement = model.placement
    if rank == 1:
        row = placement.physical_to_logical[0].clone()
        row[[0, 1]] = row[[1, 0]]
        model.install_placement(placement.with_layer(0, row), rank, 2)
    try:
        model.probe()
        r["placement_diverged"] = "no error"
    except ReplicaDivergence as exc:
        r["placement_diverged"] = f"{type(exc).__name__}: {exc}"
    model.install_placement(placement, rank, 2)
    r["after"] = model.probe().compare(ref)


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    paths = {}
    for arch in CHECKPOINT_ARCHS:
        path = tmp_path_factory.mktemp(f"ckpt-{arch}")
        write_checkpoint(arch, str(path))
        paths[arch] = str(path)
    return run_distributed(body_checkpoint, 2, args=(paths,), timeout=150, pg_timeout=TIMEOUT)


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", CHECKPOINT_ARCHS)
def test_checkpoint_serves_joins_and_reloads_lost_experts(checkpoint_runs, arch):
    r0, r1 = (per_rank[arch] for per_rank in checkpoint_runs)
    assert r0["alone"]["identical"], r0["alone"]
    for r in (r0, r1):
        assert r["grown"]["identical"] and r["recovered"]["identical"], (r["grown"], r["recovered"])
        assert r["verify"] == []
        assert r["non_expert"]["bytes"] > 0 and r["non_expert"]["bytes"] == r0["non_expert"]["bytes"]
    # the joining rank read nothing from the directory: non-expert weights from the peer, experts by transfer
    assert r1["joined_read"] == 0
    # the replacement of the lost rank reloaded experts 6 and 7 (every layer), reading only those
    assert r1["reloads"] == 2 * r1["layers"] and r0["reloads"] == 0
    assert r1["reload_bytes"] == 2 * r1["layers"] * r1["expert_bytes"]
    assert r0["reload_bytes"] == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", CHECKPOINT_ARCHS)
def test_wrong_expert_in_one_slot_trips_the_probe(checkpoint_runs, arch):
    # every rank probes with its own requests; the pairs of an expert are spread over all its
    # replicas, so the group's probe (every rank's digest must match) reaches the wrong slot
    tripped = [per_rank[arch]["tripped"] for per_rank in checkpoint_runs]
    assert any(not t["identical"] and t["max_abs_logit_diff"] > 0 for t in tripped), tripped
    for rank, per_rank in enumerate(checkpoint_runs):
        r = per_rank[arch]
        assert r["tripped_verify"] == ([r["wrong_slot"]] if rank == 1 else [])
        assert r["repaired"]["identical"]


# -- in one process -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_kernel_computes_what_transformers_computes(arch):
    """The row-independent kernel is the same function as transformers' own (to rounding)."""
    from eplb.models.hf import unsharded

    model = unsharded({"architecture": arch, "seed": 3})
    ids = model.probe_batch()
    with torch.no_grad():
        ours = model.model(input_ids=ids).logits
        model.model.set_experts_implementation("eager")
        theirs = model.model(input_ids=ids).logits
    assert not torch.equal(ours, torch.zeros_like(ours))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch, overrides", [("mixtral", {}), ("qwen3_moe", {"tie_word_embeddings": True})])
def test_checkpoint_loads_what_transformers_loads(tmp_path, arch, overrides):
    """Our loader (meta skeleton, non-expert tensors whole, experts one by one) builds the model
    transformers' from_pretrained builds: mixtral's renamed keys, tied embeddings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eplb.models.hf import unsharded

    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **tiny_config(arch, overrides))).save_pretrained(tmp_path)
    ours = unsharded({"kind": "hf", "path": str(tmp_path)})
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    theirs.set_experts_implementation("eager")
    ids = ours.probe_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours.model(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert ours.verify() == []


def test_a_config_that_does_not_describe_the_checkpoint_s_weights_is_refused_naming_them(tmp_path):
    """A config.json of fewer layers than the weights (or another architecture's) built a smaller
    model and served it, silently: the tensors it never reads are named instead."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from eplb.models.hf import unsharded

    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **tiny_config("qwen3_moe", {}))).save_pretrained(tmp_path)
    assert unsharded({"kind": "hf", "path": str(tmp_path)}).verify() == []  # as written, it loads
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] - 1}))
    last = config["num_hidden_layers"] - 1
    with pytest.raises(ValueError, match=rf"tensors the model its config.json describes does not use \(model\.layers\.{last}\."):
        unsharded({"kind": "hf", "path": str(tmp_path)})


def test_self_check_trips_on_a_row_dependent_kernel():
    from eplb.models.hf import unsharded
    from eplb.models.kernel import check_row_independent

    model = unsharded({"architecture": "mixtral", "seed": 1})
    experts = model.model.model.layers[0].mlp.experts
    weights = dict(zip(model.names, model.expert_weights()[0]))
    check_row_independent(experts, weights, model.hidden_size, torch.float32, min_rows=model.min_rows)  # the real one passes
    experts._apply_gate = lambda h: torch.nn.functional.silu(h[:, : h.shape[1] // 2] - h.mean()) * h[:, h.shape[1] // 2:]
    with pytest.raises(RuntimeError, match="not row-independent"):
        check_row_independent(experts, weights, model.hidden_size, torch.float32, min_rows=model.min_rows)


@pytest.mark.parametrize("hidden", [64, 512])
def test_the_row_floor_is_measured_on_this_machine_and_padding_to_it_is_what_keeps_the_bits(hidden):
    """The floor ``row_floor`` measures is the one the kernel needs here: padding a slot's rows to
    it keeps a row's bits whatever the row count; one row fewer (where the floor is above 1)
    changes them. (Measured: 2 rows at hidden 64 on both CPUs seen; 4 on an AVX2 Xeon and 16 on
    an AVX-512 one at hidden 512.)"""
    from eplb.models.hf import unsharded
    from eplb.models.kernel import check_row_independent, row_floor

    torch.set_num_threads(1)
    model = unsharded({"architecture": "mixtral", "seed": 1, "config": {"hidden_size": hidden, "intermediate_size": hidden}})
    experts = model.model.model.layers[0].mlp.experts
    weights = model._probe_weights()
    floor = row_floor(experts, weights, model.hidden_size, torch.float32)
    assert model.min_rows == floor and all(c.min_rows == floor for c in model._contexts)
    check_row_independent(experts, weights, model.hidden_size, torch.float32, min_rows=floor)
    if floor > 1:
        with pytest.raises(RuntimeError, match="not row-independent"):
            check_row_independent(experts, weights, model.hidden_size, torch.float32, min_rows=floor - 1,
                                  rows=3 * floor + 5)


@pytest.mark.parametrize("hidden", [64, 512])
def test_decode_rows_keep_the_bits_of_a_row_alone_and_one_more_breaks_them(hidden):
    """A decode row (a request's one new token) is computed unpadded, in a group of at most
    ``decode_rows`` rows of its slot: each such row has the bits of the row computed alone, so a
    decode step costs its own rows, not the floor's. Grouping one more row than measured (where
    the floor is above 1) changes bits, and the start-up check says so."""
    from eplb.models.hf import unsharded
    from eplb.models.kernel import check_row_independent, decode_rows, pair_forward

    torch.set_num_threads(1)
    model = unsharded({"architecture": "mixtral", "seed": 1, "config": {"hidden_size": hidden, "intermediate_size": hidden}})
    experts = model.model.model.layers[0].mlp.experts
    weights = model._probe_weights()
    width = decode_rows(experts, weights, model.hidden_size, torch.float32, floor=model.min_rows)
    assert model.decode_rows == width and all(c.decode_rows == width for c in model._contexts)
    assert 1 <= width < max(model.min_rows, 2)
    x = torch.randn(3 * width + 2, hidden, generator=torch.Generator().manual_seed(4))
    slots = torch.zeros(x.shape[0], dtype=torch.long)
    alone = torch.cat([pair_forward(experts, weights, x[i : i + 1], slots[:1], min_rows=1) for i in range(x.shape[0])])
    grouped = pair_forward(experts, weights, x, slots, min_rows=model.min_rows,
                           decode=torch.ones(x.shape[0], dtype=torch.bool), decode_rows=width)
    assert torch.equal(grouped, alone)
    check_row_independent(experts, weights, model.hidden_size, torch.float32, min_rows=model.min_rows, decode_rows=width)
    if model.min_rows > 1:
        with pytest.raises(RuntimeError, match="not row-independent"):
            check_row_independent(experts, weights, model.hidden_size, torch.float32, min_rows=model.min_rows,
                                  decode_rows=width + 1)


def test_model_config_kinds():
    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(ModelSpec)
    assert isinstance(adapter.validate_python({"num_experts": 8}), ReferenceModelConfig)  # configs before kinds
    hf = adapter.validate_python({"kind": "hf", "architecture": "gpt_oss", "config": {"hidden_size": 64}, "seed": 2})
    assert isinstance(hf, HFModelConfig) and hf.config == {"hidden_size": 64}
    assert adapter.validate_python({"kind": "hf", "path": "/models/x"}).path == "/models/x"
    for bad in ({"kind": "hf"}, {"kind": "hf", "path": "/x", "architecture": "mixtral"},
                {"kind": "hf", "architecture": "llama"}, {"kind": "hf", "path": "/x", "config": {"a": 1}},
                {"kind": "hf", "architecture": "mixtral", "dtype": "float16"}):
        with pytest.raises(ValidationError):
            adapter.validate_python(bad)


def test_load_recording_and_placement_checks():
    from eplb.models.hf import HFMoE, describe

    spec = HFModelConfig(architecture="qwen3_moe")
    info = describe(spec)
    model = HFMoE(spec, Placement.static(info.num_moe_layers, L, 12), 0, 1)
    model.probe()
    assert int(model.take_load()[0].sum()) == 0  # the probe is not load
    model.generate(model.probe_batch(), 3)
    logical, physical = model.take_load()
    p = spec.probe
    pairs = (p.batch * p.prompt_len + 2 * p.batch) * 2  # prefill + 2 decode steps, top-2
    assert logical.sum(dim=1).tolist() == [pairs] * info.num_moe_layers
    # slots 8-11 are replicas of experts 0-3 on the same (only) rank: cutting an expert's pairs
    # cannot even out ranks here, so they go whole to its first replica
    assert torch.equal(physical[:, :8].sum(1), logical.sum(1))
    assert not (physical[:, 8:] > 0).any()
    assert int(model.take_load()[0].sum()) == 0
    with pytest.raises(ValueError, match="MoE layers"):
        model.install_placement(Placement.static(5, L, 8), 0, 1)
    assert info.expert_bytes == sum(t[0].numel() * t.element_size() for t in model.expert_weights()[0])



@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", CHECKPOINT_ARCHS)
def test_ranks_that_diverge_fail_with_a_reason(checkpoint_runs, arch):
    r0, r1 = (per_rank[arch] for per_rank in checkpoint_runs)
    # a rank runs attention for its own requests: only the rank with the bad weight fails its probe
    assert r0["diverged"]["identical"] and not r1["diverged"]["identical"]
    # ranks on different placements refuse at the first MoE layer, instead of gloo aborting on unequal sizes
    for r in (r0, r1):
        assert r["placement_diverged"].startswith("ReplicaDivergence: MoE layer 0: rank "), r["placement_diverged"]
        assert "ranks [" in r["placement_diverged"] and r["after"]["identical"]


def test_serving_helpers_for_both_kinds():
    from eplb.model import ModelShape
    from eplb.models.hf import unsharded
    from eplb.models.serving import DecodeBatches, build_model, model_info

    spec = HFModelConfig(architecture="glm4_moe")
    sizes = model_info(spec)
    assert (sizes.kind, sizes.num_moe_layers, sizes.num_logical_experts, sizes.num_expert_groups) == ("hf", 2, 8, 2)
    # slots are stored [in, out]: gate_up [hidden 32, 2 x 16], down [16, hidden 32]
    assert [tuple(t.shape) for t in sizes.allocate(3)[0]] == [(3, 32, 32), (3, 16, 32)]
    model = build_model(spec, Placement.static(2, L, L), 0, 1)
    batches = DecodeBatches(model, batch=2, prompt_len=3, max_new_tokens=3, seed=4)
    outs = [batches.step() for _ in range(4)]
    assert [o.new_batch for o in outs] == [True, False, False, True]
    assert [int(o.logical[0].sum()) for o in outs] == [2 * 3 * 2, 2 * 2, 2 * 2, 2 * 3 * 2]  # pairs per step, top-2
    want, _ = unsharded(spec).generate(batches.prompts(0), 3)
    assert torch.equal(torch.stack([o.tokens for o in outs[:3]], dim=1), want)

    shape = ModelShape(num_layers=2, num_experts=8, hidden_size=16, intermediate_size=8)
    ref = model_info(shape)
    assert (ref.kind, ref.num_moe_layers, ref.expert_bytes) == ("reference", 2, shape.expert_bytes)
    joining = build_model(shape, Placement.static(2, 8, 12), 1, 2, joining=True)
    assert joining.num_local_physical_experts == 6 and len(ref.allocate(6)) == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_a_joining_ranks_skeleton_has_the_full_models_non_expert_tensors(arch):
    """A joining rank builds a meta skeleton (build(load=False)) and receives the non-expert weights
    from a peer in one flat buffer per dtype: every tensor must have the full model's name, dtype and
    shape. In bfloat16 the skeleton's rotary frequencies were float32 (the full model's bfloat16),
    and every scale up of a bf16 random model died in gloo ("30096 vs 30080")."""
    from eplb.models.hf import RandomSource, _is_expert_param

    spec = HFModelConfig(kind="hf", architecture=arch, seed=0, dtype="bfloat16")

    def tensors(model) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {n: (t.dtype, tuple(t.shape)) for n, t in [*model.named_parameters(), *model.named_buffers()]
                if not _is_expert_param(n)}

    full, skeleton = RandomSource(spec).build(load=True), RandomSource(spec).build(load=False)
    assert tensors(skeleton) == tensors(full)
    assert all(b.device.type == "cpu" for b in skeleton.buffers())
