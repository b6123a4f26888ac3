"""vLLM's process settings on CPU machines, set before vLLM is imported."""

from __future__ import annotations

import os

__all__ = ["vllm_environment"]


def vllm_environment(kv_cache_gib: int) -> None:
    """KV cache size, OpenMP threads bound to every core with none reserved (vLLM reserves
    cores by default, which leaves nothing on a 2-core machine), offline model loading, and
    the engine core and its worker in this process."""
    cores = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
