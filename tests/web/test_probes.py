"""``GET livez`` and ``GET readyz`` on every service of a real cluster, and readiness that
follows what the services really do: an instance draining, a controller left with no active
instance, an Index Service whose Redis is stopped."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from kvsp.auth import Principals
from kvsp.core.problems import NotReady
from kvsp.local import LocalCluster
from kvsp.web.openapi import routes_of
from kvsp.web.probes import probe_ops
from tests.servers import RedisServer, Service, running

pytestmark = pytest.mark.slow


def ready(http: httpx.Client, url: str) -> tuple[int, list[str]]:
    answer = http.get(url + "readyz")
    if answer.status_code == 200:
        return 200, []
    doc = answer.json()
    assert doc["type"].endswith(NotReady.slug)
    assert answer.headers["content-type"].startswith("application/problem+json")
    return answer.status_code, doc["reasons"]


def test_readyz_answers_once_per_change_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    reasons: list[str] = ["the store does not answer"]

    async def readiness() -> list[str]:
        return list(reasons)

    app = Starlette(routes=routes_of("/kvsp/", "t", probe_ops("t", readiness), Principals({})))
    with TestClient(app) as client, caplog.at_level(logging.INFO, "kvsp.probes"):
        for _ in range(3):
            answer = client.get("/kvsp/readyz")
            assert answer.status_code == 503
            assert answer.json()["reasons"] == reasons
        reasons.clear()
        for _ in range(3):
            assert client.get("/kvsp/readyz").json() == {"status": "ready"}
        assert client.get("/kvsp/livez").json() == {"status": "ok"}
    lines = [r.getMessage() for r in caplog.records if r.name == "kvsp.probes"]
    assert lines == ["t not ready: the store does not answer", "t ready"]


def test_every_service_is_live_and_ready_and_a_drained_instance_is_not(
    operated_cluster: Any,
) -> None:
    up: LocalCluster = operated_cluster
    instance = up.instance_processes[0].url
    with httpx.Client(timeout=10) as http:
        for process in up.processes:
            assert http.get(process.url + "livez").json() == {"status": "ok"}, process.name
            assert ready(http, process.url) == (200, []), process.name
        drain = {"instance": instance, "state": "draining"}
        auth = {"authorization": f"Bearer {up.operator_token}"}
        assert http.put(up.controller.url + "instances/state", json=drain, headers=auth).is_success
        # an idle instance drains at once and sleeps
        assert ready(http, instance)[1][0] in (
            "the instance is draining",
            "the instance is sleeping",
        )
        assert http.get(instance + "livez").status_code == 200
        assert ready(http, up.controller.url) == (503, ["no active instance"])
        wake = {"instance": instance, "state": "active"}
        assert http.put(up.controller.url + "instances/state", json=wake, headers=auth).is_success
        assert ready(http, instance) == (200, [])
        assert ready(http, up.controller.url) == (200, [])


def test_an_index_service_whose_redis_stops_is_live_but_not_ready() -> None:
    redis = RedisServer()
    index = Service("index", "serve", "--store", redis.url)
    with running(redis, index), httpx.Client(timeout=15) as http:
        assert ready(http, index.base_url) == (200, [])
        assert redis.process is not None
        os.kill(redis.process.pid, signal.SIGSTOP)
        try:
            status, reasons = ready(http, index.base_url)
            assert status == 503
            assert reasons[0].startswith("the redis store does not answer"), reasons
            assert http.get(index.base_url + "livez").json() == {"status": "ok"}
        finally:
            os.kill(redis.process.pid, signal.SIGCONT)
        assert ready(http, index.base_url) == (200, [])
