"""The live cluster page in a real browser: Debian's Chromium, headless, loads ``GET ui/`` of a
running ``kvsp up`` cluster and runs its script; the test reads the page as the browser drew
it (the DOM after its scripts ran): a row per instance, a session appearing after a
completion, an instance turning red once it was SIGKILLed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.local import LocalCluster
from kvsp.model import ModelFiles

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
#: how the page is opened: a fresh profile, nothing fetched but the page (this machine has no
#: network beyond loopback, and Chromium's background fetches would only fail)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]  # fmt: skip


class Browser:
    """Chromium opening one URL per call, in a profile of its own."""

    def __init__(self, profile: Path) -> None:
        assert CHROMIUM is not None
        self.command = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}"]

    def page(self, url: str) -> str:
        """The DOM once the page's scripts ran (its first refresh answered)."""
        done = subprocess.run([*self.command, "--virtual-time-budget=3000", "--dump-dom", url],
                              capture_output=True, text=True, timeout=90, check=True)  # fmt: skip
        return done.stdout

    def screenshot(self, url: str, out: Path) -> None:
        subprocess.run([*self.command, "--virtual-time-budget=3000", "--window-size=1400,900",
                        f"--screenshot={out}", url],
                       capture_output=True, timeout=90, check=True)  # fmt: skip


def rows(dom: str, kind: str) -> list[dict[str, str]]:
    """Each ``<tr class="KIND ...">``'s attributes and cell texts."""
    found = []
    for attributes, body in re.findall(rf'<tr class="{kind}([^>]*)>(.*?)</tr>', dom, re.S):
        row = dict(re.findall(r'data-(\w+)="([^"]*)"', attributes))
        row["class"] = attributes.split('"')[0].strip()
        row["cells"] = "|".join(re.findall(r"<td[^>]*>(.*?)</td>", body, re.S))
        found.append(row)
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_files: ModelFiles) -> Iterator[Any]:
    up = LocalCluster(tmp_path_factory.mktemp("ui") / "c", instances=2, g1_blocks=32,
                      g2_bytes="16M", kv_events=None, status_ttl_ms=1_500)  # fmt: skip
    up.start()
    try:
        yield up
    finally:
        up.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test does)")
def test_the_cluster_page_shows_instances_sessions_and_a_failed_instance(
    cluster: Any, tmp_path: Path
) -> None:
    up: LocalCluster = cluster
    browser = Browser(tmp_path / "profile")
    first = rows(browser.page(up.cluster_page), "instance")
    assert sorted(r["instance"] for r in first) == sorted(p.url for p in up.instance_processes)
    assert all(r["state"] == "active" and "state-active" in r["class"] for r in first)
    without = rows(browser.page(up.controller.url + "ui/"), "instance")
    assert without == []  # no token, no data: the page says the controller refused

    with httpx.Client(timeout=120) as http:
        answer = http.post(
            up.frontend.url + "v1/completions",
            json={"model": "x", "prompt": "A page that draws the cluster.", "max_tokens": 4,
                  "temperature": 0, "session": "ui-conversation"},
            headers={"authorization": f"Bearer {up.api_key}"},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        summary = answer.json()["kvsp"]
    dom = browser.page(up.cluster_page)
    sessions = {r["session"]: r for r in rows(dom, "session")}
    assert summary["session"] in sessions
    assert summary["instance"] in sessions[summary["session"]]["cells"]
    assert rows(dom, "placement"), "the placement and its candidates' costs"
    assert "chosen" in dom
    browser.screenshot(up.cluster_page, tmp_path / "before.png")

    victim = up.instance_processes[1]
    assert victim.popen is not None
    os.kill(victim.popen.pid, signal.SIGKILL)
    auth = {"authorization": f"Bearer {up.operator_token}"}
    deadline = time.monotonic() + 30
    with httpx.Client(timeout=10) as http:
        while time.monotonic() < deadline:
            states = http.get(up.controller.url + "instances", headers=auth).json()["instances"]
            if any(i["instance"] == victim.url and i["state"] == "failed" for i in states):
                break
            time.sleep(0.2)
    after = {r["instance"]: r for r in rows(browser.page(up.cluster_page), "instance")}
    assert after[victim.url]["state"] == "failed"
    assert "state-failed" in after[victim.url]["class"]  # ui.css draws it red
    assert after[up.instance_processes[0].url]["state"] == "active"
    shot = tmp_path / "after.png"
    browser.screenshot(up.cluster_page, shot)
    assert shot.stat().st_size > 10_000
    keep = os.environ.get("KVSP_UI_SCREENSHOTS")
    if keep:
        shutil.copy(tmp_path / "before.png", Path(keep) / "before.png")
        shutil.copy(shot, Path(keep) / "after.png")
