"""The whole system through the OpenAI-compatible front end, in real processes on the real model:
an Index Service, a holder, a controller with the front end, and instances.

- a prompt reused on another instance through the IS and prefetch (cached tokens > 0 there);
- chat and text completions, streamed (SSE) and not, with usage and cached tokens;
- a tenant's API key never reaches another tenant's cache; unknown keys are refused;
- an instance killed mid-stream: the client's stream goes on from another instance, every index
  once, output equal to the reference (greedy and seeded top-p);
- a draining instance finishes its live request, takes no new one, and goes to sleep;
- a block evicted at its holder during prefetch: the rest is recomputed, output still correct.
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.core.container import Container
from kvsp.core.ids import parse_compat_id, tenant_session
from kvsp.core.keys import block_keys, scope_id
from kvsp.core.records import Sampler
from kvsp.instance.engine import Engine, KvState
from tests.integration.instances import KEYS, PROMPT, SCOPE_KEY, Cluster, active, eventually
from tests.servers import Service, free_port, running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def auth(tenant: str = "acme") -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


async def complete(base: str, body: dict[str, Any], tenant: str = "acme") -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(base + "v1/completions", json=body, headers=auth(tenant))
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer


async def sse(
    base: str, path: str, body: dict[str, Any], on_chunk: Any = None
) -> list[dict[str, Any]]:
    """Every data chunk of a streamed answer, up to ``[DONE]``."""
    chunks: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=120) as http:
        body = {**body, "stream": True}
        async with http.stream("POST", base + path, json=body, headers=auth()) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return chunks
                chunks.append(json.loads(line[6:]))
                if on_chunk is not None:
                    await on_chunk(chunks[-1])
    raise AssertionError("the stream ended without [DONE]")


async def test_reuse_across_instances_chat_and_streaming(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat, controller=True, frontend=True)
    pc = cluster.pc
    a, b = cluster.instance(), cluster.instance()
    with running(cluster.index, cluster.holder, cluster.controller, a, b):
        await eventually(lambda: active(pc), {a.base_url, b.base_url})
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        cold = await complete(pc, body)
        assert cold["kvsp"]["token_ids"] == reference
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cold["usage"]["completion_tokens"] == 24
        first = cold["kvsp"]["instance"]
        other = b.base_url if first == a.base_url else a.base_url
        async with httpx.AsyncClient() as http:  # the next request must go to the other one
            change = {"instance": first, "state": "draining"}
            assert (await http.put(pc + "instances/state", json=change)).status_code == 200
        warm = await complete(pc, body)
        assert warm["kvsp"]["instance"] == other
        assert warm["kvsp"]["token_ids"] == reference
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 48

        chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12, "temperature": 0}  # fmt: skip
        async with httpx.AsyncClient(timeout=120) as http:
            answer = (await http.post(pc + "v1/chat/completions", json=chat,
                                      headers=auth())).json()  # fmt: skip
        assert answer["object"] == "chat.completion"
        text = answer["choices"][0]["message"]["content"]
        assert "Paris" in text
        chunks = await sse(pc, "v1/chat/completions", chat)
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert streamed == text
        assert chunks[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        text_chunks = await sse(pc, "v1/completions", {**body, "max_tokens": 8})
        assert [c["kvsp"]["token"] for c in text_chunks[:-1]] == reference[:8]
    for service in (a, b, cluster.controller):
        assert service.log.count(b"Traceback") == 0


async def test_a_tenant_never_reaches_another_tenants_cache(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat, controller=True, frontend=True)
    pc = cluster.pc
    a = cluster.instance()
    with running(cluster.index, cluster.holder, cluster.controller, a):
        await eventually(lambda: active(pc), {a.base_url})
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        await complete(pc, body, "acme")
        again = await complete(pc, body, "acme")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        other = await complete(pc, body, "other")  # same prompt, same instance, other tenant
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert other["kvsp"]["token_ids"] == reference[:8]
        async with httpx.AsyncClient(timeout=60) as http:
            for headers in ({}, {"authorization": "Bearer nope"}):
                refused = await http.post(pc + "v1/completions", json=body, headers=headers)
                assert refused.status_code == 401
                assert refused.headers["content-type"] == "application/problem+json"
            bad = await http.post(pc + "v1/completions", json={"max_tokens": 3}, headers=auth())
            assert bad.status_code == 400
            assert "prompt" in bad.json()["detail"]


@pytest.mark.parametrize("mode", ["greedy", "top-p"])
async def test_an_instance_killed_mid_stream_the_client_stream_goes_on_exactly_once(
    tmp_path: Path, engine: Engine, compat: str, mode: str
) -> None:
    if mode == "greedy":
        sampler = Sampler(method="greedy", deterministic=True)
        extra: dict[str, Any] = {"temperature": 0}
    else:
        sampler = Sampler(method="top-p", params={"p": 0.9, "temperature": 0.8}, seed=7)
        extra = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
    expected = list(engine.generate(KvState(), PROMPT, sampler, 32))
    cluster = Cluster(tmp_path, compat, controller=True, frontend=True)
    pc = cluster.pc
    a, b = cluster.instance(), cluster.instance()
    session = str(uuid.uuid4())
    placed_as = tenant_session(scope_id(bytes.fromhex(SCOPE_KEY)).hex(), session)
    killed: list[str] = []

    async def kill_after_ten(chunk: dict[str, Any]) -> None:
        if chunk.get("kvsp", {}).get("index") == 9 and not killed:
            async with httpx.AsyncClient() as http:
                serving = (await http.get(f"{pc}sessions/{placed_as}")).json()["instance"]
            victim = a if serving == a.base_url else b
            victim.stop(signal.SIGKILL)
            killed.append(serving)

    with running(cluster.index, cluster.holder, cluster.controller, a, b):
        await eventually(lambda: active(pc), {a.base_url, b.base_url})
        body = {"prompt": PROMPT, "max_tokens": 32, "session": session, **extra}
        chunks = await sse(pc, "v1/completions", body, kill_after_ten)
    assert killed
    tokens = [c["kvsp"] for c in chunks[:-1]]
    assert [t["index"] for t in tokens] == list(range(32))  # every index, once, in order
    assert [t["token"] for t in tokens] == expected  # nothing altered
    assert {t["epoch"] for t in tokens} == {0, 1}
    summary = chunks[-1]["kvsp"]
    assert summary["resumed"] == 1
    assert summary["instance"] != killed[0]
    assert summary["indexes"] == 32


async def test_a_draining_instance_finishes_its_live_request_then_sleeps(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat, controller=True, frontend=True)
    pc = cluster.pc
    a, b = cluster.instance(), cluster.instance()
    drained: list[str] = []

    async def drain_at_five(chunk: dict[str, Any]) -> None:
        if chunk.get("kvsp", {}).get("index") == 4 and not drained:
            async with httpx.AsyncClient() as http:
                view = (await http.get(pc + "instances")).json()["instances"]
                busy = next(i["instance"] for i in view if i["running"])
                change = {"instance": busy, "state": "draining"}
                assert (await http.put(pc + "instances/state", json=change)).status_code == 200
                drained.append(busy)
                # while it drains, new requests go elsewhere
                other = await complete(pc, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
                assert other["kvsp"]["instance"] != busy

    with running(cluster.index, cluster.holder, cluster.controller, a, b):
        await eventually(lambda: active(pc), {a.base_url, b.base_url})
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        chunks = await sse(pc, "v1/completions", body, drain_at_five)
        assert [c["kvsp"]["token"] for c in chunks[:-1]] == reference  # finished in full
        assert chunks[-1]["kvsp"]["instance"] == drained[0]

        async def state_of_drained() -> str:
            async with httpx.AsyncClient() as http:
                view = (await http.get(pc + "instances")).json()["instances"]
            return str(next(i["state"] for i in view if i["instance"] == drained[0]))

        await eventually(state_of_drained, "sleeping")


async def test_a_block_evicted_at_its_holder_during_prefetch_is_recomputed(
    tmp_path: Path, engine: Engine, reference: list[int], compat: str
) -> None:
    """The IS still lists a holder's copy of block 1 of the prompt, but the holder evicted it:
    the lease and the fetch fail, block 0 is reused, the rest recomputed, output unchanged."""
    cluster = Cluster(tmp_path, compat, controller=True, frontend=True)
    pc = cluster.pc
    port = free_port()
    holder_url = f"http://127.0.0.1:{port}/kvsp/"
    # a holder that does not tell the IS (the test does), with room for 3 blocks
    small = Service("holder", "serve", "--url", holder_url, "--host-bytes", "2300K",
                    "--log-level", "warning", port=port)  # fmt: skip
    a = cluster.instance()
    state = KvState()
    engine.forward(state, PROMPT[:48])
    scope = scope_id(bytes.fromhex(SCOPE_KEY)).hex()
    keys = [k.hex() for k in block_keys(bytes.fromhex(SCOPE_KEY), parse_compat_id(compat),
                                          PROMPT[:48], 16)]  # fmt: skip
    with running(cluster.index, cluster.holder, cluster.controller, small, a):
        await eventually(lambda: active(pc), {a.base_url})
        async with httpx.AsyncClient(timeout=60) as http:
            records = []
            for i, key in enumerate(keys):
                octets = engine.export_block(state, i).tobytes()
                put = await http.put(
                    f"{holder_url}blocks/{compat}/{scope}/{key}", content=octets,
                    headers={"content-type": "application/kvsp-block", "if-none-match": "*"},
                )  # fmt: skip
                assert put.status_code == 201, put.text
                records.append(put.json())
            for record in records:  # what the holder would have published
                path = f"replicas/{compat}/{scope}/{record['block_key']}"
                assert (await http.put(cluster.index.base_url + path, json=record)).is_success
            # blocks 0 and 2 are used, then another block takes block 1's room: the IS is now
            # wrong about block 1 only
            for key in (keys[0], keys[2]):
                assert (await http.get(f"{holder_url}blocks/{compat}/{scope}/{key}")).is_success
            filler = Container.build(0, 16, [(bytes(12_288), b"\x01" * 12_288)] * 30)
            put = await http.put(
                f"{holder_url}blocks/{compat}/{scope}/{'0' * 64}", content=filler.tobytes(),
                headers={"content-type": "application/kvsp-block", "if-none-match": "*"},
            )  # fmt: skip
            assert put.status_code == 201, put.text
            gone = await http.get(f"{holder_url}blocks/{compat}/{scope}/{keys[1]}")
            assert gone.status_code == 404
        answer = await complete(pc, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert answer["kvsp"]["token_ids"] == reference
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # block 0 only
    assert a.log.count(b"Traceback") == 0
