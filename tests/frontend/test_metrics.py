"""The figures operators read, checked against what the requests really did on a running
cluster: the front end's per-tenant TTFT, inter-token and cached-token series, the instance's
``vllm:`` series (the llm-d scheduler's and vLLM dashboards' names) and the IS's hit counters."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsp.local import LocalCluster

pytestmark = pytest.mark.slow


def scrape(http: httpx.Client, url: str, token: str) -> dict[tuple[str, tuple[Any, ...]], float]:
    """Every sample of ``GET metrics``, by name and sorted labels."""
    text = http.get(url + "metrics", headers={"authorization": f"Bearer {token}"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, tuple[Any, ...]], float], name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
    )


def test_the_series_count_what_the_requests_did(operated_cluster: Any) -> None:
    up: LocalCluster = operated_cluster
    tenant = next(iter(up.api_keys))
    instance, controller = up.instance_processes[0].url, up.controller.url
    prompt = "Count the words of this long sentence about caches, pages and blocks, twice. " * 4
    with httpx.Client(timeout=120) as http:
        before_front = scrape(http, controller, up.metrics_token)
        before_engine = scrape(http, instance, up.metrics_token)
        usages = []
        for _ in range(3):
            answer = http.post(
                up.frontend.url + "v1/completions",
                json={"model": "x", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                      "stream": True},
                headers={"authorization": f"Bearer {up.api_keys[tenant]}"},
            )  # fmt: skip
            chunks = [line for line in answer.text.splitlines() if line.startswith("data: {")]
            usages.append(httpx.Response(200, content=chunks[-1][6:]).json()["usage"])
        front = scrape(http, controller, up.metrics_token)
        engine = scrape(http, instance, up.metrics_token)

    def grew(now: dict[Any, float], then: dict[Any, float], name: str, **labels: str) -> float:
        return value(now, name, **labels) - value(then, name, **labels)

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert cached > 0  # the second and third requests reuse the first's blocks
    t = {"tenant": tenant}
    assert grew(front, before_front, "kvsp_frontend_prompt_tokens_total", **t) == prompt_tokens
    assert grew(front, before_front, "kvsp_frontend_cached_prompt_tokens_total", **t) == cached
    assert grew(front, before_front, "kvsp_frontend_generation_tokens_total", **t) == generated
    assert grew(front, before_front, "kvsp_frontend_time_to_first_token_seconds_count", **t) == 3
    assert (
        grew(front, before_front, "kvsp_frontend_inter_token_latency_seconds_count", **t)
        == generated - 3
    )
    ended = grew(front, before_front, "kvsp_frontend_requests_total", **t)
    assert ended == 3
    # the instance's vllm: series, with vLLM's meaning (prompt tokens; local pages' hits)
    model = {"model_name": "smollm2-135m-instruct"}
    assert grew(engine, before_engine, "vllm:prefix_cache_queries_total", **model) == prompt_tokens
    assert grew(engine, before_engine, "vllm:prefix_cache_hits_total", **model) == cached
    assert grew(engine, before_engine, "vllm:prompt_tokens_total", **model) == prompt_tokens
    assert grew(engine, before_engine, "vllm:generation_tokens_total", **model) == generated
    assert grew(engine, before_engine, "vllm:request_success_total", **model) == 3
    assert value(engine, "vllm:num_requests_running", **model) == 0
    assert value(engine, "vllm:num_requests_waiting", **model) == 0
    assert 0 <= value(engine, "vllm:kv_cache_usage_perc", **model) <= 1
