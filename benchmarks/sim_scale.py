"""Simulator speed at scale. Prints one JSON line.

100,000 requests of the Mooncake conversation trace (the trace nine times over, one tenant each,
spread in time) across the 64-instance scenario, placed by the KVSP cost policy over the real
store, index and placement code. Figures: simulated requests per second and the wall time, with
``ratio`` = wall time / the 5-minute limit (<= 1 holds). Building the workload (synthetic tokens
and Block Keys) is timed apart.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvsp.sim.runner import Run, WorkloadSpec, build_workload, run_all
from kvsp.sim.scenario import load_scenario

LIMIT_S = 300.0
TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "conversation_trace.jsonl"


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    scenario = load_scenario("h100-8b-64")
    spec = WorkloadSpec("trace", str(TRACE), copies=-(-requests // 12_031), limit=requests)
    started = time.perf_counter()
    build_workload(spec, scenario)
    built = time.perf_counter() - started
    (result,) = run_all(scenario, spec, [Run("kvsp")], jobs=1)
    wall = time.perf_counter() - started
    summary = result.summary
    print(
        json.dumps(
            {
                "benchmark": "sim_scale",
                "instances": scenario.instances.count,
                "requests": summary["requests"],
                "workload_build_s": round(built, 1),
                "simulate_s": summary["wall_s"],
                "wall_s": round(wall, 1),
                "requests_per_s": summary["requests_per_s"],
                "hit_rate": summary["hit_rate"],
                "limit_s": LIMIT_S,
                "ratio": round(wall / LIMIT_S, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
