"""Completion requests through the EP group (elastic.control.requests, elastic.worker.batch): real workers, real groups, real HTTP.

Every request's tokens are checked against the unsharded single-process model's greedy output
for the same prompt, through a scale up, a scale down, and a killed rank with its recovery.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, settings

from elastic.control.requests import RequestEngine
from elastic.coordinator import Coordinator, OperationStatus
from elastic.core import protocol as p
from elastic.core.config import ServingConfig
from elastic.deployment import DeploymentConfig
from elastic.service.api import create_app
from elastic.service.server import BackgroundServer
from eplb.models.hf import unsharded
from tests.conftest import TEST_SCALING

MODEL = {"kind": "hf", "architecture": "qwen3_moe", "seed": 0}


def deployment(**serving) -> DeploymentConfig:
    return DeploymentConfig.model_validate({
        "model": MODEL, "ep_size": 2, "max_ep_size": 4, "auto_recover": True, "heartbeat_s": 0.05,
        "eplb": {"num_redundant_experts": 4, "use_async": True, "window_size": 6, "step_interval": 6},
        "timeouts": {"collective": 6, "heartbeat": 8, "worker_start": 120},
        "step_delay_s": 0.01, "scaling": TEST_SCALING,
        "serving": {"max_batch": 4, "max_queue": 4, "max_tokens_limit": 64, **serving},
    })


@dataclass
class Live:
    coordinator: Coordinator
    client: httpx.Client
    url: str
    model: str
    reference: object
    expected: dict = field(default_factory=dict)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self.expected:
            tokens, _ = self.reference.generate(torch.tensor([prompt]), n)
            self.expected[key] = tokens[0].tolist()
        return self.expected[key]


@pytest.fixture(scope="module")
def live():
    torch.set_num_threads(1)  # the workers' thread count: the reference's bits depend on it
    reference = unsharded(MODEL)
    with Coordinator(deployment()) as c, BackgroundServer(create_app(c)) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        c.wait_for_step(3, timeout=60)
        model = client.get("/v1/models").json()["data"][0]["id"]
        yield Live(c, client, server.url, model, reference)


def prompt_of(i: int, n: int = 6) -> list[int]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 128, (n,), generator=g).tolist()


@dataclass
class Stream:
    """A streaming request on its own thread: its tokens and when each arrived."""

    live: Live
    prompt: list[int]
    max_tokens: int
    stop_after: int | None = None  # disconnect after this many tokens
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    status: int | None = None
    finish: str | None = None
    replays: int | None = None
    error: str | None = None
    id: str | None = None  # the engine's request id (the chunks' id)

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        import json

        body = {"model": self.live.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True}
        with httpx.Client(base_url=self.live.url, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=body) as response:
            self.status = response.status_code
            if response.status_code != 200:
                self.error = response.read().decode()
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.error = str(chunk["error"])
                    return
                self.id = chunk["id"]
                choice = chunk["choices"][0]
                for token in choice["token_ids"]:
                    self.tokens.append(token)
                    self.times.append(time.monotonic())
                if choice["finish_reason"]:
                    self.finish = choice["finish_reason"]
                    self.replays = chunk["elastic_ep"]["replays"]
                if self.stop_after is not None and len(self.tokens) >= self.stop_after:
                    return  # leaving the with-block closes the connection mid-stream

    def wait_tokens(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n:
            assert time.monotonic() < deadline, f"only {len(self.tokens)} tokens after {timeout}s: {self.error}"
            assert self.thread.is_alive() or len(self.tokens) >= n, f"stream ended early: {self.status} {self.error}"
            time.sleep(0.01)

    def join(self, timeout: float = 120) -> Stream:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream never ended"
        return self


def wait_until(predicate, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- one request ------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_completion_is_the_unsharded_models_greedy_output_streamed_or_not(live):
    prompt = prompt_of(0)
    body = {"model": live.model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    r = live.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    choice = answer["choices"][0]
    assert choice["token_ids"] == live.greedy(prompt, 10)
    assert choice["finish_reason"] == "length" and answer["usage"] == {"prompt_tokens": 6, "completion_tokens": 10,
                                                                       "total_tokens": 16}
    # the chosen token is the most likely one, and its log-probability is the top one's
    assert [lp for lp in choice["logprobs"]["token_logprobs"]] == \
        [max(top.values()) for top in choice["logprobs"]["top_logprobs"]]
    stream = Stream(live, prompt, 10).start().join()
    assert stream.status == 200 and stream.tokens == live.greedy(prompt, 10) and stream.finish == "length"
    listing = live.client.get("/v1/models").json()
    assert listing["data"][0]["id"] == live.model and listing["data"][0]["max_model_len"] == 128
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, s.labels.get("outcome")): s.value
               for family in text_string_to_metric_families(live.client.get("/metrics").text) for s in family.samples}
    assert samples[("elastic_ep_requests_total", "ok")] >= 2 and ("elastic_ep_requests_running", None) in samples


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time, every thread (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_idle_deployment_stops_stepping_uses_almost_no_cpu_and_an_admission_wakes_it(live):
    c = live.coordinator
    # serving.background_load is off by default (this deployment does not set it), as for `serve`
    assert not c.config.serving.background_load and not DeploymentConfig(model=MODEL).serving.background_load
    settled: list = []

    def asleep() -> bool:  # every rank idle, at the same steps as half a second ago (a rebalance may end first)
        ranks = c.snapshot()["ranks"]
        settled.append([r["step"] for r in ranks] if all(r["idle"] for r in ranks) else None)
        time.sleep(0.5)
        return len(settled) > 1 and settled[-1] is not None and settled[-1] == settled[-2]

    wait_until(asleep, timeout=60, what="every rank idle")
    workers = c.live_workers()
    steps = settled[-1]
    reported = [w.last_report for w in workers]
    windows = []
    for _ in range(2):  # the better of two 2 s windows: one stray blip of a shared machine is not idling
        cpu = [cpu_seconds(w.pid) for w in workers]
        started = time.monotonic()
        time.sleep(2)
        windows.append([(cpu_seconds(w.pid) - before) / (time.monotonic() - started) for w, before in zip(workers, cpu)])
    assert [r["step"] for r in c.snapshot()["ranks"]] == steps  # no step ran
    assert all(w.last_report > before for w, before in zip(workers, reported))  # heartbeats went on (every 0.05 s)
    assert min(max(cores) for cores in windows) <= 0.05, f"idle ranks used {windows} cores"
    prompt = prompt_of(7)
    r = live.client.post("/v1/completions", json={"model": live.model, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == live.greedy(prompt, 6)
    # it woke and decoded: 6 steps (the last heartbeats may come after the response)
    wait_until(lambda: min(r["step"] for r in c.snapshot()["ranks"]) >= min(steps) + 6, timeout=10, what="6 steps")


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_an_admit_whose_owner_is_past_the_group_is_refused_and_sends_nothing(live):
    c = live.coordinator
    seq = repr(c.registry.bus._seq)  # "count(N)": the next number the bus gives, unchanged if nothing is sent
    stale = p.RequestSpec(request_id="stale", prompt=(1, 2), max_tokens=2, owner=c.size)  # chosen for a bigger group
    assert c.send_serving(p.Admit, requests=(stale,)) is False
    assert repr(c.registry.bus._seq) == seq and c.requests.get("stale") is None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_stop_token_ends_the_request_at_that_token(live):
    prompt = prompt_of(1)
    expected = live.greedy(prompt, 12)
    stop = expected[4]
    cut = expected.index(stop) + 1
    r = live.client.post("/v1/completions", json={"model": live.model, "prompt": prompt, "max_tokens": 12,
                                                  "temperature": 0, "stop_token_ids": [stop]})
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == expected[:cut] and choice["finish_reason"] == "stop"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sampling_with_a_seed_gives_the_same_tokens_every_time(live):
    body = {"model": live.model, "prompt": prompt_of(2), "max_tokens": 8, "temperature": 1.5, "seed": 7}
    first = live.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    again = live.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    other = live.client.post("/v1/completions", json={**body, "seed": 8}).json()["choices"][0]["token_ids"]
    assert first == again and len(first) == 8
    assert other != first  # a different seed samples differently (8 tokens from 128: equal by chance ~never)
    # a vanishing temperature is greedy (logits / 1e-45 overflowed to NaN and broke every rank once)
    tiny = live.client.post("/v1/completions", json={**body, "temperature": 1e-45}).json()["choices"][0]["token_ids"]
    assert tiny == live.greedy(body["prompt"], 8) and live.coordinator.machine.state.value == "running"


# -- bad requests -------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("change, status, names", [
    ({"model": "gpt-4"}, 404, "gpt-4"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 128]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": "hello"}, 400, "tokenizer"),
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 65}, 400, "max_tokens"),  # past serving.max_tokens_limit
    ({"prompt": [1] * 100, "max_tokens": 40}, 400, "max_tokens"),  # within the limit, past the context with the prompt
    ({"prompt": [1] * 128}, 400, "prompt"),  # the prompt alone fills the context
    ({"temperature": -1}, 400, "temperature"),
    ({"logprobs": 50}, 400, "logprobs"),
    ({"n": 20}, 400, "n"),
    ({"n": 2, "best_of": 3}, 400, "best_of"),
    ({"top_p": 0}, 400, "top_p"),
    ({"suffix": "x"}, 400, "suffix"),  # a vLLM field this server does not implement
    ({"stop": ["x"]}, 400, "stop"),
    ({"stop_token_ids": [999]}, 400, "stop_token_ids"),
    ({"logit_bias": {"999": 1}}, 400, "logit_bias"),
    ({"stream": "yes"}, 400, "stream"),
])
def test_a_bad_request_gets_4xx_naming_the_field_and_queues_nothing(live, change, status, names):
    before = live.coordinator.requests.stats()
    body = {"model": live.model, "prompt": [1, 2, 3], "max_tokens": 4, **change}
    r = live.client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]  # OpenAI's shape: what the openai client shows
    assert names in error["message"] and set(error) == {"message", "type", "param", "code"}, error
    after = live.coordinator.requests.stats()
    assert (after["running"], after["queued"], after["ok"]) == (before["running"], before["queued"], before["ok"])


# -- admission and cancellation ------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_full_batch_and_queue_answer_429_and_a_client_that_leaves_frees_its_slot(live):
    c = live.coordinator
    # 4 decode (max_batch) and 4 wait (max_queue): of 14 sent at once, the rest are refused at once
    streams = [Stream(live, prompt_of(10 + i), 64).start() for i in range(14)]
    # (a refused stream's status is set before its error body is read)
    wait_until(lambda: all(s.status == 200 or (s.status is not None and s.error is not None) for s in streams),
               what="every answer's status")
    refused = [s for s in streams if s.status == 429]
    assert len(refused) >= 6 and all("max_batch" in s.error for s in refused), [s.status for s in streams]
    r = live.client.post("/v1/completions", json={"model": live.model, "prompt": [1, 2], "max_tokens": 4})
    assert r.status_code in (200, 429) and (r.status_code == 200 or r.headers["Retry-After"] == "1")
    # the clients go away: every slot is freed, on the coordinator and in the ranks' batches
    for s in streams:
        s.stop_after = 0
    for s in streams:
        s.join()
    wait_until(lambda: c.requests.stats()["running"] == 0 and c.requests.stats()["queued"] == 0, timeout=60,
               what="every slot freed")
    wait_until(lambda: all(r["requests"] == 0 for r in c.snapshot()["ranks"]), timeout=30,
               what="the ranks' batches to empty")
    assert c.requests.stats()["cancelled"] >= 1
    # and the deployment serves the next request in full
    prompt = prompt_of(31)
    r = live.client.post("/v1/completions", json={"model": live.model, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.json()["choices"][0]["token_ids"] == live.greedy(prompt, 6)


# -- through scales and a rank failure --------------------------------------------------------------------

def spanned(stream: Stream, started: float, ended: float) -> bool:
    return any(t < started for t in stream.times) and any(t > ended for t in stream.times)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", [4, 2])
def test_requests_decode_through_a_scale_without_restarting_and_with_the_same_tokens(live, target):
    c = live.coordinator
    streams: list[Stream] = []
    stop = threading.Event()

    def feed() -> None:
        # three requests in flight all the time, whatever the scale's phase, of three lengths: requests
        # of one length started together would finish together, and the pause could fall in the gap
        # before the next three decode their first token
        while not stop.is_set():  # as many as ranks, at least 3: each rank holds one (the least loaded takes the next)
            if sum(s.thread.is_alive() for s in streams) < max(3, start):
                streams.append(Stream(live, prompt_of(1000 * target + len(streams)), (36, 50, 64)[len(streams) % 3]).start())
            time.sleep(0.02)

    start = c.size
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    wait_until(lambda: sum(len(s.tokens) >= 3 for s in streams) >= 3, what="three requests decoding")
    # each request is owned by one rank, the least loaded: at the scale, requests are on every rank
    owners = {s.id: c.requests.get(s.id).rank for s in streams if s.id and s.thread.is_alive()}
    op = c.scale(target, timeout=180)
    stop.set()
    feeder.join(5)
    assert op.status == OperationStatus.SUCCEEDED, op.error
    assert len(set(owners.values())) >= min(start, 3), f"requests not spread over the {start} ranks: {owners}"
    later = [Stream(live, prompt_of(2000 * target + i), 8).start() for i in range(target)] if target > start else []
    for s in streams + later:
        s.join()
        assert s.status == 200 and s.error is None, s.error
        assert s.tokens == live.greedy(s.prompt, s.max_tokens), "the tokens changed"
        assert s.finish == "length" and s.replays == 0, "a request restarted from its prompt"
    if later:  # a scale up's new ranks serve new requests (the least loaded: they held none)
        assert {c.requests.get(s.id).rank for s in later} & set(range(start, target)), "no new request on a new rank"
    if target < start:  # a scale down moved the leaving ranks' requests, KV caches included: none replayed
        rescaled = [r.result for done in list(c.registry.done.values()) for r in list(done.values())
                    if r.operation_id == op.id and isinstance(r.result, p.RescaleDone)]
        assert sum(r.timing.get("requests_moved", 0) for r in rescaled) >= 1, [r.timing for r in rescaled]
        assert c.requests.stats()["replayed"] == 0
    pause = c.get_operation(op.id)["phases"]["rescaling"]
    assert any(spanned(s, pause["started"], pause["ended"]) for s in streams), (
        "no request decoded across the pause", pause["started"], pause["ended"],
        [(s.times[0], s.times[-1]) for s in streams if s.times], c.get_operation(op.id)["phases"])
    assert c.requests.stats()["mismatched"] == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_seeded_sample_with_vllms_parameters_is_the_same_at_every_ep_size(live):
    body = {"model": live.model, "prompt": prompt_of(7), "max_tokens": 12, "temperature": 0.9, "seed": 11, "n": 2,
            "top_k": 50, "top_p": 0.9, "min_p": 0.01, "repetition_penalty": 1.3, "frequency_penalty": 0.2,
            "presence_penalty": 0.1, "logit_bias": {"5": 2.0}}

    def sampled() -> list[list[int]]:
        r = live.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return [choice["token_ids"] for choice in r.json()["choices"]]

    start = live.coordinator.snapshot()["ep_size"]
    at_start = sampled()
    assert len(at_start) == 2 and all(len(t) == 12 for t in at_start) and at_start[0] != at_start[1]
    other = 3 if start != 3 else 2
    try:
        assert live.coordinator.scale(other, timeout=180).status == OperationStatus.SUCCEEDED
        assert sampled() == at_start
    finally:
        live.coordinator.scale(start, timeout=180)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_killed_rank_loses_no_request_they_are_replayed_with_the_same_tokens(live):
    c = live.coordinator
    assert c.size == 2
    streams = [Stream(live, prompt_of(90 + i), 64).start() for i in range(3)]
    for s in streams:
        s.wait_tokens(3)
    owners = {s.id: c.requests.get(s.id).rank for s in streams}
    assert sorted(owners.values()) == [0, 0, 1], owners  # the same load each: ranks 0, 1, 0
    victim = next(w for w in c.live_workers() if w.rank == 1)
    os.kill(victim.handle.pid, signal.SIGKILL)
    for s in streams:
        s.join(timeout=240)
        assert s.status == 200 and s.error is None, s.error
        assert s.tokens == live.greedy(s.prompt, 64), "a replayed request's tokens differ"
        assert s.finish == "length"
        # only the lost rank's request replays from its prompt; the survivor's go on where they were
        assert s.replays == (1 if owners[s.id] == 1 else 0), (owners[s.id], s.replays)
    assert c.machine.state.value == "running" and c.auto_recoveries >= 1
    assert c.requests.stats()["mismatched"] == 0


# -- the engine's bookkeeping (pure logic: a gate that records what it is asked to send) -----------------

class RecordingGate:
    def __init__(self) -> None:
        self.sent: list[tuple[type, dict]] = []
        self.health = "ok"

    def send_serving(self, command, **fields) -> bool:
        if self.health != "ok":
            return False
        self.sent.append((command, fields))
        return True

    def serving_health(self) -> str:
        return self.health

    size = 1

    def group_size(self) -> int:
        return self.size


def engine_with(gate: RecordingGate, clock=None, **config) -> RequestEngine:
    return RequestEngine(gate, ServingConfig(**config), clock=clock or time.monotonic)


def spec(rid: str, n: int = 4) -> p.RequestSpec:
    return p.RequestSpec(request_id=rid, prompt=(1, 2), max_tokens=n)


def tokens(rid: str, *pairs: tuple[int, int], last: int | None = None) -> p.TokensOut:
    return p.TokensOut(rank=0, generation=0, pid=1, at=0.0, step=0, tokens=tuple(
        p.TokenOut(rid, pos, tok, finish_reason="length" if pos == last else None) for pos, tok in pairs))


def test_tokens_past_a_gap_wait_for_it_and_a_replay_must_repeat_them():
    gate = RecordingGate()
    engine = engine_with(gate)
    c = engine.submit(spec("a"))
    engine._admit_once()
    assert gate.sent[-1][0] is p.Admit and c.status == "running"
    engine.on_tokens(tokens("a", (0, 5), (2, 7)))
    assert c.tokens == [5], "token 2 waits for token 1"
    engine.on_tokens(tokens("a", (1, 6)))
    assert c.tokens == [5, 6, 7]
    # the group lost it (a recovery): it is admitted again and its tokens come back from position 0
    engine.on_held(p.RequestsHeld(rank=0, generation=1, pid=1, at=0.0, seq=9, held=()))
    engine._admit_once()
    assert gate.sent[-1] == (p.Admit, {"requests": (spec("a"),)}) and c.replays == 1 and c.rank == 0
    engine.on_tokens(tokens("a", (0, 5), (1, 6), (2, 7), (3, 8), last=3))
    assert c.status == "finished" and c.tokens == [5, 6, 7, 8] and engine.counts["mismatched"] == 0


def test_each_request_goes_to_the_least_loaded_rank_by_tokens_in_flight_and_held_reports_move_it():
    gate = RecordingGate()
    gate.size = 3
    engine = engine_with(gate)
    # in flight: the prompt until prefilled, then what is left to generate
    assert spec("x", 4).in_flight(0) == 2 + 4 and spec("x", 4).in_flight(3) == 1 and spec("x", 4).in_flight(9) == 0
    big = engine.submit(p.RequestSpec(request_id="big", prompt=(1,) * 10, max_tokens=20))  # 30 in flight
    small = [engine.submit(spec(f"s{i}", 4)) for i in range(3)]  # 6 each
    engine._admit_once()
    owners = {c.id: c.rank for c in (big, *small)}
    assert owners == {"big": 0, "s0": 1, "s1": 2, "s2": 1}  # s2: ranks 1 and 2 hold 6 each, the lower wins
    assert [s.owner for s in gate.sent[-1][1]["requests"]] == [0, 1, 2, 1]
    late = engine.submit(spec("late", 4))
    engine._admit_once()
    assert late.rank == 2  # rank 1 holds 12 in flight, rank 2 6, rank 0 30
    # a rescale: the group of 2 says who holds what; what no rank holds is admitted again, to the lightest
    gate.size = 2
    engine.on_held(p.RequestsHeld(rank=0, generation=1, pid=1, at=0.0, seq=9,
                                  held=(("big", 0, 1), ("s0", 0, 0), ("s1", 0, 0), ("s2", 0, 0))))
    assert big.rank == 1 and late.replays == 1
    engine._admit_once()
    assert late.rank == 0 and gate.sent[-1][1]["requests"][0].owner == 0  # 18 on rank 0 against 30 on rank 1
    with pytest.raises(ValueError, match="owner must be a rank"):
        p.RequestSpec(request_id="bad", prompt=(1,), max_tokens=1, owner=-1)


def test_admission_asks_the_coordinator_for_the_group_size_without_holding_the_engines_lock():
    """The coordinator answers group_size() under its own lock, and its threads read the engine's stats
    while holding that lock (snapshot()): admission asking for the size inside the engine's lock
    deadlocked the two (the hf_traffic scenario hung in the suite)."""
    engine_ref: list[RequestEngine] = []

    class CoordinatorLikeGate(RecordingGate):
        def group_size(self) -> int:
            seen: list[dict] = []
            other = threading.Thread(target=lambda: seen.append(engine_ref[0].stats()))  # snapshot() meanwhile
            other.start()
            other.join(2.0)
            assert seen, "stats() blocked: group_size() was asked inside the engine's lock"
            return 2

    gate = CoordinatorLikeGate()
    engine_ref.append(engine_with(gate))
    c = engine_ref[0].submit(spec("a"))
    engine_ref[0]._admit_once()
    assert c.status == "running" and gate.sent[-1][0] is p.Admit


def test_a_step_that_fails_midway_is_rolled_back_and_the_requests_go_on_with_the_same_tokens(monkeypatch):
    """What a recovery's survivor does with its batch: a step cut short (here: after the first request
    of two took its token and state) is undone, and the next step gives the tokens it would have."""
    import elastic.worker.batch as b

    torch.set_num_threads(1)
    model = unsharded(MODEL)
    specs = tuple(p.RequestSpec(request_id=f"r{i}", prompt=tuple(prompt_of(i)), max_tokens=5) for i in range(2))
    real = b.choose

    def run(fail_at: int | None) -> dict[str, list[int]]:
        batch = b.RequestBatch(model, 8)
        batch.admit(specs + (p.RequestSpec(request_id="other", prompt=(1,), max_tokens=1, owner=1),), 0)
        assert list(batch.running) == ["r0", "r1"]  # only what this rank (0) owns
        out: dict[str, list[int]] = {"r0": [], "r1": []}
        for step in range(5):
            if step == fail_at:
                calls = itertools.count()

                def failing(*args, calls=calls, **kwargs):
                    if next(calls) == 1:
                        raise RuntimeError("a peer died in the combine")
                    return real(*args, **kwargs)

                monkeypatch.setattr(b, "choose", failing)
                with pytest.raises(RuntimeError):
                    batch.step()
                monkeypatch.setattr(b, "choose", real)
                assert len(batch.running["r0"].generated) == step + 1  # the half-made token is there
                assert batch.rollback() == 2 and batch.rollback() == 0
                for r in batch.running.values():
                    assert len(r.generated) == step
                    assert b.state_length(model, r.cache) == (0 if step == 0 else len(r.spec.prompt) + step - 1)
            for t in batch.step().tokens:
                out[t.request_id].append(t.token)
        return out

    expected = {s.request_id: model.generate(torch.tensor([s.prompt]), 5)[0][0].tolist() for s in specs}
    assert run(None) == expected and run(0) == expected and run(3) == expected


def test_a_replayed_token_that_differs_fails_the_request_as_an_output_mismatch():
    gate = RecordingGate()
    seen = []
    engine = RequestEngine(gate, ServingConfig(), on_mismatch=lambda c, pos, old, new: seen.append((pos, old, new)))
    c = engine.submit(spec("a"))
    engine._admit_once()
    engine.on_tokens(tokens("a", (0, 5), (1, 6)))
    engine.on_tokens(tokens("a", (0, 5), (1, 9)))
    assert c.status == "failed" and seen == [(1, 6, 9)] and engine.counts["mismatched"] == 1
    engine._admit_once()
    assert gate.sent[-1] == (p.Cancel, {"request_ids": ("a",)}), "its slot in the ranks' batch is freed"


def test_requests_in_a_failed_deployment_wait_for_recovery_then_get_503():
    now = [0.0]
    gate = RecordingGate()
    engine = engine_with(gate, clock=lambda: now[0], failed_grace_s=5.0)
    c = engine.submit(spec("a"))
    engine._admit_once()
    gate.health = "failed"  # a recovery may come: the request waits
    engine._expire()
    now[0] = 4.0
    engine._expire()
    assert c.status == "running"
    now[0] = 5.5
    engine._expire()
    assert c.status == "failed" and c.error is not None and c.error.retry_after_s == 1
    gate.health = "down"  # failed, nothing recovers it: refused at once
    with pytest.raises(Exception, match="no recovery"):
        engine.submit(spec("b"))


def test_a_request_cancelled_while_its_admit_is_sent_is_cancelled_on_the_ranks_too():
    gate = RecordingGate()
    engine = engine_with(gate)
    c = engine.submit(spec("a"))
    send = gate.send_serving

    def cancel_in_the_window(command, **fields):  # the client leaves after the Admit was built, before it returns
        ok = send(command, **fields)
        if command is p.Admit:
            engine.cancel("a")
        return ok

    gate.send_serving = cancel_in_the_window  # type: ignore[method-assign]
    engine._admit_once()
    gate.send_serving = send  # type: ignore[method-assign]
    engine._admit_once()
    assert c.status == "cancelled" and (p.Cancel, {"request_ids": ("a",)}) in gate.sent
    assert engine.stats()["running"] == 0


def test_a_full_batch_and_queue_refuse_with_overloaded():
    from elastic.core.errors import Overloaded

    engine = engine_with(RecordingGate(), max_batch=1, max_queue=1)
    engine.submit(spec("a"))
    engine._admit_once()
    engine.submit(spec("b"))
    with pytest.raises(Overloaded):
        engine.submit(spec("c"))


def test_the_choices_of_one_request_are_queued_all_or_none_and_a_refusal_counts_no_cancel():
    """A request of n choices that does not fit was refused after its first choices were queued,
    and those were counted as cancelled (the client left): 10 of a 16-choice request, measured."""
    from elastic.core.errors import Overloaded

    engine = engine_with(RecordingGate(), max_batch=1, max_queue=3)
    engine.submit(spec("a"))
    engine._admit_once()  # a decodes; the queue has room for 3
    with pytest.raises(Overloaded, match="4 choices at once"):
        engine.submit_all([spec("b"), spec("c"), spec("d"), spec("e")])
    stats = engine.stats()
    assert (stats["queued"], stats["cancelled"], stats["rejected"]) == (0, 0, 1)
    assert [c.id for c in engine.submit_all([spec("b"), spec("c"), spec("d")])] == ["b", "c", "d"]
    assert engine.stats()["queued"] == 3


# -- the schema, fuzzed ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v1_schema(live):
    import schemathesis
    from schemathesis.config import SchemathesisConfig

    # the coverage phase enumerates every boundary of the schema: its invalid bodies are all kept
    # (about 120, each refused at once); its valid ones are left to the examples and fuzzing
    # phases, since each decodes 16 tokens (with them the test took 28 s of the suite, now 2 s)
    config = SchemathesisConfig.from_str('[phases.coverage.generation]\nmode = "negative"\n')
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json", config=config)


v1 = schemathesis.pytest.from_fixture("v1_schema")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@v1.include(path_regex="^/v1/").parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_completions_schema_fuzzed_finds_no_server_errors(case, live):
    from schemathesis.checks import positive_data_acceptance

    response = case.call(base_url=live.url, timeout=60)
    assert case.path.startswith("/v1/"), "only the completion routes are fuzzed here"
    # a schema-valid body may still be refused by rule (404 another model, 422 a token past the vocabulary)
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        # the routes answer in OpenAI's shape; what never reaches one (a wrong method) in the server's
        error = body["error"] if isinstance(body["error"], dict) else body
        assert error["message"] and (error.get("type") or response.status_code in (404, 405)), (response.status_code, body)


# -- the load generator ------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_load_generator_reports_requests_latencies_and_a_plot_and_checks_tokens(live, tmp_path):
    import json

    from tests.helpers import run_cli

    deployment_file = tmp_path / "deployment.yaml"
    deployment_file.write_text(f"model: {json.dumps(MODEL)}\nep_size: 2\nmax_ep_size: 4\n"
                               "eplb: {num_redundant_experts: 4}\n")
    out = tmp_path / "load"
    result = run_cli("loadgen", live.url, "--rate", "6", "--concurrency", "3", "--duration", "3",
                     "--prompt-len", "4:8", "--max-tokens", "6:12", "--seed", "3", "--out", str(out),
                     "--check", str(deployment_file), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "loadgen.json").read_text())
    summary = data["summary"]
    assert summary["ok"] == summary["requests"] > 0 and summary["failed"] == 0
    assert summary["check"]["identical"] == summary["check"]["checked"] == summary["ok"]
    assert summary["itl"] and all(row["p99_ms"] >= row["p50_ms"] > 0 for row in summary["itl"].values())
    assert all(len(r["tokens"]) == r["max_tokens"] for r in data["requests"])
    png = (out / "loadgen.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_the_load_generator_exits_3_when_the_server_cannot_be_reached(tmp_path):
    from tests.helpers import free_port, run_cli

    result = run_cli("loadgen", f"http://127.0.0.1:{free_port()}", "--duration", "1", "--out", str(tmp_path))
    assert result.exit_code == 3 and "cannot reach" in result.output


@pytest.mark.parametrize("start, end, expected", [
    (1.0, 2.0, "steady"), (9.5, 10.5, "scale"), (10.5, 11.0, "scale"), (19.0, 21.0, "recovery"),
    (29.9, 30.1, "rebalance"), (14.0, 22.0, "recovery"),  # overlapping a scale and a recovery: the recovery
])
def test_a_latency_gap_is_labelled_by_the_server_windows_it_overlaps(start, end, expected):
    from elastic.service.loadgen import _windows, label_gaps

    timeline = {"windows": [{"kind": "scale", "started_at": 10.0, "ended_at": 15.0},
                            {"kind": "failure", "started_at": 20.0, "ended_at": None},
                            {"kind": "rebalance", "started_at": 30.0, "ended_at": 30.05}]}
    assert label_gaps(start, end, _windows(timeline, until=25.0)) == expected


def test_a_waiting_handler_is_woken_by_the_engine_not_by_a_poll():
    """The HTTP handlers wait on the engine's change notices: a token reported from another thread
    wakes the waiter at once, though its fallback timeout is 30 s; an idle waiter is not woken."""
    import asyncio

    from elastic.service.completions import Wakeups

    gate = RecordingGate()
    engine = engine_with(gate)
    wakeups = Wakeups(engine)
    c = engine.submit(spec("a", n=2))
    engine._admit_once()

    async def scenario() -> tuple[float, bool]:
        with wakeups.waiter() as event:
            started = time.monotonic()
            await wakeups.wait(event, 0.3)  # nothing happens: it sleeps its whole timeout
            woken_while_idle = time.monotonic() - started < 0.25
            loop = asyncio.get_running_loop()
            started = time.monotonic()
            loop.run_in_executor(None, lambda: (time.sleep(0.05), engine.on_tokens(tokens("a", (0, 5)))))
            await wakeups.wait(event, 30.0)
            return time.monotonic() - started, woken_while_idle

    waited, woken_while_idle = asyncio.run(scenario())
    assert c.tokens == [5] and waited < 5.0 and not woken_while_idle
