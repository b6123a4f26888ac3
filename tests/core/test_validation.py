"""Numbers in query parameters and fields: ASCII digits only, whatever ``str.isdigit`` says;
validation messages stay short however many members are wrong."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.problems import RecordError
from kvsp.core.records import ReplicaBatch
from kvsp.core.validation import MAX_LISTED_ERRORS, decimal


@given(st.integers(0, 10**18 - 1))
def test_every_non_negative_number_reads_back(number: int) -> None:
    assert decimal(str(number)) == number


@given(st.text())
def test_anything_else_is_refused_rather_than_misread(text: str) -> None:
    value = decimal(text)
    if value is not None:
        assert text.isascii()
        assert text.isdigit()
        assert len(text) <= 18
        assert int(text) == value


def test_digits_of_other_scripts_are_not_numbers() -> None:
    for text in ["²", "\u0661", "12³", "", " 1", "1 ", "+1", "-1", "1_000", "1" * 19]:
        assert decimal(text) is None, text


def test_a_batch_of_many_bad_records_is_refused_in_one_short_line() -> None:
    bad = {"block_key": "x", "compat_id": "y", "scope_id": "z"}
    with pytest.raises(RecordError) as refused:
        ReplicaBatch.parse({"put": [bad] * 4096})
    detail = refused.value.detail
    assert detail.startswith("invalid ReplicaBatch: put.0.block_key: ")
    assert detail.count(": ") == MAX_LISTED_ERRORS + 1
    assert detail.endswith(" more")
    assert len(detail) < 1024
