"""Leases (KVSP 6.6), pure and Clock-injected: while a lease is valid its blocks are not evicted.

Each client (an authenticated principal) has a quota of leased octets (the sizes of the blocks
of all its valid leases, a block counted once per lease) and a maximum lease TTL; a longer TTL
is clipped to the maximum and the grant says so, more octets than the quota is
``LeaseQuotaExceeded`` and grants nothing. Leases expire on their own: expiry pops a heap of
deadlines, so it costs O(expired). A lease is visible only to the client that holds it; another
client's lease id answers 404 like an unknown one.
"""

from __future__ import annotations

import heapq
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsp.core.clock import Clock
from kvsp.core.problems import ConfigurationError, LeaseQuotaExceeded, NotFound
from kvsp.core.records import LeaseGrant
from kvsp.holder.blocks import BlockId

__all__ = ["LeaseLimits", "LeaseTable"]


@dataclass(frozen=True, slots=True)
class LeaseLimits:
    quota_octets: int = 1 << 30
    max_ttl_ms: int = 60_000
    #: valid leases per client, so lease ids cannot pin memory
    max_leases: int = 4096

    def __post_init__(self) -> None:
        if self.quota_octets < 0 or self.max_ttl_ms < 1 or self.max_leases < 1:
            raise ConfigurationError("lease quota >= 0, max TTL >= 1 ms and max leases >= 1")


@dataclass(slots=True)
class _Lease:
    client: str
    blocks: tuple[BlockId, ...]
    octets: int
    expires_at: int


class LeaseTable:
    def __init__(self, clock: Clock, limits: LeaseLimits) -> None:
        self.clock = clock
        self.limits = limits
        self._leases: dict[str, _Lease] = {}
        self._deadlines: list[tuple[int, str]] = []
        self._pins: Counter[BlockId] = Counter()
        self._octets: Counter[str] = Counter()
        self._count: Counter[str] = Counter()

    def _clip(self, ttl_ms: int) -> tuple[int, bool]:
        if ttl_ms > self.limits.max_ttl_ms:
            return self.limits.max_ttl_ms, True
        return ttl_ms, False

    def grant(self, client: str, blocks: Sequence[tuple[BlockId, int]], ttl_ms: int) -> LeaseGrant:
        """A new lease on ``blocks`` (each with its size in octets), all held by the caller's
        check; beyond the client's quota nothing is granted."""
        self.expire()
        octets = sum(size for _, size in blocks)
        if self._octets[client] + octets > self.limits.quota_octets:
            raise LeaseQuotaExceeded(
                f"{octets} more leased octets would exceed the quota of "
                f"{self.limits.quota_octets} ({self._octets[client]} already leased)"
            )
        if self._count[client] >= self.limits.max_leases:
            raise LeaseQuotaExceeded(f"at most {self.limits.max_leases} valid leases per client")
        granted, clipped = self._clip(ttl_ms)
        lease_id = secrets.token_urlsafe(18)
        lease = _Lease(client, tuple(b for b, _ in blocks), octets, self.clock.now_ms() + granted)
        self._leases[lease_id] = lease
        heapq.heappush(self._deadlines, (lease.expires_at, lease_id))
        self._pins.update(lease.blocks)
        self._octets[client] += octets
        self._count[client] += 1
        return LeaseGrant(lease=lease_id, ttl_ms=granted, clipped=clipped)

    def _own(self, client: str, lease_id: str) -> _Lease:
        self.expire()
        lease = self._leases.get(lease_id)
        if lease is None or lease.client != client:
            raise NotFound("no such lease")
        return lease

    def renew(self, client: str, lease_id: str, ttl_ms: int) -> LeaseGrant:
        lease = self._own(client, lease_id)
        granted, clipped = self._clip(ttl_ms)
        lease.expires_at = self.clock.now_ms() + granted
        heapq.heappush(self._deadlines, (lease.expires_at, lease_id))
        return LeaseGrant(lease=lease_id, ttl_ms=granted, clipped=clipped)

    def release(self, client: str, lease_id: str) -> None:
        self._end(lease_id, self._own(client, lease_id))

    def _end(self, lease_id: str, lease: _Lease) -> None:
        del self._leases[lease_id]
        self._pins.subtract(lease.blocks)
        for block in lease.blocks:
            if self._pins[block] <= 0:
                del self._pins[block]
        self._octets[lease.client] -= lease.octets
        self._count[lease.client] -= 1
        if not self._count[lease.client]:
            del self._octets[lease.client], self._count[lease.client]

    def expire(self) -> int:
        """End every lease whose TTL has passed; returns how many."""
        now = self.clock.now_ms()
        deadlines = self._deadlines
        ended = 0
        while deadlines and deadlines[0][0] <= now:
            at, lease_id = heapq.heappop(deadlines)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at == at:
                self._end(lease_id, lease)
                ended += 1
        if len(deadlines) > 64 + 2 * len(self._leases):  # renewals leave stale deadlines
            self._deadlines = [(lease.expires_at, i) for i, lease in self._leases.items()]
            heapq.heapify(self._deadlines)
        return ended

    # -- the store's view ------------------------------------------------------------------------

    def leased(self, block: BlockId) -> bool:
        self.expire()
        return block in self._pins

    def leased_blocks(self) -> Iterable[BlockId]:
        self.expire()
        return list(self._pins)

    def leased_count(self) -> int:
        return len(self._pins)  # leases past their deadline not yet expired included

    def octets_by_client(self) -> dict[str, int]:
        self.expire()
        return dict(self._octets)
