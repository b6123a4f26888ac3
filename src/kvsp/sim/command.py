"""``kvsp sim``: run a scenario under every requested policy, show the figures, write the report
(``report.json``) and the plots (``ttft_cdf.png``; with ``sweep``, also ``hit_vs_cache.png`` and
``ttft_vs_rate.png``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvsp.sim.report import compare, plot_hit_vs_cache, plot_ttft_cdf, plot_ttft_vs_rate
from kvsp.sim.runner import Run, RunResult, WorkloadSpec, build_workload, run_all
from kvsp.sim.scenario import Scenario

__all__ = ["CACHE_SCALES", "RATES", "simulate"]

#: sweep points: cache sizes (times the scenario's) and request rates (times the workload's)
CACHE_SCALES = (0.25, 0.5, 1.0, 2.0)
RATES = (1.0, 2.0, 3.0, 4.0)
#: the policies a cache-size sweep compares (the oracle's cache is infinite anyway)
_CACHE_POLICIES = ("least-loaded", "overlap", "kvsp", "kvsp-hints")


def _table(report: dict[str, Any]) -> Table:
    table = Table(title=f"kvsp sim: {report['scenario']} ({report['requests']} requests)")
    for column in ("policy", "hit rate", "of oracle", "TTFT mean", "p90", "p99", "SLO met"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    table.add_column("fetched", justify="right")
    table.add_column("req/s", justify="right")
    shares = report["comparison"].get("share_of_oracle_reuse", {})
    for name, p in report["policies"].items():
        t = p["ttft_ms"]
        table.add_row(
            name,
            f"{p['hit_rate']:.1%}",
            f"{shares[name]:.1%}" if name in shares else "-",
            f"{t['mean']:.0f} ms",
            f"{t['p90']:.0f}",
            f"{t['p99']:.0f}",
            f"{p['slo_attainment']:.1%}",
            f"{p['fetched_octets'] / 1e12:.1f} TB",
            f"{p['requests_per_s']:.0f}",
        )
    return table


def simulate(
    scenario: Scenario,
    spec: WorkloadSpec,
    policies: Sequence[str],
    out: Path,
    sweep: bool = False,
    jobs: int | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run, show, and write the report and plots under ``out``; returns the report."""
    console = console or Console()
    requests = len(build_workload(spec, scenario))
    runs = [Run(p) for p in policies]
    if sweep:
        cached = [p for p in policies if p in _CACHE_POLICIES]
        runs += [Run(p, cache_scale=s) for p in cached for s in CACHE_SCALES if s != 1]
        runs += [Run(p, rate=r) for p in policies for r in RATES if r != 1]
    with Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("sim", total=requests * len(runs))
        done = run_all(scenario, spec, runs, jobs, lambda n: progress.advance(task, n))
    main = {r.run.policy: r for r in done if r.run.cache_scale == 1 and r.run.rate == 1}
    figures = {name: r.summary | {"hints": r.hints} for name, r in main.items()}
    report: dict[str, Any] = {
        "scenario": scenario.name,
        "workload": {**spec.__dict__, "requests": requests},
        "requests": requests,
        "offered_requests_per_s": round(next(iter(main.values())).offered_per_s, 2),
        "policies": figures,
        "comparison": compare(figures),
    }
    out.mkdir(parents=True, exist_ok=True)
    plot_ttft_cdf(
        {n: r.results for n, r in main.items()},
        f"TTFT, {scenario.name}",
        out / "ttft_cdf.png",
    )
    if sweep:
        report["sweeps"] = _sweeps(scenario, done, out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(_table(report))
    console.print(json.dumps(report["comparison"]))
    console.print(f"report and plots in {out}")
    return report


def _sweeps(scenario: Scenario, done: list[RunResult], out: Path) -> dict[str, Any]:
    cache: dict[str, list[tuple[float, float]]] = {}
    rate: dict[str, list[tuple[float, float]]] = {}
    tb = scenario.model.block_octets * scenario.instances.count / 1e12
    per_instance = scenario.instances.g1_blocks + scenario.instances.g2_blocks
    holders = scenario.holders.blocks * scenario.holders.count / max(scenario.instances.count, 1)

    def size(scale: float) -> float:
        return round(tb * (per_instance + holders) * scale, 2)

    for r in done:
        if r.run.rate == 1 and r.run.policy in _CACHE_POLICIES:
            cache.setdefault(r.run.policy, []).append(
                (size(r.run.cache_scale), r.summary["hit_rate"])
            )
        if r.run.policy == "oracle" and r.run.rate == 1:  # its cache is infinite: a bound
            cache["oracle"] = [(size(s), r.summary["hit_rate"]) for s in CACHE_SCALES]
        if r.run.cache_scale == 1:
            rate.setdefault(r.run.policy, []).append(
                (round(r.offered_per_s, 2), r.summary["ttft_ms"]["mean"])
            )
    plot_hit_vs_cache(cache, f"hit rate vs cache size, {scenario.name}", out / "hit_vs_cache.png")
    plot_ttft_vs_rate(rate, f"TTFT vs request rate, {scenario.name}", out / "ttft_vs_rate.png")
    return {"hit_rate_vs_cache_tb": cache, "ttft_mean_ms_vs_rate": rate}
