"""The index tables' fixtures: a manual clock, and a replica table on it with small limits."""

from __future__ import annotations

import pytest

from kvsp.core.clock import ManualClock
from kvsp.index.replicas import ReplicaTable
from kvsp.index.rules import IndexLimits


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def table(clock: ManualClock) -> ReplicaTable:
    return ReplicaTable(clock, IndexLimits(max_ttl_ms=10_000, max_records=100))
