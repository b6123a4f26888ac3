"""Leases: grant, renew, release, expiry, and per-scope quotas on octets, leases and TTL."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.clock import ManualClock
from kvsp.core.problems import ConfigurationError, LeaseQuotaExceeded, NotFound
from kvsp.holder.leases import LeaseLimits, LeaseTable
from kvsp.quotas import Quota, Quotas
from tests.holder.factories import block_id


def table(
    quota: int = 1_000, max_ttl: int = 10_000, max_leases: int = 8
) -> tuple[LeaseTable, ManualClock]:
    clock = ManualClock()
    return LeaseTable(clock, LeaseLimits(quota, max_ttl, max_leases)), clock


def test_grant_renew_release_expire() -> None:
    leases, clock = table()
    grant = leases.grant("a", [(block_id(1), 100), (block_id(2), 100)], 5_000)
    assert grant.ttl_ms == 5_000
    assert len(grant.lease) >= 16
    assert leases.leased(block_id(1))
    assert leases.octets_by_scope() == {block_id(1)[1]: 200}
    clock.advance(4_000)
    assert leases.renew("a", grant.lease, 5_000).ttl_ms == 5_000
    clock.advance(4_000)
    assert leases.leased(block_id(2))  # renewed: 1 s left
    clock.advance(1_000)
    assert not leases.leased(block_id(2))
    assert leases.octets_by_scope() == {}
    with pytest.raises(NotFound):
        leases.renew("a", grant.lease, 1_000)
    second = leases.grant("a", [(block_id(1), 100)], 1_000)
    leases.release("a", second.lease)
    assert not leases.leased(block_id(1))


def test_a_ttl_above_the_quota_is_refused_with_kvsp_lease_quota() -> None:
    # KVSP 6.6: the holder enforces a per-client quota on lease TTL and returns
    # kvsp-lease-quota when a request exceeds it; nothing is granted or renewed
    leases, clock = table(max_ttl=10_000)
    with pytest.raises(LeaseQuotaExceeded, match="TTL quota of 10000 ms") as refused:
        leases.grant("a", [(block_id(1), 1)], 10_001)
    assert refused.value.slug == "kvsp-lease-quota"
    assert not leases.leased(block_id(1))
    grant = leases.grant("a", [(block_id(1), 1)], 10_000)
    with pytest.raises(LeaseQuotaExceeded):
        leases.renew("a", grant.lease, 99_999)
    clock.advance(9_999)
    assert leases.leased(block_id(1))  # the refused renewal changed nothing
    clock.advance(1)
    assert not leases.leased(block_id(1))


def test_a_scope_can_have_its_own_ttl_quota() -> None:
    scope = block_id(1)[1]
    quotas = Quotas(scopes={scope: Quota(lease_ttl_ms=500)})
    leases = LeaseTable(ManualClock(), LeaseLimits(1_000, 10_000, 8), quotas)
    with pytest.raises(LeaseQuotaExceeded, match="500 ms"):
        leases.grant("a", [(block_id(1), 1)], 501)
    assert leases.grant("a", [(block_id(2, "f" * 32), 1)], 5_000).ttl_ms == 5_000


def test_octet_quota_is_per_scope_and_grants_nothing_beyond() -> None:
    leases, _ = table(quota=250)
    leases.grant("a", [(block_id(1), 200)], 1_000)
    with pytest.raises(LeaseQuotaExceeded):
        leases.grant("a", [(block_id(2), 30), (block_id(3), 30)], 1_000)
    with pytest.raises(LeaseQuotaExceeded):  # another principal of the scope: the same quota
        leases.grant("b", [(block_id(2), 60)], 1_000)
    assert not leases.leased(block_id(2))
    assert leases.octets_by_scope() == {block_id(1)[1]: 200}
    leases.grant("b", [(block_id(2, "f" * 32), 250)], 1_000)  # another scope: its own quota


def test_lease_count_is_bounded() -> None:
    leases, _ = table(max_leases=2)
    leases.grant("a", [(block_id(1), 1)], 1_000)
    leases.grant("a", [(block_id(1), 1)], 1_000)
    with pytest.raises(LeaseQuotaExceeded):
        leases.grant("a", [(block_id(1), 1)], 1_000)


def test_a_lease_belongs_to_its_client() -> None:
    leases, _ = table()
    grant = leases.grant("a", [(block_id(1), 1)], 1_000)
    with pytest.raises(NotFound):
        leases.release("b", grant.lease)
    with pytest.raises(NotFound):
        leases.renew("b", grant.lease, 1_000)
    assert leases.leased(block_id(1))


def test_overlapping_leases_pin_until_the_last_ends() -> None:
    leases, clock = table()
    leases.grant("a", [(block_id(1), 1)], 1_000)
    leases.grant("b", [(block_id(1), 1)], 3_000)
    clock.advance(1_000)
    assert leases.leased(block_id(1))
    clock.advance(2_000)
    assert not leases.leased(block_id(1))


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigurationError):
        LeaseLimits(quota_octets=-1)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a" * 32, "b" * 32, "c" * 32]),
            st.integers(1, 400),
            st.integers(1, 30_000),
            st.integers(0, 5_000),
        ),
        max_size=40,
    )
)
def test_quotas_always_hold(requests: list[tuple[str, int, int, int]]) -> None:
    leases, clock = table(quota=1_000, max_ttl=10_000, max_leases=8)
    for i, (scope, octets, ttl, wait) in enumerate(requests):
        try:
            grant = leases.grant("client", [(block_id(i, scope), octets)], ttl)
            assert grant.ttl_ms <= 10_000
        except LeaseQuotaExceeded:
            pass
        assert all(v <= 1_000 for v in leases.octets_by_scope().values())
        clock.advance(wait)
