"""Prefetch directives at their target (KVSP 6.5): load the blocks a controller expects a request
to need before the request comes.

For each block of the directive, in order: nothing to do if it is held here; else its replica
records come from one IS lookup, a listed source that has it is leased for ``lease_ms`` (so it
cannot evict the block mid-transfer), the block is fetched with every digest verified, the lease
released, and the block placed in the pool (published by the holder). Block keys are chained, so
the first block that cannot be loaded ends the directive: nothing after it is usable. At the
deadline the work stops; the status says ``complete``, ``partial`` (the deadline expired, or
the blocks from the first up to one that could not be loaded are loaded) or ``failed`` (nothing
could be loaded before the deadline), with the keys loaded so far, readable while it runs.

A directive only uses the event loop and the store's thread, never the engine's, so requests
being served are not held up. The last ``keep`` statuses are kept; older ones are forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from kvsp.core.container import Container
from kvsp.core.problems import AlreadyStored, KvspError, NotFound
from kvsp.core.records import (
    LeaseRequest,
    LookupRequest,
    PrefetchDirective,
    PrefetchState,
    PrefetchStatus,
    ReplicaRecord,
)
from kvsp.core.registries import Tier
from kvsp.core.urls import canonical_url
from kvsp.holder.client import HolderClient, fetchable
from kvsp.holder.service import HolderService
from kvsp.index.client import IndexClient

__all__ = ["Prefetcher"]

log = logging.getLogger("kvsp.instance.prefetch")

Placement = Sequence[tuple[Tier, tuple[int, int]]]


class Prefetcher:
    def __init__(
        self,
        holder: HolderService,
        peers: HolderClient,
        index: IndexClient | None,
        fetch: Callable[[ReplicaRecord], Awaitable[Container]],
        placement: Placement | None = None,
        keep: int = 1024,
    ) -> None:
        self.holder = holder
        self.peers = peers
        self.index = index
        self.fetch = fetch
        self.placement = placement
        self.keep = keep
        self._status: OrderedDict[str, PrefetchStatus] = OrderedDict()

    def accept(self, directive: PrefetchDirective) -> bool:
        """Record a new directive as pending; False if it is already known (run it once)."""
        if directive.directive in self._status:
            return False
        self._status[directive.directive] = PrefetchStatus(
            directive=directive.directive, state=PrefetchState.PENDING
        )
        while len(self._status) > self.keep:
            self._status.popitem(last=False)
        return True

    def status(self, directive: str) -> PrefetchStatus:
        found = self._status.get(directive)
        if found is None:
            raise NotFound(f"no directive {directive}")
        return found

    def _set(self, directive: str, state: PrefetchState, loaded: Sequence[str]) -> None:
        if directive in self._status:  # not forgotten meanwhile
            self._status[directive] = PrefetchStatus(
                directive=directive, state=state, loaded=tuple(loaded)
            )

    async def run(self, directive: PrefetchDirective) -> None:
        loaded: list[str] = []
        expired = False
        try:
            async with asyncio.timeout(directive.deadline_ms / 1000):
                await self._load(directive, loaded)
        except TimeoutError:
            expired = True
        except KvspError as exc:
            log.warning("prefetch %s: %s", directive.directive, exc.detail)
        if len(loaded) == len(directive.blocks):
            state = PrefetchState.COMPLETE
        elif expired or loaded:  # KVSP 6.5: a deadline that expires is "partial"
            state = PrefetchState.PARTIAL
        else:
            state = PrefetchState.FAILED
        self._set(directive.directive, state, loaded)

    async def _load(self, directive: PrefetchDirective, loaded: list[str]) -> None:
        wanted = list(directive.blocks)
        store = self.holder.store
        missing = [
            b for b in wanted if (directive.compat_id, directive.scope_id, b.block_key) not in store
        ]
        records: dict[str, list[ReplicaRecord]] = {}
        if self.index is not None and missing:  # a prefix lookup of what is not held here
            answer = await self.index.lookup(
                LookupRequest(
                    scope_id=directive.scope_id,
                    compat_id=directive.compat_id,
                    block_keys=tuple(b.block_key for b in missing),
                )
            )
            for block, found in zip(missing, answer.replicas, strict=False):
                records[block.block_key] = list(found)
        for block in wanted:
            key = (directive.compat_id, directive.scope_id, block.block_key)
            if key not in store:
                sources = {canonical_url(s) for s in block.sources}
                usable = [
                    r
                    for r in fetchable(records.get(block.block_key, ()))
                    if canonical_url(r.holder) in sources
                ]
                if not await self._load_one(directive, key, usable):
                    return  # chained keys: nothing after a block we cannot load is usable
            loaded.append(block.block_key)
            self._set(directive.directive, PrefetchState.PENDING, loaded)

    async def _load_one(
        self,
        directive: PrefetchDirective,
        key: tuple[str, str, str],
        records: Sequence[ReplicaRecord],
    ) -> bool:
        """Lease the block at a source, fetch it verified, release, and hold it here."""
        for record in records:
            holder = canonical_url(record.holder)
            try:
                lease = await self.peers.lease(
                    holder,
                    LeaseRequest(
                        compat_id=directive.compat_id,
                        scope_id=directive.scope_id,
                        block_keys=(record.block_key,),
                        ttl_ms=directive.lease_ms,
                    ),
                )
                try:
                    container = await self.fetch(record)
                finally:
                    with contextlib.suppress(KvspError):
                        await self.peers.release(holder, lease.lease)
            except KvspError as exc:
                log.info("block from %s not prefetched: %s", holder, exc.detail)
                continue
            with contextlib.suppress(AlreadyStored):
                await self.holder.store_block(key, container, self.placement)
            return True
        return False
