"""Instance statuses with a manual clock (epochs, expiry, bounded memory) and the estimates
of a lookup with targets."""

from __future__ import annotations

import pytest

from kvsp.core.clock import ManualClock
from kvsp.core.problems import CapacityExhausted, StaleEpoch
from kvsp.index.replicas import BlockReplicas, ReplicaTable
from kvsp.index.rules import (
    IndexLimits,
)
from kvsp.index.statuses import STATUS_RETENTION_MS, StatusTable, estimate_targets
from tests.index.factories import (
    COMPAT,
    H1,
    H2,
    I1,
    LAYER_OCTETS,
    LAYERS,
    SCOPE_A,
    keys,
    replica,
    status,
)


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
