"""``kvsp demo``, the README's main job: a cluster on this machine and a workload whose every check
must hold (exit status 0)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvsp.model import ModelFiles
from tests.servers import KVSP

pytestmark = pytest.mark.slow


def test_the_demo_runs_and_every_check_holds(tmp_path: Path, model_files: ModelFiles) -> None:
    done = subprocess.run(
        [str(KVSP), "demo", "--dir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "every check held" in done.stdout
    for check in ("TTFT cold", "warm local", "warm remote", "hit rate", "tool gap", "failover"):
        assert check in done.stdout
