"""Record models: round trips, ignored unknown members, and the invariants of the spec."""

from __future__ import annotations

import base64
import hashlib
import uuid
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.container import Container
from kvsp.core.problems import RecordError
from kvsp.core.records import (
    HolderMatch,
    InstanceState,
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    PrefetchStatus,
    ReplicaBatch,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    Sampler,
    SessionCheckpoint,
    ShardMap,
    StateAnswer,
    StateChange,
    TargetEstimate,
    decode_moqt_namespace,
    split_prompt,
)
from tests.index.factories import COMPAT, H1, H2, SCOPE_A, SCOPE_B, keys
from tests.index.factories import replica as replica_of

HEX32 = "ab" * 32
HEX16 = "cd" * 16
LAYER_DIGESTS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
REPLICA_DIGEST = (
    "sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in LAYER_DIGESTS)).hexdigest()
)


def replica(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "block_key": HEX32,
        "compat_id": HEX32,
        "scope_id": HEX16,
        "holder": "https://h1.example/kvsp/",
        "codec": 1,
        "size": 2097152,
        "digest": REPLICA_DIGEST,
        "layer_digests": LAYER_DIGESTS,
        "residency": [
            {"tier": "device", "layers": [0, 1]},
            {"tier": "host", "layers": [2, 3], "read_mbit_per_s": 400000},
        ],
        "ttl_ms": 600000,
    }
    record.update(changes)
    return record


def status(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "instance": "https://ii7.example/kvsp/",
        "epoch": 12,
        "state": "active",
        "running": 18,
        "queued": 3,
        "batch_size": 32,
        "kv_utilization": 0.71,
        "prefill_tokens_per_s": 42000,
        "decode_tokens_per_s": 3100,
        "links": [{"holder": "https://h1.example/kvsp/", "mbit_per_s": 200000, "rtt_us": 12}],
        "requested_state": None,
        "ttl_ms": 3000,
    }
    record.update(changes)
    return record


def checkpoint(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
        "epoch": 1,
        "compat_id": HEX32,
        "scope_id": HEX16,
        "prompt_blocks": [HEX32, HEX32],
        "prompt_tail": [374, 264],
        "generated": [1296, 315, 279],
        "output_offset": 3,
        "sampler": {
            "method": "top-p",
            "params": {"p": 0.9},
            "seed": 7,
            "step": 3,
            "deterministic": False,
        },
    }
    record.update(changes)
    return record


SHARD_MAP = {
    "map": "c3f8e1",
    "version": 4,
    "shards": [
        {"tokens": [0, 32768], "instance": "https://ii1.example/kvsp/"},
        {"tokens": [32768, 65536], "instance": "https://ii2.example/kvsp/"},
        {"tokens": [65536, 98304], "instance": "https://ii3.example/kvsp/"},
    ],
}
PLAN = {
    "map": "c3f8e1",
    "from": 4,
    "to": 5,
    "deadline_ms": 200,
    "retain": [[0, 32768]],
    "fetch": [{"tokens": [32768, 49152], "from": "https://ii2.example/kvsp/"}],
    "release": [],
}
DIRECTIVE = {
    "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10",
    "request_ref": "opaque-value-from-PC",
    "scope_id": HEX16,
    "compat_id": HEX32,
    "blocks": [{"block_key": HEX32, "sources": ["https://h1.example/kvsp/"]}],
    "layer_order": "ascending",
    "deadline_ms": 50,
    "lease_ms": 2000,
}


