"""RFC 4231 HMAC-SHA-256 cases through the keyed-template path the Block Key chain uses."""

from __future__ import annotations

import pytest

from kvsp.core.keys import HmacTemplate
from tests.conftest import load_vector

CASES = load_vector("rfc4231_hmac_sha256.json")["cases"]


def _expected(case: dict[str, object]) -> tuple[str, int]:
    if "hmac_sha256_hex" in case:
        return str(case["hmac_sha256_hex"]), 32
    return str(case["hmac_sha256_truncated_128_hex"]), 16


@pytest.mark.parametrize("case", CASES, ids=[f"case-{c['test_case']}" for c in CASES])
@pytest.mark.parametrize("split", [0, 1, 7])
def test_rfc4231_case(case: dict[str, object], split: int) -> None:
    key = bytes.fromhex(str(case["key_hex"]))
    data = bytes.fromhex(str(case["data_hex"]))
    expected, octets = _expected(case)
    template = HmacTemplate(key, data[:split])
    assert template.digest(data[split:])[:octets].hex() == expected
    # the template is reusable, and a message may come in several parts
    assert template.digest(data[split : split + 3], data[split + 3 :])[:octets].hex() == expected


def test_all_seven_cases_present() -> None:
    assert sorted(int(str(c["test_case"])) for c in CASES) == [1, 2, 3, 4, 5, 6, 7]
