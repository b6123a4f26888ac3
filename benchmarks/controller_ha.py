"""What a controller's state in Redis costs, and how fast a controller's death is healed, in real
processes on the real model. Prints one JSON line.

- ``placements_per_s``, ``checkpoints_per_s``: ``POST place`` (each opening a session) and
  ``PUT sessions/{s}/checkpoint`` (each a session's next tokens, as an instance sends them)
  sent by ``CONCURRENCY`` clients to the leading controller of two clusters on this machine:
  ``kvsp up`` (the memory state) and ``kvsp up --controllers 2`` (the Redis state: redis-server
  append-only with fsync always, every change written before it is answered). Rounds
  alternate between the two; the best of ``ROUNDS`` each. ``ratio_*`` is Redis over memory
  (target >= 0.5).
- ``kill_to_token_*``: a sampled stream through the Redis cluster's front end while the leading
  controller is SIGKILLed ``KILLS`` times (and started again as a standby): the time from the
  kill to the arrival of a token that needed the new leader's acknowledgement (a token more
  than two release batches past the last one before the kill: no acknowledgement given before
  the kill can cover it). Median and worst (target <= 3 s).
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsp.instance.release import ReleaseGate
from kvsp.local import LocalCluster, Process

CONCURRENCY = 16
SECONDS = 3.0
ROUNDS = 3
KILLS = 6
#: tokens past the last one seen before a kill that no earlier acknowledgement can cover
UNCOVERED = 2 * ReleaseGate(gated=True, checkpoints=True).release_batch + 1
PROMPT = list(range(300, 310))  # shorter than a block: the checkpoint's tail is the prompt


class Load:
    """Placements, then checkpoints, against one cluster's leading controller."""

    def __init__(self, cluster: LocalCluster, leader: str) -> None:
        self.cluster = cluster
        self.leader = leader
        self.operator = {"authorization": f"Bearer {cluster.operator_token}"}
        token = (cluster.folder / "instance-0.token").read_text().strip()
        self.instance = {"authorization": f"Bearer {token}"}
        #: per client: its sessions, each (UUID, epoch, offset so far)
        self.sessions: list[list[list[Any]]] = [[] for _ in range(CONCURRENCY)]
        self.placed = 0

    async def _placements(self, http: httpx.AsyncClient, client: int, until: float) -> int:
        done = 0
        while time.monotonic() < until:
            body = {"tenant": "demo", "compat_id": self.cluster.compat_id, "tokens": PROMPT,
                    "session": f"bench-{client}-{self.placed}-{done}",
                    "sampler": {"method": "top-p", "params": {"p": 0.9}, "seed": done}}  # fmt: skip
            answer = await http.post(self.leader + "place", json=body, headers=self.operator)
            assert answer.status_code == 200, answer.text
            doc = answer.json()
            assert doc["outcome"] == "placed", doc
            self.sessions[client].append([doc["session"], doc["session_epoch"], 0])
            done += 1
        return done

    async def _checkpoints(self, http: httpx.AsyncClient, client: int, until: float) -> int:
        done, mine = 0, self.sessions[client]
        while time.monotonic() < until:
            entry = mine[done % len(mine)]
            entry[2] += 4
            body = {"session": entry[0], "epoch": entry[1], "compat_id": self.cluster.compat_id,
                    "scope_id": self.cluster.scope_ids["demo"], "prompt_blocks": [],
                    "prompt_tail": PROMPT, "generated": [7] * entry[2], "output_offset": entry[2],
                    "sampler": {"method": "top-p", "params": {"p": 0.9}, "seed": 1,
                                "step": entry[2]}}  # fmt: skip
            url = f"{self.leader}sessions/{entry[0]}/checkpoint"
            answer = await http.put(url, json=body, headers=self.instance)
            assert answer.status_code == 200, answer.text
            assert answer.json()["acknowledged"] == entry[2], answer.text
            done += 1
        return done

    async def rate(self, what: str) -> float:
        work = self._placements if what == "place" else self._checkpoints
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            started = time.monotonic()
            until = started + SECONDS
            counts = await asyncio.gather(*(work(http, c, until) for c in range(CONCURRENCY)))
            rate = sum(counts) / (time.monotonic() - started)
        if what == "place":
            self.placed += 1
        return rate


