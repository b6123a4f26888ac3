"""The Placement Controller as a real process beside real Index Service and holder processes:
blocks stored at the holder are found through the IS and prefetched into the instance that can
load them; an instance that stops reporting has its session resumed on another."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.core.ids import parse_compat_id
from kvsp.core.keys import block_keys, scope_id
from kvsp.holder.client import HolderClient
from tests.controller.factories import SESSION
from tests.controller.standin import StandIn
from tests.holder.factories import container
from tests.index.factories import COMPAT
from tests.principals import principal
from tests.servers import Service, free_port, running, serving

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SCOPE_KEY = "22" * 32
TOKENS = list(range(2000, 2080))


def principals(holder: str, i1: str, i2: str) -> str:
    return "\n".join(
        [
            principal("op", ["controller", "client"]),
            principal("pc", ["controller"], ["*"]),
            principal("holder", ["holder"], [holder]),
            principal("i1", ["instance"], [i1]),
            principal("i2", ["instance"], [i2]),
        ]
    )


async def test_placement_prefetch_and_failover_across_real_services(tmp_path: Path) -> None:
    stand_ins = [StandIn(), StandIn()]
    async with contextlib.AsyncExitStack() as stack:
        i1, i2 = [await stack.enter_async_context(serving(s.app)) for s in stand_ins]
        holder_port = free_port()
        holder_url = f"http://127.0.0.1:{holder_port}/kvsp/"
        auth = tmp_path / "principals.toml"
        auth.write_text(principals(holder_url, i1, i2))
        tenants = tmp_path / "tenants.toml"
        tenants.write_text(
            f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{COMPAT}"]\n'
        )
        for name in ("holder", "pc"):
            (tmp_path / f"{name}.token").write_text(name)
        index = Service("index", "serve", "--auth", str(auth), "--log-level", "warning")
        holder = Service(
            "holder", "serve", "--url", holder_url, "--host-bytes", "64M", "--auth", str(auth),
            "--index", index.base_url, "--index-token-file", str(tmp_path / "holder.token"),
            "--log-level", "warning", port=holder_port,
        )  # fmt: skip
        controller = Service(
            "controller", "serve", "--tenants", str(tenants), "--auth", str(auth),
            "--index", index.base_url, "--index-token-file", str(tmp_path / "pc.token"),
            "--log-level", "warning",
        )  # fmt: skip
        stack.enter_context(running(index, holder, controller))
        scope_key = bytes.fromhex(SCOPE_KEY)
        keys = [k.hex() for k in block_keys(scope_key, parse_compat_id(COMPAT), TOKENS, 16)]
        scope = scope_id(scope_key).hex()
        async with HolderClient("op") as client:
            for n, key in enumerate(keys[:4]):
                await client.put(holder_url, (COMPAT, scope, key), container(n))
        pc = await stack.enter_async_context(
            httpx.AsyncClient(base_url=controller.base_url, headers={"authorization": "Bearer op"})
        )

        async def report(url: str, token: str, **extra: Any) -> None:
            doc = {
                "instance": url, "epoch": 1, "state": "active", "running": 0, "queued": 0,
                "batch_size": 8, "kv_utilization": 0.1, "prefill_tokens_per_s": 400,
                "decode_tokens_per_s": 15, "ttl_ms": 600, **extra,
            }  # fmt: skip
            r = await pc.put("status", json=doc, headers={"authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text

        link = [{"holder": holder_url, "mbit_per_s": 10_000, "rtt_us": 50}]
        body = {"tenant": "acme", "compat_id": COMPAT, "tokens": TOKENS, "wait_prefetch": True}
        for _ in range(50):  # until the holder's publishes have reached the IS
            await report(i1, "i1", links=link)
            await report(i2, "i2", queued=1)
            doc = (await pc.post("place", json=body)).json()
            if doc["matched_blocks"] == 4:
                break
            await asyncio.sleep(0.1)
        assert doc["instance"] == i1, doc
        assert doc["prefetch"]["state"] == "complete"
        directive = stand_ins[0].of("prefetch")[-1]
        assert [b["block_key"] for b in directive["blocks"]] == keys[:4]
        assert directive["blocks"][0]["sources"] == [holder_url]

        placed = (await pc.post("place", json={**body, "session": SESSION})).json()
        assert placed["instance"] == i1
        sid = placed["session"]  # the tenant's name for it, namespaced
        for _ in range(40):  # I1 goes silent; I2 keeps reporting
            await report(i2, "i2", queued=1)
            if stand_ins[1].of("resume"):
                break
            await asyncio.sleep(0.1)
        (resume,) = stand_ins[1].of("resume")
        assert resume["session"] == sid
        assert resume["epoch"] == 1
        # 80 tokens end on a block boundary: five blocks, an empty tail (KVSP 4.4), and the
        # last block's tokens, which the resuming engine recomputes for the first logits
        assert resume["prompt_blocks"] == keys[:5]
        assert resume["prompt_tail"] == []
        assert resume["last_block"] == TOKENS[64:]
        for _ in range(40):  # the session moves once I2 has answered the resume
            view = (await pc.get(f"sessions/{sid}")).json()
            if view["instance"] == i2:
                break
            await asyncio.sleep(0.05)
        assert (view["instance"], view["epoch"]) == (i2, 1)
    assert controller.log.count(b"Traceback") == 0


async def test_a_path_with_a_line_break_cannot_forge_a_log_line(tmp_path: Path) -> None:
    """A path parameter with %0d%0a, reflected in the problem logged for it, stays one line."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{COMPAT}"]\n')
    controller = Service("controller", "serve", "--tenants", str(tenants), "--log-level", "info")
    with running(controller):  # raw octets: an HTTP client may clean the target up
        reader, writer = await asyncio.open_connection("127.0.0.1", controller.port)
        writer.write(b"GET /kvsp/shards/m%0d%0aFORGED%20200%20OK HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 404 ")
    lines = controller.log.decode().splitlines()
    assert not [line for line in lines if line.startswith("FORGED")]
    assert any("no shard map m\\x0d\\x0aFORGED 200 OK" in line for line in lines)
