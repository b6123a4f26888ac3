"""Shared fixtures: where the public vectors live, and a fast hypothesis profile."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVSP_SHARED", ROOT.parent / "shared"))
VECTORS = SHARED / "vectors"

settings.register_profile(
    "kvsp", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("kvsp")


def load_vector(name: str) -> Any:
    path = VECTORS / name
    if not path.exists():
        pytest.fail(f"test vectors missing: {path} (set KVSP_SHARED to the shared/ folder)")
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
    from kvsp.instance.model import install

    return install()


@pytest.fixture(scope="session")
def engine(model_files: Any) -> Any:
    from kvsp.instance.engine import Engine

    return Engine(model_files)
