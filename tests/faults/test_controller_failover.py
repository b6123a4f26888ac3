"""Controllers that survive themselves (decision 0019), in real processes on the real model: three
controllers sharing one redis-server, a front end of its own, two instances, an IS and a
holder (``kvsp up --controllers 3``).

While sampled sessions stream through the front end, the leading controller is SIGKILLed at
random points (``KVSP_CONTROLLER_KILLS``, 50 by default) and started again; an instance is
killed and restarted twice, and a shard map is resharded between kills. Every stream must end
with every index once and ``[DONE]``, no stale epoch is accepted, no reshard is left half
committed, and each recovery (a new leader that places requests) is timed. Then Redis itself
is stopped (SIGSTOP) and killed (SIGKILL, restarted from its append-only file): the controllers
answer 503 problems meanwhile, never hang, lose no acknowledged checkpoint, and recover alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.local import LocalCluster, Process

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

KILLS = int(os.environ.get("KVSP_CONTROLLER_KILLS", "50"))
TOKENS = 24


def _role(process: Process) -> str | None:
    try:
        return str(httpx.get(process.url + "healthz", timeout=1).json()["role"])
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def _leader(cluster: LocalCluster, timeout_s: float = 20.0) -> Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in cluster.controller_processes:
            if process.alive() and await asyncio.to_thread(_role, process) == "leader":
                return process
        await asyncio.sleep(0.05)
    raise AssertionError(f"no controller led within {timeout_s} s")


class Streams:
    """Sampled sessions streamed through the front end, each checked as it ends."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.base = cluster.frontend.url + "v1/completions"
        self.key = {"authorization": f"Bearer {cluster.api_key}"}
        self.done = 0
        self.sessions: dict[str, int] = {}  # session -> highest epoch it was served at
        self.failures: list[str] = []
        self.arrivals: list[float] = []
        self.running = True

    async def one(self, http: httpx.AsyncClient, n: int) -> None:
        # multi-turn sessions, each a worker's own (n keeps its worker's parity), so a
        # conversation's next turn comes after its last answer, as a client sends it
        body = {"prompt": f"Story {n}: once upon a time", "max_tokens": TOKENS,
                "temperature": 0.8, "seed": n, "stream": True, "session": f"s-{n % 8}"}  # fmt: skip
        indexes: list[int] = []
        finished = False
        finish_reason = None
        async with http.stream("POST", self.base, json=body, headers=self.key) as response:
            if response.status_code != 200:  # no controller led at that moment: refused, clean
                await response.aread()
                assert response.status_code == 503, response.text
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                doc = json.loads(line[6:])
                if "error" in doc:
                    self.failures.append(f"stream {n}: {doc}")
                    continue
                if "index" in doc.get("kvsp", {}):
                    indexes.append(doc["kvsp"]["index"])
                    self.arrivals.append(time.monotonic())
                elif "usage" in doc:
                    summary = doc["kvsp"]
                    self.sessions[summary["session"]] = max(summary["epochs"] or [0])
                    finish_reason = doc["choices"][0]["finish_reason"]
        # every index once, in order, up to max_tokens or the model's own end of text
        whole = indexes == list(range(TOKENS if finish_reason != "stop" else len(indexes)))
        if not finished or not whole or finish_reason is None:
            self.failures.append(
                f"stream {n}: finished {finished} ({finish_reason}), indexes {indexes}"
            )
        self.done += 1

    async def run(self, worker: int) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            n = worker
            while self.running:
                await self.one(http, n)
                n += 2


async def _reshard(cluster: LocalCluster, version: list[int]) -> None:
    """Move map ``ctx`` to the other order; any outcome is fine, a half-committed one is not."""
    op = {"authorization": f"Bearer {cluster.operator_token}"}
    urls = [p.url for p in cluster.instance_processes]
    order = urls if version[0] % 2 else urls[::-1]
    leader = await _leader(cluster)
    async with httpx.AsyncClient(timeout=30, headers=op) as http:
        body = {"instances": order, "deadline_ms": 5_000}
        with_error = None
        try:
            answer = await http.post(f"{leader.url}shards/ctx/reshard", json=body)
            with_error = answer.status_code
        except httpx.TransportError:
            pass
        assert with_error in (None, 200, 503), with_error


