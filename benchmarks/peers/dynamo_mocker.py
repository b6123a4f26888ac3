"""NVIDIA Dynamo's mocker (``dynamo._core.run_mocker_trace_replay``, ai-dynamo-runtime 1.6.1)
replaying a Mooncake trace offline, run under build/peers/dynamo's interpreter: the peer of
kvsp's simulator in benchmarks/peer_sim.py."""

from __future__ import annotations

from typing import Any

from _driver import serve
from dynamo._core import run_mocker_trace_replay


def replay(
    trace: str, workers: int, gpu_blocks: int, block_tokens: int, router_mode: str
) -> dict[str, Any]:
    """The replay's summary (``prefix_cache_reused_ratio`` among its figures)."""
    engine = {"engine": {"block_size": block_tokens, "num_gpu_blocks": gpu_blocks}}
    result = run_mocker_trace_replay(
        [trace], extra_engine_args=engine, num_workers=workers, router_mode=router_mode,
        trace_block_size=512,
    )  # fmt: skip
    return dict(result.summary)


if __name__ == "__main__":
    serve({"replay": replay, "close": dict})
