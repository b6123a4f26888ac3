"""The reference instance's engine figures under the names vLLM exports, with vLLM's meaning,
so what already reads vLLM pods reads kvsp instances unchanged: the llm-d scheduler's scorers
(``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``),
vLLM's Grafana dashboards, and prefix-cache hit rates taken as ``rate()`` of two counters.

vLLM counts prefix-cache queries and hits in prompt tokens: ``prefix_cache_*`` for its own
pages (here G1 and G2 of this instance), ``external_prefix_cache_*`` for a KV connector's
(here blocks fetched from other holders through the IS). ``EngineCounters`` is the plain
tally (updated on the event loop); ``EngineMetrics`` reads it and the live queue at scrape
time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["EngineCounters", "EngineLoad", "EngineMetrics"]

#: where a reused prompt token came from (``Session.cached``) -> local or external
_LOCAL_TIERS = ("g1", "g2")


@dataclass
class EngineCounters:
    """Prompt and output tokens since start, as vLLM counts them."""

    prompt_tokens: int = 0
    local_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    generation_tokens: int = 0
    finished: int = 0
    preempted: int = 0

    def prompt(self, tokens: int, cached: Mapping[str, int]) -> None:
        """A prompt of ``tokens`` tokens was admitted with ``cached`` tokens reused, by tier.
        What the local pages did not have was asked of the other holders."""
        local = sum(cached.get(tier, 0) for tier in _LOCAL_TIERS)
        self.prompt_tokens += tokens
        self.local_hits += local
        self.external_queries += tokens - local
        self.external_hits += cached.get("remote", 0)

    def finish(self, generated: int, stopped_early: bool) -> None:
        self.generation_tokens += generated
        if stopped_early:
            self.preempted += 1
        else:
            self.finished += 1


@dataclass(frozen=True)
class EngineLoad:
    """The engine's queue and pages at one instant."""

    waiting: int
    running: int
    kv_usage: float


class EngineMetrics(Collector):
    """``vllm:``-named families of one instance, labelled as vLLM labels them
    (``model_name``, ``engine``)."""

    def __init__(
        self, counters: EngineCounters, load: Callable[[], EngineLoad], model_name: str
    ) -> None:
        self._counters = counters
        self._load = load
        self._labels = {"model_name": model_name, "engine": "0"}

    def _family(
        self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, text: str,
        value: float,
    ) -> Metric:  # fmt: skip
        family = kind(name, text, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        c, now = self._counters, self._load()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(
            gauge,
            "vllm:num_requests_running",
            "Requests the engine is advancing (in its batch)",
            now.running,
        )
        yield self._family(
            gauge,
            "vllm:num_requests_waiting",
            "Requests admitted and waiting for their first step",
            now.waiting,
        )
        yield self._family(
            gauge,
            "vllm:kv_cache_usage_perc",
            "KV-cache (engine pages) usage; 1 means 100 percent",
            now.kv_usage,
        )
        yield self._family(
            counter,
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the local prefix cache",
            c.prompt_tokens,
        )
        yield self._family(
            counter,
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the local prefix cache (G1, G2)",
            c.local_hits,
        )
        yield self._family(
            counter,
            "vllm:external_prefix_cache_queries",
            "Prompt tokens asked of other holders",
            c.external_queries,
        )
        yield self._family(
            counter,
            "vllm:external_prefix_cache_hits",
            "Prompt tokens fetched from other holders",
            c.external_hits,
        )
        yield self._family(counter, "vllm:prompt_tokens", "Prompt tokens admitted", c.prompt_tokens)
        yield self._family(
            counter, "vllm:generation_tokens", "Tokens generated", c.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Requests finished, by reason",
            labels=[*self._labels, "finished_reason"],
        )
        success.add_metric([*self._labels.values(), "stop"], c.finished)
        success.add_metric([*self._labels.values(), "abort"], c.preempted)
        yield success
