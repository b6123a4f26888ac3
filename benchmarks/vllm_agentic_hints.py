"""The agentic workload of ``agentic_hints`` (tool gaps under cache pressure) on the vLLM-backed
instance: continuation hit rate and TTFT with the controller's KvHints against LRU alone, in
the same run. Prints one JSON line.

vLLM keeps 12 pages of 32 tokens (G1: the room of the reference run's 24 blocks; vLLM's CPU
attention takes pages of a multiple of 32 tokens), and the embedded holder (G2) the 48 blocks
of the reference run's G1 and G2 together: the pool kvsp manages is the same size, all of it in
G2 because vLLM's pages cannot hold a pin. With hints, the controller's pin for a tool gap
protects the session's G2 copies (vLLM's pages follow vLLM's own eviction: the outcomes say
``engine-g1``), and the continuation loads them through ``KVSPConnector``; with LRU alone, the
other users' requests push them out of both tiers and vLLM recomputes. Targets: hit rate with
hints >= 98 %, TTFT ratio hints / LRU <= 0.45.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.agentic_hints import BLOCK, G1_BLOCKS, compare

PAGE_TOKENS = 32
PAGES = G1_BLOCKS * BLOCK // PAGE_TOKENS
G2_BYTES = "36M"  # 48 blocks of 738 KB
VLLM_POOL = ["--engine", "vllm", "--vllm-page-tokens", str(PAGE_TOKENS),
             "--vllm-pages", str(PAGES), "--g2-bytes", G2_BYTES]  # fmt: skip


def main() -> None:
    # the connector's in-process reads of the instance's own holder, measured against HTTP
    http = ("local_reads", ["--no-vllm-local-reads"])
    compare("vllm_agentic_hints", VLLM_POOL, http, vllm_pages=PAGES, page_tokens=PAGE_TOKENS,
            g2_bytes=G2_BYTES)  # fmt: skip


if __name__ == "__main__":
    main()
