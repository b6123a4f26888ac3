"""Compatibility Descriptor validation, Compatibility ID, and the file digests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from kvsp.core.compat import (
    CompatibilityDescriptor,
    canonical_json,
    compute_compat_id,
    model_digest,
    tokenizer_digest,
)
from kvsp.core.problems import DescriptorError
from tests.core.test_golden_vectors import COMPAT_HEX, DESCRIPTOR


def _with(**changes: Any) -> dict[str, Any]:
    out = dict(DESCRIPTOR)
    for key, value in changes.items():
        if value is ...:
            out.pop(key)
        else:
            out[key] = value
    return out


def test_parse_from_json_text_and_bytes() -> None:
    text = json.dumps(DESCRIPTOR)
    assert CompatibilityDescriptor.parse(text).compat_id().hex() == COMPAT_HEX
    assert CompatibilityDescriptor.parse(text.encode()).compat_id().hex() == COMPAT_HEX


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": ...}, "model: Field required"),
        ({"layers": ...}, "layers: Field required"),
        ({"extra_scaling": 2}, "extra_scaling: unknown member"),
        ({"adapters": []}, "adapters"),
        ({"adapters": ["sha-256:" + "a" * 63]}, "adapters.0"),
        ({"model_digest": "sha-256:" + "A" * 64}, "model_digest"),
        ({"model_digest": "sha256:" + "a" * 64}, "model_digest"),
        ({"tokenizer_digest": "sha-512:" + "a" * 64}, "tokenizer_digest"),
        ({"layers": "30"}, "layers: Input should be a valid integer"),
        ({"layers": 30.0}, "layers: Input should be a valid integer"),
        ({"layers": True}, "layers: Input should be a valid integer"),
        ({"layers": 0}, "layers"),
        ({"kv_dtype": "float64"}, "kv_dtype 'float64' is not registered"),
        ({"layout": "kvsp-layout-2"}, "layout 'kvsp-layout-2' is not registered"),
        ({"positional": "yarn"}, "positional encoding 'yarn' is not registered"),
        ({"positional": "rope;theta=1e5"}, "not a canonical number"),
        ({"positional": "rope;theta=10000.0"}, "not a canonical number"),
        ({"positional": "rope;theta=10000;factor=2"}, "ascending order"),
        ({"positional": "rope;theta=1;theta=2"}, "ascending order"),
        ({"positional": "rope;speed=2"}, "not registered for 'rope'"),
        ({"positional": "rope;theta"}, "not registered for 'rope'"),
        ({"positional": "none;theta=1"}, "not registered for 'none'"),
        ({"positional": "rope;original_max_position=1.5"}, "canonical integer"),
        ({"model": ""}, "model"),
    ],
)
def test_rejections(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(DescriptorError, match="invalid descriptor") as info:
        CompatibilityDescriptor.parse(_with(**changes))
    assert message in str(info.value)


def test_not_json() -> None:
    with pytest.raises(DescriptorError, match="invalid descriptor"):
        CompatibilityDescriptor.parse("{not json")


@pytest.mark.parametrize(
    "positional",
    [
        "rope",
        "rope;theta=100000",
        "rope;factor=8;high_freq_factor=4;low_freq_factor=1;original_max_position=8192;"
        "scaling=llama3;theta=500000",
        "rope;factor=0.5;scaling=linear",
        "alibi;max_bias=8",
        "none",
    ],
)
def test_registered_positional_forms(positional: str) -> None:
    CompatibilityDescriptor.parse(_with(positional=positional))


def test_every_member_changes_the_id() -> None:
    base = CompatibilityDescriptor.parse(DESCRIPTOR).compat_id()
    variants = [
        _with(model="SmolLM2-360M"),
        _with(model_digest="sha-256:" + "3" * 64),
        _with(tokenizer_digest="sha-256:" + "3" * 64),
        _with(adapters=["sha-256:" + "4" * 64]),
        _with(layers=31),
        _with(kv_heads=4),
        _with(head_dim=32),
        _with(kv_dtype="float16"),
        _with(positional="rope;theta=10000"),
        _with(block_tokens=32),
    ]
    ids = {CompatibilityDescriptor.parse(v).compat_id() for v in variants}
    assert len(ids) == len(variants)
    assert base not in ids


def test_adapters_absent_when_unused_and_ordered_when_present() -> None:
    plain = CompatibilityDescriptor.parse(DESCRIPTOR)
    assert "adapters" not in plain.to_json_object()
    a, b = "sha-256:" + "4" * 64, "sha-256:" + "5" * 64
    first = CompatibilityDescriptor.parse(_with(adapters=[a, b]))
    second = CompatibilityDescriptor.parse(_with(adapters=[b, a]))
    assert first.to_json_object()["adapters"] == [a, b]
    assert first.compat_id() != second.compat_id()


def test_compat_id_is_the_domain_separated_hash() -> None:
    descriptor = CompatibilityDescriptor.parse(DESCRIPTOR)
    canonical = canonical_json(descriptor.to_json_object())
    assert compute_compat_id(canonical) == hashlib.sha256(b"KVSP-COMPAT-1\0" + canonical).digest()


def test_geometry() -> None:
    geometry = CompatibilityDescriptor.parse(DESCRIPTOR).geometry
    assert geometry.section_bytes(16) == 16 * 3 * 64 * 4
    assert 2 * geometry.section_bytes(1) * geometry.layers == 46_080  # SmolLM2 KV per token


def test_unrepresentable_values_are_descriptor_errors() -> None:
    with pytest.raises(DescriptorError, match="canonicalized"):
        canonical_json({"n": 2**60})


def test_model_digest_orders_files_by_name_octets(tmp_path: Path) -> None:
    files = {
        "model-00002.safetensors": b"second",
        "Model-00001.safetensors": b"upper",
        "a.bin": b"a",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    # byte order: "M" (0x4d) < "a" (0x61) < "m" (0x6d)
    expected = "sha-256:" + hashlib.sha256(b"upper" + b"a" + b"second").hexdigest()
    assert model_digest(tmp_path / n for n in files) == expected
    assert model_digest(sorted(tmp_path / n for n in files)) == expected


def test_model_digest_streams_large_files(tmp_path: Path) -> None:
    big = tmp_path / "w.safetensors"
    data = bytes(range(256)) * 20_000  # several read chunks
    big.write_bytes(data)
    assert model_digest([big]) == "sha-256:" + hashlib.sha256(data).hexdigest()


def test_model_digest_rejects_ambiguous_or_empty_input(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "w.bin").write_bytes(b"1")
    (tmp_path / "x" / "w.bin").write_bytes(b"2")
    with pytest.raises(DescriptorError, match="distinct"):
        model_digest([tmp_path / "w.bin", tmp_path / "x" / "w.bin"])
    with pytest.raises(DescriptorError, match="at least one"):
        model_digest([])


def test_tokenizer_digest(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b'{"version": "1.0"}')
    assert tokenizer_digest(path) == "sha-256:" + hashlib.sha256(path.read_bytes()).hexdigest()
