"""The scale API over real worker processes: a real server (uvicorn on a thread, port 0) and a
real HTTP client (httpx).

One deployment (2 ranks, tiny model) serves most tests; each test leaves it at 2 ranks and
``running``. Its before-scale hooks are a gate (to hold an operation in ``before_hooks``) and
a switchable veto (so the schema fuzz can hit ``POST /scale`` without rescaling for real).
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import positive_data_acceptance

from elastic.core.config import TimeoutsConfig
from elastic.core.machine import Phase
from elastic.deployment import DeploymentConfig, TracePhase
from elastic.service.api import create_app
from elastic.service.autoscaler import Autoscaler, AutoscalerConfig
from elastic.service.hooks import ScaleHooks
from elastic.service.server import BackgroundServer, load_serve_config, register_cli
from eplb.config import EPLBConfig
from eplb.model import ModelShape
from eplb.trace import TraceConfig
from tests.conftest import TEST_SCALING

ORDER = ["before_hooks", "draining", "suppressed", "rescaling", "resuming", "succeeded"]


def tiny_deployment(**overrides) -> DeploymentConfig:
    """2 ranks of a tiny model: 8 experts + 4 redundant = 12 slots, 6 per rank (so 1 rank cannot hold it)."""
    base = dict(
        model=ModelShape(num_layers=2, num_experts=8, hidden_size=16, intermediate_size=32),
        eplb=EPLBConfig(num_redundant_experts=4, window_size=10, step_interval=10, use_async=True),
        trace=[TracePhase(trace=TraceConfig(kind="zipf", tokens_per_step=32))],
        ep_size=2, max_ep_size=4, step_delay_s=0.005, scaling=TEST_SCALING,
        timeouts=TimeoutsConfig(draining=30, suppressed=30, rescaling=60, resuming=30, worker_start=60,
                                collective=10, heartbeat=15),
    )
    base.update(overrides)
    return DeploymentConfig(**base)


class Live(SimpleNamespace):
    coordinator: object
    client: httpx.Client
    url: str
    gate: threading.Event
    veto: dict
    hooks: ScaleHooks
    after: list


@pytest.fixture(scope="module")
def live():
    from elastic.control.coordinator import Coordinator

    gate = threading.Event()
    gate.set()
    veto = {"on": False}
    after: list = []

    def gate_hook(op):
        if not gate.wait(30):
            raise RuntimeError("gate never opened")

    def veto_hook(op):
        if veto["on"]:
            raise RuntimeError("capacity check says no")

    coordinator = Coordinator(tiny_deployment())
    coordinator.start()
    try:
        hooks = ScaleHooks(before=[gate_hook, veto_hook], after=[lambda op: after.append(op["id"])]).install(coordinator)
        scaler = Autoscaler(coordinator, AutoscalerConfig(up_threshold=1e9, down_threshold=0, enabled=False))
        app = create_app(coordinator, autoscaler=scaler, hooks=hooks)
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            coordinator.wait_for_step(3, timeout=60)
            yield Live(coordinator=coordinator, client=client, url=server.url, gate=gate, veto=veto, hooks=hooks,
                       after=after, scaler=scaler)
    finally:
        gate.set()
        coordinator.shutdown()


@pytest.fixture
def api(live):
    """The shared deployment, reset: hooks pass, the autoscaler is off, 2 ranks, running."""
    live.veto["on"] = False
    live.gate.set()
    live.scaler.disable()
    assert live.coordinator.machine.state == Phase.RUNNING
    back_to_two(live)
    return live


def poll(client: httpx.Client, op_id: str, timeout: float = 60.0) -> tuple[dict, list[str], list[tuple[str, bool]]]:
    """Poll an operation to its end: (final view, phases seen in order, (state, serving) from /healthz)."""
    seen: list[str] = []
    health: list[tuple[str, bool]] = []
    deadline = time.monotonic() + timeout
    while True:
        view = client.get(f"/operations/{op_id}").json()
        if not seen or seen[-1] != view["phase"]:
            seen.append(view["phase"])
        h = client.get("/healthz")
        assert h.status_code == 200
        health.append((h.json()["state"], h.json()["serving"]))
        if view["status"] in ("succeeded", "failed", "noop"):
            return view, seen, health
        assert time.monotonic() < deadline, f"operation {op_id} still {view['phase']} after {timeout}s"
        time.sleep(0.003)


def metrics(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def unchanged(coordinator) -> tuple:
    s = coordinator.snapshot()
    return s["state"], s["generation"], s["ep_size"], len(coordinator.operations), len(coordinator.machine.history())


def back_to_two(live) -> None:
    live.veto["on"] = False
    live.gate.set()
    if live.coordinator.size != 2:
        r = live.client.post("/scale", json={"ep_size": 2})
        assert r.status_code == 202, r.text
        assert poll(live.client, r.json()["id"])[0]["status"] == "succeeded"


# -- end to end ---------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_scale_up_and_down_end_to_end(api):
    live = api
    c, client = live.coordinator, live.client
    gen = c.machine.generation
    r = client.post("/scale", json={"ep_size": 3, "expected_generation": gen})
    assert r.status_code == 202, r.text
    op = r.json()
    assert op["target_size"] == 3 and op["from_size"] == 2 and op["phase"] in ORDER and op["pending_size"] == 3
    assert r.headers["location"] == f"/operations/{op['id']}"
    view, seen, health = poll(client, op["id"])
    assert view["status"] == "succeeded", view["error"]
    assert seen == [p for p in ORDER if p in seen], seen  # polled phases come in order
    assert list(view["phases"]) == ORDER[:-1]  # every phase timed, in order
    starts = [view["phases"][p]["started"] for p in ORDER[:-1]]
    assert starts == sorted(starts) and all(view["phases"][p]["seconds"] >= 0 for p in ORDER[:-1])
    assert view["effective_size"] == 3 and view["pending_size"] is None and view["generation_after"] == gen + 1
    # experts crossed the network ahead of the pause (prepare, the default) or in it
    assert view["ranks_safe_to_release"] == [] and view["bytes_moved"] + view["prepare"].get("bytes_received", 0) > 0
    assert [h["when"] for h in view["hooks"]][:2] == ["before", "before"]
    for state, serving in health:  # only rescaling (and failed) stop decoding
        assert serving == (state not in ("rescaling", "failed")), health

    # GET /state and /metrics agree with the controller
    c.wait_for_step(c.snapshot()["step"] + 3, timeout=30)
    state = client.get("/state").json()
    snap = c.snapshot()
    for key in ("state", "generation", "ep_size", "num_physical"):
        assert state[key] == snap[key], key
    assert state["serving"] is True and state["decoding_paused"] is False and "only rescaling" in state["note"]
    assert state["history"][-1]["dest"] == "running" and state["operation"]["id"] == op["id"]
    m = metrics(client)
    assert m["elastic_ep_ep_size"] == 3 and m["elastic_ep_generation"] == gen + 1
    assert m["elastic_ep_state{state=running}"] == 1 and m["elastic_ep_state{state=rescaling}"] == 0
    assert m["elastic_ep_serving"] == 1
    assert m["elastic_ep_operations{kind=scale,status=succeeded}"] == sum(
        1 for o in c.operations.values() if o.kind == "scale" and o.status == "succeeded")
    assert m["elastic_ep_operation_phase_seconds_count{kind=scale,phase=rescaling}"] >= 1
    assert m["elastic_ep_transitions_total{dest=rescaling,trigger=suppressed}"] >= 1
    assert {f"elastic_ep_rank_load{{rank={r}}}" for r in range(3)} <= set(m)
    assert 0 < m["elastic_ep_balancedness"] <= 1

    # scale down: the retired rank is reported as safe to release
    r = client.post("/scale", json={"ep_size": 2})
    assert r.status_code == 202
    view, seen, _ = poll(client, r.json()["id"])
    assert view["status"] == "succeeded" and view["ranks_safe_to_release"] == [2] and view["effective_size"] == 2
    assert live.hooks.wait_idle(10) and view["id"] in live.after  # the after-hook ran
    listed = client.get("/operations", params={"limit": 2}).json()["operations"]
    assert [o["id"] for o in listed] == [view["id"], op["id"]]
    c.wait_for_step(c.snapshot()["step"] + 3, timeout=30)
    assert all(not v["mismatched"] for v in c.verify().values())
    # the same size again is a no-op: 200, nothing moves
    r = client.post("/scale", json={"ep_size": 2})
    assert r.status_code == 200 and r.json()["status"] == "noop" and c.machine.generation == gen + 2


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_one_hundred_concurrent_scale_requests(api):
    live = api
    c = live.coordinator
    before_ops = set(c.operations)
    requests_before = sum(1 for t in c.machine.history() if t.trigger == "request_scale")
    live.gate.clear()  # hold the winner in before_hooks so every request races against it
    key = "retry-key-1"

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=live.url, timeout=30,
                                     limits=httpx.Limits(max_connections=100)) as client:
            bodies = [{"ep_size": 3, **({"idempotency_key": key} if i % 2 else {})} for i in range(100)]
            return await asyncio.gather(*(client.post("/scale", json=b) for b in bodies))

    try:
        responses = asyncio.run(fire())
    finally:
        live.gate.set()
    new_ops = set(c.operations) - before_ops
    assert len(new_ops) == 1, f"{len(new_ops)} operations started"
    winner = new_ops.pop()
    codes = [r.status_code for r in responses]
    assert set(codes) <= {202, 409}, codes
    for r in responses:
        body = r.json()
        if r.status_code == 202:
            assert body["id"] == winner
        else:
            assert body["error"] == "scale_conflict" and body["operation_id"] == winner and body["message"]
    keyed = [r for i, r in enumerate(responses) if i % 2]
    if c.operations[winner].idempotency_key == key:  # a keyed request won: every retry got the same operation
        assert all(r.status_code == 202 and r.json()["id"] == winner for r in keyed)
        assert sum(r.headers.get("idempotency-replayed") == "true" for r in keyed) == 49
    assert codes.count(202) >= 1
    view, _, _ = poll(live.client, winner)
    assert view["status"] == "succeeded", view["error"]
    assert sum(1 for t in c.machine.history() if t.trigger == "request_scale") == requests_before + 1
    assert c.size == 3
    c.wait_for_step(c.snapshot()["step"] + 3, timeout=30)
    verdicts = c.verify()
    assert len(verdicts) == 3 and all(not v["mismatched"] for v in verdicts.values())
    assert len({v["digest"] for v in verdicts.values()}) == 1
    # a late retry with the key still answers with that operation; a different size under it is refused
    if c.operations[winner].idempotency_key == key:
        assert live.client.post("/scale", json={"ep_size": 3, "idempotency_key": key}).json()["id"] == winner
        r = live.client.post("/scale", json={"ep_size": 4}, headers={"Idempotency-Key": key})
        assert r.status_code == 422 and r.json()["error"] == "idempotency_key_reused"
    back_to_two(live)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_vetoing_hook_fails_the_operation_not_the_server(api):
    live = api
    c, client = live.coordinator, live.client
    gen, size = c.machine.generation, c.size
    live.veto["on"] = True
    try:
        r = client.post("/scale", json={"ep_size": 3})
        assert r.status_code == 202
        view, seen, _ = poll(client, r.json()["id"])
    finally:
        live.veto["on"] = False
    assert view["status"] == "failed" and "capacity check says no" in view["error"] and "vetoed" in view["error"]
    assert seen[-1] == "failed" and "draining" not in view["phases"]
    assert [h["ok"] for h in view["hooks"]] == [True, False]
    assert c.machine.state == Phase.RUNNING and c.machine.generation == gen and c.size == size
    assert client.get("/healthz").json()["serving"] is True
    # the next request goes through: nothing is wedged
    r = client.post("/scale", json={"ep_size": 3})
    assert r.status_code == 202 and poll(client, r.json()["id"])[0]["status"] == "succeeded"
    back_to_two(live)


BAD_BODIES = [
    ({}, 422, "field required"),
    ({"ep_size": "3"}, 422, "valid integer"),
    ({"ep_size": 3.5}, 422, "valid integer"),
    ({"ep_size": True}, 422, "valid integer"),
    ({"ep_size": None}, 422, "valid integer"),
    ({"ep_size": 0}, 422, "greater than or equal to 1"),
    ({"ep_size": -4}, 422, "greater than or equal to 1"),
    ({"ep_size": 1}, 422, "fewer than the 8 logical experts"),
    ({"ep_size": 5}, 422, "exceeds the launcher's capacity of 4"),
    ({"ep_size": 10**30}, 422, "exceeds the launcher's capacity"),
    ({"ep_size": 3, "force": True}, 422, "extra inputs are not permitted"),
    ({"ep_size": 3, "expected_generation": -1}, 422, "greater than or equal to 0"),
    ({"ep_size": 3, "expected_generation": 999}, 409, "expected_generation=999 but the group is at generation"),
    ({"ep_size": 3, "idempotency_key": ""}, 422, "string should match pattern"),
    ({"ep_size": 3, "idempotency_key": "has space"}, 422, "string should match pattern"),
    ([3], 422, "valid dictionary"),
    ("3", 422, "valid dictionary"),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("body, status, message", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_invalid_scale_bodies_change_nothing(api, body, status, message):
    live = api
    before = unchanged(live.coordinator)
    r = live.client.post("/scale", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"] and message.lower() in r.json()["message"].lower(), r.json()
    assert unchanged(live.coordinator) == before


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_invalid_requests_and_paths_answer_4xx_with_a_message(api):
    live = api
    client, before = live.client, unchanged(live.coordinator)
    cases = [
        client.post("/scale", content=b"{not json", headers={"content-type": "application/json"}),
        client.post("/scale", content=b"", headers={"content-type": "application/json"}),
        client.post("/scale", content=b"\xff\xfe", headers={"content-type": "application/json"}),
        client.post("/scale", content=b'{"ep_size": 3}', headers={"content-type": "text/plain"}),
        client.post("/scale", json={"ep_size": 3, "idempotency_key": "a"}, headers={"Idempotency-Key": "b"}),
        client.post("/scale", json={"ep_size": 3}, headers={"Idempotency-Key": "with space"}),
        client.get("/operations/op-does-not-exist"),
        client.get("/operations", params={"limit": 0}),
        client.get("/operations", params={"limit": "many"}),
        client.post("/rebalance", params={"timeout_s": -1}),
        client.post("/recover"),  # not failed
        client.delete("/scale"),
        client.put("/state"),
        client.get("/no/such/path"),
    ]
    expected = [422, 422, 422, 422, 422, 422, 404, 422, 422, 422, 409, 405, 405, 404]
    assert [r.status_code for r in cases] == expected, [(r.status_code, r.text) for r in cases]
    for r in cases:
        body = r.json()
        assert isinstance(body["error"], str) and body["error"] and body["message"], body
    assert cases[6].json()["error"] == "operation_not_found"
    assert cases[10].json()["error"] == "invalid_transition" and "running" in cases[10].json()["message"]
    assert unchanged(live.coordinator) == before


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_openapi_rebalance_and_autoscaler_endpoints(api):
    live = api
    client = live.client
    schema = client.get("/openapi.json").json()
    assert {"/scale", "/operations/{operation_id}", "/operations", "/state", "/recover", "/rebalance", "/metrics",
            "/healthz"} <= set(schema["paths"])
    assert set(schema["paths"]["/scale"]["post"]["responses"]) >= {"200", "202", "409", "422"}
    r = client.post("/rebalance")  # started is false when a periodic rebalance was already in flight
    assert r.status_code == 200 and r.json()["confirmed"] is True and isinstance(r.json()["started"], bool)
    r = client.post("/rebalance", params={"timeout_s": 1e-9})  # sent, but no rank can confirm that fast
    assert r.status_code == 202 and r.json()["confirmed"] is False and "did not finish" in r.json()["message"]
    status = client.get("/autoscaler").json()
    assert status["enabled"] is False and status["policy"] == "threshold"
    assert client.post("/autoscaler/enable").json()["enabled"] is True
    assert metrics(client)["elastic_ep_autoscaler_enabled{observe_only=false}"] == 1
    assert client.post("/autoscaler/disable").json()["enabled"] is False


# -- schema-driven fuzzing ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def api_schema(live):
    live.veto["on"] = True  # /scale is fuzzed for real, but every accepted scale is vetoed before it moves anything
    live.scaler.disable()
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_schema_fuzz_finds_no_server_errors(case, live):
    live.veto["on"] = True
    response = case.call(base_url=live.url, timeout=30)
    # every built-in check (status codes and bodies as documented, invalid data rejected, no 5xx) except
    # "a schema-valid request is accepted": /scale answers 409 or 422 by state and by rule (e.g. an
    # Idempotency-Key header that differs from the body's key), which a schema cannot express
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert body["error"] and body["message"]
    assert live.coordinator.machine.state == Phase.RUNNING and live.coordinator.size == 2


# -- a failed scale, then recovery --------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_failed_scale_then_recover_through_the_api():
    from elastic.control.coordinator import Coordinator
    from elastic.faults import KillRank

    # 8 redundant slots: 16 slots, 8 per rank, so one surviving rank can hold all 8 experts
    config = tiny_deployment(eplb=EPLBConfig(num_redundant_experts=8, window_size=10, step_interval=10, use_async=True))
    coordinator = Coordinator(config, faults=(KillRank(rank=1, in_phase="draining", generation=0),))
    with coordinator:
        app = create_app(coordinator)
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            coordinator.wait_for_step(3, timeout=60)
            r = client.post("/scale", json={"ep_size": 3})
            assert r.status_code == 202
            view, _, _ = poll(client, r.json()["id"])
            assert view["status"] == "failed" and view["error"] and view["pending_size"] is None
            assert view["effective_size"] == 2
            health = client.get("/healthz")
            assert health.status_code == 200 and health.json() == {**health.json(), "state": "failed", "serving": False}
            state = client.get("/state").json()
            assert state["state"] == "failed" and state["failure_reason"] and state["serving"] is False
            for size in (2, 3):  # the same size is no no-op while failed
                refused = client.post("/scale", json={"ep_size": size})
                assert refused.status_code == 409 and "recover first" in refused.json()["message"], refused.text
            assert client.post("/rebalance").status_code == 409
            assert metrics(client)["elastic_ep_state{state=failed}"] == 1
            r = client.post("/recover")
            assert r.status_code == 202 and r.json()["kind"] == "recover"
            view, _, _ = poll(client, r.json()["id"])
            assert view["status"] == "succeeded", view["error"]
            assert client.post("/recover").status_code == 409  # running again: nothing to recover
            state = client.get("/state").json()
            assert state["state"] == "running" and state["serving"] is True and state["ep_size"] == 1
            r = client.post("/scale", json={"ep_size": 2})  # and it scales again
            assert r.status_code == 202 and poll(client, r.json()["id"])[0]["status"] == "succeeded"
            coordinator.wait_for_step(coordinator.snapshot()["step"] + 3, timeout=30)
            assert all(not v["mismatched"] for v in coordinator.verify().values())


# -- without workers ----------------------------------------------------------------------------

class FakeController:
    """The read side of a Coordinator, stuck in one state (no workers)."""

    def __init__(self, state: Phase):
        self.machine = SimpleNamespace(state=state, generation=4)
        self.requests = None
        self.config = SimpleNamespace(eplb=SimpleNamespace(min_balancedness=None), heartbeat_s=1.0)

    def subscribe(self, callback):
        pass

    def get_operation(self, operation_id):
        return None

    def list_operations(self, limit=None):
        return []

    def timeline_windows(self):
        return []

    def export_placement(self, timeout=30.0):
        from elastic.core.errors import ScaleConflict

        raise ScaleConflict(None, self.machine.state, (), trigger="export the placement")

    def snapshot(self):
        return {"state": self.machine.state.value, "generation": 4, "ep_size": 3, "num_physical": 12,
                # what the ranks' heartbeats would say: decoding in every state but rescaling
                "serving": self.machine.state != Phase.RESCALING, "balancedness": None, "step": 7,
                "in_flight_layer": None, "operation": None,
                "failure_reason": None, "history": []}

    def live_workers(self):
        return []


@pytest.mark.parametrize("state, serving", [(Phase.RESCALING, False), (Phase.DRAINING, True),
                                            (Phase.SUPPRESSED, True), (Phase.RUNNING, True)])
def test_health_and_state_say_only_rescaling_pauses_decoding(state, serving):
    with BackgroundServer(create_app(FakeController(state))) as server, httpx.Client(base_url=server.url) as client:
        h = client.get("/healthz")
        assert h.status_code == 200 and h.json()["serving"] is serving and h.json()["state"] == state.value
        s = client.get("/state").json()
        assert s["serving"] is serving and s["decoding_paused"] is (state == Phase.RESCALING)
        assert "only rescaling pauses" in s["note"]
        m = client.get("/metrics")
        assert m.status_code == 200 and f'elastic_ep_state{{state="{state.value}"}} 1.0' in m.text
        assert client.get("/autoscaler").status_code == 404


def test_serve_config_and_cli(tmp_path):
    import typer
    from typer.testing import CliRunner

    good = tmp_path / "serve.yaml"
    good.write_text("ep_size: 2\nmax_ep_size: 4\nmodel: {num_experts: 8}\neplb: {num_redundant_experts: 4}\n"
                    "autoscaler: {up_threshold: 100, down_threshold: 10, observe_only: true}\n"
                    "hooks: {before_scale: [{command: 'true', timeout_s: 5}]}\n")
    loaded = load_serve_config(good)
    assert loaded.deployment.ep_size == 2 and loaded.autoscaler.observe_only and loaded.hooks.before_scale
    bad = tmp_path / "bad.yaml"
    bad.write_text("ep_size: 2\nautoscaler: {up_threshold: 1, down_threshold: 5}\nwat: 1\n")
    with pytest.raises(ValueError) as info:
        load_serve_config(bad)
    assert "bad.yaml" in str(info.value) and "wat" in str(info.value) and "down_threshold" in str(info.value)

    app = typer.Typer()
    register_cli(app)

    @app.command("other")
    def other() -> None:  # a second command so typer keeps subcommands
        pass

    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--host" in result.output and "--port" in result.output
    result = runner.invoke(app, ["serve", str(bad)])
    assert result.exit_code == 2 and f"error: {bad}: wat: unknown key" in result.output
