"""``kvsp.settings``: flags over ``KVSP_*`` environment over the config file over defaults, for
every service; secrets only from files or the environment, masked when printed; an invalid
setting is refused naming its flag, variable and table; a real service runs from a file."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

import kvsp.cli  # noqa: F401 - registers every service's settings
from kvsp.core.problems import ConfigurationError
from kvsp.local import free_port
from kvsp.settings import SERVICES
from tests.servers import KVSP

DOCS = Path(__file__).parents[1] / "docs" / "operations.md"


def test_every_service_has_settings_and_every_setting_is_documented_with_its_variable() -> None:
    assert set(SERVICES) == {"index", "holder", "controller", "frontend", "instance", "ingest"}
    text = DOCS.read_text()
    missing = [
        f"{model.env_prefix()}{name.upper()}"
        for model in SERVICES.values()
        for name in model.model_fields
        if f"`{model.env_prefix()}{name.upper()}`" not in text
    ]
    assert missing == []


def test_flags_beat_the_environment_which_beats_the_file_which_beats_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kvsp.toml"
    config.write_text("[index]\nport = 9400\nmax_ttl_ms = 1000\nmax_records = 7\n")
    index = SERVICES["index"]
    monkeypatch.setenv("KVSP_INDEX_MAX_TTL_MS", "2000")
    monkeypatch.setenv("KVSP_INDEX_MAX_RECORDS", "8")
    loaded = index.load(config, {"max_records": 9}).arguments()
    assert loaded["port"] == 9400  # the file
    assert loaded["max_ttl_ms"] == 2000  # the environment over the file
    assert loaded["max_records"] == 9  # the flag over both
    assert loaded["max_layers"] == 1024  # the default
    assert index.load(None, {}).arguments()["port"] == 9100


def test_an_invalid_setting_names_its_flag_variable_and_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kvsp.toml"
    config.write_text(
        "[holder]\nurl = 'http://127.0.0.1:1/kvsp/'\nhost_bytes = '1G'\nport = 70000\n"
    )
    with pytest.raises(ConfigurationError, match=r"--port \(KVSP_HOLDER_PORT, holder.port\)"):
        SERVICES["holder"].load(config, {})
    config.write_text("[holder]\nnot_a_setting = 1\n")
    with pytest.raises(ConfigurationError, match="not_a_setting"):
        SERVICES["holder"].load(config, {})
    with pytest.raises(ConfigurationError, match=r"--url \(KVSP_HOLDER_URL"):  # required
        SERVICES["holder"].load(None, {"host_bytes": "1G"})
    monkeypatch.setenv("KVSP_INDEX_PORT", "many")
    with pytest.raises(ConfigurationError, match="KVSP_INDEX_PORT"):
        SERVICES["index"].load(None, {})


def test_a_token_comes_from_its_file_or_the_environment_never_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = SERVICES["holder"]
    base = {"url": "http://127.0.0.1:1/kvsp/", "host_bytes": "1G"}
    monkeypatch.setenv("KVSP_HOLDER_INDEX_TOKEN", "from-the-environment")
    given = holder.load(None, base).arguments()["index_token_file"]
    assert given.get_secret_value() == "from-the-environment"
    file = tmp_path / "t"
    file.write_text("from-a-file")
    assert (
        holder.load(None, {**base, "index_token_file": file}).arguments()["index_token_file"]
        == file
    )
    config = tmp_path / "kvsp.toml"
    config.write_text("[holder]\nindex_token = 'leaked'\n")
    with pytest.raises(ConfigurationError, match="secrets"):
        holder.load(config, base)


def test_config_check_prints_effective_settings_masked_and_exits_2_when_invalid(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvsp.toml"
    config.write_text("[index]\nport = 9400\n[controller]\ntenants = 'tenants.toml'\n")
    env = {"KVSP_CONTROLLER_INDEX_TOKEN": "sekrit", "KVSP_INDEX_LOG_LEVEL": "warning",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    done = subprocess.run([str(KVSP), "config", "check", str(config)], capture_output=True,
                          text=True, env=env, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["index"]["port"] == 9400
    assert shown["index"]["log_level"] == "warning"
    assert shown["controller"]["index_token"] == "**********"
    assert "sekrit" not in done.stdout
    config.write_text("[index]\nport = -1\n[nothing]\n")
    done = subprocess.run([str(KVSP), "config", "check", str(config)], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2
    assert "unknown tables ['nothing']" in done.stderr


def test_a_service_runs_from_its_config_file_and_environment(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "kvsp.toml"
    config.write_text(f"[index]\nport = {port}\nlog_format = 'text'\n")
    env = {"KVSP_INDEX_LOG_FORMAT": "json", "PATH": "/usr/bin:/bin"}
    command = [str(KVSP), "index", "serve", "--config", str(config)]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env) as process:
        try:
            for _ in range(600):
                try:
                    assert httpx.get(f"http://127.0.0.1:{port}/kvsp/livez").status_code == 200
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
        finally:
            process.terminate()
            _, err = process.communicate(timeout=15)
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert lines  # the environment's json over the file's text
    assert {line["service"] for line in lines} == {"index"}
