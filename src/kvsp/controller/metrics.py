"""The controller's Prometheus metrics, in their own registry (docs/operations.md lists them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["ControllerMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.placements = Counter(
            "kvsp_controller_placements", "Placement decisions, by outcome", ["outcome"], registry=r
        )
        self.predicted_ttft = Histogram(
            "kvsp_controller_predicted_ttft_seconds",
            "cost(i) of the chosen instance: predicted time to first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.measured_ttft = Histogram(
            "kvsp_controller_measured_ttft_seconds",
            "Time to first token reported for placed requests",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.ttft_ratio = Histogram(
            "kvsp_controller_ttft_measured_over_predicted",
            "Measured TTFT / predicted cost(i), per reported decision",
            buckets=(0.25, 0.5, 0.8, 0.9, 1.1, 1.25, 2, 4, 8),
            registry=r,
        )
        self.failovers = Counter(
            "kvsp_controller_failovers", "Sessions resumed elsewhere", ["result"], registry=r
        )
        self.reshard_results = Counter(
            "kvsp_controller_reshards", "Reshards, by result", ["result"], registry=r
        )
        self.prefetches = Counter(
            "kvsp_controller_prefetches", "Prefetch directives, by final state", ["state"],
            registry=r,
        )  # fmt: skip
        self.hint_outcomes = Counter(
            "kvsp_controller_hints", "KvHint actions sent, by action and outcome",
            ["action", "outcome"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "kvsp_controller_rejected_requests",
            "Requests answered with a problem",
            ["type"],
            registry=r,
        )
