"""A vLLM pod's KV events turned into kvsp Replica Records, pure.

``kvsp index ingest`` subscribes to unmodified ``vllm serve`` pods. Each ``BlockStored``
names vLLM's blocks by vLLM's hashes, with their tokens and the parent's hash; kvsp recomputes
its own Block Keys from the tokens, in the tenant's scope: the scope of the tenant the chain's
cache salt names (vLLM puts a request's ``cache_salt`` in the first block's extra keys), or the
pod's default tenant. Each block's chain state (the scope, the last Block Key) is kept by vLLM
hash, so a child extends its parent's chain without its parent's tokens. A vLLM block of ``n``
times kvsp's block size is ``n`` kvsp blocks.

The records say where the block is held: at the pod's URL, in the tiers its media name
(``GPU`` device, ``CPU`` host, ``STORAGE`` disk), codec ``engine-pages`` (nothing anyone can
fetch: docs/decisions/0001), a TTL the stream refreshes. A ``BlockRemoved`` narrows or drops
them, ``AllBlocksCleared`` and ``reset`` (the pod restarted, or a gap no replay filled) drop
every record. A block whose parent is unknown (stored before the stream was read) or whose
cache salt names no tenant is not recorded. Chain states of blocks no longer held are kept for
at most ``max_orphans`` blocks, since vLLM may evict a parent before its child.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvsp.core.ids import BlockKey
from kvsp.core.keys import BLOCK_DOMAIN, ROOT_PARENT, HmacTemplate, token_octets
from kvsp.core.problems import KeyMaterialError
from kvsp.core.registries import CODEC_ENGINE_PAGES, Tier
from kvsp.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvsp.tenants import Tenant

__all__ = ["PodChanges", "PodIndex", "PodSource"]

_TIER_OF_MEDIUM = {"GPU": "device", "CPU": "host", "STORAGE": "disk"}


@dataclass(frozen=True, slots=True)
class PodSource:
    """One pod: where its records say the blocks are, and whose scopes its requests use."""

    url: str
    compat_id: str
    block_tokens: int
    layers: int
    #: requests without a cache salt
    tenant: Tenant | None
    #: cache salt -> tenant
    salts: Mapping[str, Tenant] = field(default_factory=dict)
    ttl_ms: int = 30_000


@dataclass(slots=True)
class _Block:
    tenant: Tenant
    #: the kvsp Block Keys this vLLM block holds, in order (the last one chains the next)
    keys: list[BlockKey]
    media: set[str] = field(default_factory=set)


@dataclass(slots=True)
class PodChanges:
    #: (scope id, Block Key hex) -> the tiers holding it, for every record to write
    put: dict[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    #: records to drop
    delete: set[tuple[str, str]] = field(default_factory=set)
    #: blocks not recorded: unknown parent, unknown salt, a block size kvsp's does not divide
    skipped: int = 0

    def record_put(self, block: tuple[str, str], tiers: frozenset[str]) -> None:
        self.delete.discard(block)
        self.put[block] = tiers

    def record_delete(self, block: tuple[str, str]) -> None:
        self.put.pop(block, None)
        self.delete.add(block)


class PodIndex:
    def __init__(self, source: PodSource, max_orphans: int = 65_536) -> None:
        self.source = source
        self.max_orphans = max_orphans
        self._domain = BLOCK_DOMAIN + bytes.fromhex(source.compat_id)
        #: each tenant's keyed HMAC, its key schedule absorbed once (``core.keys``'s chain)
        self._templates: dict[str, HmacTemplate] = {}
        self._residency: dict[frozenset[str], str] = {}
        self._held: dict[int | bytes, _Block] = {}
        #: chain states of blocks no longer held, newest last
        self._orphans: OrderedDict[int | bytes, _Block] = OrderedDict()

    def __len__(self) -> int:
        """vLLM blocks held in at least one medium."""
        return len(self._held)

    def apply(self, batch: EventBatch, changes: PodChanges) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event, changes)
            elif isinstance(event, BlockRemoved):
                self._removed(event, changes)
            elif isinstance(event, AllBlocksCleared):
                self.reset(changes)

    def reset(self, changes: PodChanges) -> None:
        """Everything the pod held is gone (a restart, a gap, ``AllBlocksCleared``)."""
        for block in self._held.values():
            for key in block.keys:
                changes.record_delete((block.tenant.scope_id, key.hex()))
        self._held.clear()
        self._orphans.clear()

    def _chain_of(self, parent: int | bytes | None, salt: object) -> tuple[Tenant, BlockKey] | None:
        if parent is None:
            if salt is None:
                tenant = self.source.tenant
            else:
                tenant = self.source.salts.get(salt) if isinstance(salt, str) else None
            return None if tenant is None else (tenant, ROOT_PARENT)
        known = self._held.get(parent) or self._orphans.get(parent)
        return None if known is None else (known.tenant, known.keys[-1])

    def _stored(self, event: BlockStored, changes: PodChanges) -> None:
        size = event.block_size
        kvsp_b = self.source.block_tokens
        tier = _TIER_OF_MEDIUM.get(event.medium or "GPU")
        shape_ok = len(event.token_ids) == size * len(event.block_hashes)
        # an adapter's cache is another cache: kvsp's Compatibility ID names none
        if size % kvsp_b or tier is None or not shape_ok or event.lora_name is not None:
            changes.skipped += len(event.block_hashes)
            return
        parent = event.parent_block_hash
        for i, vllm_hash in enumerate(event.block_hashes):
            salt = _salt(event.extra_keys, i)
            chain = None if salt is _OTHER else self._chain_of(parent, salt)
            parent = vllm_hash
            if chain is None:
                changes.skipped += 1
                continue
            tenant, last = chain
            block = self._held.get(vllm_hash) or self._orphans.pop(vllm_hash, None)
            if block is None:
                keys = self._keys(tenant, last, event.token_ids[i * size : (i + 1) * size])
                if keys is None:
                    changes.skipped += 1
                    continue
                block = _Block(tenant, keys)
            self._held[vllm_hash] = block
            block.media.add(tier)
            self._put(block, changes)

    def _keys(self, tenant: Tenant, parent: BlockKey, tokens: list[int]) -> list[BlockKey] | None:
        """The kvsp Block Keys of one vLLM block's tokens after ``parent`` (None: a token id
        outside 0..2^32-1), as ``core.keys.BlockKeyChain`` derives them."""
        template = self._templates.get(tenant.scope_id)
        if template is None:
            template = self._templates[tenant.scope_id] = HmacTemplate(
                tenant.scope_key, self._domain
            )
        try:
            octets = token_octets(tokens)
        except KeyMaterialError:
            return None
        step = 4 * self.source.block_tokens
        keys = []
        for start in range(0, len(octets), step):
            parent = BlockKey(template.digest(parent, octets[start : start + step]))
            keys.append(parent)
        return keys

    def _removed(self, event: BlockRemoved, changes: PodChanges) -> None:
        tier = _TIER_OF_MEDIUM.get(event.medium or "GPU")
        for vllm_hash in event.block_hashes:
            block = self._held.get(vllm_hash)
            if block is None:
                continue
            block.media.discard(tier or "")
            if block.media:
                self._put(block, changes)
                continue
            del self._held[vllm_hash]
            for key in block.keys:
                changes.record_delete((block.tenant.scope_id, key.hex()))
            self._orphans[vllm_hash] = block
            while len(self._orphans) > self.max_orphans:
                self._orphans.popitem(last=False)

    def _put(self, block: _Block, changes: PodChanges) -> None:
        tiers = frozenset(block.media)
        for key in block.keys:
            changes.record_put((block.tenant.scope_id, key.hex()), tiers)

    def held(self) -> Iterator[tuple[tuple[str, str], frozenset[str]]]:
        """Every record the pod's blocks make (what a TTL refresh writes again)."""
        for block in self._held.values():
            tiers = frozenset(block.media)
            for key in block.keys:
                yield (block.tenant.scope_id, key.hex()), tiers

    def record_json(self, block: tuple[str, str], tiers: frozenset[str]) -> bytes:
        """The Replica Record of one of the pod's blocks, as the IS reads it (rendered here, not
        through the record model: ingest writes every held record again each third of a TTL).
        """
        scope, key = block
        residency = self._residency.get(tiers)
        if residency is None:
            last = self.source.layers - 1
            residency = self._residency[tiers] = json.dumps(
                [{"tier": t, "layers": [0, last]} for t in _TIERS if t in tiers]
            )
        source = self.source
        # the digest identifies the record; it protects no octets, since none are served
        digest = hashlib.sha256(bytes.fromhex(key)).hexdigest()
        return (
            f'{{"block_key":"{key}","compat_id":"{source.compat_id}","scope_id":"{scope}",'
            f'"holder":{json.dumps(source.url)},"codec":{CODEC_ENGINE_PAGES},'
            f'"size":{source.block_tokens},"digest":"sha-256:{digest}",'
            f'"residency":{residency},"ttl_ms":{source.ttl_ms}}}'
        ).encode()


_TIERS: tuple[Tier, ...] = ("device", "host", "disk")


def _salt(extra_keys: Sequence[tuple[object, ...] | None] | None, index: int) -> object:
    """The cache salt of block ``index`` (None: none), or ``_OTHER`` where its extra keys hold
    something kvsp's Block Keys do not carry (a multimodal input: the same tokens are then
    another cache). vLLM lists, per block, the LoRA name, ``(mm_identifier, offset)`` pairs,
    the request's cache salt (first block only) and prompt embedding digests."""
    if not extra_keys or index >= len(extra_keys):
        return None
    keys = extra_keys[index] or ()
    if any(not isinstance(k, str) for k in keys):
        return _OTHER
    return keys[0] if keys else None


_OTHER = object()
