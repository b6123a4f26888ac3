"""The ``kvsp`` command line, run as a real process."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.core.test_golden_vectors import (
    COMPAT_HEX,
    DESCRIPTOR,
    KEY_HEX,
    SCOPE_HEX,
    SCOPE_KEY,
    TOKENS,
)

KVSP = Path(sys.executable).with_name("kvsp")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVSP), *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def fails(*args: str, match: str) -> None:
    result = run(*args)
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvsp: error: ")
    assert match in lines[0], lines[0]


def test_console_script_is_installed() -> None:
    assert KVSP.exists()
    assert "compat-id" in run("--help").stdout


def test_compat_id(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(DESCRIPTOR))
    result = run("compat-id", str(path))
    assert result.returncode == 0
    assert result.stdout == COMPAT_HEX + "\n"


def test_compat_id_rejects_unknown_members(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({**DESCRIPTOR, "rope_scaling": 2}))
    fails("compat-id", str(path), match="rope_scaling: unknown member")
    fails("compat-id", str(tmp_path / "none.json"), match="cannot read descriptor")


def test_scope_id() -> None:
    result = run("scope-id", "--scope-key", SCOPE_KEY.hex())
    assert result.stdout == SCOPE_HEX + "\n"
    fails("scope-id", "--scope-key", "ab" * 31, match="at least 32 octets")
    fails("scope-id", "--scope-key", "xyz", match="hex digits")
    fails("scope-id", match="--scope-key")


def test_block_keys(tmp_path: Path) -> None:
    common = ["--scope-key", SCOPE_KEY.hex(), "--compat-id", COMPAT_HEX, "--block-tokens", "4"]
    result = run("block-keys", *common, "--tokens", ",".join(map(str, TOKENS)))
    assert result.stdout.split() == KEY_HEX
    as_json = tmp_path / "t.json"
    as_json.write_text(json.dumps(TOKENS))
    as_text = tmp_path / "t.txt"
    as_text.write_text(" ".join(map(str, TOKENS)) + "\n")
    for path in (as_json, as_text):
        assert run("block-keys", *common, "--tokens-file", str(path)).stdout.split() == KEY_HEX
    chained = run("block-keys", *common, "--tokens", "1,2,3,4", "--parent", KEY_HEX[1])
    assert len(chained.stdout.split()) == 1
    assert run("block-keys", *common, "--tokens", "1,2").stdout == ""


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--tokens", "1,-2"], "non-negative integer"),
        (["--tokens", "1,4294967296,3,4"], "0..2^32-1"),
        (["--tokens", "1,2", "--tokens-file", "x"], "exactly one"),
        ([], "exactly one"),
        (["--tokens", "1", "--parent", "zz"], "block key"),
    ],
)
def test_block_keys_rejections(extra: list[str], match: str) -> None:
    common = ["--scope-key", SCOPE_KEY.hex(), "--compat-id", COMPAT_HEX, "--block-tokens", "4"]
    fails("block-keys", *common, *extra, match=match)


def test_block_keys_rejects_a_bad_compat_id_and_block_size() -> None:
    fails(
        "block-keys",
        "--scope-key",
        SCOPE_KEY.hex(),
        "--compat-id",
        "12",
        "--block-tokens",
        "4",
        "--tokens",
        "1",
        match="compat id",
    )
    fails(
        "block-keys",
        "--scope-key",
        SCOPE_KEY.hex(),
        "--compat-id",
        COMPAT_HEX,
        "--block-tokens",
        "0",
        "--tokens",
        "1",
        match="--block-tokens",
    )


def test_container_build_and_inspect(tmp_path: Path) -> None:
    sections = []
    for i in range(4):
        path = tmp_path / f"s{i}"
        path.write_bytes(np.full((16, 3, 64), i, dtype="<f4").tobytes())
        sections.append(str(path))
    descriptor = tmp_path / "d.json"
    descriptor.write_text(json.dumps(DESCRIPTOR))
    out = tmp_path / "block.kvb"
    result = run(
        "container",
        "build",
        "--first-layer",
        "3",
        "--token-count",
        "16",
        "--out",
        str(out),
        "--descriptor",
        str(descriptor),
        *sections,
    )
    assert result.returncode == 0, result.stderr
    inspected = run("container", "inspect", str(out), "--descriptor", str(descriptor))
    doc = json.loads(inspected.stdout)
    data = [Path(p).read_bytes() for p in sections]
    layer_digests = [
        hashlib.sha256(data[0] + data[1]).hexdigest(),
        hashlib.sha256(data[2] + data[3]).hexdigest(),
    ]
    assert doc == {
        "version": 1,
        "flags": 0,
        "codec": 1,
        "first_layer": 3,
        "layer_count": 2,
        "token_count": 16,
        "layers": [
            {"layer": 3, "k_length": 12288, "v_length": 12288, "digest": layer_digests[0]},
            {"layer": 4, "k_length": 12288, "v_length": 12288, "digest": layer_digests[1]},
        ],
        "digest": hashlib.sha256(b"".join(bytes.fromhex(d) for d in layer_digests)).hexdigest(),
    }


def test_container_rejections(tmp_path: Path) -> None:
    section = str(tmp_path / "s")
    Path(section).write_bytes(bytes(8))

    def build(tokens: str, out: Path, *sections: str) -> list[str]:
        return [
            "container",
            "build",
            "--first-layer",
            "0",
            "--token-count",
            tokens,
            "--out",
            str(out),
            *sections,
        ]

    out = tmp_path / "o"
    fails(*build("1", out, section), match="K V pairs")
    fails(*build("3", out, section, section), match="whole number")
    fails(*build("1", out, section, str(tmp_path / "missing")), match="cannot read section")
    fails(*build("1", tmp_path / "no" / "dir", section, section), match="cannot write")
    garbage = tmp_path / "g"
    garbage.write_bytes(b"KVB1" + bytes(30))
    fails("container", "inspect", str(garbage), match="version")
    fails("container", "inspect", str(tmp_path / "missing"), match="cannot read container")


def test_usage_errors_are_one_line() -> None:
    fails("bogus", match="No such command")
    fails("container", "inspect", match="Missing argument")
    fails("scope-id", "--scope-key", "ab" * 32, "--what", match="No such option")
    result = run()
    assert result.returncode == 2
    assert "Usage" in result.stderr


def test_module_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvsp", "scope-id", "--scope-key", SCOPE_KEY.hex()],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.strip() == SCOPE_HEX


def test_index_serve_rejections(tmp_path: Path) -> None:
    fails("index", "serve", "--host", "0.0.0.0", "--port", "0", match="loopback only")
    fails("index", "serve", "--store", "postgres://db", "--port", "0", match="redis:// URL")
    fails("index", "serve", "--auth", str(tmp_path / "none.toml"), match="cannot read principals")
    bad = tmp_path / "p.toml"
    bad.write_text("[principals.a]\nroles = ['holder']\n")
    fails("index", "serve", "--auth", str(bad), match="token_sha256")
