"""Simulated against real on this machine. Prints one JSON line.

The same requests go to real SmolLM2 instances (a ``kvsp up`` cluster: Index Service, holder
with offload, two instances on the CPU, one thread each) and to the simulator (``cpu-smollm2-2``
scenario, each request on the same instance through ``policies.Replay``). The simulator's
parameters come from the real run: the per-request overhead, the prefill rate and the attention
cost per token pair are fitted to the cold prompts (TTFT = overhead + n / rate + pair cost x
n^2 / 2, least relative squares); the link rate and round trip are what the instances measured
(their Instance Status Records), and the link rate is also the instance's ingress: it fetches
from several sources at once, but verifies every digest on its one receiving thread. Requests
go one at a time, so neither side queues. The workload: cold prompts of 16 to 1,536 tokens,
continuations that reuse their prefix from the instance's own pool, and continuations sent to
the other instance, which fetches the prefix through the Index Service.

Figures: per request, real and simulated TTFT and cached tokens; per kind of request, the
median real and simulated TTFT over the rounds (and the real range); the largest relative
error among cold prefills, local reuse and remote reuse; ``ratio`` = the largest error over the
20 % limit (<= 1 holds).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvsp.core.keys import block_keys
from kvsp.local import TENANT, LocalCluster
from kvsp.sim.cluster import Cluster
from kvsp.sim.policies import Replay
from kvsp.sim.scenario import HolderSpec, LinkSpec, load_scenario
from kvsp.sim.workload import SimRequest, tenant_scope_key

LIMIT = 0.20
RNG = np.random.default_rng(7)


def prompt(n: int) -> list[int]:
    return [int(t) for t in RNG.integers(100, 40_000, n)]


#: the workload is sent this many times (fresh prompts each time); each request's real and
#: simulated TTFTs are compared by their medians, as single real runs vary by +-20 % here
ROUNDS = 3


def one_round() -> list[tuple[str, str, int, list[int]]]:
    """(name, kind, instance, tokens) of every request of one round."""
    a, b, c, d = prompt(256), prompt(512), prompt(1024), prompt(1536)
    return [
        ("cold 16", "cold", 0, prompt(16)),
        ("cold 16", "cold", 1, prompt(16)),
        ("cold 256", "cold", 0, a),
        ("cold 512", "cold", 0, b),
        ("cold 1024", "cold", 1, c),
        ("cold 1536", "cold", 0, d),
        ("1024 cached + 64, same instance", "local", 1, c + prompt(64)),
        ("256 cached + 32, same instance", "local", 0, a + prompt(32)),
        ("1536 fetched + 64, other instance", "remote", 1, d + prompt(64)),
        ("512 fetched + 128, other instance", "remote", 1, b + prompt(128)),
        ("256 fetched + 16, other instance", "remote", 1, a + prompt(16)),
    ]


WORKLOAD = [request for _ in range(ROUNDS) for request in one_round()]


def generate(http: httpx.Client, url: str, token: str, tokens: list[int]) -> dict[str, Any]:
    body = {"tenant": TENANT, "tokens": tokens, "max_tokens": 1}
    started = time.perf_counter()
    ttft = None
    summary: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {token}"}
    with http.stream("POST", url + "generate", json=body, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            doc = json.loads(line)
            if doc.get("done"):
                summary = doc
            elif ttft is None:
                ttft = time.perf_counter() - started
    return {"ttft_ms": round(1e3 * (ttft or 0.0), 1), "cached": summary["cached_tokens"]}


def run_real(cluster: LocalCluster) -> tuple[list[dict[str, Any]], tuple[float, int] | None]:
    urls = [p.url for p in cluster.instance_processes]
    token = (cluster.folder / "controller.token").read_text().strip()
    rows: list[dict[str, Any]] = []
    with httpx.Client(timeout=300) as http:
        for url in urls:  # first requests pay one-time costs: not measured
            generate(http, url, token, prompt(64))
        started = time.perf_counter()
        for name, kind, instance, tokens in WORKLOAD:
            arrival = 1e3 * (time.perf_counter() - started)
            row = {"name": name, "kind": kind, "instance": instance, "tokens": len(tokens)}
            row.update(generate(http, urls[instance], token, tokens))
            rows.append({**row, "arrival_ms": round(arrival, 1)})
        links, rtts = [], []
        for url in urls:
            for link in http.get(url + "status").json()["links"]:
                links.append(link["mbit_per_s"])
                rtts.append(link["rtt_us"])
    measured = (statistics.median(links), int(statistics.median(rtts))) if links else None
    return rows, measured


def main() -> None:
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="kvsp-simval-")), instances=2)
    cluster.start()
    try:
        rows, links = run_real(cluster)
    finally:
        cluster.stop()
    cold = [r for r in rows if r["kind"] == "cold"]
    n = np.array([r["tokens"] for r in cold], dtype=float)
    terms = np.vstack([np.ones_like(n), n, n * n / 2]).T  # overhead, per token, per pair
    ttft = np.array([r["ttft_ms"] for r in cold])
    # relative residuals: a 16-token prompt's error counts as much as a 1,536-token one's
    (overhead, per_token, per_pair), *_ = np.linalg.lstsq(
        terms / ttft[:, None], np.ones_like(ttft), rcond=None
    )
    base = load_scenario("cpu-smollm2-2")
    link, rtt = links or (base.links.mbit_per_s, base.links.rtt_us)
    scenario = dataclasses.replace(
        base,
        instances=dataclasses.replace(
            base.instances,
            prefill_tokens_per_s=1e3 / per_token,
            attention_ns_per_pair=max(per_pair * 1e6, 0.0),
            overhead_ms=max(overhead, 0.0),
            ingress_mbit_per_s=link,
        ),
        links=LinkSpec(mbit_per_s=link, rtt_us=rtt),
        holders=HolderSpec(count=1, blocks=4096, read_mbit_per_s=base.holders.read_mbit_per_s),
    )
    compat = scenario.model.compat_id
    requests = []
    for n, (_, _, instance, tokens) in enumerate(WORKLOAD):
        keys = [k.hex() for k in block_keys(tenant_scope_key(0), compat, tokens, 16)]
        # one at a time in both: a simulated request that runs longer than the real one must
        # not delay the next (one minute apart)
        requests.append(SimRequest(n * 60_000, 0, f"r{n}", keys, len(tokens), 1, instance=instance))
    simulated = sorted(Cluster(scenario, Replay(), 512).run(requests), key=lambda r: r.arrival_us)
    for row, sim in zip(rows, simulated, strict=True):
        row["sim_ttft_ms"] = round(sim.ttft_us / 1e3, 1)
        row["sim_cached"] = sim.reused_tokens
        row["sim_fetched_octets"] = sim.fetched_octets
    compared: dict[str, dict[str, Any]] = {}
    for name, kind, _, _ in WORKLOAD[: len(WORKLOAD) // ROUNDS]:
        same = [r for r in rows if r["name"] == name]
        real = statistics.median(r["ttft_ms"] for r in same)
        sim = statistics.median(r["sim_ttft_ms"] for r in same)
        compared[name] = {
            "kind": kind,
            "real_ttft_ms": real,
            "sim_ttft_ms": sim,
            "real_range_ms": [min(r["ttft_ms"] for r in same), max(r["ttft_ms"] for r in same)],
            "error": round(abs(sim - real) / real, 3),
        }
    errors: dict[str, list[float]] = {"cold": [], "local": [], "remote": []}
    for figures in compared.values():
        errors[figures["kind"]].append(figures["error"])
    worst = max(max(e) for e in errors.values())
    print(
        json.dumps(
            {
                "benchmark": "sim_validation",
                "fitted": {
                    "prefill_tokens_per_s": round(1e3 / per_token, 1),
                    "attention_ns_per_pair": round(per_pair * 1e6),
                    "overhead_ms": round(overhead, 1),
                },
                "links": {"mbit_per_s": link, "rtt_us": rtt, "measured": links is not None},
                "compared": compared,
                "requests": rows,
                **{f"max_error_{kind}": max(e) for kind, e in errors.items()},
                "limit": LIMIT,
                "ratio": round(worst / LIMIT, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
