"""Index state with a manual clock: prefix lookup, expiry, TTL cap, limits, epochs, auth."""

from __future__ import annotations

import json

import pytest

from kvsp.auth import Principal, Role
from kvsp.core.clock import ManualClock
from kvsp.core.problems import CapacityExhausted, Forbidden, RecordError, StaleEpoch
from kvsp.core.records import ReplicaRecord
from kvsp.index.state import (
    STATUS_RETENTION_MS,
    BlockReplicas,
    IndexLimits,
    PackedKeys,
    ReplicaTable,
    StatusTable,
    authorize_lookup,
    authorize_publish,
    authorize_status,
    authorize_withdraw,
    check_path,
    estimate_targets,
)
from tests.index.factories import (
    COMPAT,
    H1,
    H2,
    I1,
    I2,
    LAYER_OCTETS,
    LAYERS,
    SCOPE_A,
    SCOPE_B,
    key,
    ref,
    replica,
    status,
)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def table(clock: ManualClock) -> ReplicaTable:
    return ReplicaTable(clock, IndexLimits(max_ttl_ms=10_000, max_records=100))


def keys(*ns: int) -> list[str]:
    return [key(n) for n in ns]


def test_lookup_stops_at_the_first_miss(table: ReplicaTable) -> None:
    for n in (0, 1, 3):
        table.publish(replica(n))
    found = table.lookup(COMPAT, SCOPE_A, keys(0, 1, 2, 3))
    assert len(found) == 2
    none = table.lookup(COMPAT, SCOPE_A, keys(2, 3))
    assert none == []


def test_scopes_and_compats_are_separate(table: ReplicaTable) -> None:
    table.publish(replica(0, scope=SCOPE_A))
    assert table.lookup(COMPAT, SCOPE_B, keys(0)) == []
    assert table.lookup("00" * 32, SCOPE_A, keys(0)) == []


def test_records_of_every_holder_are_returned(table: ReplicaTable, clock: ManualClock) -> None:
    table.publish(replica(0, holder=H1))
    table.publish(replica(0, holder=H2))
    found = table.lookup(COMPAT, SCOPE_A, keys(0))
    assert sorted(r["holder"] for r in json.loads(found[0].rendered())) == [H1, H2]


def test_a_block_array_stays_right_as_its_replicas_change(table: ReplicaTable) -> None:
    holders = [H1, H2, I1, I2]
    for n, holder in enumerate(holders):
        table.publish(replica(0, holder=holder, ttl_ms=1_000 + n))
    table.withdraw(ref(0, holder=H2))
    table.publish(replica(0, holder=I1, ttl_ms=5_000))  # refreshed: moves to the end
    table.publish(replica(0, holder=H2, ttl_ms=2_000))
    (block,) = table.lookup(COMPAT, SCOPE_A, keys(0))
    served = [ReplicaRecord.parse(r) for r in json.loads(block.rendered())]
    assert [(r.holder, r.ttl_ms) for r in served] == [
        (H1, 1_000),
        (I2, 1_003),
        (I1, 5_000),
        (H2, 2_000),
    ]
    assert served[1] == replica(0, holder=I2, ttl_ms=1_003)


@pytest.mark.parametrize("render_at_publish", [True, False])
def test_served_json_is_the_record_with_the_granted_ttl(
    clock: ManualClock, render_at_publish: bool
) -> None:
    table = ReplicaTable(clock, IndexLimits(max_ttl_ms=10_000, max_records=100), render_at_publish)
    record = replica(0, ttl_ms=50_000)
    table.publish(record)
    clock.advance(1_200)
    found = table.lookup(COMPAT, SCOPE_A, keys(0))
    served = json.loads(found[0].rendered())
    assert [ReplicaRecord.parse(r) for r in served] == [
        record.model_copy(update={"ttl_ms": 10_000})
    ]


def test_expiry_and_ttl_cap(table: ReplicaTable, clock: ManualClock) -> None:
    short = table.publish(replica(0, ttl_ms=1_000))
    capped = table.publish(replica(1, ttl_ms=50_000))
    assert (short.ttl_ms, capped.ttl_ms) == (1_000, 10_000)
    clock.advance(999)
    assert len(table.lookup(COMPAT, SCOPE_A, keys(0, 1))) == 2
    clock.advance(1)
    assert table.lookup(COMPAT, SCOPE_A, keys(0, 1)) == []
    assert len(table.lookup(COMPAT, SCOPE_A, keys(1))) == 1
    assert table.count == 1
    clock.advance(9_000)
    assert table.count == 0
    assert table.expired_total == 2


