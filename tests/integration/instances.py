"""Clusters of real processes for instance tests: an Index Service, a holder that keeps a copy of
every block, instances on the real model, and optionally a controller."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from kvsp.core.ids import parse_compat_id
from kvsp.core.keys import block_keys, scope_id
from tests.servers import Service, free_port

SCOPE_KEY = "55" * 32
#: 50 tokens of a story ("Once upon a time, in a small village by the sea, ..."): 3 whole blocks;
#: the model goes on for more than 40 tokens without an end of sequence
PROMPT = [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28, 665, 4161, 354,
          1573, 43663, 3365, 8581, 30, 5081, 5738, 384, 13197, 1187, 288, 260, 28899, 28, 12775,
          650, 20958, 284, 12816, 288, 260, 310, 32942, 30, 1963, 1194, 28, 253, 22483, 6612, 281,
          260, 6560, 351]  # fmt: skip


#: torch threads of each instance: a reference computed in the test with another count can
#: differ in its last bits (the matrix products split their sums by thread)
INSTANCE_THREADS = 1


@contextlib.contextmanager
def instance_threads() -> Iterator[None]:
    """Compute in the test process as the instances do, for bit-exact comparisons."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(INSTANCE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


#: API keys of the front end: tenant acme and another tenant, other
KEYS = {"acme": "key-acme", "other": "key-other"}


def tenants_toml(compat: str) -> str:
    """Two tenants with their own scope keys and front-end API keys."""
    out = []
    for name, scope_key in (("acme", SCOPE_KEY), ("other", "66" * 32)):
        digest = hashlib.sha256(KEYS[name].encode()).hexdigest()
        out.append(
            f'[tenants.{name}]\nscope_key = "{scope_key}"\ncompat_ids = ["{compat}"]\n'
            f'api_keys_sha256 = ["{digest}"]\n'
        )
    return "\n".join(out)


class Cluster:
    def __init__(
        self, tmp: Path, compat: str, controller: bool = False, frontend: bool = False
    ) -> None:
        tenants = tmp / "tenants.toml"
        tenants.write_text(tenants_toml(compat))
        self.index = Service("index", "serve", "--log-level", "warning")
        holder_port = free_port()
        self.holder_url = f"http://127.0.0.1:{holder_port}/kvsp/"
        self.holder = Service(
            "holder", "serve", "--url", self.holder_url, "--host-bytes", "256M",
            "--index", self.index.base_url, "--log-level", "warning", port=holder_port,
        )  # fmt: skip
        self.controller = None
        if controller:
            self.controller = Service(
                "controller", "serve", "--tenants", str(tenants), "--index", self.index.base_url,
                "--min-active", "1", "--log-level", "warning",
                *(["--frontend"] if frontend else []),
            )  # fmt: skip
        self.tenants = tenants

    @property
    def pc(self) -> str:
        """The controller's base URL."""
        if self.controller is None:
            raise AssertionError("this cluster has no controller")
        return self.controller.base_url

    def instance(self, *extra: str) -> Service:
        port = free_port()
        args = [
            "instance", "serve", "--url", f"http://127.0.0.1:{port}/kvsp/",
            "--tenants", str(self.tenants), "--index", self.index.base_url,
            "--offload", self.holder_url, "--status-ttl-ms", "900",
            "--threads", str(INSTANCE_THREADS),
            "--log-level", "warning",
        ]  # fmt: skip
        if self.controller is not None:
            args += ["--controller", self.controller.base_url]
        return Service(*args, *extra, port=port)


async def generate(base: str, tokens: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"tenant": "acme", "tokens": tokens, "max_tokens": max_tokens, **extra}
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(base + "generate", json=body)
        assert response.status_code == 200, response.text
        lines = [json.loads(line) for line in response.text.splitlines()]
    return {"tokens": [x["token"] for x in lines[:-1]], "summary": lines[-1], "lines": lines[:-1]}


async def residency(
    index: str, compat: str, tokens: list[int], holder: str, block: int = 0
) -> list[list[Any]]:
    """The residency at ``holder`` of block ``block`` of ``tokens``, as the IS has it."""
    prefix = tokens[: (block + 1) * 16]
    key = block_keys(bytes.fromhex(SCOPE_KEY), parse_compat_id(compat), prefix, 16)[block]
    body = {"scope_id": scope_id(bytes.fromhex(SCOPE_KEY)).hex(), "compat_id": compat,
            "block_keys": [key.hex()]}  # fmt: skip
    async with httpx.AsyncClient(timeout=30) as http:
        answer = (await http.post(index + "lookup", json=body)).json()
    replicas = answer["replicas"][0] if answer["matched"] else []
    return [
        [r["tier"], r["layers"]]
        for rec in replicas
        if rec["holder"] == holder
        for r in rec["residency"]
    ]


async def eventually(check: Any, expected: Any) -> None:
    for _ in range(100):
        if (found := await check()) == expected:
            return
        await asyncio.sleep(0.1)
    assert found == expected


async def active(pc: str) -> set[str]:
    """The instances the controller at ``pc`` has active."""
    async with httpx.AsyncClient() as http:
        view = (await http.get(pc + "instances")).json()["instances"]
    return {i["instance"] for i in view if i["state"] == "active"}
