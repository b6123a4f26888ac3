"""A holder served over real HTTP in this process, publishing to an in-process Index Service:
shared by the holder's HTTP tests and the instance's prefetch tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx

from kvsp.auth import Principals
from kvsp.core.clock import ManualClock
from kvsp.core.records import LookupRequest
from kvsp.holder.app import create_app
from kvsp.holder.client import HolderClient
from kvsp.holder.leases import LeaseLimits
from kvsp.holder.service import HolderConfig, HolderService
from kvsp.index.app import create_app as create_index_app
from kvsp.index.client import IndexClient
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from tests.holder.factories import COMPAT, OTHER_SCOPE, SCOPE, block_id
from tests.principals import principal
from tests.servers import free_port, serving

INDEX = "http://index.test/kvsp/"
BLOCK_DATA = 4 * 128


def principals(holder: str) -> str:
    return "\n".join(
        [
            principal("c1", ["client"], scopes=[SCOPE]),
            principal("c2", ["client"], scopes=[SCOPE]),
            principal("other", ["client"], scopes=[OTHER_SCOPE]),
            principal("holder", ["holder"], [holder]),
            principal("pc", ["controller"]),
            principal("scraper", ["metrics"]),
        ]
    )


class Env:
    def __init__(
        self, holder: str, clock: ManualClock, host_blocks: int = 2, max_ttl_ms: int = 600_000
    ) -> None:
        self.holder = holder
        self.principals = Principals.parse(principals(holder))
        self.index_service = IndexService(
            MemoryReplicaStore(clock, IndexLimits(max_ttl_ms=max_ttl_ms, max_records=1000))
        )
        self.index_app = create_index_app(self.index_service, self.principals)
        self.index_transport = httpx.ASGITransport(app=self.index_app)
        self.service = HolderService(
            HolderConfig(
                url=holder,
                host_bytes=host_blocks * BLOCK_DATA,
                leases=LeaseLimits(quota_octets=2_000, max_ttl_ms=30_000),
                record_ttl_ms=60_000,
                block_overhead_octets=0,  # tiers of exactly two blocks
            ),
            clock,
            IndexClient(INDEX, "holder", transport=self.index_transport),
        )
        self.app = create_app(self.service, self.principals)
        self.http = httpx.AsyncClient(base_url=holder)
        self.clients: list[HolderClient] = []

    def client(self, token: str | None) -> HolderClient:
        self.clients.append(HolderClient(token))
        return self.clients[-1]

    async def settle(self) -> None:
        """Wait until every index update has been delivered."""
        await self.service.call(lambda: None)
        if self.service._pending:
            await self.service._flush()

    async def lookup(self, *ns: int) -> int:
        pc = IndexClient(INDEX, "pc", transport=self.index_transport)
        request = LookupRequest(
            scope_id=SCOPE, compat_id=COMPAT, block_keys=tuple(block_id(n)[2] for n in ns)
        )
        return (await pc.lookup(request)).matched


@contextlib.asynccontextmanager
async def holder_env(host_blocks: int = 2, max_ttl_ms: int = 600_000) -> AsyncIterator[Env]:
    port = free_port()
    e = Env(f"http://127.0.0.1:{port}/kvsp/", ManualClock(), host_blocks, max_ttl_ms)
    async with serving(e.app, port):
        try:
            yield e
        finally:
            for client in e.clients:
                await client.aclose()
            await e.http.aclose()
