"""Clock implementations, the problem registry, and registry lookups."""

from __future__ import annotations

import pytest

from kvsp.core.clock import Clock, ManualClock, SystemClock
from kvsp.core.problems import (
    PROBLEM_TYPE_BASE,
    ContainerTruncatedError,
    KvspError,
    LayersUnavailable,
    LeaseQuotaExceeded,
    StaleEpoch,
    problem_types,
)
from kvsp.core.registries import CODECS, ELEMENT_TYPES, TIERS, element_type, parse_positional


def test_manual_clock_moves_only_forward() -> None:
    clock = ManualClock(start_ms=100)
    assert isinstance(clock, Clock)
    wall = clock.wall_ms()
    clock.advance(50)
    assert clock.now_ms() == 150
    assert clock.wall_ms() == wall + 50
    clock.set(200)
    with pytest.raises(ValueError, match="backward"):
        clock.set(199)
    with pytest.raises(ValueError, match="backward"):
        clock.advance(-1)


def test_system_clock() -> None:
    clock = SystemClock()
    assert isinstance(clock, Clock)
    first = clock.now_ms()
    assert clock.now_ms() >= first
    assert clock.wall_ms() > 1_600_000_000_000


def test_problem_documents() -> None:
    doc = LeaseQuotaExceeded("too many leased octets", limit=100).to_problem("/kvsp/leases")
    assert doc == {
        "type": PROBLEM_TYPE_BASE + "kvsp-lease-quota",
        "title": "Lease quota exceeded",
        "status": 429,
        "detail": "too many leased octets",
        "instance": "/kvsp/leases",
        "limit": 100,
    }
    assert LayersUnavailable("x").to_problem()["type"].endswith("#kvsp-layers-unavailable")
    assert StaleEpoch("x").status == 409
    assert ContainerTruncatedError("x").to_problem()["status"] == 400


def test_problem_registry_is_derived_from_the_tree() -> None:
    types = problem_types()
    assert {"kvsp-lease-quota", "kvsp-layers-unavailable", "kvsp-stale-epoch"} <= set(types)
    assert all(issubclass(cls, KvspError) for cls in types.values())
    assert all(slug.startswith("kvsp-") for slug in types)


def test_registries() -> None:
    assert element_type("bfloat16").size == 2
    assert {t: ELEMENT_TYPES[t].size for t in ("float32", "float8_e4m3fn", "int8")} == {
        "float32": 4,
        "float8_e4m3fn": 1,
        "int8": 1,
    }
    assert CODECS[1].name == "raw"
    assert TIERS == ("device", "host", "disk")
    encoding, params = parse_positional("rope;scaling=linear;theta=10000")
    assert encoding.name == "rope"
    assert params == {"scaling": "linear", "theta": "10000"}
