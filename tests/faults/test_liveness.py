"""A cluster that heals: an instance stopped past its status TTL, and an Index Service stopped
for 5 s, leave no lasting outage; prompts the model cannot take are 400 before placing."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.instance.model import ModelFiles
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
