"""The quotas file: defaults, per scope, sizes, and its round trip."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.problems import ConfigurationError
from kvsp.quotas import Quota, Quotas, parse_octets

SCOPE = "ab" * 16


def test_a_scope_has_its_own_quota_over_the_default() -> None:
    quotas = Quotas.parse(
        '[quota]\nleased_octets = "256M"\nleases = 10\n'
        f'[scopes.{SCOPE}]\nstored_octets = "1G"\nleases = 3\n'
    )
    assert quotas.of(SCOPE) == Quota(1 << 30, 256 << 20, 3)
    assert quotas.of("cd" * 16) == Quota(leased_octets=256 << 20, leases=10)
    assert quotas.limit("cd" * 16, "stored_octets", 7) == 7  # the service's own default
    assert Quotas.load(None).of(SCOPE) == Quota()


@pytest.mark.parametrize(
    "text",
    [
        "[quota]\nstored = 1\n",  # an unknown quota
        "[quota]\nleases = -1\n",
        "[quota]\nleases = true\n",
        '[quota]\nleases = "3M"\n',  # a count is no size
        "[scopes.nothex]\nleases = 1\n",
        "[other]\n",
        "not toml [",
    ],
)
def test_a_bad_quotas_file_is_a_configuration_error(text: str) -> None:
    with pytest.raises(ConfigurationError):
        Quotas.parse(text)


optional = st.none() | st.integers(0, 1 << 40)


@given(
    st.builds(Quota, optional, optional, optional, optional, optional),
    st.dictionaries(
        st.text("0123456789abcdef", min_size=32, max_size=32),
        st.builds(Quota, optional, optional, optional, optional, optional),
        max_size=4,
    ),
)
def test_the_quotas_file_round_trips(default: Quota, scopes: dict[str, Quota]) -> None:
    quotas = Quotas(default, scopes)
    again = Quotas.parse(quotas.to_toml())
    assert again.default == quotas.default
    for scope in scopes:
        assert again.of(scope) == quotas.of(scope)


def test_sizes() -> None:
    assert [parse_octets(t) for t in ("1024", "2K", "3M", "1G", "1TiB")] == [
        1024, 2048, 3 << 20, 1 << 30, 1 << 40,
    ]  # fmt: skip
    with pytest.raises(ConfigurationError):
        parse_octets("12 bytes")