@pytest.mark.parametrize(
    ("model", "document"),
    [
        (ReplicaRecord, replica()),
        (InstanceStatusRecord, status()),
        (SessionCheckpoint, checkpoint()),
        (ShardMap, SHARD_MAP),
        (ReshardPlan, PLAN),
        (ReshardCommit, {"map": "c3f8e1", "commit": 5}),
        (ReshardAbort, {"map": "c3f8e1", "abort": 5}),
        (PrefetchDirective, DIRECTIVE),
        (
            PrefetchStatus,
            {"directive": DIRECTIVE["directive"], "state": "partial", "loaded": [HEX32]},
        ),
        (
            LookupRequest,
            {
                "scope_id": HEX16,
                "compat_id": HEX32,
                "block_keys": [HEX32],
                "targets": ["https://ii7.example/kvsp/"],
            },
        ),
        (
            LookupResponse,
            {
                "matched": 1,
                "replicas": [[replica()]],
                "estimates": [
                    {"target": "https://ii7.example/kvsp/", "fetch_us": 10.5, "recompute_us": 300}
                ],
            },
        ),
        (
            LeaseRequest,
            {"compat_id": HEX32, "scope_id": HEX16, "block_keys": [HEX32], "ttl_ms": 2000},
        ),
        (LeaseRequest, {"block_keys": [HEX32], "ttl_ms": 2000}),  # KVSP 6.6 as written
        (LeaseGrant, {"lease": "l-1", "ttl_ms": 1000}),
        (LeaseRenewal, {"ttl_ms": 1000}),
        (StateChange, {"state": "sleeping"}),
        (StateAnswer, {"state": "draining"}),
        (
            ReplicaBatch,
            {
                "put": [replica()],
                "delete": [
                    {
                        "compat_id": HEX32,
                        "scope_id": HEX16,
                        "block_key": HEX32,
                        "holder": "https://h1.example/kvsp/",
                    }
                ],
            },
        ),
    ],
)
def test_spec_examples_round_trip_and_ignore_unknown_members(
    model: type[Any], document: dict[str, Any]
) -> None:
    parsed = model.parse({**document, "x_future_member": {"anything": 1}})
    assert "x_future_member" not in parsed.to_json()
    again = model.parse(parsed.to_json())
    assert again == parsed
    wire = {k: v for k, v in document.items() if v is not None}
    assert _normalise(parsed.to_json()) == _normalise(wire)


def _normalise(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_normalise(v) for v in value]
    return value


def _rejects(model: type[Any], document: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        model.parse(document)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {
                "residency": [
                    {"tier": "device", "layers": [0, 2]},
                    {"tier": "host", "layers": [2, 3]},
                ]
            },
            "overlap",
        ),
        ({"residency": [{"tier": "device", "layers": [0, 4]}]}, "outside the block's 4 layers"),
        ({"residency": [{"tier": "device", "layers": [3, 1]}]}, "first <= last"),
        ({"residency": [{"tier": "nvme", "layers": [0, 3]}]}, "tier"),
        ({"residency": []}, "residency"),
        ({"digest": "sha-256:" + "0" * 64}, "concatenated layer digests"),
        ({"layer_digests": [HEX32[:-2] + "AB"]}, "layer_digests"),
        ({"block_key": HEX32[:-1]}, "block_key"),
        ({"scope_id": HEX32}, "scope_id"),
        ({"codec": 9}, "codec 9 is not registered"),
        ({"holder": "ftp://h1.example/"}, "http\\(s\\) URL or a moqt URI"),
        ({"holder": "https:///kvsp/"}, "host"),
        ({"size": "2097152"}, "size"),
        ({"size": 10**30}, "size"),
        ({"ttl_ms": 0}, "ttl_ms"),
        ({"ttl_ms": 1 << 32}, "ttl_ms"),
        ({"moqt_namespace": "AA"}, "only for moqt holders"),
        ({"holder": "moqt://relay.example/"}, "needs moqt_namespace"),
    ],
)
def test_replica_record_rejections(changes: dict[str, Any], message: str) -> None:
    _rejects(ReplicaRecord, replica(**changes), message)


def test_layer_digests_are_optional_and_layers_checkable() -> None:
    record = ReplicaRecord.parse(
        replica(layer_digests=None, residency=[{"tier": "host", "layers": [0, 29]}])
    )
    assert record.layer_digests is None
    record.check_layers(30)
    with pytest.raises(ValueError, match="outside"):
        record.check_layers(16)


def test_holds_layers() -> None:
    record = ReplicaRecord.parse(replica())
    assert record.holds_layers(0, 3)
    assert record.holds_layers(1, 2)
    gap = ReplicaRecord.parse(
        replica(
            layer_digests=None,
            residency=[{"tier": "host", "layers": [0, 1]}, {"tier": "disk", "layers": [3, 3]}],
        )
    )
    assert gap.holds_layers(0, 1)
    assert not gap.holds_layers(0, 3)
    assert gap.holds_layers(3, 3)


