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
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.instances import KEYS, PROMPT, Cluster, eventually
from tests.servers import running

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


async def active(pc: str) -> set[str]:
    async with httpx.AsyncClient() as http:
        view = (await http.get(pc + "instances")).json()["instances"]
    return {i["instance"] for i in view if i["state"] == "active"}


async def test_reuse_across_instances_chat_and_streaming(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat, controller=True, frontend=True)
    assert cluster.controller is not None
    pc = cluster.controller.base_url
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
