"""eplb.models.shared_weights: an EP group's ranks on one host read one copy of the dense weights.

With it on, the ranks' dense parameters read one copy-on-write mapping, the tokens and logits are
bitwise those of private weights, a rank that writes a weight changes only its own, and no file is
left in /dev/shm; ``EPLB_SHARED_WEIGHTS=0`` keeps each rank's own weights.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def body(rank: int, world: int, flag: str) -> dict:
    import torch.distributed as dist

    from tests.test_local_exchange import decode_small_model

    os.environ["EPLB_SHARED_WEIGHTS"] = flag
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    model, tokens, logits = decode_small_model(rank, world)
    mapping = model._dense_map
    shared = []
    if mapping is not None:
        start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
        end = start + len(mapping)
        shared = [name for name, p in model.model.named_parameters() if start <= p.data_ptr() < end]
    # a rank that writes a shared weight (a sync_non_expert) changes its own copy only
    weight = model.model.model.layers[0].self_attn.q_proj.weight
    before = weight.detach().clone()
    dist.barrier()
    if rank == 1:
        with torch.no_grad():
            weight.add_(1.0)
    dist.barrier()
    unchanged = bool(torch.equal(weight, before)) if rank == 0 else bool(torch.equal(weight, before + 1.0))
    dist.barrier()
    left = [p for p in glob.glob("/dev/shm/eplb-w-*") if int(os.path.basename(p).split("-")[2]) in pids]
    # a group formed again (a rescale: its rank 0 has served before) writes nothing, and the weights keep their mapping
    from eplb.models.shared_weights import share_dense

    pointer = model.model.model.layers[0].self_attn.k_proj.weight.data_ptr()
    again = share_dense(model.model, None, rank, world, 30, first_group=False)
    kept = model.model.model.layers[0].self_attn.k_proj.weight.data_ptr() == pointer
    return {"tokens": tokens, "logits": logits.tolist(), "shared": shared, "unchanged": unchanged, "left": left,
            "again": again[1], "kept": kept}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the group's shared memory is /dev/shm on Linux")
def test_shared_dense_weights_give_the_same_bits_and_stay_private_to_writes():
    on = run_distributed(body, 2, args=("1",), timeout=200)
    off = run_distributed(body, 2, args=("0",), timeout=200)
    for r in on:
        assert "model.layers.0.self_attn.q_proj.weight" in r["shared"]
        assert not any(".experts." in name for name in r["shared"])
        assert r["unchanged"] and r["left"] == []
        assert r["again"] == 0 and r["kept"]
    for r in off:
        assert r["shared"] == [] and r["unchanged"]
    for a, b in zip(on, off):
        assert a["tokens"] == b["tokens"]
        assert a["logits"] == b["logits"]
