"""``kvsp up``: a whole cluster in separate processes that answers completions, and that Ctrl-C
stops completely (no process left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvsp.model import ModelFiles
from tests.servers import KVSP

pytestmark = pytest.mark.slow


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize(
    ("controllers", "processes"),
    [
        (1, 5),  # the IS, the controller (with the front end), the holder, two instances
        (2, 8),  # and redis-server, a second controller, the front end on its own
    ],
)
def test_up_serves_completions_and_ctrl_c_leaves_no_process(
    tmp_path: Path, model_files: ModelFiles, controllers: int, processes: int
) -> None:
    folder = tmp_path / "cluster"
    up = subprocess.Popen(
        [str(KVSP), "up", "--dir", str(folder), "--instances", "2",
         "--controllers", str(controllers)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, "kvsp up ended early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("Ctrl-C stops everything"):
                break
        text = "".join(lines)
        info = json.loads((folder / "cluster.json").read_text())
        assert info["openai_base_url"] in text
        assert "curl -s" in text
        assert len(info["pids"]) == processes
        assert len(info["controllers"]) == controllers
        assert all(url in text for url in info["controllers"])
        roles = sorted(httpx.get(u + "healthz", timeout=5).json()["role"]
                       for u in info["controllers"])  # fmt: skip
        assert roles == ["leader"] + ["standby"] * (controllers - 1)
        state = str(info["state"])
        assert state == "memory" if controllers == 1 else state.startswith("redis://127.0.0.1:")
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        headers = {"authorization": f"Bearer {info['api_key']}"}
        answer = httpx.post(
            info["openai_base_url"] + "/completions", json=body, headers=headers, timeout=60
        ).json()
        assert answer["usage"]["completion_tokens"] == 8
        assert answer["choices"][0]["text"]
        # the generated principals file is in force: no token, no answer
        for url in info["controllers"]:
            assert httpx.get(url + "instances", timeout=5).status_code == 401
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        rest = up.stdout.read()
        assert "stopped: no kvsp process left" in rest
        assert all(gone(pid) for pid in info["pids"])
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if up.stdout is not None:
            up.stdout.close()
