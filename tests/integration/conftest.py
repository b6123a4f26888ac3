"""Fixtures of the real-process tests."""

from __future__ import annotations

import pytest

from kvsp.core.records import Sampler
from kvsp.instance.engine import Engine, KvState
from kvsp.model import ModelFiles
from tests.integration.instances import PROMPT


@pytest.fixture
def compat(model_files: ModelFiles) -> str:
    return model_files.compat_id.hex()


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[int]:
    greedy = Sampler(method="greedy", deterministic=True)
    return list(engine.generate(KvState(), PROMPT, greedy, 24))
