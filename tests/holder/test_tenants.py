"""One tenant cannot take another's room at a holder: fair eviction across scopes, a stored-octets
quota, and leased octets and leases counted per scope (noisy neighbours, in the pure modules)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.core.clock import ManualClock
from kvsp.core.problems import CapacityExhausted, LeaseQuotaExceeded
from kvsp.core.registries import Tier
from kvsp.holder.blocks import BlockId
from kvsp.holder.leases import LeaseLimits, LeaseTable
from kvsp.holder.store import BlockStore, TierSpec
from kvsp.holder.tiers import MemoryTier
from kvsp.quotas import Quota, Quotas
from tests.holder.factories import block_id, stored

HOLDER = "http://127.0.0.1:9101/kvsp/"
BLOCK = 4 * 128
A, B = "a" * 32, "b" * 32


def make(
    host_blocks: int, disk_blocks: int = 0, quotas: Quotas | None = None
) -> tuple[BlockStore, LeaseTable]:
    clock = ManualClock()
    leases = LeaseTable(clock, LeaseLimits(quota_octets=4 * BLOCK, max_leases=3), quotas)
    tiers = [TierSpec("host", host_blocks * BLOCK)]
    data: dict[Tier, MemoryTier] = {"host": MemoryTier()}
    if disk_blocks:
        tiers.append(TierSpec("disk", disk_blocks * BLOCK))
        data["disk"] = MemoryTier()
    store = BlockStore(tiers, data, leases, clock, HOLDER, 10_000, quotas=quotas)  # type: ignore[arg-type]
    return store, leases


def put(store: BlockStore, n: int, scope: str) -> BlockId:
    meta, data, _ = stored(n)
    block = block_id(n, scope)
    store.put(block, meta, data)
    return block


def test_a_flood_evicts_the_flooding_tenants_own_blocks() -> None:
    store, _ = make(host_blocks=8)
    mine = [put(store, n, B) for n in range(3)]  # B uses less than its half
    for n in range(100, 200):  # A writes 100 blocks into an 8-block holder
        put(store, n, A)
    assert all(block in store for block in mine)  # B kept every block
    assert store.used_by_scope() == {A: 5 * BLOCK, B: 3 * BLOCK}


def test_a_tenant_over_its_share_gives_way_to_one_under_it() -> None:
    store, _ = make(host_blocks=4)
    for n in range(4):
        put(store, n, A)  # A alone: the whole holder
    for n in range(10, 13):
        put(store, n, B)  # B comes: A, furthest over its share, gives way
    assert store.used_by_scope() == {A: 2 * BLOCK, B: 2 * BLOCK}
    # B is now over nothing; A's next block takes A's own oldest, not B's
    put(store, 20, A)
    assert store.used_by_scope() == {A: 2 * BLOCK, B: 2 * BLOCK}
    assert block_id(20, A) in store
    assert block_id(12, B) in store


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([A, B]), min_size=1, max_size=60))
def test_a_scope_at_or_under_its_share_is_never_evicted(scopes: list[str]) -> None:
    """Whatever order two tenants write in, a tenant holding at most half the tier keeps all of
    its blocks while the other one writes."""
    store, _ = make(host_blocks=6)
    for n, scope in enumerate(scopes):
        before = store.used_by_scope()
        held = {b for b in store.held() if b[1] != scope}
        put(store, n, scope)
        other = B if scope == A else A
        if before.get(other, 0) <= 3 * BLOCK:
            assert held <= set(store.held())  # the other scope lost nothing


def test_a_stored_octets_quota_drops_the_scopes_own_blocks_then_refuses() -> None:
    quotas = Quotas(scopes={A: Quota(stored_octets=2 * BLOCK)})
    store, leases = make(host_blocks=8, quotas=quotas)
    put(store, 1, B)
    for n in range(10, 14):
        put(store, n, A)
    assert store.used_by_scope() == {A: 2 * BLOCK, B: BLOCK}  # A keeps within its quota
    assert block_id(13, A) in store
    assert block_id(10, A) not in store
    leases.grant("a", [(block_id(12, A), BLOCK), (block_id(13, A), BLOCK)], 5_000)
    with pytest.raises(CapacityExhausted, match="stored-octets quota of 1024"):
        put(store, 20, A)  # everything A holds is leased: refused, nothing dropped
    assert store.used_by_scope() == {A: 2 * BLOCK, B: BLOCK}


def test_leased_octets_and_leases_are_counted_per_scope_whoever_leases() -> None:
    store, leases = make(host_blocks=16)
    a = [put(store, n, A) for n in range(6)]
    b = [put(store, n, B) for n in range(6)]
    leases.grant("client-a", [(block, BLOCK) for block in a[:3]], 5_000)
    with pytest.raises(LeaseQuotaExceeded, match="leased-octets quota of 2048"):
        # another principal of scope A (an admin, say) leases against A's quota, not a new one
        leases.grant("admin", [(block, BLOCK) for block in a[3:5]], 5_000)
    leases.grant("admin", [(a[3], BLOCK)], 5_000)
    assert leases.octets_by_scope() == {A: 4 * BLOCK}
    # A's quota used up leaves B's whole quota
    leases.grant("client-b", [(block, BLOCK) for block in b[:4]], 5_000)
    assert leases.octets_by_scope() == {A: 4 * BLOCK, B: 4 * BLOCK}
    leases.grant("client-b", [(b[4], 0)], 5_000)
    leases.grant("client-b", [(b[5], 0)], 5_000)
    with pytest.raises(LeaseQuotaExceeded, match="quota of 3 valid leases"):
        leases.grant("client-b", [(b[5], 0)], 5_000)


def test_a_scopes_own_lease_quota_comes_from_the_quotas() -> None:
    quotas = Quotas(Quota(leased_octets=BLOCK), {B: Quota(leased_octets=3 * BLOCK)})
    store, leases = make(host_blocks=8, quotas=quotas)
    a, b = [put(store, n, A) for n in range(2)], [put(store, n, B) for n in range(3)]
    with pytest.raises(LeaseQuotaExceeded):
        leases.grant("c", [(block, BLOCK) for block in a], 5_000)
    leases.grant("c", [(block, BLOCK) for block in b], 5_000)
