"""The links an instance reports (KVSP 6.4: ``mbit_per_s`` and ``rtt_us`` per holder), pure.

The rate is an exponential average of the transfers' rates (each new one weighs 0.3); the round
trip is measured once per holder. Each measurement is applied in one step once it is complete,
reading the estimate as it is then: fetches that run at the same time each count, none
overwrites another's with a value read before its await.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["LinkEstimates"]

#: what a new transfer weighs in the rate
WEIGHT = 0.3
#: the round trip assumed until one is measured (µs)
UNMEASURED_RTT_US = 200.0


class LinkEstimates:
    def __init__(self) -> None:
        #: holder -> (rate in Mbit/s, 0.0 before a transfer; round trip in µs)
        self._links: dict[str, tuple[float, float]] = {}

    def knows(self, holder: str) -> bool:
        return holder in self._links

    def round_trip(self, holder: str, rtt_us: float) -> None:
        rate, _ = self._links.get(holder, (0.0, rtt_us))
        self._links[holder] = (rate, rtt_us)

    def transfer(self, holder: str, octets: int, seconds: float) -> None:
        """``octets`` arrived from ``holder`` in ``seconds``."""
        rate = 8 * octets / max(seconds, 1e-6) / 1e6
        old_rate, rtt = self._links.get(holder, (0.0, UNMEASURED_RTT_US))
        averaged = rate if old_rate == 0.0 else (1 - WEIGHT) * old_rate + WEIGHT * rate
        self._links[holder] = (averaged, rtt)

    def __iter__(self) -> Iterator[tuple[str, float, float]]:
        """(holder, Mbit/s, round trip µs) for every holder with a transfer measured."""
        for holder, (rate, rtt) in self._links.items():
            if rate > 0.0:
                yield holder, rate, rtt
