"""Every KVSP record and request body, defined once (KVSP 4.4, 6.x).

Servers, clients, the simulator and the CLI all use these models. Unknown members are ignored
(KVSP 4.4 requires it: a newer peer may add members), but every known member is strictly typed:
a JSON string is never coerced into a number, nor a float into an integer. Invariants the spec
states (inclusive, non-overlapping residency; contiguous half-open shard ranges; the replica
digest covering the layer digests) are checked here, so no state machine ever holds an
inconsistent record. Validation failures raise ``RecordError`` through ``Record.parse``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import itertools
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from kvsp.core.compat import DIGEST_PATTERN
from kvsp.core.container import replica_digest
from kvsp.core.ids import HEX16_PATTERN, HEX32_PATTERN
from kvsp.core.problems import PayloadTooLarge, RecordError
from kvsp.core.registries import CODECS, Tier
from kvsp.core.urls import canonical_url
from kvsp.core.validation import parse_model

__all__ = [
    "MAX_BATCH_ENTRIES",
    "MAX_KEYS_PER_REQUEST",
    "MOQT_NAMESPACE_FIELDS",
    "MOQT_PUBLISHER",
    "U16",
    "U32",
    "U63",
    "FetchRange",
    "Hex16",
    "Hex32",
    "HolderMatch",
    "HttpUrl",
    "InstanceState",
    "InstanceStatusRecord",
    "LeaseGrant",
    "LeaseRenewal",
    "LeaseRequest",
    "Link",
    "LookupRequest",
    "LookupResponse",
    "PrefetchBlock",
    "PrefetchDirective",
    "PrefetchState",
    "PrefetchStatus",
    "Record",
    "ReplicaBatch",
    "ReplicaRecord",
    "ReplicaRef",
    "ReshardAbort",
    "ReshardCommit",
    "ReshardPlan",
    "Residency",
    "Sampler",
    "SessionCheckpoint",
    "SessionName",
    "Shard",
    "ShardMap",
    "StateAnswer",
    "StateChange",
    "TargetEstimate",
    "TokenId",
    "TokenRange",
    "Uuid",
    "decode_moqt_namespace",
    "replica_holder",
    "split_prompt",
]

#: Bound on keys in one request body, so no client can make a service hold unbounded lists.
MAX_KEYS_PER_REQUEST = 65_536
#: Entries (puts plus deletes) in one ``POST replicas``.
MAX_BATCH_ENTRIES = 4096
MOQT_NAMESPACE_FIELDS = 5
_MAX_URL = 2048
_U32_MAX = 0xFFFFFFFF
_U64_MAX = (1 << 64) - 1
_B64URL = re.compile(r"[A-Za-z0-9_-]*")

Hex32 = Annotated[StrictStr, Field(pattern=HEX32_PATTERN)]
Hex16 = Annotated[StrictStr, Field(pattern=HEX16_PATTERN)]
Digest = Annotated[StrictStr, Field(pattern=DIGEST_PATTERN)]
_U63_MAX = (1 << 63) - 1
_U16_MAX = 0xFFFF
#: every integer on the wire has an upper bound (docs/api.md): counts and durations in ms fit
#: 32 bits (49 days), versions, epochs and octet counts 63
U16 = Annotated[StrictInt, Field(ge=0, le=_U16_MAX)]
U32 = Annotated[StrictInt, Field(ge=0, le=_U32_MAX)]
U63 = Annotated[StrictInt, Field(ge=0, le=_U63_MAX)]
PositiveU32 = Annotated[StrictInt, Field(ge=1, le=_U32_MAX)]
PositiveU63 = Annotated[StrictInt, Field(ge=1, le=_U63_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0, le=_U32_MAX)]
#: a client's name for its session (visible ASCII, so it is safe to log): a UUID or any other
#: name, namespaced by its tenant (``kvsp.core.ids.tenant_session``)
SessionName = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[!-~]+$")]
Rate = Annotated[StrictFloat | StrictInt, Field(gt=0, allow_inf_nan=False)]
NonNegNumber = Annotated[StrictFloat | StrictInt, Field(ge=0, allow_inf_nan=False)]


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http(s) URL with a host")
    return value


def _uuid(value: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ValueError("must be a UUID") from None


HttpUrl = Annotated[StrictStr, Field(max_length=_MAX_URL), AfterValidator(_http_url)]
Uuid = Annotated[StrictStr, Field(max_length=64), AfterValidator(_uuid)]


def decode_moqt_namespace(value: str) -> tuple[bytes, ...]:
    """The five Track Namespace Fields of a ``moqt_namespace`` (base64url, no padding, each
    field preceded by its one-octet length; fields are non-empty). Raises ValueError."""
    if _B64URL.fullmatch(value) is None:
        raise ValueError("moqt_namespace must be base64url without padding")
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("moqt_namespace is not valid base64url") from None
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != value:
        raise ValueError("moqt_namespace is not canonical base64url")
    fields: list[bytes] = []
    pos = 0
    while pos < len(raw):
        length = raw[pos]
        if length == 0 or pos + 1 + length > len(raw):
            raise ValueError(f"moqt_namespace field {len(fields)} has a bad length")
        fields.append(raw[pos + 1 : pos + 1 + length])
        pos += 1 + length
    if len(fields) != MOQT_NAMESPACE_FIELDS:
        raise ValueError(
            f"moqt_namespace must hold {MOQT_NAMESPACE_FIELDS} fields, got {len(fields)}"
        )
    return tuple(fields)


def _non_overlapping(ranges: Iterable[tuple[int, int]], what: str, half_open: bool) -> None:
    """Ranges may come in any order but must not share a token or layer."""
    previous_end: int | None = None
    for start, end in sorted(ranges):
        if previous_end is not None and (
            start < previous_end if half_open else start <= previous_end
        ):
            raise ValueError(f"{what} ranges overlap")
        previous_end = end


class Record(BaseModel):
    """Base of every record: unknown members ignored, instances immutable."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    @classmethod
    def parse(cls, data: str | bytes | Mapping[str, Any]) -> Self:
        """Validate JSON text or a decoded object; any failure is a ``RecordError``."""
        return parse_model(cls, data, RecordError, cls.__name__)

    def to_json(self) -> dict[str, Any]:
        """The wire form: optional members that are unset are absent."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Residency(Record):
    tier: Tier
    layers: tuple[U16, U16]
    read_mbit_per_s: Rate | None = None

    @field_validator("layers")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise ValueError("layer range must be [first, last] with first <= last")
        return value


class _HeldBy:
    """A replica's holder: a URL, and a namespace for a moqt holder (the members are the
    models'; annotated here for type checkers only, so they keep their place in each model)."""

    if TYPE_CHECKING:
        holder: str
        moqt_namespace: str | None

    @property
    def publisher(self) -> str:
        """Who serves the replica, as the IS keys and authorizes it (``replica_holder``)."""
        return replica_holder(self.holder, self.moqt_namespace)


