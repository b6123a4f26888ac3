"""Runs of a scenario, one per policy (and per point of a sweep), in worker processes.

A run is fully described by picklable values (the scenario, a ``WorkloadSpec``, the policy's
name and the sweep point), so workers build their own workload (deterministic: the same
requests and Block Keys in every process) instead of receiving millions of keys, and keep it
for their next run. Progress comes back through a queue as simulated requests complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsp.core.problems import ConfigurationError
from kvsp.sim import traces, workload
from kvsp.sim.cluster import Cluster, RequestResult
from kvsp.sim.policies import make_policy
from kvsp.sim.report import summarise
from kvsp.sim.scenario import Scenario

__all__ = ["Run", "RunResult", "WorkloadSpec", "build_workload", "run_all"]


@dataclass(frozen=True)
class WorkloadSpec:
    #: "trace", "agentic" or "shared-prefix"
    kind: str = "trace"
    trace: str | None = None
    copies: int = 1
    rate_scale: float = 1.0
    limit: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class Run:
    policy: str
    #: G1, G2 and holders scaled by this (hit rate against cache size)
    cache_scale: float = 1.0
    #: arrivals this many times faster (TTFT against request rate)
    rate: float = 1.0


@dataclass
class RunResult:
    run: Run
    summary: dict[str, Any]
    results: list[RequestResult]
    hints: dict[str, int]
    #: the simulated requests per second of this run's workload
    offered_per_s: float


_BUILT: dict[tuple[WorkloadSpec, str], list[workload.SimRequest]] = {}


def build_workload(spec: WorkloadSpec, scenario: Scenario) -> list[workload.SimRequest]:
    """The requests of ``spec`` for the scenario's model (kept per process)."""
    key = (spec, scenario.model.compat_id.hex())
    if key in _BUILT:
        return _BUILT[key]
    compat, bt = scenario.model.compat_id, scenario.model.block_tokens
    if spec.kind == "trace":
        if spec.trace is None:
            raise ConfigurationError("a trace workload needs a trace file")
        requests = workload.from_trace(
            traces.load(spec.trace), compat, bt, spec.copies, spec.rate_scale, spec.limit
        )
    elif spec.kind == "agentic":
        requests = workload.agentic(compat, bt, tenants=spec.copies, seed=spec.seed)
    elif spec.kind == "shared-prefix":
        requests = workload.shared_prefix(compat, bt, seed=spec.seed)
    else:
        raise ConfigurationError(f"unknown workload {spec.kind!r}")
    if spec.kind != "trace":
        requests = _rescale(requests, spec.rate_scale)[: spec.limit]
    _BUILT.clear()  # one workload at a time: they can be large
    _BUILT[key] = requests
    return requests


def _rescale(requests: list[workload.SimRequest], rate: float) -> list[workload.SimRequest]:
    if rate == 1.0:
        return requests
    return [dataclasses.replace(r, arrival_ms=r.arrival_ms / rate) for r in requests]


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """A run allocates millions of long-lived objects (records, keys, heaps) and no cycles:
    the collector looks less often and skips what existed before the run (about 10 % of a
    large run's time otherwise)."""
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _one(
    scenario: Scenario,
    spec: WorkloadSpec,
    run: Run,
    report: Callable[[int], None] | None,
) -> RunResult:
    requests = _rescale(build_workload(spec, scenario), run.rate)
    if run.cache_scale != 1.0:
        scenario = scenario.with_sizes(run.cache_scale)
    mean_prompt = float(np.mean([r.prompt_tokens for r in requests]))
    cluster = Cluster(scenario, make_policy(run.policy), mean_prompt)
    started = time.perf_counter()
    with _few_collections():
        results = cluster.run(requests, report)
    wall = time.perf_counter() - started
    span_s = (requests[-1].arrival_ms - requests[0].arrival_ms) / 1e3 if requests else 0.0
    summary = summarise(results, scenario.controller.ttft_slo_ms, wall)
    summary["failovers"] = cluster.counters.failovers
    summary["uncached_blocks"] = cluster.counters.uncached_blocks
    return RunResult(
        run, summary, results, dict(cluster.counters.hints), len(requests) / max(span_s, 1e-9)
    )


def _worker(
    scenario: Scenario, spec: WorkloadSpec, run: Run, progress: Any, index: int
) -> RunResult:
    last = [0]

    def report(done: int) -> None:
        progress.put((index, done - last[0]))
        last[0] = done

    return _one(scenario, spec, run, report)


def run_all(
    scenario: Scenario,
    spec: WorkloadSpec,
    runs: Sequence[Run],
    jobs: int | None = None,
    advance: Callable[[int], None] | None = None,
) -> list[RunResult]:
    """Every run, ``jobs`` at a time (default: one per CPU), in the order given; ``advance``
    is called with the number of requests simulated since its last call."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(runs)))
    if jobs == 1:
        out = []
        for run in runs:
            seen = [0]

            def report(done: int, seen: list[int] = seen) -> None:
                if advance is not None:
                    advance(done - seen[0])
                seen[0] = done

            out.append(_one(scenario, spec, run, report))
        return out
    context = multiprocessing.get_context("fork")
    with context.Manager() as manager, ProcessPoolExecutor(jobs, mp_context=context) as pool:
        progress = manager.Queue()
        futures = [
            pool.submit(_worker, scenario, spec, run, progress, i) for i, run in enumerate(runs)
        ]
        while not all(f.done() for f in futures):
            try:
                _, step = progress.get(timeout=0.2)
            except queue.Empty:
                continue
            if advance is not None:
                advance(step)
        while not progress.empty() and advance is not None:
            advance(progress.get()[1])
        return [f.result() for f in futures]
