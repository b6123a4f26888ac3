"""The report's figures from hand-made results, and ``kvsp sim`` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvsp.cli import main
from kvsp.sim.cluster import RequestResult
from kvsp.sim.report import compare, summarise
from kvsp.sim.runner import Run, WorkloadSpec, run_all
from kvsp.sim.scenario import load_scenario


def result(ttft_ms: float, prompt: int = 100, reused: int = 0) -> RequestResult:
    return RequestResult(0, ttft_ms * 1e3, 0, prompt, reused, 10, 0, 0, False)


def test_summary_figures_are_token_weighted_and_percentiles_in_ms() -> None:
    results = [result(t, 100, r) for t, r in ((100, 0), (200, 50), (300, 100), (400, 50))]
    results.append(RequestResult(0, math.inf, math.inf, 100, 0, 0, 0, -1, True))
    s = summarise(results, ttft_slo_ms=250, wall_s=2)
    assert (s["requests"], s["unserved"], s["failed_over"]) == (5, 1, 1)
    assert s["hit_rate"] == 200 / 500
    assert s["recomputed_tokens"] == 300
    assert s["ttft_ms"]["mean"] == 250
    assert s["ttft_ms"]["p50"] == 250
    assert s["slo_attainment"] == 0.5
    assert (s["fetched_octets"], s["requests_per_s"]) == (40, 2.5)


def test_comparison_ratios() -> None:
    def figures(mean: float, p90: float, reused: int) -> dict:
        return {"ttft_ms": {"mean": mean, "p90": p90}, "reused_tokens": reused, "hit_rate": reused}

    policies = {
        "round-robin": figures(200, 400, 10),
        "overlap": figures(120, 300, 40),
        "kvsp": figures(100, 200, 80),
        "oracle": figures(90, 180, 100),
    }
    c = compare(policies)
    assert c["share_of_oracle_reuse"]["kvsp"] == 0.8
    assert c["kvsp_ttft_vs_overlap"] == {"mean": round(100 / 120, 3), "p90": round(200 / 300, 3)}
    assert c["global_vs_local_hit_round-robin"] == 8
    assert c["kvsp_beats_baselines"]
    policies["overlap"] = figures(90, 300, 40)
    assert not compare(policies)["kvsp_beats_baselines"]


SMALL_TOML = """
name = "tiny"
[model]
layers = 2
kv_heads = 1
head_dim = 4
element_octets = 2
block_tokens = 16
[instances]
count = 3
prefill_tokens_per_s = 2000
g1_blocks = 16
g2_blocks = 32
[links]
mbit_per_s = 10000
rtt_us = 100
"""


@pytest.mark.slow
def test_kvsp_sim_writes_its_report_and_plots(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SMALL_TOML)
    out = tmp_path / "out"
    args = ["sim", "--scenario", str(scenario), "--workload", "shared-prefix"]
    args += ["--requests", "200", "--policy", "round-robin,kvsp,oracle", "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        main([*args, "--sweep", "--jobs", "2"])
    assert done.value.code == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["policies"]) == ["round-robin", "kvsp", "oracle"]
    assert report["requests"] == 200
    assert all(p["requests"] == 200 for p in report["policies"].values())
    assert report["comparison"]["share_of_oracle_reuse"]["oracle"] == 1.0
    sweeps = report["sweeps"]
    assert len(sweeps["hit_rate_vs_cache_tb"]["kvsp"]) == 4
    assert len(sweeps["ttft_mean_ms_vs_rate"]["round-robin"]) == 4
    for plot in ("ttft_cdf.png", "hit_vs_cache.png", "ttft_vs_rate.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kvsp_sim_refuses_unknown_policies_and_a_missing_trace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["sim", "--policy", "fastest", "--workload", "agentic"])
    assert done.value.code != 0
    assert "unknown policies" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["sim"])
    assert done.value.code != 0
    assert "--trace" in capsys.readouterr().err


def test_runs_in_this_process_report_every_request_once(tmp_path: Path) -> None:
    scenario_file = tmp_path / "tiny.toml"
    scenario_file.write_text(SMALL_TOML)
    scenario = load_scenario(scenario_file)
    spec = WorkloadSpec("shared-prefix", limit=120)
    advanced: list[int] = []
    done = run_all(scenario, spec, [Run("kvsp"), Run("oracle", rate=2.0)], 1, advanced.append)
    assert sum(advanced) == 2 * 120
    assert [r.summary["requests"] for r in done] == [120, 120]
    assert done[1].offered_per_s == pytest.approx(2 * done[0].offered_per_s)