def test_refresh_is_idempotent_and_extends(table: ReplicaTable, clock: ManualClock) -> None:
    first = table.publish(replica(0, ttl_ms=1_000))
    clock.advance(900)
    again = table.publish(replica(0, ttl_ms=1_000))
    assert (first.created, again.created) == (True, False)
    assert table.count == 1
    clock.advance(900)
    assert len(table.lookup(COMPAT, SCOPE_A, keys(0))) == 1
    clock.advance(100)
    assert table.lookup(COMPAT, SCOPE_A, keys(0)) == []
    assert table.expired_total == 1


def test_holder_urls_are_compared_canonically(table: ReplicaTable) -> None:
    table.publish(replica(0, holder="HTTP://127.0.0.1:9101/kvsp"))
    assert not table.publish(replica(0, holder=H1)).created
    assert table.withdraw(ref(0, holder=H1))
    assert table.count == 0


def test_withdraw(table: ReplicaTable) -> None:
    table.publish(replica(0, holder=H1))
    table.publish(replica(0, holder=H2))
    assert table.withdraw(ref(0, holder=H1))
    assert not table.withdraw(ref(0, holder=H1))
    found = table.lookup(COMPAT, SCOPE_A, keys(0))
    assert [r["holder"] for r in json.loads(found[0].rendered())] == [H2]
    assert table.counts_by_scope() == {SCOPE_A: 1}


def test_record_limit_is_507_and_stores_nothing(clock: ManualClock) -> None:
    table = ReplicaTable(clock, IndexLimits(max_records=3))
    table.publish_many([replica(0), replica(1)])
    with pytest.raises(CapacityExhausted, match="limit of 3"):
        table.publish_many([replica(2), replica(3)])
    assert table.count == 2
    assert not table.publish(replica(1)).created  # refreshing needs no room
    table.publish(replica(2))
    with pytest.raises(CapacityExhausted):
        table.publish(replica(3))
    clock.advance(600_000)
    table.publish(replica(3))  # expiry made room


def test_expiry_costs_only_the_expired(clock: ManualClock) -> None:
    table = ReplicaTable(clock, IndexLimits(max_ttl_ms=10**9, max_records=10**6))
    table.publish_many([replica(n, ttl_ms=10**8) for n in range(5_000)])
    table.publish(replica(99_999, ttl_ms=10))
    clock.advance(10)
    assert table.expire() == clock.now_ms()
    assert table.expired_total == 1
    # the heap still holds one entry per live record: nothing was scanned or rebuilt
    assert len(table._deadlines) == 5_000
    assert table.count == 5_000


def test_refresh_storm_keeps_the_deadline_heap_bounded(table: ReplicaTable) -> None:
    for _ in range(5_000):
        table.publish(replica(0))
    assert len(table._deadlines) <= 2 * table.count + 1024


def test_path_must_match_body() -> None:
    record = replica(0)
    check_path(record, COMPAT, SCOPE_A, key(0))
    with pytest.raises(RecordError, match="match the path"):
        check_path(record, COMPAT, SCOPE_A, key(1))


def _principal(roles: set[Role], scopes: set[str], holders: set[str]) -> Principal:
    return Principal("p", frozenset(roles), frozenset(scopes), frozenset(holders))


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("scope_ok", [True, False])
@pytest.mark.parametrize("holder_ok", [True, False])
def test_authorization_matrix(role: Role, scope_ok: bool, holder_ok: bool) -> None:
    principal = _principal({role}, {SCOPE_A if scope_ok else SCOPE_B}, {H1 if holder_ok else H2})
    may_publish = role in (Role.HOLDER, Role.INSTANCE, Role.ADMIN) and scope_ok and holder_ok
    for action, subject in ((authorize_publish, replica(0)), (authorize_withdraw, ref(0))):
        if may_publish:
            action(principal, subject)  # type: ignore[operator]
        else:
            with pytest.raises(Forbidden):
                action(principal, subject)  # type: ignore[operator]
    if scope_ok and role is not Role.METRICS:  # a scraper reads metrics, nothing else
        authorize_lookup(principal, SCOPE_A)
    else:
        with pytest.raises(Forbidden):
            authorize_lookup(principal, SCOPE_A)
    instance = _principal({role}, {SCOPE_A}, {I1 if holder_ok else H2})
    if role in (Role.INSTANCE, Role.CONTROLLER, Role.ADMIN) and holder_ok:
        authorize_status(instance, status(I1))
    else:
        with pytest.raises(Forbidden):
            authorize_status(instance, status(I1))