class ReplicaRecord(_HeldBy, Record):
    block_key: Hex32
    compat_id: Hex32
    scope_id: Hex16
    holder: Annotated[StrictStr, Field(max_length=_MAX_URL)]
    codec: U32
    size: PositiveU63
    digest: Digest
    layer_digests: Annotated[tuple[Hex32, ...], Field(min_length=1, max_length=65_535)] | None = (
        None
    )
    residency: Annotated[tuple[Residency, ...], Field(min_length=1, max_length=64)]
    ttl_ms: PositiveU32
    moqt_namespace: Annotated[StrictStr, Field(max_length=2048)] | None = None

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, value: int) -> int:
        if value not in CODECS:
            raise ValueError(f"codec {value} is not registered")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        _check_holder(self.holder, self.moqt_namespace)
        _non_overlapping((r.layers for r in self.residency), "residency", half_open=False)
        if self.layer_digests is not None:
            self.check_layers(len(self.layer_digests))
            expected = replica_digest([bytes.fromhex(d) for d in self.layer_digests])
            if self.digest != "sha-256:" + expected.hex():
                raise ValueError("digest is not the SHA-256 of the concatenated layer digests")
        return self

    def check_layers(self, layers: int) -> None:
        """Residency must lie within the block's ``layers`` layers (0..layers-1)."""
        for entry in self.residency:
            if entry.layers[1] >= layers:
                first, last = entry.layers
                raise ValueError(f"residency {first}-{last} outside the block's {layers} layers")

    @property
    def layer_count(self) -> int:
        """Layers of the block: from ``layer_digests``, else the highest resident layer + 1."""
        if self.layer_digests is not None:
            return len(self.layer_digests)
        return max(r.layers[1] for r in self.residency) + 1

    @property
    def digest_octets(self) -> bytes:
        """The replica digest as octets, for ``Container.verify``."""
        return bytes.fromhex(self.digest.removeprefix("sha-256:"))

    def layer_digest_octets(self) -> list[bytes]:
        """The layer digests as octets indexed by layer, for ``Container.verify``."""
        return [bytes.fromhex(d) for d in self.layer_digests or ()]

    def holds_layers(self, first: int, last: int) -> bool:
        """Whether every layer of ``first..last`` is resident in some tier."""
        covered = first
        for lo, hi in sorted(r.layers for r in self.residency):
            if lo > covered:
                break
            covered = max(covered, hi + 1)
        return covered > last


