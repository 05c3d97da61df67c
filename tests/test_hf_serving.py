"""Hugging Face MoE architectures served by the control plane (real workers, real groups): the
greedy tokens and logits of the probe batch stay bitwise those of the unsharded model through
rebalances and a scale, and a wrong expert trips the check.

deepseek_v3, gpt_oss and qwen3_moe are also replayed as shipped scenarios (scenarios/hf_*.yaml,
tests/test_scenarios.py): a kill and its recovery, 1 -> 4 -> 2 ranks, a rebalance, each with
``identical_output: true``; here the other architectures get a rebalance and a scale each."""

from __future__ import annotations

import time

import pytest

from elastic.coordinator import Coordinator, OperationStatus
from elastic.deployment import DeploymentConfig
from elastic.faults import CorruptBuffer
from eplb.models.config import ARCHITECTURES
from tests.conftest import TEST_SCALING
from tests.helpers import assert_consistent

#: the architectures the shipped scenarios replay (scenarios/hf_*.yaml)
SCENARIOS = ("deepseek_v3", "gpt_oss", "qwen3_moe")

pytestmark = [pytest.mark.multiprocess]


def hf_config(architecture: str, **overrides) -> DeploymentConfig:
    data = {"model": {"kind": "hf", "architecture": architecture}, "ep_size": 2, "max_ep_size": 3,
            "eplb": {"num_redundant_experts": 4, "use_async": True, "window_size": 6, "step_interval": 6},
            "timeouts": {"collective": 20, "heartbeat": 25, "worker_start": 120}, "heartbeat_s": 0.05,
            "scaling": TEST_SCALING, "serving": {"background_load": True}}  # synthetic batches: the EPLB's load
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    return DeploymentConfig.model_validate(data)


def committed(c: Coordinator) -> int:
    return max((w.heartbeat.eplb.layers_committed for w in c.live_workers() if w.heartbeat and w.heartbeat.eplb), default=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("architecture", sorted(set(ARCHITECTURES) - set(SCENARIOS)))
def test_an_architecture_answers_the_same_through_a_rebalance_and_a_scale(architecture):
    with Coordinator(hf_config(architecture)) as c:
        assert c.probe()["identical"], "before any move"
        before = committed(c)
        deadline = c.snapshot()["step"] + 200
        while committed(c) <= before and c.snapshot()["step"] < deadline:  # rebalances commit layers meanwhile
            c.wait_for_step(c.snapshot()["step"] + 5, timeout=60)
        assert committed(c) > before, "no layer moved: the check below would prove nothing"
        assert c.probe()["identical"], "after rebalances"
        op = c.scale(3, timeout=120)
        assert op.status == OperationStatus.SUCCEEDED, op.error
        result = c.probe()
        assert result["identical"] and sorted(result["digests"]) == [0, 1, 2], result
        assert c.output_check["mismatches"] == 0 and c.output_check["checks"] >= 3
        assert_consistent(c, 3)


@pytest.mark.timeout(180)
def test_a_wrong_expert_in_one_slot_trips_the_output_check():
    # verify_transfers off: corrupted received layers are committed, as a silent bug would; one
    # rebalance, asked for by hand, so no later rebalance rewrites the corrupted slots first
    config = hf_config("qwen3_moe", eplb={"verify_transfers": False, "step_interval": 100000})
    with Coordinator(config, faults=(CorruptBuffer(rank=0, times=100),)) as c:
        assert c.probe()["identical"]
        c.wait_for_step(c.snapshot()["step"] + 10, timeout=60)  # a load window to rebalance from
        assert c.rebalance(timeout=60)
        deadline = time.monotonic() + 90
        while (committed(c) == 0 or c.snapshot()["in_flight_layer"] is not None) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert committed(c) > 0, "the rebalance moved nothing: nothing was corrupted"
        result = c.probe()
        assert not result["identical"], result
        assert c.output_check["mismatches"] >= 1 and c.snapshot()["output_check"]["identical"] is False
        assert any(v["mismatched"] for v in c.verify().values())  # verify names the slots too
        from prometheus_client import generate_latest

        from elastic.service.metrics import build_registry

        exposition = generate_latest(build_registry(c)).decode()
        mismatches = next(line for line in exposition.splitlines() if line.startswith("elastic_ep_output_mismatch_total "))
        assert float(mismatches.split()[1]) >= 1, mismatches
