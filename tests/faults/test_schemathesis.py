"""schemathesis against every service started as a real process: no server error, and no
answer that breaks the service's own OpenAPI document.

Generated records name arbitrary hosts (a status's instance, a prefetch's sources) that a
service would then call, so each service and schemathesis run in a network namespace of the
test's own (``unshare -n``) where only loopback exists: nothing generated leaves the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvsp.model import ModelFiles
from tests.integration.instances import tenants_toml
from tests.servers import KVSP

pytestmark = pytest.mark.slow

ST = Path(sys.executable).with_name("st")
ROOT = Path(__file__).resolve().parents[2]
PORT = 9180
CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance"
# readyz takes no input, and its 503 is an answer (not ready), not a fault: tests/web/test_probes


def _fuzz(service: list[str], examples: int, timeout_s: int, folder: Path) -> str:
    """Run ``kvsp SERVICE...`` and schemathesis against it in a private network namespace,
    in ``folder`` (the service's log and schemathesis's files go there); schemathesis's report
    (the test fails on a non-zero exit)."""
    if shutil.which("unshare") is None:
        raise AssertionError("unshare (util-linux) is needed to keep generated traffic local")
    base = f"http://127.0.0.1:{PORT}/kvsp/"
    script = textwrap.dedent(
        f"""
        set -u
        ip link set lo up
        {KVSP} {" ".join(service)} --port {PORT} --log-level warning > service.log 2>&1 &
        pid=$!
        for _ in $(seq 600); do
            "{sys.executable}" -c "import urllib.request as u; u.urlopen('{base}healthz')" \\
                2>/dev/null && break
            sleep 0.1
        done
        "{ST}" run "{base}openapi.json" --checks {CHECKS} --max-examples {examples} \\
            --exclude-path /kvsp/readyz --request-timeout 60 --no-color
        status=$?
        kill $pid
        wait $pid
        exit $status
        """
    )
    hooks = {"SCHEMATHESIS_HOOKS": "tests.faults.schemathesis_hooks", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["unshare", "-n", "bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, **hooks},
        cwd=folder,
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-6000:]
    generated = [line.strip() for line in report.splitlines() if "generated," in line]
    print(f"schemathesis, kvsp {service[0]}: {generated}")
    return report


def test_index_service(tmp_path: Path) -> None:
    report = _fuzz(["index", "serve"], 60, 300, tmp_path)
    assert "passed" in report


def test_holder(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{PORT}/kvsp/"
    report = _fuzz(["holder", "serve", "--url", url, "--host-bytes", "64M"], 60, 300, tmp_path)
    assert "passed" in report


def test_controller_and_front_end(tmp_path: Path, model_files: ModelFiles) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml(model_files.compat_id.hex()))
    report = _fuzz(
        ["controller", "serve", "--tenants", str(tenants), "--frontend"], 40, 400, tmp_path
    )
    assert "passed" in report


def test_instance(tmp_path: Path, model_files: ModelFiles) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml(model_files.compat_id.hex()))
    url = f"http://127.0.0.1:{PORT}/kvsp/"
    args = ["instance", "serve", "--url", url, "--tenants", str(tenants), "--max-tokens", "2",
            "--threads", "1"]  # fmt: skip
    report = _fuzz(args, 20, 500, tmp_path)
    assert "passed" in report