class ReplicaRef(_HeldBy, Record):
    """Names one replica for withdrawal: the block resource and its holder (with the
    namespace for a moqt holder: its publisher is the holder, 4.4)."""

    compat_id: Hex32
    scope_id: Hex16
    block_key: Hex32
    holder: Annotated[StrictStr, Field(max_length=_MAX_URL)]
    moqt_namespace: Annotated[StrictStr, Field(max_length=2048)] | None = None

    @model_validator(mode="after")
    def _checked(self) -> Self:
        _check_holder(self.holder, self.moqt_namespace)
        return self


#: how the publisher of a MOQT namespace is named where a holder URL would be (principals'
#: ``holders``, the IS's replica slots)
MOQT_PUBLISHER = "moqt-namespace:"


def replica_holder(holder: str, moqt_namespace: str | None) -> str:
    """Who serves a replica (KVSP 4.4): an http(s) holder's canonical URL; for a moqt holder
    the publisher of its namespace, ``moqt-namespace:<namespace>``: a relay's URI carries many
    publishers' namespaces, so it authorizes nobody and names no replica slot."""
    if moqt_namespace is None:
        return canonical_url(holder)
    return MOQT_PUBLISHER + moqt_namespace


@functools.lru_cache(maxsize=1024)
def _check_holder(holder: str, moqt_namespace: str | None) -> None:
    """Raises ValueError for a holder no replica can name. Cached: the records of a batch
    name a few holders, and parsing each one's URL again took a fifth of a record's parse
    (a refusal raises, and is not cached; at most 1,024 pairs of members of at most 2,048
    characters each are kept, a few MB)."""
    scheme = urlsplit(holder).scheme
    if scheme == "moqt":
        if moqt_namespace is None:
            raise ValueError("a moqt holder needs moqt_namespace")
        decode_moqt_namespace(moqt_namespace)
        if not urlsplit(holder).hostname:
            raise ValueError("holder must name a host")
    elif scheme in ("http", "https"):
        _http_url(holder)
        if moqt_namespace is not None:
            raise ValueError("moqt_namespace is only for moqt holders")
    else:
        raise ValueError("holder must be an http(s) URL or a moqt URI")


class ReplicaBatch(Record):
    """``POST replicas``: publish and withdraw many records in one request, at most
    ``MAX_BATCH_ENTRIES`` of them (puts plus deletes); more is a 413."""

    put: Annotated[tuple[ReplicaRecord, ...], Field(max_length=MAX_BATCH_ENTRIES)] = ()
    delete: Annotated[tuple[ReplicaRef, ...], Field(max_length=MAX_BATCH_ENTRIES)] = ()

    @classmethod
    def parse(cls, data: str | bytes | Mapping[str, Any]) -> Self:
        batch = parse_model(cls, data, RecordError, cls.__name__, too_long=PayloadTooLarge)
        entries = len(batch.put) + len(batch.delete)
        if entries > MAX_BATCH_ENTRIES:
            raise PayloadTooLarge(f"{entries} entries; a batch holds at most {MAX_BATCH_ENTRIES}")
        return batch