def _namespace(fields: list[bytes]) -> str:
    raw = b"".join(bytes([len(f)]) + f for f in fields)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_moqt_holders() -> None:
    fields = [b"kvsp", b"v1", b"compat", b"scope", b"\xff\x00"]
    ns = _namespace(fields)
    record = ReplicaRecord.parse(replica(holder="moqt://relay.example:4443/", moqt_namespace=ns))
    assert decode_moqt_namespace(record.moqt_namespace or "") == tuple(fields)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (_namespace([b"a", b"b", b"c", b"d"]), "5 fields, got 4"),
        (_namespace([b"a"] * 6), "5 fields, got 6"),
        (_namespace([b"a"] * 5) + "=", "without padding"),
        ("AWEBYgFjAWQ+ZQ", "without padding"),
        (
            base64.urlsafe_b64encode(b"\x01a\x01b\x01c\x01d\x05e").rstrip(b"=").decode(),
            "bad length",
        ),
        (base64.urlsafe_b64encode(b"\x00\x01a\x01b\x01c\x01d").rstrip(b"=").decode(), "bad length"),
        ("AWEBYgFjAWQBZR", "canonical"),
    ],
)
def test_moqt_namespace_rejections(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_moqt_namespace(value)
    _rejects(
        ReplicaRecord,
        replica(holder="moqt://relay.example/", moqt_namespace=value),
        "moqt_namespace",
    )


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=6))
def test_residency_accepted_iff_ordered_non_overlapping_and_in_range(
    ranges: list[tuple[int, int]],
) -> None:
    layers = 32
    residency = [{"tier": "host", "layers": [a, b]} for a, b in ranges]
    covered = [layer for a, b in ranges for layer in range(a, b + 1)]
    valid = (
        all(a <= b for a, b in ranges)
        and len(covered) == len(set(covered))
        and all(b < layers for _, b in ranges)
    )
    digests = [hashlib.sha256(bytes([i])).hexdigest() for i in range(layers)]
    document = replica(
        layer_digests=digests,
        digest="sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest(),
        residency=residency,
    )
    if valid:
        ReplicaRecord.parse(document)
    else:
        _rejects(ReplicaRecord, document, "residency")


@given(st.lists(st.integers(1, 50), min_size=1, max_size=6), st.data())
def test_shard_maps_must_be_contiguous_half_open(widths: list[int], data: st.DataObject) -> None:
    bounds = [0]
    for width in widths:
        bounds.append(bounds[-1] + width)
    shards = [
        {"tokens": [bounds[i], bounds[i + 1]], "instance": f"https://ii{i}.example/kvsp/"}
        for i in range(len(widths))
    ]
    ShardMap.parse({"map": "m", "version": 1, "shards": shards})
    broken = [dict(s, tokens=list(s["tokens"])) for s in shards]
    which = data.draw(st.integers(0, len(broken) - 1))
    mutation = data.draw(st.sampled_from(["gap", "overlap", "empty", "reorder"]))
    if mutation == "reorder" and len(broken) < 2:
        mutation = "gap"
    if mutation == "gap":
        broken[which]["tokens"][1] += 1
        if which == len(broken) - 1:
            broken[which]["tokens"][0] += 1
    elif mutation == "overlap":
        broken[which]["tokens"][0] = max(broken[which]["tokens"][0] - 1, 0) if which else 1
    elif mutation == "empty":
        broken[which]["tokens"][1] = broken[which]["tokens"][0]
    else:
        broken[0], broken[1] = broken[1], broken[0]
    with pytest.raises(RecordError):
        ShardMap.parse({"map": "m", "version": 1, "shards": broken})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"epoch": -1}, "epoch"),
        ({"state": "asleep"}, "state"),
        ({"kv_utilization": 1.5}, "kv_utilization"),
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ({"requested_state": "active"}, "requested_state"),
        ({"instance": "not a url"}, "instance"),
        (
            {"links": [{"holder": "https://h1/", "mbit_per_s": 1, "rtt_us": 1}] * 2},
            "one link per holder",
        ),
        ({"queued": 1.5}, "queued"),
    ],
)
def test_status_rejections(changes: dict[str, Any], message: str) -> None:
    _rejects(InstanceStatusRecord, status(**changes), message)