def _role(process: Process) -> str | None:
    try:
        return str(httpx.get(process.url + "healthz", timeout=1).json()["role"])
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def _leader(cluster: LocalCluster, timeout_s: float = 30.0) -> Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in cluster.controller_processes:
            if process.alive() and _role(process) == "leader":
                return process
        time.sleep(0.02)
    raise RuntimeError(f"no controller led within {timeout_s} s")


async def kill_to_token(cluster: LocalCluster) -> list[float]:
    """Seconds from each leader kill to the first token only the new leader could release."""
    arrivals: list[tuple[float, int, int]] = []  # (when, stream, index)
    failures: list[str] = []
    running = True

    async def stream() -> None:
        n = 0
        key = {"authorization": f"Bearer {cluster.api_key}"}
        async with httpx.AsyncClient(timeout=120) as http:
            while running:
                body = {"prompt": f"Story {n}: once upon a time", "max_tokens": 200,
                        "temperature": 0.8, "seed": n, "stream": True}  # fmt: skip
                url = cluster.frontend.url + "v1/completions"
                async with http.stream("POST", url, json=body, headers=key) as response:
                    if response.status_code != 200:
                        await response.aread()  # no leader at that moment: refused, clean
                        await asyncio.sleep(0.05)
                        continue
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            doc = json.loads(line[6:])
                            if "error" in doc:
                                failures.append(str(doc))
                            elif "index" in doc.get("kvsp", {}):
                                arrivals.append((time.monotonic(), n, doc["kvsp"]["index"]))
                n += 1

    streaming = asyncio.create_task(stream())
    waits: list[float] = []
    try:
        while len(arrivals) < 20:
            await asyncio.sleep(0.05)
        for _ in range(KILLS):
            await asyncio.sleep(1.0)
            leader = await asyncio.to_thread(_leader, cluster)
            assert leader.popen is not None
            _, last_stream, last_index = arrivals[-1]
            leader.popen.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            leader.popen.wait()
            leader.start()  # back as a standby
            while True:
                later = [
                    when
                    for when, s, i in arrivals
                    if when > killed_at and (s > last_stream or i >= last_index + UNCOVERED)
                ]
                if later:
                    waits.append(later[0] - killed_at)
                    break
                if time.monotonic() - killed_at > 60:
                    raise RuntimeError("no token within 60 s of a controller kill")
                await asyncio.sleep(0.01)
            await asyncio.to_thread(cluster.frontend.healthy)
    finally:
        running = False
        await asyncio.wait_for(streaming, 120)
    if failures:
        raise RuntimeError(f"streams failed: {failures[:3]}")
    return waits


async def measure(memory: LocalCluster, redis: LocalCluster) -> dict[str, Any]:
    loads = {
        "memory": Load(memory, memory.controller_processes[0].url),
        "redis": Load(redis, (await asyncio.to_thread(_leader, redis)).url),
    }
    best = {(state, what): 0.0 for state in loads for what in ("place", "checkpoint")}
    for _ in range(ROUNDS):
        for what in ("place", "checkpoint"):
            for state, load in loads.items():
                best[state, what] = max(best[state, what], await load.rate(what))
    waits = await kill_to_token(redis)
    return {
        "placements_per_s": {s: round(best[s, "place"], 1) for s in loads},
        "checkpoints_per_s": {s: round(best[s, "checkpoint"], 1) for s in loads},
        "ratio_placements": round(best["redis", "place"] / best["memory", "place"], 3),
        "ratio_checkpoints": round(best["redis", "checkpoint"] / best["memory", "checkpoint"], 3),
        "ratio_target": 0.5,
        "kills": len(waits),
        "kill_to_token_median_s": round(statistics.median(waits), 3),
        "kill_to_token_worst_s": round(max(waits), 3),
        "kill_to_token_target_s": 3.0,
    }


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvsp-bench-ha-") as folder:
        common: dict[str, Any] = {"instances": 1, "status_ttl_ms": 1_500, "g1_blocks": 64,
                                  "g2_bytes": "64M", "holder_bytes": "256M"}  # fmt: skip
        memory = LocalCluster(Path(folder) / "memory", controllers=1, **common)
        redis = LocalCluster(Path(folder) / "redis", controllers=2, **common)
        try:
            memory.start()
            redis.start()
            result = asyncio.run(measure(memory, redis))
        finally:
            memory.stop()
            redis.stop()
    print(json.dumps({"benchmark": "controller_ha", "concurrency": CONCURRENCY, **result}))


if __name__ == "__main__":
    main()
