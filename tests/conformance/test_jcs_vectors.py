"""RFC 8785 reference data through kvsp's one canonicalisation path (``canonical_json``)."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from kvsp.core.compat import canonical_json
from tests.conftest import load_vector

CASES = load_vector("jcs_testdata.json")["cases"]
NUMBERS = load_vector("jcs_es6_numbers_first10000.json")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reference_case(case: dict[str, str]) -> None:
    got = canonical_json(json.loads(case["input_utf8"]))
    assert got == bytes.fromhex(case["expected_canonical_hex"])
    assert got.decode("utf-8") == case["expected_canonical_utf8"]
    assert hashlib.sha256(got).hexdigest() == case["expected_sha256_hex_of_canonical"]


def test_first_10000_es6_numbers() -> None:
    lines = NUMBERS["first_10000_lines"]
    assert len(lines) == 10_000
    mismatches = []
    for bits, expected in lines:
        value = struct.unpack(">d", int(bits, 16).to_bytes(8, "big"))[0]
        got = canonical_json(value).decode("ascii")
        if got != expected:
            mismatches.append((bits, expected, got))
    assert mismatches == []


def test_number_lines_reproduce_upstream_table() -> None:
    """The vector file itself is the upstream prefix the table hashes (guards the data)."""
    row = next(r for r in NUMBERS["upstream_sha256_table"] if r["lines"] == 10_000)
    text = "".join(f"{bits},{expected}\n" for bits, expected in NUMBERS["first_10000_lines"])
    assert hashlib.sha256(text.encode("ascii")).hexdigest() == row["sha256"]
    assert len(text) == row["bytes"]
