"""The real model for instance tests (``kvsp model install`` prepares it; the test command of
the README runs that first)."""

from __future__ import annotations

import pytest

from kvsp.instance.engine import Engine
from kvsp.instance.model import ModelFiles, install


@pytest.fixture(scope="session")
def model_files() -> ModelFiles:
    return install()


@pytest.fixture(scope="session")
def engine(model_files: ModelFiles) -> Engine:
    return Engine(model_files)
