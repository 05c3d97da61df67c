"""The CLI client (elastic-ep status|scale|recover|rebalance|operations) against a real server."""

from __future__ import annotations

import json

import pytest

from tests.conftest import small_config
from tests.helpers import free_port, run_cli


def test_an_unreachable_server_exits_3_with_one_line():
    result = run_cli("status", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 3 and "cannot reach" in result.output, result.output


def test_a_bad_argument_exits_2():
    assert run_cli("scale", "three").exit_code == 2
    assert run_cli("scale", "0").exit_code == 2  # below its minimum, refused before any request


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("url", ["http://[::1", "localhost:8000", "ftp://x"])
def test_a_url_that_is_not_http_exits_2_naming_it(url):
    """A malformed --url was a traceback (httpx's InvalidURL, exit 1) or 'cannot reach' (exit 3), as if
    the server were down; loadgen's URL the same."""
    for args, prefix in ((["status", "--url", url], f"error: --url {url}: "),
                         (["loadgen", url, "--duration", "1"], f"error: URL {url}: ")):
        result = run_cli(*args)
        assert result.exit_code == 2, result.output
        line = result.output.strip()
        assert line.startswith(prefix + "expected an http:// or https:// URL such as http://127.0.0.1:8000"), line
        assert len(line.splitlines()) == 1 and "Traceback" not in line


def test_the_client_drives_a_served_deployment():
    from elastic.control.coordinator import Coordinator
    from elastic.service.api import create_app
    from elastic.service.server import BackgroundServer

    coordinator = Coordinator(small_config(max_ep_size=3))
    coordinator.start()
    try:
        with BackgroundServer(create_app(coordinator)) as server:
            url = server.url
            coordinator.wait_for_step(3, timeout=60)
            status = run_cli("status", "--url", url)
            assert status.exit_code == 0 and "running" in status.output and "serving yes" in status.output, status.output
            as_json = json.loads(run_cli("status", "--url", url, "--json").output)
            assert as_json["ep_size"] == 2 and len(as_json["ranks"]) == 2

            up = run_cli("scale", "3", "--wait", "--json", "--url", url)
            assert up.exit_code == 0, up.output
            op = json.loads(up.output)
            assert op["status"] == "succeeded" and op["target_size"] == 3 and coordinator.size == 3

            too_big = run_cli("scale", "9", "--url", url)  # the server's 422 names the field
            assert too_big.exit_code == 2 and "422" in too_big.output and "ep_size" in too_big.output, too_big.output
            not_failed = run_cli("recover", "--url", url)  # the server's 409: nothing to recover
            assert not_failed.exit_code == 2 and "409" in not_failed.output, not_failed.output

            listed = run_cli("operations", "--url", url)
            assert listed.exit_code == 0 and op["id"] in listed.output
            one = json.loads(run_cli("operations", op["id"], "--json", "--url", url).output)
            assert one["id"] == op["id"] and one["status"] == "succeeded"
            assert run_cli("operations", "op-nope", "--url", url).exit_code == 2  # 404

            rebalanced = run_cli("rebalance", "--url", url, "--json")
            assert rebalanced.exit_code == 0 and json.loads(rebalanced.output)["confirmed"] is True, rebalanced.output
    finally:
        coordinator.shutdown()


def test_with_an_api_key_every_change_needs_it_and_reading_stays_open(monkeypatch):
    import httpx

    from elastic.core.machine import Phase
    from elastic.service.api import create_app
    from elastic.service.server import BackgroundServer
    from tests.test_api import FakeController

    controller = FakeController(Phase.RUNNING)
    calls: list[int] = []
    controller.rebalance = lambda timeout=30.0: calls.append(1) or True
    with BackgroundServer(create_app(controller, api_key="s3cret")) as server, \
            httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/state").status_code == 200 and client.get("/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.post("/rebalance", headers=headers)
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", r.text
            assert r.headers["WWW-Authenticate"] == "Bearer"
        assert client.post("/scale", json={"ep_size": 3}).status_code == 401
        assert calls == []  # nothing was done
        ok = client.post("/rebalance", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and calls == [1], ok.text
        # the CLI client sends the key from ELASTIC_EP_API_KEY
        assert run_cli("rebalance", "--url", server.url).exit_code == 2
        monkeypatch.setenv("ELASTIC_EP_API_KEY", "s3cret")
        assert run_cli("rebalance", "--url", server.url).exit_code == 0 and calls == [1, 1]


def test_json_logs_carry_the_deployment_context(capsys):
    import logging

    from elastic.service.logs import configure

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure("json", logging.INFO, context=lambda: {"generation": 4, "operation_id": "op-1", "rank": None})
        logging.getLogger("elastic.test").info("scaled to %d", 3, extra={"rank": 2})
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        root.handlers[:], root.level = saved
    record = json.loads(line)
    assert record["message"] == "scaled to 3" and record["level"] == "INFO" and record["logger"] == "elastic.test"
    assert (record["generation"], record["operation_id"], record["rank"]) == (4, "op-1", 2)
    with pytest.raises(ValueError, match="expected text or json"):
        configure("xml")
