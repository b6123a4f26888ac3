"""Link estimates: every transfer counts, even those that ran at the same time."""

from __future__ import annotations

import pytest

from kvsp.instance.links import UNMEASURED_RTT_US, LinkEstimates


def test_the_first_transfer_sets_the_rate_and_later_ones_are_averaged() -> None:
    links = LinkEstimates()
    assert not links.knows("h")
    links.round_trip("h", 50.0)
    assert list(links) == []  # no transfer yet: nothing to report
    links.transfer("h", 1_000_000, 0.008)  # 1,000 Mbit/s
    assert list(links) == [("h", pytest.approx(1_000.0), 50.0)]
    links.transfer("h", 1_000_000, 0.004)  # 2,000 Mbit/s
    ((_, rate, rtt),) = links
    assert rate == pytest.approx(0.7 * 1_000 + 0.3 * 2_000)
    assert rtt == 50.0


def test_concurrent_transfers_each_count_none_overwrites_another() -> None:
    # two fetches started together: each applies its measurement when it completes, reading
    # the estimate as it is then (the old code read it before the await and lost one)
    links = LinkEstimates()
    links.transfer("h", 1_000_000, 0.008)
    for seconds in (0.004, 0.002):
        links.transfer("h", 1_000_000, seconds)
    ((_, rate, rtt),) = links
    assert rate == pytest.approx(0.7 * (0.7 * 1_000 + 0.3 * 2_000) + 0.3 * 4_000)
    assert rtt == UNMEASURED_RTT_US  # never measured