def test_status_epochs_and_expiry(clock: ManualClock) -> None:
    statuses = StatusTable(clock, IndexLimits())
    statuses.put(status(epoch=5, ttl_ms=1_000))
    with pytest.raises(StaleEpoch, match="below 5"):
        statuses.put(status(epoch=4))
    statuses.put(status(epoch=5, prefill=800, ttl_ms=1_000))
    assert statuses.get(I1).prefill_tokens_per_s == 800  # type: ignore[union-attr]
    clock.advance(1_000)
    assert statuses.get(I1) is None
    with pytest.raises(StaleEpoch):  # the highest epoch outlives the record
        statuses.put(status(epoch=4))
    statuses.put(status(epoch=6))
    assert statuses.get("HTTP://127.0.0.1:9201/kvsp") is not None


def _stored(table: ReplicaTable, *ns: int) -> list[BlockReplicas]:
    return table.lookup(COMPAT, SCOPE_A, keys(*ns))


def test_estimates_against_the_formulas(table: ReplicaTable) -> None:
    block_us = 8 * LAYERS * LAYER_OCTETS / 8  # 8 Mbit/s = one octet per microsecond
    table.publish(replica(0, holder=H1))
    table.publish(replica(0, holder=H2))
    table.publish(replica(1, holder=H1))
    table.publish(replica(1, holder=H2))
    table.publish(replica(2, holder=I1))  # already resident at the target
    table.publish(
        replica(
            3,
            holder=H1,
            residency=[
                {"tier": "host", "layers": [0, 1]},
                {"tier": "disk", "layers": [2, 3], "read_mbit_per_s": 4},
            ],
        )
    )
    matched = _stored(table, 0, 1, 2, 3)
    links = [
        {"holder": H1, "mbit_per_s": 8, "rtt_us": 10},
        {"holder": H2, "mbit_per_s": 8, "rtt_us": 20},
    ]
    statuses = {I1: status(I1, links=links, prefill=400)}
    (estimate,) = estimate_targets([I1], statuses, matched, block_tokens=16)
    # H1: block 0 (rtt 10 + 4000) then block 3 (2 layers at 1 o/us, 2 at 0.5 o/us = 6000);
    # H2: block 1 (rtt 20 + 4000); block 2 resident.
    assert estimate.fetch_us == pytest.approx(max(10 + block_us + 6000, 20 + block_us))
    assert estimate.recompute_us == pytest.approx(1e6 * 4 * 16 / 400)
    assert estimate.fetch_blocks == 4
    assert estimate_targets(["http://unknown/kvsp/"], statuses, matched, 16) == []
    assert estimate_targets([I1], statuses, matched, None) == []


def test_estimates_stop_at_an_unreachable_block(table: ReplicaTable) -> None:
    table.publish(replica(0, holder=H1))
    table.publish(replica(1, holder=H2))
    statuses = {I1: status(I1, links=[{"holder": H1, "mbit_per_s": 8, "rtt_us": 0}])}
    (estimate,) = estimate_targets([I1], statuses, _stored(table, 0, 1), block_tokens=16)
    assert estimate.fetch_blocks == 1
    assert estimate.fetch_us == pytest.approx(LAYERS * LAYER_OCTETS)


def test_statuses_cannot_pin_memory(clock: ManualClock) -> None:
    statuses = StatusTable(clock, IndexLimits(max_instances=2))
    statuses.put(status("http://a/kvsp/", epoch=7))
    statuses.put(status("http://b/kvsp/"))
    with pytest.raises(CapacityExhausted):
        statuses.put(status("http://c/kvsp/"))
    statuses.put(status("http://a/kvsp/", epoch=8))  # known instances still report
    clock.advance(STATUS_RETENTION_MS)
    statuses.put(status("http://c/kvsp/"))  # a and b are forgotten a day after their last status
    statuses.put(status("http://a/kvsp/", epoch=1))  # so is a's epoch


def test_packed_keys_read_as_the_hex_keys_they_pack() -> None:
    hexes = keys(0, 1, 2)
    packed = PackedKeys(b"".join(bytes.fromhex(k) for k in hexes))
    assert len(packed) == 3
    assert list(packed) == hexes
    assert (packed[0], packed[-1], packed[::2]) == (hexes[0], hexes[2], hexes[::2])
    assert hexes[1] in packed
    with pytest.raises(IndexError):
        packed[3]
    with pytest.raises(IndexError):
        packed[-4]