def test_status_links() -> None:
    record = InstanceStatusRecord.parse(status(requested_state="sleeping"))
    assert record.requested_state is InstanceState.SLEEPING
    assert record.link_to("https://h1.example/kvsp/") is not None
    assert record.link_to("https://h2.example/kvsp/") is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"session": "not-a-uuid"}, "UUID"),
        ({"output_offset": 2}, "output_offset"),
        ({"prompt_tail": [2**32]}, "prompt_tail"),
        ({"sampler": {"method": "beam"}}, "method"),
        ({"sampler": {"method": "top-p", "params": {}}}, "needs p"),
        ({"sampler": {"method": "top-p", "params": {"p": 1.5}}}, "p must be"),
        ({"sampler": {"method": "top-k", "params": {"k": 0}}}, "k must be"),
        ({"sampler": {"method": "greedy", "params": {"k": 2}}}, "no parameter k"),
        ({"sampler": {"method": "temperature", "params": {"temperature": 0}}}, "temperature must"),
        ({"sampler": {"method": "top-p", "params": {"p": 0.5}, "deterministic": True}}, "greedy"),
    ],
)
def test_checkpoint_rejections(changes: dict[str, Any], message: str) -> None:
    _rejects(SessionCheckpoint, checkpoint(**changes), message)


def test_session_ids_are_normalised_uuids() -> None:
    upper = str(uuid.uuid4()).upper()
    assert SessionCheckpoint.parse(checkpoint(session=upper)).session == upper.lower()
    assert Sampler.parse({"method": "greedy", "deterministic": True}).deterministic


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"to": 6}, "v to v\\+1"),
        ({"retain": [[0, 40000]]}, "overlap"),
        ({"retain": [[5, 5]]}, "start < end"),
        ({"release": [[0, 10], [5, 20]]}, "overlap"),
    ],
)
def test_reshard_plan_rejections(changes: dict[str, Any], message: str) -> None:
    _rejects(ReshardPlan, {**PLAN, **changes}, message)


def test_reshard_plan_uses_the_from_alias() -> None:
    plan = ReshardPlan.parse(PLAN)
    assert plan.from_ == 4
    assert plan.to_json()["from"] == 4
    assert plan.fetch[0].from_ == "https://ii2.example/kvsp/"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"blocks": DIRECTIVE["blocks"] * 2}, "once"),
        ({"blocks": []}, "blocks"),
        ({"layer_order": "descending"}, "layer_order"),
        ({"blocks": [{"block_key": HEX32, "sources": []}]}, "sources"),
        ({"deadline_ms": 0}, "deadline_ms"),
        ({"deadline_ms": 10**19}, "deadline_ms"),
        ({"lease_ms": 10**19}, "lease_ms"),
    ],
)
def test_prefetch_directive_rejections(changes: dict[str, Any], message: str) -> None:
    _rejects(PrefetchDirective, {**DIRECTIVE, **changes}, message)


def test_lookup_response_lists_records_per_match() -> None:
    _rejects(LookupResponse, {"matched": 2, "replicas": [[replica()]]}, "each matched key")
    _rejects(LookupResponse, {"matched": 1, "replicas": [[]]}, "each matched key")


_ASKED = LookupRequest(scope_id=SCOPE_A, compat_id=COMPAT, block_keys=tuple(keys(0, 1, 2, 3)))
#: what an erring Index Service could answer at a position: the right record, one for another
#: key, another scope, another Compatibility ID
_CHOICES = [
    lambda i: replica_of(i),
    lambda i: replica_of(i + 10),
    lambda i: replica_of(i, scope=SCOPE_B),
    lambda i: replica_of(i, compat_id="0f" * 32),
]


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), max_size=6))
def test_an_answer_is_kept_to_the_keys_asked_and_the_records_that_name_them(
    positions: list[list[int]],
) -> None:
    """Whatever the IS answers, what a client uses is a prefix of the keys asked, each with
    exactly the records that name that key, scope and Compatibility ID."""
    answer = LookupResponse(
        matched=len(positions),
        replicas=tuple(tuple(_CHOICES[c](i) for c in cs) for i, cs in enumerate(positions)),
        estimates=(TargetEstimate(target=H1, fetch_us=1.0, recompute_us=2.0),),
    )
    kept = answer.kept_to(_ASKED)
    expected: list[tuple[ReplicaRecord, ...]] = []
    for i, cs in enumerate(positions[: len(_ASKED.block_keys)]):
        right = tuple(replica_of(i) for c in cs if c == 0)
        if not right:
            break
        expected.append(right)
    assert kept.replicas == tuple(expected)
    assert kept.matched == len(expected)
    assert (kept is answer) == (kept.replicas == answer.replicas)
    assert kept.estimates == (answer.estimates if kept is answer else ())  # they priced the rest


