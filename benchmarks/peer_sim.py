"""The simulator's hit rates against NVIDIA Dynamo's mocker replaying the same trace
(``dynamo._core.run_mocker_trace_replay``, ai-dynamo-runtime 1.6.1), as a cross-check. Prints
one JSON line.

Both replay the first ``REQUESTS`` requests of data/traces/conversation_trace.jsonl (a Mooncake
trace: 512-token hash ids, expanded by both into 16-token blocks; outputs cut to 8 tokens) on
``WORKERS`` workers with the same device pool each (``G1_BLOCKS`` blocks of 16 tokens, LRU), no
host tier and no holders, routed round robin and by prefix overlap (kvsp's ``overlap`` policy,
Dynamo's ``kv_router``). The figure is the share of prompt tokens served from cache: kvsp's
``hit_rate``, Dynamo's ``prefix_cache_reused_ratio``. Round robin makes the routing the same in
both, so its two figures should agree closely (the timing models differ: a request still
prefilling holds its blocks for a different time); for overlap routing both are printed with the
ratio, kvsp's other policies beside them. ``agree``: the round-robin figures within 10 % of each
other.

Needs ``make peer-deps`` (``make bench-peers`` runs it).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._peers import ROOT, PeerDriver
from kvsp.sim.runner import Run, WorkloadSpec, run_all
from kvsp.sim.scenario import load_scenario

TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
REQUESTS = 400
#: outputs cut to this many tokens in both replays: decoding adds nothing to the cache and
#: would only make the simulator step through ~500 tokens per request
OUTPUT_TOKENS = 8
WORKERS = 4
G1_BLOCKS = 16_384
BLOCK_TOKENS = 16

SCENARIO = f"""
name = "{WORKERS} workers, G1 only, as Dynamo's mocker is configured beside it"
[model]
layers = 32
kv_heads = 8
head_dim = 128
element_octets = 2
block_tokens = {BLOCK_TOKENS}
[instances]
count = {WORKERS}
prefill_tokens_per_s = 20000
attention_ns_per_pair = 0
overhead_ms = 5
decode_step_ms = 20.0
decode_ms_per_gbyte = 0.0
g1_blocks = {G1_BLOCKS}
g2_blocks = 0
host_read_mbit_per_s = 400000
import_mbit_per_s = 400000
ingress_mbit_per_s = 200000
[links]
mbit_per_s = 200000
rtt_us = 10
[holders]
count = 0
blocks = 0
read_mbit_per_s = 200000
[controller]
mean_service_ms = 0
ttft_slo_ms = 5000
record_ttl_ms = 600000
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        scenario_file = folder / "scenario.toml"
        scenario_file.write_text(SCENARIO)
        trace = folder / "trace.jsonl"
        trace.write_text("".join(
            json.dumps({**r, "output_length": min(r["output_length"], OUTPUT_TOKENS)}) + "\n"
            for r in map(json.loads, TRACE.read_text().splitlines()[:REQUESTS])
        ))  # fmt: skip
        scenario = load_scenario(scenario_file)
        spec = WorkloadSpec("trace", str(trace), limit=REQUESTS)
        ours = {
            r.run.policy: r.summary["hit_rate"]
            for r in run_all(scenario, spec, [Run(p) for p in ("round-robin", "overlap", "kvsp")])
        }
        with PeerDriver("dynamo", "dynamo_mocker", {"DYN_LOG": "warn"}) as mocker:
            theirs = {
                mode: mocker.call(
                    "replay", trace=str(trace), workers=WORKERS, gpu_blocks=G1_BLOCKS,
                    block_tokens=BLOCK_TOKENS, router_mode=mode,
                )["prefix_cache_reused_ratio"]
                for mode in ("round_robin", "kv_router")
            }  # fmt: skip
    pairs: dict[str, Any] = {}
    for kvsp_policy, mode in (("round-robin", "round_robin"), ("overlap", "kv_router")):
        pairs[f"{kvsp_policy}_vs_{mode}"] = {
            "kvsp_hit_rate": round(ours[kvsp_policy], 4),
            "dynamo_reused_ratio": round(theirs[mode], 4),
            "ratio": round(ours[kvsp_policy] / theirs[mode], 3) if theirs[mode] else None,
        }
    round_robin = pairs["round-robin_vs_round_robin"]["ratio"]
    print(json.dumps({
        "benchmark": "peer_sim",
        "peers": {"dynamo": "ai-dynamo-runtime 1.6.1 run_mocker_trace_replay (offline)"},
        "requests": REQUESTS, "workers": WORKERS, "g1_blocks": G1_BLOCKS,
        "results": {**pairs, "kvsp_cost_policy_hit_rate": round(ours["kvsp"], 4)},
        "agree": round_robin is not None and abs(round_robin - 1) <= 0.1,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
