"""Timing helpers shared by the benchmark scripts: interleaved best-of-N runs, so a noisy
neighbour slows the measured code and its limit alike."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["best_times"]


def best_times(funcs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The best wall time of each function over ``repeats`` interleaved rounds."""
    best = dict.fromkeys(funcs, float("inf"))
    for _ in range(repeats):
        for name, func in funcs.items():
            start = time.perf_counter()
            func()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