def test_a_compact_answer_is_cut_to_the_keys_asked() -> None:
    holders = (HolderMatch(holder=H1, blocks=6), HolderMatch(holder=H2, blocks=2))
    kept = LookupResponse(matched=6, holders=holders).kept_to(_ASKED)
    assert kept.matched == 4
    assert kept.holders == (HolderMatch(holder=H1, blocks=4), holders[1])
    fitting = LookupResponse(matched=2, holders=holders[1:])
    assert fitting.kept_to(_ASKED) is fitting


def test_lookup_request_bounds_the_key_list() -> None:
    _rejects(
        LookupRequest,
        {"scope_id": HEX16, "compat_id": HEX32, "block_keys": [HEX32] * 65_537},
        "block_keys",
    )


def test_lookup_request_names_each_key_once() -> None:
    _rejects(
        LookupRequest,
        {"scope_id": HEX16, "compat_id": HEX32, "block_keys": [HEX32, HEX32]},
        "appears twice",
    )


def test_every_wire_integer_is_bounded() -> None:
    """Epochs and versions fit 63 bits, durations and counts 32 (docs/api.md)."""
    _rejects(ReshardAbort, {"map": "m", "abort": 10**19}, "abort")
    _rejects(ReshardCommit, {"map": "m", "commit": 1 << 63}, "commit")
    ReshardAbort.parse({"map": "m", "abort": (1 << 63) - 1})


def test_invalid_json_is_a_record_error() -> None:
    with pytest.raises(RecordError, match="ReplicaRecord"):
        ReplicaRecord.parse(b'{"bad json')


def test_a_record_verifies_the_container_it_describes() -> None:
    sections = [
        (np.full((2, 1, 4), i, np.float32), np.full((2, 1, 4), -i, np.float32)) for i in range(3)
    ]
    container = Container.build(0, 2, sections)
    record = ReplicaRecord.parse(
        replica(
            layer_digests=[d.hex() for d in container.layer_digests()],
            digest="sha-256:" + container.digest().hex(),
            residency=[{"tier": "host", "layers": [0, 2]}],
            size=container.size,
        )
    )
    assert record.layer_count == 3
    fetched = Container.parse(container.slice(1, 2).tobytes())
    fetched.verify(record.layer_digest_octets(), record.digest_octets)


@given(
    tokens=st.lists(st.integers(0, 1000), min_size=1, max_size=80),
    block_tokens=st.integers(1, 20),
    generated=st.lists(st.integers(0, 1000), max_size=5),
)
def test_a_checkpoint_holds_a_prompt_as_the_text_writes_it_and_resumes_from_it(
    tokens: list[int], block_tokens: int, generated: list[int]
) -> None:
    blocks, tail, last_block = split_prompt(tokens, block_tokens)
    # KVSP 4.4: every complete block, then only the tokens after the last one
    assert blocks == len(tokens) // block_tokens
    assert len(tail) < block_tokens
    assert blocks * block_tokens + len(tail) == len(tokens)
    assert last_block == (tuple(tokens[-block_tokens:]) if blocks and not tail else None)
    record = SessionCheckpoint.parse(
        checkpoint(
            prompt_blocks=[HEX32] * blocks,
            prompt_tail=list(tail),
            generated=generated,
            output_offset=len(generated),
            last_block=None if last_block is None else list(last_block),
        )
    )
    start, known = record.resume_input(block_tokens)
    # what the engine loads and what it computes make up the prompt and the output so far,
    # and the last known token is always computed (the next token needs its logits)
    assert start <= blocks
    assert known
    assert list(known) == (tokens + generated)[start * block_tokens :]


def test_a_boundary_checkpoint_needs_its_last_block_and_a_tail_is_under_a_block() -> None:
    boundary = SessionCheckpoint.parse(checkpoint(prompt_tail=[], generated=[], output_offset=0))
    with pytest.raises(RecordError, match="last_block"):
        boundary.resume_input(16)
    assert "last_block" not in boundary.to_json()  # absent unless sent
    with pytest.raises(RecordError, match="last_block"):  # of the wrong length
        boundary.model_copy(update={"last_block": (1, 2)}).resume_input(16)
    whole = SessionCheckpoint.parse(checkpoint(prompt_tail=list(range(16))))
    with pytest.raises(RecordError, match="whole block"):
        whole.resume_input(16)
    with pytest.raises(RecordError, match="no prompt"):
        SessionCheckpoint.parse(
            checkpoint(prompt_blocks=[], prompt_tail=[], generated=[], output_offset=0)
        ).resume_input(16)
