"""Where a session's KV comes from and where its blocks go: the longest prefix held here (G1,
G2) or elsewhere through the Index Service, fetched with every digest verified; completed
blocks held in the pool (published, served, leasable) and copied to the offload holder.

A session uses every block it loaded or stored until it ends (``BlockRefs``): pressure never
moves or drops a block a running request reads. The links to other holders are measured on the
way (``LinkEstimates``, each measurement applied in one step after its transfer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsp.core.container import Container
from kvsp.core.problems import AlreadyStored, KvspError
from kvsp.core.records import LookupRequest, ReplicaRecord
from kvsp.core.registries import Tier
from kvsp.core.shared import scope_runs
from kvsp.core.urls import canonical_url
from kvsp.holder.blocks import BlockId
from kvsp.holder.client import HolderClient, fetchable
from kvsp.holder.service import HolderService
from kvsp.index.client import IndexClient
from kvsp.instance.kvpool import BlockRefs
from kvsp.instance.links import LinkEstimates
from kvsp.instance.session_kv import SessionKv
from kvsp.instance.sessions import Session
from kvsp.web import tracing

__all__ = ["Reuse"]

log = logging.getLogger("kvsp.instance")

#: block fetches of one lookup that run at once
FETCHES_AT_ONCE = 8


@dataclass
class Reuse:
    #: this instance: its URL (never fetched from), Compatibility ID and block size
    url: str
    compat_id: str
    block_tokens: int
    holder: HolderService
    peers: HolderClient
    index: IndexClient | None
    kv: SessionKv
    in_use: BlockRefs
    links: LinkEstimates
    #: where the instance's own blocks go (None: whole blocks, G1 first)
    placement: list[tuple[Tier, tuple[int, int]]] | None = None
    offload_url: str | None = None

    def _use(self, session: Session, block: BlockId) -> None:
        """``session`` uses ``block`` until it ends (called on the store's thread)."""
        self.in_use.acquire([block])
        session.uses.append(block)

    async def release(self, session: Session) -> None:
        """The session ended: every block it used may move or go again, its chain's tail
        before its head (``BlockStore.use``)."""
        uses, session.uses = session.uses, []
        position = {key: i for i, key in enumerate(session.keys())}
        chain = sorted(uses, key=lambda block: position.get(block[2], len(position)))

        def release() -> None:
            self.in_use.release(uses)
            self.holder.store.use(chain)

        await self.holder.call(release)

    async def hold(self, session: Session, block: BlockId, body: bytes | Container) -> None:
        """Hold a block in the pool, used by ``session``; with no room left (every block in
        use) it is not held, which only costs a later recompute. A fetched container is held
        as it is: verified, its digests are known."""
        try:
            await self.holder.store_block(
                block, body, self.placement, lambda b: self._use(session, b)
            )
        except AlreadyStored:
            pass
        except KvspError as exc:
            log.warning("block %s not held: %s", block[2][:16], exc.detail)

    async def store(self, session: Session, index: int, body: bytes) -> None:
        """Hold completed block ``index`` of the session here and copy it to the offload
        holder."""
        block = session.block_of(self.compat_id, index)
        if block is None:
            return
        await self.hold(session, block, body)
        if self.offload_url is not None:
            try:
                await self.peers.put(self.offload_url, block, Container.parse(body))
            except AlreadyStored:
                pass
            except KvspError as exc:
                log.warning("offload of %s failed: %s", block[2][:16], exc.detail)

    async def fetch(self, record: ReplicaRecord) -> Container:
        """A verified block from another holder; the link to it is measured on the way (the
        rate of the transfer, and a round trip measured once per holder)."""
        holder = canonical_url(record.holder)
        if not self.links.knows(holder):
            with contextlib.suppress(KvspError):
                self.links.round_trip(holder, await self.peers.round_trip_us(holder))
        start = time.perf_counter()
        container = await self.peers.get(record)
        self.links.transfer(holder, container.size, time.perf_counter() - start)
        block = (record.compat_id, record.scope_id, record.block_key)
        self.kv.transfer(block, holder, self.url, container.size)
        return container

    async def load(
        self, session: Session, keys: Sequence[str], arrived: Callable[[int, Container], None]
    ) -> int:
        """How many of ``keys`` (the session's first blocks) make the longest prefix held here
        (G1, G2) or, through the IS, elsewhere; ``arrived`` is called, on one thread at a time,
        with each block's index and container as it comes (blocks past the prefix's end among
        them; one it refuses with a ``KvspError`` is fetched from the next holder). The session
        uses every block loaded, and counts where its tokens came from."""
        b = self.block_tokens
        blocks = [(self.compat_id, session.chain.scope_of(i), k) for i, k in enumerate(keys)]

        def read_local() -> list[Container]:
            store = self.holder.store
            found = []
            for block in blocks:
                if block not in store:
                    break
                found.append(store.get(block).container())
                # a block whose first layers are in G1 is a G1 hit: its later layers load
                # while the first ones compute
                tier = "g1" if "device" in store.spans(block) else "g2"
                session.cached[tier] = session.cached.get(tier, 0) + b
                self._use(session, block)
            return found

        with tracing.span("kvsp.reuse.local", blocks=len(blocks)):
            local = await self.holder.call(read_local)

        def take_local() -> None:  # off the event loop: a long prefix copies for milliseconds
            for index, container in enumerate(local):
                arrived(index, container)

        if local:
            await asyncio.get_running_loop().run_in_executor(None, take_local)
        n = len(local)
        runs = scope_runs(blocks[n:], session.chain.scope_of, n) if self.index else []
        for _, part in runs:  # one lookup per scope: a shared prefix's first
            found = await self._load_remote(session, part, n, arrived)
            n += found
            if found < len(part):
                break
        self.kv.reused(session.session, blocks[:n], [session.tokens_of(i, b) for i in range(n)])
        return n

    async def _load_remote(
        self,
        session: Session,
        rest: Sequence[BlockId],
        first: int,
        arrived: Callable[[int, Container], None],
    ) -> int:
        """How many of ``rest`` (blocks ``first`` on, of one scope) make the longest prefix
        found through the IS, verified and then held here; ``arrived`` as for ``load``."""
        assert self.index is not None
        try:
            answer = await self.index.lookup(
                LookupRequest(
                    scope_id=rest[0][1],
                    compat_id=self.compat_id,
                    block_keys=tuple(block[2] for block in rest),
                )
            )
        except KvspError as exc:
            log.warning("index lookup failed: %s", exc.detail)
            return 0
        limit = asyncio.Semaphore(FETCHES_AT_ONCE)

        async def one(index: int, records: Sequence[ReplicaRecord]) -> Container | None:
            for record in fetchable(records):
                if canonical_url(record.holder) == self.url:
                    continue
                try:
                    async with limit:
                        with tracing.span("kvsp.block.get", holder=record.holder,
                                          block=record.block_key):  # fmt: skip
                            container = await self.fetch(record)
                    arrived(index, container)  # its copy overlaps the other fetches
                    return container
                except KvspError as exc:
                    log.info("block from %s not loaded: %s", record.holder, exc.detail)
            return None

        fetched = await asyncio.gather(
            *(one(first + i, rs) for i, rs in enumerate(answer.replicas))
        )
        found = 0
        for block, container in zip(rest, fetched, strict=False):
            if container is None:
                break
            found += 1
            session.cached["remote"] = session.cached.get("remote", 0) + self.block_tokens
            await self.hold(session, block, container)
        return found
