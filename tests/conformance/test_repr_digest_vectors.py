"""RFC 9530 examples through ``kvsp.core.digests``."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest

from kvsp.core.digests import parse_repr_digest, repr_digest_of, verify_repr_digest
from kvsp.core.problems import DigestError
from tests.conftest import load_vector

DATA = load_vector("rfc9530_repr_digest_examples.json")
EXAMPLES: list[dict[str, Any]] = DATA["examples"]


def _member(example: dict[str, Any], algorithm: str) -> dict[str, Any] | None:
    return next((m for m in example["members"] if m["algorithm"] == algorithm), None)


WITH_SHA256 = [e for e in EXAMPLES if _member(e, "sha-256") and e["representation_hex"]]
WITHOUT_SHA256 = [e for e in EXAMPLES if _member(e, "sha-256") is None]


def _id(e: dict[str, Any]) -> str:
    return f"{e['section']} {e['title']}"


@pytest.mark.parametrize("example", WITH_SHA256, ids=[_id(e) for e in WITH_SHA256])
def test_sha256_examples_verify(example: dict[str, Any]) -> None:
    representation = bytes.fromhex(example["representation_hex"])
    digest = parse_repr_digest(example["field_value"])
    assert digest == hashlib.sha256(representation).digest()
    assert digest.hex() == _member(example, "sha-256")["digest_hex"]  # type: ignore[index]
    verify_repr_digest(example["field_value"], hashlib.sha256(representation).digest())
    with pytest.raises(DigestError):
        verify_repr_digest(example["field_value"], hashlib.sha256(representation + b"x").digest())


@pytest.mark.parametrize("example", WITH_SHA256, ids=[_id(e) for e in WITH_SHA256])
def test_our_field_round_trips(example: dict[str, Any]) -> None:
    representation = bytes.fromhex(example["representation_hex"])
    field = repr_digest_of(representation)
    b64 = base64.b64encode(hashlib.sha256(representation).digest()).decode()
    assert field == f"sha-256=:{b64}:"
    assert parse_repr_digest(field) == hashlib.sha256(representation).digest()


@pytest.mark.parametrize("example", WITHOUT_SHA256, ids=[_id(e) for e in WITHOUT_SHA256])
def test_sha256_is_required(example: dict[str, Any]) -> None:
    with pytest.raises(DigestError, match="no sha-256"):
        parse_repr_digest(example["field_value"])


def test_enough_examples() -> None:
    assert len(WITH_SHA256) >= 15
    assert WITHOUT_SHA256


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("sha-256=RK/0qy18", "Byte Sequence"),  # a Token, not a Byte Sequence
        ("sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg:", "Incorrect padding"),
        ("SHA-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:", "Structured Field"),
        ("sha-256=:YQ==:", "1 octets"),
        ("sha-256=1", "Byte Sequence"),
        ("sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:,", "Structured Field"),
        ("sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:éé", "Structured Field"),
    ],
)
def test_rejections(value: str, reason: str) -> None:
    with pytest.raises(DigestError, match=reason):
        parse_repr_digest(value)


def test_edge_behaviour_matches_recorded_http_sfv() -> None:
    """The recorded http_sfv edge cases: parsed ones yield 32 octets, rejected ones error."""
    for case in DATA["http_sfv_0_9_9_edge_behaviour"]:
        if case["result"] == "parsed" and case["value_types"] == ["bytes"]:
            assert len(parse_repr_digest(case["input"])) == 32
        else:
            with pytest.raises(DigestError):
                parse_repr_digest(case["input"])


def test_missing_field() -> None:
    with pytest.raises(DigestError, match="no Repr-Digest"):
        verify_repr_digest(None, bytes(32))