async def _map_settled(cluster: LocalCluster) -> int:
    """The leader's version of ``ctx`` once nothing is in flight, equal at every member."""
    op = {"authorization": f"Bearer {cluster.operator_token}"}
    deadline = time.monotonic() + 30
    seen: list[Any] = []
    async with httpx.AsyncClient(timeout=10, headers=op) as http:
        while time.monotonic() < deadline:
            leader = await _leader(cluster)
            try:
                doc = (await http.get(f"{leader.url}shards/ctx")).json()
                if doc.get("in_flight") is None and "map" in doc:
                    version = int(doc["map"]["version"])
                    members = {s["instance"] for s in doc["map"]["shards"]}
                    seen = [doc, *[(await http.get(f"{m}shards/ctx")).json() for m in members]]
                    seen = [doc] + [s.get("version") for s in seen[1:]]
                    if all(v == version for v in seen[1:]):
                        return version
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"the shard map did not settle at one version everywhere: {seen}")


async def test_killing_the_leader_50_times_loses_nothing(tmp_path: Path) -> None:
    cluster = LocalCluster(
        tmp_path / "cluster", instances=2, controllers=3, status_ttl_ms=1_500, g1_blocks=64,
        g2_bytes="64M", holder_bytes="256M",
    )  # fmt: skip
    cluster.start()
    rng = random.Random(29)
    recoveries: list[float] = []
    versions: list[int] = []
    to_token: list[float] = []
    try:
        op = {"authorization": f"Bearer {cluster.operator_token}"}
        urls = [p.url for p in cluster.instance_processes]
        v1 = {"map": "ctx", "version": 1, "shards": [
            {"tokens": [0, 16], "instance": urls[0]}, {"tokens": [16, 32], "instance": urls[1]},
        ]}  # fmt: skip
        leader = await _leader(cluster)
        async with httpx.AsyncClient(timeout=30, headers=op) as http:
            assert (await http.post(leader.url + "shards", json=v1)).status_code == 201
            tokens = list(range(100, 132))
            for url, part in ((urls[0], [0, 16]), (urls[1], [16, 32])):
                load = {"version": 1, "tokens": tokens, "ranges": [part]}
                assert (await http.post(f"{url}shards/ctx/load", json=load)).status_code == 200
        streams = Streams(cluster)
        workers = [asyncio.create_task(streams.run(w)) for w in range(2)]
        version = [1]
        resharding: asyncio.Task[None] | None = None
        for kill in range(KILLS):
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            if resharding is not None:  # killed mid-reshard or not: one version, everywhere
                await resharding
                versions.append(await _map_settled(cluster))
                resharding = None
            if kill in (1, 3, 6, 9) and kill < KILLS // 3:  # before any member restarts
                version[0] += 1
                resharding = asyncio.create_task(_reshard(cluster, version))
                await asyncio.sleep(rng.uniform(0.0, 0.3))
            if kill in (KILLS // 3, 2 * KILLS // 3):  # an instance dies too, and comes back
                victim = cluster.instance_processes[kill % 2]
                assert victim.popen is not None
                victim.popen.send_signal(signal.SIGKILL)
                victim.popen.wait()
                victim.start()
            leader = await _leader(cluster)
            assert leader.popen is not None
            before = len(streams.arrivals)
            leader.popen.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            leader.popen.wait()
            await _leader(cluster)
            recoveries.append(time.monotonic() - killed_at)
            leader.start()  # back as a standby
            while len(streams.arrivals) <= before + 4 and time.monotonic() - killed_at < 30:
                await asyncio.sleep(0.01)  # a token that needed the new leader's acknowledgement
            if len(streams.arrivals) > before + 4:
                to_token.append(streams.arrivals[before + 4] - killed_at)
        streams.running = False
        await asyncio.wait_for(asyncio.gather(*workers), 180)
        assert versions, versions
        assert versions == sorted(versions), versions
        # a checkpoint of a session's superseded epoch is refused by the leader's state
        moved = {s: e for s, e in streams.sessions.items() if e > 0}
        leader = await _leader(cluster)
        token = (cluster.folder / "instance-0.token").read_text().strip()
        async with httpx.AsyncClient(timeout=10) as http:
            for session in list(moved)[:3]:
                doc = (await http.get(f"{leader.url}sessions/{session}", headers=op)).json()
                stale = {"session": session, "epoch": doc["epoch"] - 1, "compat_id":
                         cluster.compat_id, "scope_id": cluster.scope_ids["demo"],
                         "prompt_blocks": [], "prompt_tail": [1], "generated": [5] * 999,
                         "output_offset": 999, "sampler": {"method": "greedy"}}  # fmt: skip
                answer = await http.put(
                    f"{leader.url}sessions/{session}/checkpoint", json=stale,
                    headers={"authorization": f"Bearer {token}"},
                )  # fmt: skip
                assert answer.status_code in (403, 409), answer.text
        print(json.dumps({
            "kills": KILLS, "streams": streams.done, "map_versions": versions,
            "failed_over_sessions": len(moved),
            "recovery_median_s": round(statistics.median(recoveries), 3),
            "recovery_worst_s": round(max(recoveries), 3),
            "kill_to_token_median_s": round(statistics.median(to_token), 3) if to_token else None,
            "kill_to_token_worst_s": round(max(to_token), 3) if to_token else None,
        }))  # fmt: skip
        assert not streams.failures, streams.failures[:5]
        assert streams.done >= KILLS // 2
        assert len(recoveries) == KILLS
        assert max(recoveries) < 10.0
    finally:
        cluster.stop()


async def test_redis_stopped_or_killed_is_503_then_recovers_with_every_acknowledgement(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(
        tmp_path / "cluster", instances=1, controllers=2, status_ttl_ms=1_500, g1_blocks=64,
        g2_bytes="64M", holder_bytes="256M",
    )  # fmt: skip
    cluster.start()
    try:
        redis = cluster.redis
        assert redis is not None
        assert redis.popen is not None
        streams = Streams(cluster)
        async with httpx.AsyncClient(timeout=120) as http:
            await streams.one(http, 1)  # a session the controllers know, acknowledged in full
        assert not streams.failures
        (session,) = streams.sessions
        op = {"authorization": f"Bearer {cluster.operator_token}"}

        async def view() -> httpx.Response:
            leader = await _leader(cluster)
            async with httpx.AsyncClient(timeout=10) as http:
                return await http.get(f"{leader.url}sessions/{session}", headers=op)

        acknowledged = (await view()).json()["acknowledged"]
        assert acknowledged == TOKENS
        for stop in (signal.SIGSTOP, signal.SIGKILL):
            redis.popen.send_signal(stop)
            await asyncio.sleep(2.5)  # past the lease: nobody may lead without the store
            async with httpx.AsyncClient(timeout=10) as http:
                for controller in cluster.controller_processes:
                    started = time.monotonic()
                    answer = await http.get(f"{controller.url}sessions/{session}", headers=op)
                    assert answer.status_code == 503, answer.text
                    assert answer.headers["content-type"] == "application/problem+json"
                    assert time.monotonic() - started < 5  # never hangs
            if stop is signal.SIGSTOP:
                redis.popen.send_signal(signal.SIGCONT)
            else:
                redis.popen.wait()
                redis.start()  # from its append-only file
            answer = await view()  # a controller leads again by itself
            assert answer.status_code == 200, answer.text
            assert answer.json()["acknowledged"] == acknowledged
        async with httpx.AsyncClient(timeout=120) as http:
            await streams.one(http, 3)  # and serves again
        assert not streams.failures, streams.failures
    finally:
        cluster.stop()
