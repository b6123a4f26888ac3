"""What a simulation run measured, per policy, and its plots.

``summarise`` turns one run's results into the figures users compare: token-weighted prefix hit
rate (and its share of the oracle's reusable tokens), recomputed tokens, octets moved, TTFT mean
and percentiles, queueing, SLO attainment. ``compare`` adds the ratios between policies that
the performance section quotes. ``plot_*`` write PNGs (matplotlib, no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsp.sim.cluster import RequestResult

__all__ = ["compare", "plot_hit_vs_cache", "plot_ttft_cdf", "plot_ttft_vs_rate", "summarise"]


def _ms(values: npt.NDArray[np.float64], q: float) -> float:
    return round(float(np.percentile(values, q)) / 1e3, 1) if values.size else math.nan


def summarise(
    results: Sequence[RequestResult], ttft_slo_ms: float, wall_s: float
) -> dict[str, Any]:
    """The figures of one policy's run."""
    served = [r for r in results if math.isfinite(r.ttft_us)]
    ttft = np.array([r.ttft_us for r in served])
    queue = np.array([r.queue_us for r in served])
    prompt = sum(r.prompt_tokens for r in results)
    reused = sum(r.reused_tokens for r in served)
    return {
        "requests": len(results),
        "unserved": len(results) - len(served),
        "failed_over": sum(r.failed_over for r in results),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "recomputed_tokens": prompt - reused,
        "hit_rate": round(reused / prompt, 4) if prompt else 0.0,
        "fetched_octets": sum(r.fetched_octets for r in served),
        "g2_octets": sum(r.g2_octets for r in served),
        "ttft_ms": {
            "mean": round(float(ttft.mean()) / 1e3, 1) if ttft.size else math.nan,
            "p50": _ms(ttft, 50),
            "p90": _ms(ttft, 90),
            "p99": _ms(ttft, 99),
        },
        "queue_ms": {
            "mean": round(float(queue.mean()) / 1e3, 1) if queue.size else math.nan,
            "p90": _ms(queue, 90),
        },
        "slo_ms": ttft_slo_ms,
        "slo_attainment": round(float((ttft <= ttft_slo_ms * 1e3).mean()), 4) if ttft.size else 0.0,
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(results) / wall_s, 1) if wall_s else math.nan,
    }


def compare(policies: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios between policies: each one's share of the oracle's reusable tokens, KVSP's TTFT
    against the baselines, and the global-versus-local hit ratio (KVSP's hit rate over that of
    the same cluster with per-instance caches only)."""
    out: dict[str, Any] = {}
    oracle = policies.get("oracle")
    if oracle and oracle["reused_tokens"]:
        out["share_of_oracle_reuse"] = {
            name: round(p["reused_tokens"] / oracle["reused_tokens"], 4)
            for name, p in policies.items()
        }
    kvsp = policies.get("kvsp")
    if kvsp is None:
        return out
    for base in ("round-robin", "least-loaded", "overlap"):
        other = policies.get(base)
        if other is None:
            continue
        out[f"kvsp_ttft_vs_{base}"] = {
            stat: round(kvsp["ttft_ms"][stat] / other["ttft_ms"][stat], 3)
            for stat in ("mean", "p90")
            if other["ttft_ms"][stat]
        }
        if other["hit_rate"]:
            out[f"global_vs_local_hit_{base}"] = round(kvsp["hit_rate"] / other["hit_rate"], 2)
    baselines = [policies[b] for b in ("round-robin", "least-loaded", "overlap") if b in policies]
    out["kvsp_beats_baselines"] = all(
        kvsp["ttft_ms"][stat] < b["ttft_ms"][stat] for b in baselines for stat in ("mean", "p90")
    )
    return out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(ax: Any, fig: Any, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_ttft_cdf(runs: Mapping[str, Sequence[RequestResult]], title: str, path: Path) -> Path:
    """TTFT CDF per policy (log scale)."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    for name, results in runs.items():
        ttft = np.sort([r.ttft_us / 1e3 for r in results if math.isfinite(r.ttft_us)])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=name)
    ax.set_xscale("log")
    return _save(ax, fig, "time to first token (ms)", "share of requests", title, path)


def _lines(
    points: Mapping[str, Sequence[tuple[float, float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
    log_y: bool = False,
) -> Path:
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    for name, series in points.items():
        xs, ys = zip(*sorted(series), strict=True)
        ax.plot(xs, ys, marker="o", label=name)
    if log_y:
        ax.set_yscale("log")
    return _save(ax, fig, xlabel, ylabel, title, path)


def plot_hit_vs_cache(
    points: Mapping[str, Sequence[tuple[float, float]]], title: str, path: Path
) -> Path:
    """Prefix hit rate per policy against the cluster's cache size (TB)."""
    return _lines(points, "cluster cache (G1 + G2, TB)", "prefix hit rate (tokens)", title, path)


def plot_ttft_vs_rate(
    points: Mapping[str, Sequence[tuple[float, float]]], title: str, path: Path
) -> Path:
    """Mean TTFT per policy against the request rate."""
    return _lines(points, "requests per second", "mean TTFT (ms)", title, path, log_y=True)
