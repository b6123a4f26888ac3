"""Simulated against real on this machine. Prints one JSON line.

The same requests go through a real cluster (``kvsp up``: Index Service, controller with its
front end, holder, two SmolLM2 instances on the CPU) and through the simulator with the
``cpu-smollm2-2`` scenario, whose rates are replaced by what the real instances measured (their
Instance Status Records: link rate and round trip; the prefill rate from the first cold prompt)
and whose per-request overhead is measured with 16-token requests. The workload: cold prompts
of several lengths, continuations that reuse a prefix on the instance that holds it, and a
continuation sent while that instance is busy, which the controller places on the other
instance with the prefix fetched from the holder.

Figures: per request, real and simulated TTFT; the largest relative error among cold prefills
and among reusing requests; ``ratio`` = the largest error over the 20 % limit (<= 1 holds).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvsp.core.keys import block_keys
from kvsp.local import LocalCluster
from kvsp.sim.cluster import Cluster
from kvsp.sim.policies import make_policy
from kvsp.sim.scenario import HolderSpec, LinkSpec, load_scenario
from kvsp.sim.workload import SimRequest, tenant_scope_key

LIMIT = 0.20
RNG = np.random.default_rng(7)


def prompt(n: int) -> list[int]:
    return [int(t) for t in RNG.integers(100, 40_000, n)]


P, Q, R = prompt(1024), prompt(1536), prompt(512)
TAIL_A, TAIL_B, TAIL_C = prompt(64), prompt(128), prompt(96)
#: (name, prompt, kind, sent with the next one without waiting for it)
WORKLOAD: list[tuple[str, list[int], str, bool]] = [
    ("cold 1024 (calibrates the prefill rate)", P, "calibration", False),
    ("cold 512", R, "cold", False),
    ("cold 1536 (busy)", Q, "cold", True),
    ("prefix 1024 + 64 while its instance is busy", P + TAIL_A, "reuse", False),
    ("prefix 1536 + 128", Q + TAIL_B, "reuse", False),
    ("prefix 512 + 96", R + TAIL_C, "reuse", False),
    ("prefix 1088 + 128", P + TAIL_A + TAIL_B, "reuse", False),
]


def complete(http: httpx.Client, base: str, key: str, tokens: list[int]) -> dict[str, Any]:
    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0, "stream": True}
    started = time.perf_counter()
    ttft = None
    final: dict[str, Any] = {}
    with http.stream(
        "POST", base + "/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if "usage" in doc:
                final = doc
            elif ttft is None:
                ttft = time.perf_counter() - started
    return {
        "ttft_ms": 1e3 * (ttft or 0.0),
        "cached": final["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def run_real(cluster: LocalCluster) -> tuple[list[dict[str, Any]], float]:
    base = cluster.controller.url + "v1"
    key = cluster.api_key
    out: list[dict[str, Any]] = []
    with httpx.Client(timeout=300) as http:
        warm = [complete(http, base, key, prompt(16)) for _ in range(4)]
        overhead = statistics.median(w["ttft_ms"] for w in warm[1:])
        t0 = time.perf_counter()
        pending: list[threading.Thread] = []
        for name, tokens, kind, overlap in WORKLOAD:
            row: dict[str, Any] = {"name": name, "kind": kind, "tokens": len(tokens)}
            row["arrival_ms"] = 1e3 * (time.perf_counter() - t0)

            def go(row: dict[str, Any] = row, tokens: list[int] = tokens) -> None:
                row.update(complete(http, base, key, tokens))

            thread = threading.Thread(target=go)
            thread.start()
            pending.append(thread)
            out.append(row)
            if overlap:
                time.sleep(0.3)  # its prefill has started: the instance is busy
                continue
            for thread in pending:
                thread.join()
            pending = []
    return out, overhead


def measured_links(cluster: LocalCluster) -> tuple[float, int]:
    """The median rate and RTT of the links the instances measured (to the holder and to each
    other), as their Instance Status Records report them."""
    links, rtts = [], []
    for process in cluster.instance_processes:
        status = httpx.get(process.url + "status", timeout=10).json()
        for link in status["links"]:
            links.append(link["mbit_per_s"])
            rtts.append(link["rtt_us"])
    return statistics.median(links), int(statistics.median(rtts))


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvsp-simval-"))
    cluster = LocalCluster(folder, instances=2)
    cluster.start()
    try:
        rows, overhead_ms = run_real(cluster)
        link, rtt = measured_links(cluster)
    finally:
        cluster.stop()
    # the first cold prompt calibrates the one prefill rate the model has; the rest validate it
    rate = rows[0]["tokens"] / ((rows[0]["ttft_ms"] - overhead_ms) / 1e3)
    base = load_scenario("cpu-smollm2-2")
    scenario = dataclasses.replace(
        base,
        instances=dataclasses.replace(
            base.instances, prefill_tokens_per_s=rate, overhead_ms=overhead_ms
        ),
        links=LinkSpec(mbit_per_s=link, rtt_us=rtt),
        holders=HolderSpec(count=1, blocks=4096, read_mbit_per_s=base.holders.read_mbit_per_s),
    )
    compat = scenario.model.compat_id
    requests = []
    for n, (row, (_, tokens, _, _)) in enumerate(zip(rows, WORKLOAD, strict=True)):
        keys = [k.hex() for k in block_keys(tenant_scope_key(0), compat, tokens, 16)]
        requests.append(SimRequest(row["arrival_ms"], 0, f"r{n}", keys, len(tokens), 1))
    cluster_sim = Cluster(
        scenario, make_policy("kvsp"), statistics.mean(len(w[1]) for w in WORKLOAD)
    )
    simulated = sorted(cluster_sim.run(requests), key=lambda r: r.arrival_us)
    errors: dict[str, list[float]] = {"calibration": [], "cold": [], "reuse": []}
    for row, sim in zip(rows, simulated, strict=True):
        row["sim_ttft_ms"] = round(sim.ttft_us / 1e3, 1)
        row["sim_cached"] = sim.reused_tokens
        row["sim_fetched_octets"] = sim.fetched_octets
        row["ttft_ms"] = round(row["ttft_ms"], 1)
        row["arrival_ms"] = round(row["arrival_ms"], 1)
        error = abs(row["sim_ttft_ms"] - row["ttft_ms"]) / row["ttft_ms"]
        row["error"] = round(error, 3)
        errors[row["kind"]].append(error)
    worst = max(errors["cold"] + errors["reuse"])
    print(
        json.dumps(
            {
                "benchmark": "sim_validation",
                "measured": {
                    "prefill_tokens_per_s": round(rate, 1),
                    "link_mbit_per_s": link,
                    "rtt_us": rtt,
                    "overhead_ms": round(overhead_ms, 1),
                },
                "requests": rows,
                "max_error_cold": round(max(errors["cold"]), 3),
                "max_error_reuse": round(max(errors["reuse"]), 3),
                "limit": LIMIT,
                "ratio": round(worst / LIMIT, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
