"""A cluster that heals: an instance stopped past its status TTL, and an Index Service stopped
for 5 s, leave no lasting outage; prompts the model cannot take are 400 before placing."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.model import ModelFiles
from tests.integration.instances import KEYS, PROMPT, Cluster, active, eventually
from tests.servers import Service, running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def _auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS['acme']}"}


async def _complete(pc: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as http:
        return await http.post(pc + "v1/completions", json=body, headers=_auth())


async def _epoch(pc: str, url: str) -> tuple[str, int]:
    async with httpx.AsyncClient() as http:
        view = (await http.get(pc + "instances")).json()["instances"]
    entry = next(i for i in view if i["instance"] == url)
    return entry["state"], entry["epoch"]


def _pause(service: Service, seconds: float) -> None:
    assert service.process is not None
    assert service.process.pid is not None
    os.kill(service.process.pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(service.process.pid, signal.SIGCONT)


async def test_stopped_instance_and_index_rejoin_by_themselves(
    tmp_path: Path, model_files: ModelFiles
) -> None:
    compat = model_files.compat_id.hex()
    cluster = Cluster(tmp_path, compat, controller=True, frontend=True)
    pc = cluster.pc
    a = cluster.instance()
    with running(cluster.index, cluster.holder, cluster.controller, a):
        await eventually(lambda: active(pc), {a.base_url})
        _, first_epoch = await _epoch(pc, a.base_url)
        ok = await _complete(pc, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200, ok.text

        # past its 900 ms TTL: the controller marks it failed; it must come back by itself
        await asyncio.to_thread(_pause, a, 3.0)
        resumed = time.monotonic()
        await eventually(lambda: active(pc), {a.base_url})
        state, epoch = await _epoch(pc, a.base_url)
        assert (state, epoch > first_epoch) == ("active", True)
        served = await _complete(pc, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert served.status_code == 200, served.text
        rejoin_s = time.monotonic() - resumed
        print(f"instance rejoined and served within {rejoin_s:.2f} s of SIGCONT")
        assert rejoin_s < 10

        # the IS stopped for 5 s: statuses are still answered at once, the instance stays
        assert cluster.index.process is not None
        assert cluster.index.process.pid is not None
        os.kill(cluster.index.process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(5.0)
            assert await active(pc) == {a.base_url}
        finally:
            os.kill(cluster.index.process.pid, signal.SIGCONT)
        after = time.monotonic()
        served = await _complete(pc, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert served.status_code == 200, served.text
        print(f"completion after the IS resumed: {time.monotonic() - after:.2f} s")
        assert time.monotonic() - after < 10
        assert (await _epoch(pc, a.base_url))[1] == epoch  # never marked failed meanwhile

        # what the model cannot take is 400 before anything is placed
        too_long = await _complete(pc, {"prompt": [1] * 9000, "max_tokens": 2})
        assert too_long.status_code == 400, too_long.text
        assert "context" in too_long.json()["detail"]
        beyond = await _complete(pc, {"prompt": [49_152], "max_tokens": 2})
        assert beyond.status_code == 400
        assert "token ids" in beyond.json()["detail"]
        direct = await _post(a.base_url + "generate", {"tenant": "acme", "tokens": [10**6]})
        assert direct.status_code == 400, direct.text
    assert b"Traceback" not in a.log


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(url, json=body)


async def _healthz_latency_during(pc: str, work: Any) -> tuple[Any, float]:
    """``work``'s result, and the slowest ``GET healthz`` of the controller meanwhile."""
    task = asyncio.ensure_future(work)
    worst = 0.0
    async with httpx.AsyncClient(timeout=30) as http:
        while not task.done():
            started = time.monotonic()
            assert (await http.get(pc + "healthz")).status_code == 200
            worst = max(worst, time.monotonic() - started)
            await asyncio.sleep(0.02)
    return await task, worst


async def test_long_prompts_wait_their_turn_and_abandoned_ones_stop(
    tmp_path: Path, model_files: ModelFiles
) -> None:
    """One tenant's long prompt does not hold another tenant's short request; a request whose
    client went away stops generating; a 2 MiB chat body does not stall the controller."""
    cluster = Cluster(tmp_path, model_files.compat_id.hex(), controller=True, frontend=True)
    pc = cluster.pc
    a = cluster.instance()
    with running(cluster.index, cluster.holder, cluster.controller, a):
        await eventually(lambda: active(pc), {a.base_url})
        short = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        started = time.monotonic()
        assert (await _complete(pc, short)).status_code == 200
        alone_s = time.monotonic() - started

        long_prompt = {"prompt": list(range(100, 4100)), "max_tokens": 1, "temperature": 0}
        long = asyncio.ensure_future(_complete(pc, long_prompt))
        await asyncio.sleep(1.0)  # its prefill has begun
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=120) as http:
            other = await http.post(
                pc + "v1/completions", json=short,
                headers={"authorization": f"Bearer {KEYS['other']}"},
            )  # fmt: skip
        waited_s = time.monotonic() - started
        long_answer = await long
        long_s = time.monotonic() - started
        assert other.status_code == 200, other.text
        assert long_answer.status_code == 200, long_answer.text
        print(f"short request: {alone_s:.2f} s alone, {waited_s:.2f} s beside a 4,000-token "
              f"prompt of another tenant that took {long_s:.2f} s")  # fmt: skip
        assert waited_s < long_s / 2  # served between the long prompt's chunks

        # a client that goes away: the instance stops long before its 200 tokens
        body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", pc + "v1/completions", json=body, headers=_auth()) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # the first token: then hang up
        gone = time.monotonic()

        async def running_sessions() -> int:
            async with httpx.AsyncClient() as http:
                return int((await http.get(a.base_url + "status")).json()["running"])

        await eventually(running_sessions, 0)
        print(f"generation stopped {time.monotonic() - gone:.2f} s after the client left")
        assert time.monotonic() - gone < 5  # 200 tokens take about 13 s

        chat = {"messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 1}
        answer, worst_s = await _healthz_latency_during(pc, _complete(pc, {**chat, "model": "x"}))
        assert answer.status_code in (400, 413), answer.text
        print(f"2 MiB chat body: {answer.status_code}; worst healthz meanwhile {worst_s:.3f} s")
        assert worst_s < 0.5

        async with httpx.AsyncClient(timeout=30) as http:
            unknown = await http.get(a.base_url + f"sessions/{uuid.uuid4()}/tokens")
            assert unknown.status_code == 404
            assert unknown.headers["content-type"] == "application/problem+json"
            deep = await http.post(
                a.base_url + "reshard", content=b'{"map":' + b"[" * 100_000,
                headers={"content-type": "application/json"},
            )  # fmt: skip
            assert deep.status_code == 400
    assert b"Traceback" not in a.log
