"""Running peers beside kvsp in one benchmark: a peer's driver (``benchmarks/peers/``) runs
under the peer's own interpreter in ``build/peers/<peer>`` (``make peer-deps`` makes them), and
rounds of kvsp and of each peer are interleaved, so a noisy neighbour slows both alike and
each round's ratio compares like with like."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["ROOT", "PeerDriver", "interleaved", "peer_python", "report", "versus"]

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "build" / "peers"
DRIVERS = ROOT / "benchmarks" / "peers"


def peer_python(peer: str) -> Path:
    """The interpreter of ``peer``'s environment; exits with what to run when it is missing."""
    python = PEERS / peer / "bin" / "python"
    if not (PEERS / peer / ".installed").exists():
        sys.exit(f"{peer} is not set up: run `make peer-deps`")
    return python


class PeerDriver:
    """A peer's driver process, answering one JSON command at a time."""

    def __init__(self, peer: str, driver: str, env: dict[str, str] | None = None) -> None:
        log = PEERS / f"{driver}.log"
        self.process = subprocess.Popen(
            [str(peer_python(peer)), str(DRIVERS / f"{driver}.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("ab"),
            env={**os.environ, "KVSP_PEER_LOG": str(log), **(env or {})},
            text=True,
        )
        self.log = log

    def call(self, op: str, **arguments: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer's driver ended; its log is {self.log}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"peer {op} failed:\n{answer['error']}")
        return answer

    def __enter__(self) -> PeerDriver:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self.process.poll() is None:
                self.call("close")
        finally:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


async def interleaved(
    contenders: dict[str, Callable[[], Awaitable[float]]], rounds: int
) -> dict[str, list[float]]:
    """Each contender's figure in each of ``rounds`` rounds, the contenders taking turns within
    a round."""
    figures: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, measure in contenders.items():
            figures[name].append(await measure())
    return figures


def versus(
    ours: list[float], theirs: list[float], names: tuple[str, str] = ("kvsp", "peer")
) -> dict[str, Any]:
    """Medians of both figures (under ``names``) and the median of the rounds' own ratios
    (kvsp / peer)."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {
        names[0]: statistics.median(ours),
        names[1]: statistics.median(theirs),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def report(benchmark: str, peers: dict[str, str], meets: bool, results: dict[str, Any]) -> None:
    """The benchmark's one JSON line: what each peer ran as, whether every target holds, and
    the figures."""
    print(json.dumps({
        "benchmark": benchmark, "peers": peers, "meets_target": meets, "results": results,
    }))  # fmt: skip
