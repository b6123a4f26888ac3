"""The router query's overlap, against a direct count: per holder, the leading blocks held in
device memory (gpu), in device or host memory (cpu), anywhere (disk)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvsp.controller.overlap import overlap_by_holder
from kvsp.core.records import ReplicaRecord
from tests.index.factories import replica

HOLDERS = ["http://a.test/kvsp/", "http://b.test/kvsp/", "http://c.test/kvsp/"]
TIERS = st.sampled_from(["device", "host", "disk"])
blocks = st.lists(
    st.dictionaries(st.sampled_from(HOLDERS), st.frozensets(TIERS, min_size=1), min_size=1),
    max_size=8,
)


def records(held: dict[str, frozenset[str]], n: int) -> list[ReplicaRecord]:
    out = []
    for holder, tiers in held.items():
        for tier in sorted(tiers):  # one record per tier: a holder's records are joined
            out.append(replica(n, holder, residency=[{"tier": tier, "layers": [0, 1]}]))
    return out


def leading(held: list[dict[str, frozenset[str]]], holder: str, tiers: set[str]) -> int:
    n = 0
    for block in held:
        if not tiers & block.get(holder, frozenset()):
            break
        n += 1
    return n


@given(blocks)
def test_each_medium_counts_the_leading_blocks_a_holder_has_there(
    held: list[dict[str, frozenset[str]]],
) -> None:
    got = overlap_by_holder([records(block, n) for n, block in enumerate(held)])
    for holder in HOLDERS:
        o = got.get(holder)
        gpu = leading(held, holder, {"device"})
        cpu = leading(held, holder, {"device", "host"})
        disk = leading(held, holder, {"device", "host", "disk"})
        if o is None:
            assert disk == 0
            continue
        assert (o.gpu, o.cpu, o.disk) == (gpu, cpu, disk)
