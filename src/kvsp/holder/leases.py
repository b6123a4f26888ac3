"""Leases (KVSP 6.6), pure and Clock-injected: while a lease is valid its blocks are not evicted.

Each scope (tenant) has a quota of leased octets (the sizes of the blocks of all its valid
leases, a block counted once per lease, whichever of its principals holds them) and of valid
leases, its own from the quotas file (``kvsp.quotas``) or the holder's defaults, so one tenant
can never lease a holder full for another; a principal acting for several scopes (an admin)
has each scope's quota, not one more. A TTL above the scope's TTL quota (``lease_ttl_ms``, else
the holder's maximum), more octets or more leases than the quota is ``LeaseQuotaExceeded``
naming the quota (KVSP 6.6), and grants or renews nothing. Leases expire on their own:
expiry pops a heap of deadlines, so it costs O(expired). A lease is visible only to the client
that holds it; another client's lease id answers 404 like an unknown one.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsp.core.clock import Clock
from kvsp.core.deadlines import Deadlines
from kvsp.core.problems import ConfigurationError, LeaseQuotaExceeded, NotFound
from kvsp.core.records import LeaseGrant
from kvsp.holder.blocks import BlockId
from kvsp.quotas import Quotas

__all__ = ["LeaseLimits", "LeaseTable"]


@dataclass(frozen=True, slots=True)
class LeaseLimits:
    #: leased octets per scope, where the quotas file sets none
    quota_octets: int = 256 << 20
    max_ttl_ms: int = 60_000
    #: valid leases per scope where the quotas file sets none, so lease ids cannot pin memory
    max_leases: int = 4096

    def __post_init__(self) -> None:
        if self.quota_octets < 0 or self.max_ttl_ms < 1 or self.max_leases < 1:
            raise ConfigurationError("lease quota >= 0, max TTL >= 1 ms and max leases >= 1")


@dataclass(slots=True)
class _Lease:
    client: str
    scope: str
    blocks: tuple[BlockId, ...]
    octets: int


class LeaseTable:
    def __init__(self, clock: Clock, limits: LeaseLimits, quotas: Quotas | None = None) -> None:
        self.clock = clock
        self.limits = limits
        self.quotas = quotas or Quotas()
        self._leases: dict[str, _Lease] = {}
        self._deadlines: Deadlines[str] = Deadlines()
        self._pins: Counter[BlockId] = Counter()
        self._octets: Counter[str] = Counter()
        self._count: Counter[str] = Counter()
        #: leases ended so far (released or expired): a store that set leased blocks aside
        #: takes them back when this changes
        self._ended = 0

    def _check_ttl(self, scope: str, ttl_ms: int) -> None:
        most = self.quotas.limit(scope, "lease_ttl_ms", self.limits.max_ttl_ms)
        if ttl_ms > most:
            raise LeaseQuotaExceeded(
                f"a lease TTL of {ttl_ms} ms exceeds scope {scope}'s lease TTL quota of {most} ms"
            )

    def grant(self, client: str, blocks: Sequence[tuple[BlockId, int]], ttl_ms: int) -> LeaseGrant:
        """A new lease on ``blocks`` (each with its size in octets, all of one scope), all held
        by the caller's check; beyond the scope's quota nothing is granted."""
        self.expire()
        scope = blocks[0][0][1] if blocks else ""
        self._check_ttl(scope, ttl_ms)
        octets = sum(size for _, size in blocks)
        quota = self.quotas.limit(scope, "leased_octets", self.limits.quota_octets)
        if self._octets[scope] + octets > quota:
            raise LeaseQuotaExceeded(
                f"{octets} more leased octets would exceed scope {scope}'s leased-octets quota "
                f"of {quota} ({self._octets[scope]} already leased)"
            )
        most = self.quotas.limit(scope, "leases", self.limits.max_leases)
        if self._count[scope] >= most:
            raise LeaseQuotaExceeded(f"scope {scope} is at its quota of {most} valid leases")
        lease_id = secrets.token_urlsafe(18)
        lease = _Lease(client, scope, tuple(b for b, _ in blocks), octets)
        self._leases[lease_id] = lease
        self._deadlines.set(lease_id, self.clock.now_ms() + ttl_ms)
        self._pins.update(lease.blocks)
        self._octets[scope] += octets
        self._count[scope] += 1
        return LeaseGrant(lease=lease_id, ttl_ms=ttl_ms)

    def _own(self, client: str, lease_id: str) -> _Lease:
        self.expire()
        lease = self._leases.get(lease_id)
        if lease is None or lease.client != client:
            raise NotFound("no such lease")
        return lease

    def renew(self, client: str, lease_id: str, ttl_ms: int) -> LeaseGrant:
        lease = self._own(client, lease_id)
        self._check_ttl(lease.scope, ttl_ms)
        self._deadlines.set(lease_id, self.clock.now_ms() + ttl_ms)
        return LeaseGrant(lease=lease_id, ttl_ms=ttl_ms)

    def release(self, client: str, lease_id: str) -> None:
        self._end(lease_id, self._own(client, lease_id))

    def _end(self, lease_id: str, lease: _Lease) -> None:
        self._ended += 1
        del self._leases[lease_id]
        self._deadlines.discard(lease_id)
        self._pins.subtract(lease.blocks)
        for block in lease.blocks:
            if self._pins[block] <= 0:
                del self._pins[block]
        self._octets[lease.scope] -= lease.octets
        self._count[lease.scope] -= 1
        if not self._count[lease.scope]:
            del self._octets[lease.scope], self._count[lease.scope]

    def expire(self) -> int:
        """End every lease whose TTL has passed; returns how many."""
        due = self._deadlines.due(self.clock.now_ms())
        for lease_id in due:
            self._end(lease_id, self._leases[lease_id])
        return len(due)

    # -- the store's view ------------------------------------------------------------------------

    def leased(self, block: BlockId) -> bool:
        self.expire()
        return block in self._pins

    def ended(self) -> int:
        """How many leases have ended (released or expired) so far, expiries due included."""
        self.expire()
        return self._ended

    def leased_blocks(self) -> Iterable[BlockId]:
        self.expire()
        return list(self._pins)

    def leased_count(self) -> int:
        return len(self._pins)  # leases past their deadline not yet expired included

    def octets_by_scope(self) -> dict[str, int]:
        self.expire()
        return dict(self._octets)