class InstanceState(StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    FAILED = "failed"


class Link(Record):
    holder: Annotated[StrictStr, Field(max_length=_MAX_URL)]
    mbit_per_s: Rate
    rtt_us: NonNegNumber


class InstanceStatusRecord(Record):
    instance: HttpUrl
    epoch: U63
    state: InstanceState
    running: U32
    queued: U32
    batch_size: U32
    kv_utilization: Annotated[StrictFloat | StrictInt, Field(ge=0, le=1)]
    prefill_tokens_per_s: Rate
    decode_tokens_per_s: Rate
    links: Annotated[tuple[Link, ...], Field(max_length=1024)] = ()
    requested_state: Literal[InstanceState.SLEEPING] | None = None
    ttl_ms: PositiveU32
    #: extension member: what decides the instance's output bits (engine and library versions,
    #: device, element type, threads); two instances produce bit-identical tokens from one
    #: state only if they report the same identity (KVSP 4.4 ``sampler.deterministic``)
    engine: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    #: extension member: the share of the instance's G2 (host tier) in use, as
    #: ``kv_utilization`` is its G1's (what the cluster page shows)
    g2_utilization: Annotated[StrictFloat | StrictInt, Field(ge=0, le=1)] | None = None
    _links_by_holder: dict[str, Link] | None = PrivateAttr(default=None)

    @field_validator("links")
    @classmethod
    def _one_link_per_holder(cls, value: tuple[Link, ...]) -> tuple[Link, ...]:
        if len({link.holder for link in value}) != len(value):
            raise ValueError("at most one link per holder")
        return value

    def link_to(self, holder: str) -> Link | None:
        """The link to ``holder``, whatever spelling of its URL either side uses."""
        if self._links_by_holder is None:
            links = {canonical_url(link.holder): link for link in self.links}
            object.__setattr__(self, "_links_by_holder", links)
            return links.get(canonical_url(holder))
        return self._links_by_holder.get(canonical_url(holder))


_SAMPLER_PARAMS: dict[str, frozenset[str]] = {
    "greedy": frozenset(),
    "temperature": frozenset({"temperature"}),
    "top-k": frozenset({"k", "temperature"}),
    "top-p": frozenset({"p", "temperature"}),
}


class Sampler(Record):
    method: Literal["greedy", "temperature", "top-k", "top-p"]
    params: dict[StrictStr, StrictFloat | StrictInt] = Field(default_factory=dict)
    seed: Annotated[StrictInt, Field(ge=0, le=_U64_MAX)] = 0
    step: U32 = 0
    deterministic: StrictBool = False

    @model_validator(mode="after")
    def _params_fit_method(self) -> Self:
        allowed = _SAMPLER_PARAMS[self.method]
        unknown = set(self.params) - allowed
        if unknown:
            raise ValueError(f"{self.method} takes no parameter {', '.join(sorted(unknown))}")
        required = allowed - {"temperature"} if self.method != "temperature" else allowed
        missing = required - set(self.params)
        if missing:
            raise ValueError(f"{self.method} needs {', '.join(sorted(missing))}")
        p = self.params
        if "temperature" in p and not p["temperature"] > 0:
            raise ValueError("temperature must be > 0")
        if "k" in p and (not isinstance(p["k"], int) or p["k"] < 1):
            raise ValueError("k must be an integer >= 1")
        if "p" in p and not 0 < p["p"] <= 1:
            raise ValueError("p must be in (0, 1]")
        if self.deterministic and self.method != "greedy":
            raise ValueError("only a greedy sampler can be deterministic across instances")
        return self


class SessionCheckpoint(Record):
    session: Uuid
    epoch: U32
    compat_id: Hex32
    scope_id: Hex16
    prompt_blocks: Annotated[tuple[Hex32, ...], Field(max_length=MAX_KEYS_PER_REQUEST)]
    prompt_tail: Annotated[tuple[TokenId, ...], Field(max_length=1 << 20)]
    generated: Annotated[tuple[TokenId, ...], Field(max_length=1 << 20)]
    output_offset: U32
    sampler: Sampler
    #: extension member (KVSP 4.4: receivers ignore what they do not know): the tokens of the
    #: last prompt block, sent when ``prompt_tail`` and ``generated`` are empty. The logits
    #: after the last prompt token are in no KV cache, so an engine resuming there recomputes
    #: that block; the text's members alone name it only by its key
    last_block: Annotated[tuple[TokenId, ...], Field(max_length=1 << 16)] | None = None

    @model_validator(mode="after")
    def _covers_generated(self) -> Self:
        if self.output_offset != len(self.generated):
            raise ValueError("output_offset must equal the number of generated tokens")
        return self

    def resume_input(self, block_tokens: int) -> tuple[int, tuple[int, ...]]:
        """How a resumed engine starts (6.8, steps 1-2): the number of leading prompt blocks
        it may load, and the tokens it then computes. The last known token is always
        computed, since the next token needs its logits. ``RecordError`` for a checkpoint that
        does not fit ``block_tokens`` or that ends on a block boundary without ``last_block``."""
        if len(self.prompt_tail) >= block_tokens:
            raise RecordError(f"prompt_tail holds a whole block of {block_tokens} tokens or more")
        known = self.prompt_tail + self.generated
        if known:
            return len(self.prompt_blocks), known
        if not self.prompt_blocks:
            raise RecordError("the checkpoint holds no prompt")
        if self.last_block is None or len(self.last_block) != block_tokens:
            raise RecordError(
                "the checkpoint ends on a block boundary with nothing generated: resuming it "
                f"needs last_block, the {block_tokens} tokens of its last prompt block"
            )
        return len(self.prompt_blocks) - 1, self.last_block


def split_prompt(
    tokens: Sequence[int], block_tokens: int
) -> tuple[int, tuple[int, ...], tuple[int, ...] | None]:
    """A prompt as a checkpoint holds it (4.4): its complete blocks, the tokens after them
    (``prompt_tail``), and ``last_block`` when the tail is empty."""
    blocks = len(tokens) // block_tokens
    tail = tuple(tokens[blocks * block_tokens :])
    last = tuple(tokens[-block_tokens:]) if blocks and not tail else None
    return blocks, tail, last


TokenRange = tuple[U32, U32]


def _half_open(value: tuple[int, int]) -> tuple[int, int]:
    if value[0] >= value[1]:
        raise ValueError("token range must be [start, end) with start < end")
    return value


HalfOpen = Annotated[TokenRange, AfterValidator(_half_open)]


class Shard(Record):
    tokens: HalfOpen
    instance: HttpUrl


class ShardMap(Record):
    map: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    version: U63
    shards: Annotated[tuple[Shard, ...], Field(min_length=1, max_length=4096)]

    @field_validator("shards")
    @classmethod
    def _contiguous(cls, value: tuple[Shard, ...]) -> tuple[Shard, ...]:
        if value[0].tokens[0] != 0:
            raise ValueError("the first shard must start at token 0")
        for before, after in itertools.pairwise(value):
            if before.tokens[1] != after.tokens[0]:
                raise ValueError(
                    f"shards must be contiguous and in order: {list(before.tokens)} then "
                    f"{list(after.tokens)}"
                )
        return value


class FetchRange(Record):
    tokens: HalfOpen
    from_: HttpUrl = Field(alias="from")


class ReshardPlan(Record):
    map: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    from_: U63 = Field(alias="from")
    to: U63
    deadline_ms: PositiveU32
    retain: Annotated[tuple[HalfOpen, ...], Field(max_length=4096)] = ()
    fetch: Annotated[tuple[FetchRange, ...], Field(max_length=4096)] = ()
    release: Annotated[tuple[HalfOpen, ...], Field(max_length=4096)] = ()

    @model_validator(mode="after")
    def _well_formed(self) -> Self:
        if self.to != self.from_ + 1:
            raise ValueError("a reshard plan moves from version v to v+1")
        _non_overlapping(
            [*self.retain, *(f.tokens for f in self.fetch)], "retain and fetch", half_open=True
        )
        _non_overlapping(self.release, "release", half_open=True)
        return self


class ReshardCommit(Record):
    map: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    commit: U63


class ReshardAbort(Record):
    map: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    abort: U63


class PrefetchBlock(Record):
    block_key: Hex32
    sources: Annotated[tuple[HttpUrl, ...], Field(min_length=1, max_length=64)]


class PrefetchDirective(Record):
    directive: Uuid
    request_ref: Annotated[StrictStr, Field(max_length=256)] | None = None
    scope_id: Hex16
    compat_id: Hex32
    blocks: Annotated[
        tuple[PrefetchBlock, ...], Field(min_length=1, max_length=MAX_KEYS_PER_REQUEST)
    ]
    layer_order: Literal["ascending"] = "ascending"
    deadline_ms: PositiveU32
    lease_ms: PositiveU32

    @field_validator("blocks")
    @classmethod
    def _distinct(cls, value: tuple[PrefetchBlock, ...]) -> tuple[PrefetchBlock, ...]:
        if len({b.block_key for b in value}) != len(value):
            raise ValueError("each block key may appear once")
        return value


class PrefetchState(StrEnum):
    PENDING = "pending"
    PARTIAL = "partial"
    COMPLETE = "complete"
    FAILED = "failed"


class PrefetchStatus(Record):
    directive: Uuid
    state: PrefetchState
    loaded: Annotated[tuple[Hex32, ...], Field(max_length=MAX_KEYS_PER_REQUEST)] = ()


class LookupRequest(Record):
    scope_id: Hex16
    compat_id: Hex32
    block_keys: Annotated[tuple[Hex32, ...], Field(max_length=MAX_KEYS_PER_REQUEST)]
    targets: Annotated[tuple[HttpUrl, ...], Field(max_length=256)] | None = None
    #: extension: tokens per block, so the IS can estimate ``recompute_us``
    block_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 20)] | None = None
    #: extension: ``"holders"`` asks for the compact answer (``holders``, no records), what a
    #: router needs to pick an instance
    answer: Literal["holders"] | None = None

    @field_validator("block_keys")
    @classmethod
    def _no_repeats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """A chain of Block Keys never repeats one; a repeated key would only multiply the
        answer (65,536 copies of one key made a 481 MB answer)."""
        if len(set(value)) != len(value):
            raise ValueError("a key appears twice: a chain of Block Keys never repeats one")
        return value


