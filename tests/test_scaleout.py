"""Scale-out: workers on several hosts, started by a command template or as Ray actors.

- pure parts: host layouts and rank mappings, the node count, the store channel, the config;
- the command launcher on loopback with two named hosts (no root needed);
- two real hosts on one machine: network namespaces joined by veth links through a bridge,
  made by the test (needs root and iproute2; skipped with the reason elsewhere);
- the Ray launcher on a local Ray cluster the test starts (skipped without ``ray``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from elastic.core.mapping import RankMapping
from elastic.core.protocol import Heartbeat
from elastic.deployment import DeploymentConfig, LauncherConfig
from elastic.launch.channel import StoreQueue, TaggedOutbox, connect
from elastic.launch.factory import make_launcher
from elastic.launch.launchers import CommandLauncher, LocalLauncher, balanced_layout, plan_resize
from elastic.worker.groups import num_nodes_of, open_store
from tests.conftest import running, small_config
from tests.helpers import assert_consistent, wait_for_state

# a survivor blocked on the lost peer gives up after the collective timeout: keep it short
FAST_LOSS = dict(collective=10, heartbeat=14)
REMOTE = ["{python}", "-m", "elastic.launch.remote_worker", "--store", "{store}", "--worker-id", "{worker_id}"]


# -- pure parts ---------------------------------------------------------------------------------

def test_the_forkserver_preloads_transformers_only_for_a_hugging_face_model():
    hf = make_launcher(DeploymentConfig(model={"kind": "hf", "architecture": "qwen3_moe"}))
    reference = make_launcher(DeploymentConfig())
    assert "transformers" in hf.preload and "elastic.worker.preload" in hf.preload
    assert reference.preload == ["elastic.worker.preload"]


def test_a_later_reference_deployment_does_not_narrow_the_forkserver_preload():
    """The forkserver reads its list when it (re)starts: one restarted after a reference deployment
    was set up (a launch restarts a forkserver that died) must still preload transformers for the
    Hugging Face workers of the process (the reliability test's killed forkserver did not)."""
    from elastic.launch.launchers import preload_in_forkserver

    make_launcher(DeploymentConfig(model={"kind": "hf", "architecture": "qwen3_moe"}))
    make_launcher(DeploymentConfig())
    assert "transformers" in preload_in_forkserver([])


# the compiled kernels eplb.algorithm.warm_up loads (a new kernel belongs here and in warm_up)
EVERY_KERNEL = ("add_replicas", "balancedness", "bfd_pack", "copies_vs", "fill_pack", "gate_draws", "improve", "keep_idle",
                "logical_to_physical", "moved_counts", "on_draws", "repair_counts", "replica_counts", "sorted_items",
                "swap_refine", "take_counts")


def _what_a_forked_worker_finds_loaded(answers) -> None:
    from eplb import _compiled

    kernels = [name for name, f in vars(_compiled).items() if hasattr(f, "signatures") and not name.startswith("_")]
    answers.put({"transformers": "transformers.masking_utils" in sys.modules,
                 "kernels": sorted(name for name in kernels if getattr(_compiled, name).signatures)})


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_local_worker_forks_with_transformers_and_the_placement_kernels_already_loaded():
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")  # the session's, started by conftest with the preload of both model kinds
    answers = ctx.Queue()
    child = ctx.Process(target=_what_a_forked_worker_finds_loaded, args=(answers,))
    child.start()
    try:
        assert answers.get(timeout=30) == {"transformers": True, "kernels": sorted(EVERY_KERNEL)}
    finally:
        child.join(10)


@pytest.mark.timeout(10)
def test_num_nodes_needs_contiguous_equal_blocks():
    assert num_nodes_of(["a", "a", "b", "b"]) == 2
    assert num_nodes_of(["a", "b"]) == 2
    assert num_nodes_of(["a", "a", "a"]) == 1
    assert num_nodes_of(["a", "b", "a", "b"]) == 1  # interleaved: a "node" would span both hosts
    assert num_nodes_of(["a", "a", "b"]) == 1  # uneven: the hierarchical policy needs equal nodes
    assert num_nodes_of([]) == 1


@pytest.mark.timeout(10)
def test_layout_is_even_contiguous_and_within_slots():
    free = [("a", None), ("b", None)]
    assert balanced_layout(free, 2) == ["a", "b"]
    assert balanced_layout(free, 3) == ["a", "a", "b"]
    assert balanced_layout(free, 4) == ["a", "a", "b", "b"]
    assert balanced_layout([("a", 1), ("b", None)], 3) == ["a", "b", "b"]
    with pytest.raises(ValueError, match="do not fit"):
        balanced_layout([("a", 1), ("b", 1)], 3)


@pytest.mark.timeout(10)
def test_plan_keeps_workers_on_their_hosts_and_ranks_contiguous():
    layout = lambda n: balanced_layout([("a", None), ("b", None)], n)  # noqa: E731
    # scale up 2 -> 4: the b worker moves to rank 2, fresh ranks 1 (on a) and 3 (on b)
    mapping, joining = plan_resize(["a", "b"], 4, layout(4))
    assert mapping == RankMapping((0, 2), 4) and joining == {1: "a", 3: "b"}
    # scale down 4 -> 2: one survivor per host
    mapping, joining = plan_resize(["a", "a", "b", "b"], 2, layout(2))
    assert mapping == RankMapping((0, -1, 1, -1), 2) and joining == {}
    # whatever the start, the new group's hosts are the layout
    for hosts in (["a"], ["b", "b"], ["a", "b", "b"], ["b", "a", "a", "b"]):
        for n in range(1, 6):
            mapping, joining = plan_resize(hosts, n, layout(n))
            new_hosts = [joining.get(new) or hosts[mapping.new_to_old[new]] for new in range(n)]
            assert new_hosts == layout(n) or not set(hosts) & set(layout(n)), (hosts, n, mapping)
    # without a layout (Ray places actors): up keeps order, down retires from the fullest host
    assert plan_resize(["x", "y"], 3)[0] == RankMapping.for_resize(2, 3)
    assert plan_resize(["x", "x", "x", "y"], 2)[0] == RankMapping((0, -1, -1, 1), 2)
    assert plan_resize(["x", "y", "x", "y"], 2)[0] == RankMapping((0, 1, -1, -1), 2)


@pytest.mark.timeout(10)
def test_launcher_config_refuses_what_cannot_work():
    def bad(launcher, **top):
        with pytest.raises(ValueError) as info:
            DeploymentConfig.model_validate({"launcher": launcher, **top})
        return str(info.value)

    assert "only for kind 'ray'" in bad({"kind": "local", "address": "auto"})
    assert "only for kind 'command'" in bad({"kind": "ray", "hosts": [{"name": "a"}]})
    assert "needs a template" in bad({"kind": "command", "hosts": [{"name": "a"}]})
    assert "{worker_id}" in bad({"kind": "command", "template": ["ssh", "{host}", "--store", "{store}"],
                                 "hosts": [{"name": "a"}]})
    assert "placeholder" in bad({"kind": "command", "template": REMOTE + ["{nope}"], "hosts": [{"name": "a"}]})
    assert "distinct" in bad({"kind": "command", "template": REMOTE, "hosts": [{"name": "a"}, {"name": "a"}]})
    assert "slots" in bad({"kind": "command", "template": REMOTE, "hosts": [{"name": "a", "slots": 2}]}, max_ep_size=4)
    assert "store_port" in bad({"store_port": 70000})
    every = {"kind": "ray", "address": "auto", "store_port": 29500, "bind_host": "0.0.0.0"}
    with pytest.raises(ValueError, match="every interface.*pickles.*allow_all_interfaces"):
        DeploymentConfig.model_validate({"store_host": "10.0.0.5", "launcher": every})
    with pytest.raises(ValueError, match="store_host: '::'"):
        DeploymentConfig.model_validate({"store_host": "::"})
    ok = DeploymentConfig.model_validate({"store_host": "10.0.0.5", "launcher": {**every, "allow_all_interfaces": True}})
    assert (ok.store_bind_host, ok.store_advertise_host, ok.launcher.store_port) == ("0.0.0.0", "10.0.0.5", 29500)
    assert isinstance(make_launcher(small_config()), LocalLauncher)
    cmd = make_launcher(small_config(launcher={"kind": "command", "template": REMOTE, "hosts": [{"name": "a"}]}))
    assert isinstance(cmd, CommandLauncher) and cmd.capacity == 4


@pytest.mark.timeout(20)
def test_store_queue_is_fifo_across_producers_skips_holes_and_times_out():
    store = open_store("127.0.0.1", 0)
    reader = StoreQueue(connect("127.0.0.1", store.port), "q", hole_timeout_s=0.2)
    with pytest.raises(queue.Empty):
        reader.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        reader.get_nowait()

    def produce(name: str) -> None:
        q = StoreQueue(connect("127.0.0.1", store.port), "q")
        for i in range(50):
            q.put((name, i))

    threads = [threading.Thread(target=produce, args=(n,)) for n in "abc"]
    for t in threads:
        t.start()
    got = [reader.get(timeout=10) for _ in range(150)]
    for t in threads:
        t.join()
    for name in "abc":
        assert [i for n, i in got if n == name] == list(range(50))  # each producer's order kept
    # a producer that died between taking a number and writing it leaves a hole: skipped
    store.add("q/tail", 1)
    StoreQueue(store, "q").put("after the hole")
    assert reader.get(timeout=5) == "after the hole"
    assert reader.qsize() == 0
    # reports from another host carry the launcher's worker id as their pid
    tagged = TaggedOutbox(StoreQueue(store, "r"), worker_id=7)
    tagged.put(Heartbeat(rank=0, generation=0, pid=12345, at=0.0))
    assert StoreQueue(store, "r").get(timeout=5).pid == 7


@pytest.mark.timeout(10)
def test_store_listens_on_the_bind_address_only():
    store = open_store("127.0.0.1", 0)
    socket.create_connection(("127.0.0.1", store.port), timeout=2).close()
    with pytest.raises(OSError):  # another loopback address of this machine: nobody listens there
        socket.create_connection(("127.0.0.2", store.port), timeout=2).close()
    with pytest.raises(OSError, match="cannot listen"):
        open_store("127.0.0.1", store.port)


@pytest.mark.timeout(10)
def test_remote_worker_command_line():
    bad = subprocess.run([sys.executable, "-m", "elastic.launch.remote_worker", "--store", "nohost", "--worker-id", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


@pytest.mark.timeout(10)
def test_scenario_chooses_the_launcher():
    from elastic.replay.scenario import ScenarioError, parse_scenario

    s = parse_scenario({"name": "x", "steps": 10, "deployment": {"launcher": {"kind": "ray", "address": "auto"}}})
    assert s.deployment_config().launcher.kind == "ray"
    with pytest.raises(ScenarioError, match="deployment.launcher: address: only for kind 'ray'"):
        parse_scenario({"name": "x", "steps": 10, "deployment": {"launcher": {"address": "auto"}}})


# -- helpers for the multi-process tests ---------------------------------------------------------

def _hosts_by_rank(coordinator) -> list[str]:
    return [w.handle.host for w in coordinator.live_workers()]


def _rescale_placements(coordinator, size: int) -> list[list[list[int]]]:
    """``placement_after`` of the rescales that formed a group of ``size`` (from the workers' reports)."""
    out = []
    for reports in coordinator._done.values():
        for r in reports.values():
            if r.phase == "Rescale" and not r.detail.get("retired") and len(r.detail["placement_after"][0]) == \
                    coordinator.config.slots_per_rank * size:
                out.append(r.detail["placement_after"])
    return out


def _scale_over_two_hosts(c, host_a: str, host_b: str) -> None:
    """2 -> 4 -> 2 over two hosts, rebalancing between; checks the layout, the node count and the weights."""
    assert _hosts_by_rank(c) == [host_a, host_b]
    c.wait_for_step(12)
    verdict = assert_consistent(c, 2)
    assert {v["num_nodes"] for v in verdict.values()} == {2}
    assert verdict[0]["hosts"] == [host_a, host_b]

    op = c.scale(4)
    assert op.status == "succeeded", op.error
    assert _hosts_by_rank(c) == [host_a, host_a, host_b, host_b]  # ranks of a host contiguous
    verdict = assert_consistent(c, 4)
    assert {v["num_nodes"] for v in verdict.values()} == {2} and verdict[0]["hosts"] == [host_a, host_a, host_b, host_b]
    # the hierarchical policy got 2 nodes: an expert's replicas all live on one host
    for placement in _rescale_placements(c, 4):
        for row in placement:
            assert not set(row[: len(row) // 2]) & set(row[len(row) // 2 :]), row
    rebalances = c.snapshot()["rebalances"]
    assert c.rebalance()
    deadline = time.monotonic() + 30
    while c.snapshot()["rebalances"] <= rebalances:  # an async rebalance across both hosts finished
        assert time.monotonic() < deadline, "no rebalance finished on the 4-rank group"
        time.sleep(0.05)
    assert_consistent(c, 4)

    op = c.scale(2)
    assert op.status == "succeeded", op.error
    assert _hosts_by_rank(c) == [host_a, host_b]  # one survivor per host
    verdict = assert_consistent(c, 2)
    assert {v["num_nodes"] for v in verdict.values()} == {2}


def _two_host_config(hosts, **overrides):
    return small_config(
        eplb=dict(policy="hierarchical", policy_options={"num_groups": 2}),
        launcher=LauncherConfig(kind="command", template=overrides.pop("template", REMOTE), hosts=hosts),
        **overrides)


# -- the command launcher on loopback ------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_command_launcher_two_named_hosts_on_loopback():
    config = _two_host_config([{"name": "host-a"}, {"name": "host-b"}], timeouts=FAST_LOSS)
    with running(config) as c:
        assert _hosts_by_rank(c) == ["host-a", "host-b"]
        verdict = assert_consistent(c, 2)
        assert {v["num_nodes"] for v in verdict.values()} == {2}
        op = c.scale(4)
        assert op.status == "succeeded", op.error
        assert _hosts_by_rank(c) == ["host-a", "host-a", "host-b", "host-b"]  # ranks of a host contiguous
        verdict = assert_consistent(c, 4)
        assert {v["num_nodes"] for v in verdict.values()} == {2}
        for placement in _rescale_placements(c, 4):  # hierarchical with 2 nodes: replicas stay on one host
            for row in placement:
                assert not set(row[: len(row) // 2]) & set(row[len(row) // 2 :]), row
        # retire a worker the way an ssh launcher must (no signal reaches it): the store's kill key
        victim = c.live_workers()[1].handle
        c.launcher._retire(victim.worker_id)
        assert victim.join(10), "the remote worker did not leave on its kill key"
        wait_for_state(c, "failed", timeout=30)  # the loss of the worker is noticed
        assert "exited unexpectedly" in c.machine.failure_reason
        op = c.recover()
        assert op.status == "succeeded", op.error
        verdict = assert_consistent(c, 3)
        assert verdict[0]["hosts"] == ["host-a", "host-b", "host-b"]
        assert {v["num_nodes"] for v in verdict.values()} == {1}  # uneven hosts: flat balancing


# -- two hosts in network namespaces -------------------------------------------------------------

NETNS = ("eps-h0", "eps-h1")
BRIDGE, SUBNET, STORE_IP = "eps-br", "10.77.0.0/24", "10.77.0.1"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _clean_netns() -> None:
    for ns in NETNS:
        _ip("netns", "del", ns, check=False)
    for link in (BRIDGE, *NETNS):
        _ip("link", "del", link, check=False)


@pytest.fixture
def two_hosts():
    """Two namespaces, 10.77.0.2 and .3, joined through a bridge that holds 10.77.0.1 (the store).

    The names and addresses are the machine's, not the test's: a host-wide lock keeps two test
    processes (``pytest -n``) from making them at once."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip (apt-get install iproute2; .ci/run installs it)")
    with open(os.path.join(tempfile.gettempdir(), "elastic-ep-netns.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _made_hosts()


def _made_hosts():
    _clean_netns()
    try:
        _ip("netns", "add", NETNS[0])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.strip()}")
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{STORE_IP}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        addresses = {}
        for i, ns in enumerate(NETNS):
            if i:
                _ip("netns", "add", ns)
            inside, address = f"{ns}-in", f"10.77.0.{i + 2}"
            _ip("link", "add", ns, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", ns, "master", BRIDGE)
            _ip("link", "set", ns, "up")
            for args in (("addr", "add", f"{address}/24", "dev", inside), ("link", "set", inside, "up"),
                         ("link", "set", "lo", "up")):
                _ip("netns", "exec", ns, "ip", *args)
            addresses[ns] = (inside, address)
        yield addresses
    finally:
        _clean_netns()


def _connections(ns: str) -> list[tuple[str, str]]:
    """(local, peer) addresses of the established TCP connections inside ``ns``."""
    out = _ip("netns", "exec", ns, "ss", "-tnH", "state", "established").stdout
    pairs = []
    for line in out.splitlines():
        fields = line.split()
        local, peer = fields[-2], fields[-1]
        pairs.append(tuple(_plain(x.rsplit(":", 1)[0].strip("[]")) for x in (local, peer)))
    return pairs


def _plain(address: str) -> str:
    ip = ipaddress.ip_address(address.split("%")[0])
    return str(getattr(ip, "ipv4_mapped", None) or ip)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_two_hosts_in_network_namespaces(two_hosts):
    hosts = [{"name": ns, "env": {"GLOO_SOCKET_IFNAME": inside}} for ns, (inside, _) in two_hosts.items()]
    config = _two_host_config(hosts, template=["ip", "netns", "exec", "{host}", *REMOTE], store_host=STORE_IP)
    with running(config) as c:
        _scale_over_two_hosts(c, *NETNS)
        # every connection of the workers runs over the test's own addresses, and the group's
        # traffic crossed from one host to the other
        subnet = ipaddress.ip_network(SUBNET)
        (a, (_, ip_a)), (b, (_, ip_b)) = two_hosts.items()
        seen = _connections(a) + _connections(b)
        assert seen and all(ipaddress.ip_address(x) in subnet for pair in seen for x in pair), seen
        assert (ip_a, ip_b) in _connections(a) or (ip_b, ip_a) in _connections(b), seen
        assert any(peer == STORE_IP for _, peer in _connections(a)), "no store connection from host a"


# -- Ray ------------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(110)
def test_ray_launcher_scales_actors_and_reports_their_loss():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)  # its own, never a running one
    try:
        config = small_config(launcher=LauncherConfig(kind="ray", env={"GLOO_SOCKET_IFNAME": "lo"},
                                                      num_cpus_per_worker=1), timeouts=FAST_LOSS)
        with running(config) as c:
            launcher = c.launcher
            assert len(launcher.actor_names()) == 2
            c.wait_for_step(12)
            assert_consistent(c, 2)
            op = c.scale(4)
            assert op.status == "succeeded", op.error
            assert len(launcher.actor_names()) == 4  # two actors started by Ray for the new ranks
            c.wait_for_step(c.snapshot()["step"] + 2 * config.eplb.step_interval)
            assert c.snapshot()["rebalances"] >= 1  # async EPLB fired on the actors
            assert_consistent(c, 4)

            # an actor dies: the coordinator sees a worker loss, and recovers with the rest
            victim = c.live_workers()[2].handle
            ray.kill(victim.actor)
            wait_for_state(c, "failed", timeout=30)  # the actor's death is noticed
            assert "exited unexpectedly" in c.machine.failure_reason
            op = c.recover()
            assert op.status == "succeeded", op.error
            assert_consistent(c, 3)
            assert victim.name not in launcher.actor_names()

            op = c.scale(2)
            assert op.status == "succeeded", op.error
            assert_consistent(c, 2)
            assert len(launcher.actor_names()) == 2  # retired actors are gone from Ray
        assert launcher.actor_names() == []
    finally:
        ray.shutdown()
