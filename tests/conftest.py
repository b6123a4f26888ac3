"""Shared fixtures: the public vectors (tests/vectors, copies kept with their sources), and a
fast hypothesis profile."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "tests" / "vectors"
#: the public request traces the simulator replays (copies kept with their sources)
TRACES = ROOT / "data" / "traces"

settings.register_profile(
    "kvsp", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("kvsp")


def load_vector(name: str) -> Any:
    path = VECTORS / name
    if not path.exists():
        pytest.fail(f"test vector missing: {path}")
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One private redis-server for the session; tests keep apart with their own key prefix."""
    from tests.servers import RedisServer

    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def model_files() -> Any:
    """The real model (``kvsp model install`` prepares it; the README's test command runs it)."""
    from kvsp.model import install

    return install()


@pytest.fixture(scope="session")
def engine(model_files: Any) -> Any:
    from kvsp.instance.engine import Engine

    return Engine(model_files)


@pytest.fixture(scope="session")
def operated_cluster(tmp_path_factory: pytest.TempPathFactory, model_files: Any) -> Any:
    """A ``kvsp up`` cluster of one instance that operations tests share (probes, metrics,
    dashboards): each leaves it as it found it."""
    from kvsp.local import LocalCluster

    up = LocalCluster(tmp_path_factory.mktemp("operated") / "c", instances=1, g1_blocks=32,
                      g2_bytes="16M", kv_events=None)  # fmt: skip
    up.start()
    try:
        yield up
    finally:
        up.stop()
