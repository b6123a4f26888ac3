"""What the front end measures per tenant, as the client sees it: time to first token and
between tokens (histograms with vLLM's buckets, so vLLM's dashboards' quantile queries carry
over), prompt tokens and how many of them were cached (counters: a tenant's hit rate is
``rate(cached) / rate(prompt)``), tokens generated, and requests by how they ended.

Tenants label the series: they are the configured ones (a bounded set), never a client's
string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["FrontEndMetrics"]

#: vLLM's buckets for ``vllm:time_to_first_token_seconds``
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
#: vLLM's buckets for ``vllm:inter_token_latency_seconds``
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


@dataclass
class FrontEndMetrics:
    """The front end's families, in ``registry`` (the controller's when served with it)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r, tenant = self.registry, ["tenant"]
        self.ttft = Histogram(
            "kvsp_frontend_time_to_first_token_seconds",
            "From the request's arrival to its first token, per tenant",
            tenant, buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "kvsp_frontend_inter_token_latency_seconds",
            "Between one token and the next of a stream, per tenant",
            tenant, buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvsp_frontend_prompt_tokens", "Prompt tokens of placed requests, per tenant",
            tenant, registry=r,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "kvsp_frontend_cached_prompt_tokens",
            "Prompt tokens whose KV was reused, not computed, per tenant",
            tenant, registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "kvsp_frontend_generation_tokens", "Tokens delivered, per tenant", tenant, registry=r
        )
        self.requests = Counter(
            "kvsp_frontend_requests",
            "Requests by how they ended (stop, length, error, abandoned), per tenant",
            ["tenant", "finish_reason"], registry=r,
        )  # fmt: skip

    def turn(
        self, tenant: str, prompt: int, cached: int, generated: int, finish_reason: str
    ) -> None:
        """One request is over."""
        self.prompt_tokens.labels(tenant).inc(prompt)
        self.cached_tokens.labels(tenant).inc(cached)
        self.generation_tokens.labels(tenant).inc(generated)
        self.requests.labels(tenant, finish_reason).inc()
