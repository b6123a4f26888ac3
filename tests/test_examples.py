"""The walkthrough `make demo` runs works end to end (real IS and holder processes, curl)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_core_walkthrough_runs() -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / "core-walkthrough.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "matched 2 of 3 keys" in out
    assert "kvsp-already-stored" in out
    assert "repr-digest: sha-256=:" in out
    assert "residency ranges overlap" in out
