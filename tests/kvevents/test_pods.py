"""A vLLM pod's events as kvsp records: Block Keys recomputed from the tokens in the scope the
cache salt names, media as tiers, removals and clears dropping records, blocks kvsp cannot
key (unknown parent, unknown salt, an adapter's, a multimodal one) left out."""

from __future__ import annotations

import json

from kvsp.core.ids import BlockKey
from kvsp.core.keys import block_keys
from kvsp.core.records import ReplicaRecord
from kvsp.kvevents.pods import PodChanges, PodIndex, PodSource
from kvsp.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvsp.tenants import Tenants
from tests.index.factories import COMPAT

TENANTS = Tenants.parse(
    f'[tenants.acme]\nscope_key = "{"11" * 32}"\ncompat_ids = ["{COMPAT}"]\n'
    f'[tenants.globex]\nscope_key = "{"22" * 32}"\ncompat_ids = ["{COMPAT}"]\n'
)
ACME, GLOBEX = TENANTS.get("acme"), TENANTS.get("globex")
POD = PodSource("http://pod.test/", COMPAT, 16, 30, ACME, {"g-salt": GLOBEX})
TOKENS = list(range(500, 564))  # 4 kvsp blocks


def keys_of(tenant: str, tokens: list[int]) -> list[str]:
    t = TENANTS.get(tenant)
    found: list[BlockKey] = block_keys(t.scope_key, bytes.fromhex(COMPAT), tokens, 16)  # type: ignore[arg-type]
    return [k.hex() for k in found]


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int = 16,
           medium: str = "GPU", **extra: object) -> BlockStored:  # fmt: skip
    return BlockStored(hashes, parent, tokens, size, None, medium, None, **extra)  # type: ignore[arg-type]


def apply(pod: PodIndex, *events: object) -> PodChanges:
    changes = PodChanges()
    pod.apply(EventBatch(0.0, list(events)), changes)  # type: ignore[arg-type]
    return changes


def test_blocks_are_keyed_as_kvsp_keys_them_in_the_tenants_scope() -> None:
    pod = PodIndex(POD)
    changes = apply(pod, stored([1, 2], None, TOKENS[:32]), stored([3, 4], 2, TOKENS[32:]))
    expected = {(ACME.scope_id, k): frozenset({"device"}) for k in keys_of("acme", TOKENS)}
    assert changes.put == expected
    rendered = pod.record_json((ACME.scope_id, keys_of("acme", TOKENS)[0]), frozenset({"device"}))
    record = ReplicaRecord.parse(json.loads(rendered))  # what the IS validates
    assert record.holder == "http://pod.test/"
    assert record.codec == 0x8000  # engine-pages: where it is cached, nothing to fetch
    assert [r.tier for r in record.residency] == ["device"]
    assert record.residency[0].layers == (0, 29)
    # a vLLM block of 32 tokens is two kvsp blocks
    wide = apply(PodIndex(POD), stored([9], None, TOKENS[:32], size=32))
    assert set(wide.put) == {(ACME.scope_id, k) for k in keys_of("acme", TOKENS[:32])}


def test_the_cache_salt_names_the_tenant_and_unknown_ones_are_left_out() -> None:
    pod = PodIndex(POD)
    salted = apply(pod, stored([1], None, TOKENS[:16], extra_keys=[("g-salt",)]),
                   stored([2], 1, TOKENS[16:32]))  # fmt: skip
    assert set(salted.put) == {(GLOBEX.scope_id, k) for k in keys_of("globex", TOKENS[:32])}
    other = apply(pod, stored([5], None, TOKENS[:16], extra_keys=[("nobody",)]))
    assert other.put == {}
    assert other.skipped == 1
    adapter = BlockStored([6], None, TOKENS[:16], 16, None, "GPU", "my-lora")
    image = stored([7], None, TOKENS[:16], extra_keys=[(("mm-hash", 0),)])
    orphan = stored([8], 12345, TOKENS[:16])  # its parent was stored before we listened
    left_out = apply(pod, adapter, image, orphan)
    assert left_out.put == {}
    assert left_out.skipped == 3


def test_media_become_tiers_and_removals_narrow_then_drop_the_records() -> None:
    pod = PodIndex(POD)
    first = keys_of("acme", TOKENS[:16])[0]
    block = (ACME.scope_id, first)
    apply(pod, stored([1], None, TOKENS[:16]))
    assert apply(pod, stored([1], None, TOKENS[:16], medium="CPU")).put == {
        block: frozenset({"device", "host"})
    }
    assert apply(pod, BlockRemoved([1], "GPU")).put == {block: frozenset({"host"})}
    gone = apply(pod, BlockRemoved([1], "CPU"))
    assert gone.delete == {block}
    assert len(pod) == 0
    # vLLM may evict a parent before its child: the child still extends the parent's chain
    child = apply(pod, stored([2], 1, TOKENS[16:32]))
    assert set(child.put) == {(ACME.scope_id, keys_of("acme", TOKENS[:32])[1])}


def test_a_clear_drops_every_record() -> None:
    pod = PodIndex(POD)
    apply(pod, stored([1, 2], None, TOKENS[:32]))
    cleared = apply(pod, AllBlocksCleared())
    assert cleared.delete == {(ACME.scope_id, k) for k in keys_of("acme", TOKENS[:32])}
    assert list(pod.held()) == []