class TargetEstimate(Record):
    target: HttpUrl
    fetch_us: NonNegNumber
    recompute_us: NonNegNumber
    #: extension: matched blocks the target can load (a prefix of ``matched``)
    fetch_blocks: U32 | None = None


class HolderMatch(Record):
    """Extension: a holder of the matched prefix, and how many of its leading blocks it holds."""

    holder: HttpUrl
    blocks: PositiveU32


class LookupResponse(Record):
    matched: U32
    replicas: tuple[tuple[ReplicaRecord, ...], ...] = ()
    estimates: tuple[TargetEstimate, ...] = ()
    #: extension: the compact answer (``"answer": "holders"``), in place of ``replicas``
    holders: tuple[HolderMatch, ...] | None = None

    @model_validator(mode="after")
    def _one_list_per_match(self) -> Self:
        if self.holders is not None:
            if self.replicas or max((h.blocks for h in self.holders), default=0) != self.matched:
                raise ValueError("a compact answer has no replicas and a holder of every match")
        elif len(self.replicas) != self.matched or any(not r for r in self.replicas):
            raise ValueError("replicas must list at least one record for each matched key")
        return self

    def kept_to(self, request: LookupRequest) -> LookupResponse:
        """This answer as far as it answers ``request``: a record that names another block,
        Compatibility ID or scope than the key at its position is dropped (two caches are never
        substituted across Compatibility IDs, KVSP 3), and the prefix ends at the first key
        left with no record or at the last key asked. An Index Service that errs or lies then
        costs a recompute, never a wrong block. A changed answer has no estimates: they priced
        the answer as it came."""
        asked = request.block_keys
        space = (request.compat_id, request.scope_id)
        replicas: list[tuple[ReplicaRecord, ...]] = []
        dropped = False
        for key, records in zip(asked, self.replicas, strict=False):
            kept = tuple(
                r for r in records if (r.block_key, r.compat_id, r.scope_id) == (key, *space)
            )
            dropped = dropped or len(kept) < len(records)
            if not kept:
                break
            replicas.append(kept)
        # a compact answer's longest holder run is its match: only a longer one than asked is cut
        matched = len(replicas) if self.holders is None else min(self.matched, len(asked))
        if matched == self.matched and not dropped:
            return self
        holders = None
        if self.holders is not None:
            holders = tuple(
                HolderMatch(holder=h.holder, blocks=min(h.blocks, matched)) for h in self.holders
            )
        return LookupResponse(matched=matched, replicas=tuple(replicas), holders=holders)


class LeaseRequest(Record):
    """KVSP 6.6's body: block keys and a TTL. A holder finds the blocks by key (a Block Key
    names one scope); the extension members narrow the search where the client knows them."""

    block_keys: Annotated[tuple[Hex32, ...], Field(min_length=1, max_length=MAX_KEYS_PER_REQUEST)]
    ttl_ms: PositiveU32
    compat_id: Hex32 | None = None
    scope_id: Hex16 | None = None


class LeaseGrant(Record):
    lease: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    ttl_ms: PositiveU32


class LeaseRenewal(Record):
    ttl_ms: PositiveU32


class StateChange(Record):
    state: InstanceState


class StateAnswer(Record):
    state: InstanceState
