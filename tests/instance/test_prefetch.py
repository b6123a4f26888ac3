"""Prefetch at the target (KVSP 6.5) against a real holder over HTTP and an in-process IS: leases
at a listed source, verified transfers, chained keys, progress while running, the deadline,
and a bounded table of statuses."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvsp.core.clock import ManualClock
from kvsp.core.container import Container
from kvsp.core.problems import NotFound
from kvsp.core.records import PrefetchDirective, PrefetchState, ReplicaRecord, ReplicaRef
from kvsp.holder.client import MOQT_SKIPS, HolderClient, fetchable
from kvsp.holder.service import HolderConfig, HolderService
from kvsp.index.client import IndexClient
from kvsp.instance.prefetch import Prefetcher
from tests.holder.env import INDEX, Env, holder_env
from tests.holder.factories import COMPAT, SCOPE, block_id, container
from tests.index.factories import namespace

pytestmark = pytest.mark.anyio

ELSEWHERE = "http://127.0.0.1:1/kvsp/"


class Target:
    def __init__(self, env: Env) -> None:
        self.env = env
        self.holder = HolderService(
            HolderConfig(url="http://127.0.0.1:2/kvsp/", host_bytes=1 << 20), ManualClock()
        )
        self.peers = HolderClient("c1")
        self.index = IndexClient(INDEX, "pc", transport=env.index_transport)
        self.fetched: list[str] = []
        #: whether the source held a lease on the block when its fetch began
        self.leased: list[bool] = []
        self.hold_from = 99  # fetches from this one on never finish
        self.prefetcher = Prefetcher(self.holder, self.peers, self.index, self.fetch, keep=2)

    async def fetch(self, record: ReplicaRecord) -> Container:
        self.fetched.append(record.block_key)
        block = (record.compat_id, record.scope_id, record.block_key)
        self.leased.append(self.env.service.leases.leased(block))
        if len(self.fetched) >= self.hold_from:
            await asyncio.Event().wait()
        return await self.peers.get(record)

    async def run(self, *blocks: tuple[int, list[str]], deadline_ms: int = 10_000) -> Any:
        directive = PrefetchDirective.model_validate(
            {
                "directive": str(uuid.uuid4()),
                "scope_id": SCOPE,
                "compat_id": COMPAT,
                "blocks": [
                    {"block_key": block_id(n)[2], "sources": sources} for n, sources in blocks
                ],
                "deadline_ms": deadline_ms,
                "lease_ms": 5_000,
            }
        )
        assert self.prefetcher.accept(directive)
        await self.prefetcher.run(directive)
        return self.prefetcher.status(directive.directive)


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    async with holder_env(host_blocks=4) as env:
        for n in (1, 2, 3):
            await env.service.store_block(block_id(n), container(n).tobytes())
        await env.settle()
        t = Target(env)
        try:
            yield t
        finally:
            await t.peers.aclose()
            await t.index.aclose()
            await t.holder.close()


def keys(*ns: int) -> tuple[str, ...]:
    return tuple(block_id(n)[2] for n in ns)


async def test_every_block_is_leased_fetched_verified_and_held(target: Target) -> None:
    src = [target.env.holder]
    status = await target.run((1, src), (2, src), (3, src))
    assert status.state is PrefetchState.COMPLETE
    assert status.loaded == keys(1, 2, 3)
    for n in (1, 2, 3):
        held = await target.holder.call(lambda n=n: target.holder.store.get(block_id(n)))
        assert b"".join(bytes(p) for p in held.parts) == bytes(container(n).parts[1])
    assert target.leased == [True, True, True]  # each held at the source while it loaded
    assert target.env.service.leases.octets_by_scope() == {}  # every lease released


async def test_a_block_without_a_listed_source_ends_the_chain(target: Target) -> None:
    src = [target.env.holder]
    status = await target.run((1, src), (2, [ELSEWHERE]), (3, src))
    assert status.state is PrefetchState.PARTIAL
    assert status.loaded == keys(1)
    assert target.fetched == list(keys(1))  # block 3 is useless without block 2


async def test_nothing_loadable_fails_and_held_blocks_cost_nothing(target: Target) -> None:
    status = await target.run((7, [target.env.holder]))
    assert status.state is PrefetchState.FAILED
    assert status.loaded == ()
    await target.holder.store_block(block_id(5), container(5).tobytes())
    status = await target.run((5, [ELSEWHERE]), (1, [target.env.holder]))
    assert status.state is PrefetchState.COMPLETE
    assert target.fetched == list(keys(1))  # block 5 was already held here


async def test_progress_is_visible_and_the_deadline_stops_it(target: Target) -> None:
    src = [target.env.holder]
    target.hold_from = 2
    directive = PrefetchDirective.model_validate(
        {
            "directive": str(uuid.uuid4()),
            "scope_id": SCOPE,
            "compat_id": COMPAT,
            "blocks": [{"block_key": k, "sources": src} for k in keys(1, 2, 3)],
            "deadline_ms": 500,
            "lease_ms": 5_000,
        }
    )
    assert target.prefetcher.accept(directive)
    assert not target.prefetcher.accept(directive)  # one run per directive
    running = asyncio.create_task(target.prefetcher.run(directive))
    while len(target.fetched) < 2:
        await asyncio.sleep(0.01)
    status = target.prefetcher.status(directive.directive)
    assert status.state is PrefetchState.PENDING
    assert status.loaded == keys(1)
    await running
    status = target.prefetcher.status(directive.directive)
    assert status.state is PrefetchState.PARTIAL
    assert status.loaded == keys(1)


async def test_only_the_latest_statuses_are_kept(target: Target) -> None:
    first = await target.run((1, [target.env.holder]))
    await target.run((2, [target.env.holder]))
    await target.run((3, [target.env.holder]))
    with pytest.raises(NotFound):
        target.prefetcher.status(first.directive)


async def test_a_deadline_that_expires_reports_partial_even_with_nothing_loaded(
    target: Target,
) -> None:
    # KVSP 6.5: "If the deadline expires, the instance stops loading and reports partial";
    # the request is then served with what was loaded (nothing) and recomputes the rest
    target.hold_from = 1
    status = await target.run((1, [target.env.holder]), (2, [target.env.holder]), deadline_ms=200)
    assert status.state is PrefetchState.PARTIAL
    assert status.loaded == ()
    assert target.leased == [True]  # the source could not evict it while it was loading
    assert target.env.service.leases.octets_by_scope() == {}  # released at the deadline


async def test_a_replica_served_only_through_moqt_is_passed_over_and_counted(
    target: Target,
) -> None:
    env = target.env
    held = await env.service.call(lambda: env.service.store.record(block_id(1)))
    relay = "moqt://relay.example:4443/"
    ns = namespace(b"kvsp", b"v1", b"c", b"s", b"publisher")
    moqt = ReplicaRecord.parse({**held.to_json(), "holder": relay, "moqt_namespace": ns})
    http_ref = ReplicaRef.parse({**held.to_json(), "holder": env.holder})
    await env.index_service.store.withdraw([http_ref])  # the index knows only the moqt copy
    await env.index_service.store.publish([moqt])
    before = MOQT_SKIPS.total
    status = await target.run((1, [env.holder]))
    assert status.state is PrefetchState.FAILED  # not an error: nothing kvsp could fetch
    assert target.fetched == []
    assert MOQT_SKIPS.total == before + 1
    assert fetchable([moqt, held]) == [held]
