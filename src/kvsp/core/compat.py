"""The Compatibility Descriptor and its Compatibility ID (KVSP 4.1).

Two caches may substitute for each other only when their Compatibility IDs are equal, so the
descriptor is validated strictly: every REQUIRED member present with its JSON type, digests in
their exact form, registry names known, and unknown members rejected rather than dropped (a
member we do not understand might change the tensors; see docs/decisions/0002).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import rfc8785
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from kvsp.core.ids import CompatId
from kvsp.core.problems import DescriptorError
from kvsp.core.registries import ElementType, element_type, layout, parse_positional
from kvsp.core.validation import parse_model

__all__ = [
    "COMPAT_DOMAIN",
    "DIGEST_PATTERN",
    "CompatibilityDescriptor",
    "Geometry",
    "Sha256Digest",
    "canonical_json",
    "compute_compat_id",
    "file_digest",
    "model_digest",
    "tokenizer_digest",
]

COMPAT_DOMAIN = b"KVSP-COMPAT-1\x00"
DIGEST_PATTERN = r"^sha-256:[0-9a-f]{64}$"
_READ_CHUNK = 1 << 20
_REGISTRY_CHECKS: dict[str, Callable[[str], object]] = {
    "kv_dtype": element_type,
    "positional": parse_positional,
    "layout": layout,
}

Sha256Digest = Annotated[StrictStr, Field(pattern=DIGEST_PATTERN)]
_Count = Annotated[StrictInt, Field(ge=1, le=65_535)]


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the raw codec needs to size a layer section: elements per token and their width."""

    layers: int
    kv_heads: int
    head_dim: int
    element: ElementType

    def section_bytes(self, tokens: int) -> int:
        return tokens * self.kv_heads * self.head_dim * self.element.size


class CompatibilityDescriptor(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[StrictStr, Field(min_length=1)]
    model_digest: Sha256Digest
    tokenizer_digest: Sha256Digest
    adapters: Annotated[tuple[Sha256Digest, ...], Field(min_length=1)] | None = None
    layers: _Count
    kv_heads: _Count
    head_dim: _Count
    kv_dtype: StrictStr
    positional: StrictStr
    block_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 20)]
    layout: StrictStr

    @field_validator("kv_dtype", "positional", "layout")
    @classmethod
    def _registered(cls, value: str, info: ValidationInfo) -> str:
        try:
            _REGISTRY_CHECKS[str(info.field_name)](value)
        except DescriptorError as exc:
            raise ValueError(exc.detail) from None
        return value

    @classmethod
    def parse(cls, data: str | bytes | Mapping[str, Any]) -> CompatibilityDescriptor:
        """Validate a descriptor from JSON text or a decoded object; errors are DescriptorError."""
        return parse_model(cls, data, DescriptorError, "descriptor")

    def to_json_object(self) -> dict[str, Any]:
        """The descriptor as a JSON object, with ``adapters`` absent when unused."""
        return self.model_dump(mode="json", exclude_none=True)

    def canonical(self) -> bytes:
        return canonical_json(self.to_json_object())

    def compat_id(self) -> CompatId:
        return compute_compat_id(self.canonical())

    @property
    def geometry(self) -> Geometry:
        return Geometry(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            element=element_type(self.kv_dtype),
        )


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) octets of a JSON value; the one canonicalisation path kvsp uses."""
    try:
        return rfc8785.dumps(value)
    except rfc8785.CanonicalizationError as exc:
        raise DescriptorError(f"value cannot be canonicalized: {exc}") from None


def compute_compat_id(canonical_descriptor: bytes) -> CompatId:
    """SHA-256("KVSP-COMPAT-1" || 0x00 || JCS(descriptor)) over already canonical octets."""
    return CompatId(hashlib.sha256(COMPAT_DOMAIN + canonical_descriptor).digest())


def file_digest(paths: Iterable[Path]) -> str:
    """``sha-256:<hex>`` of the files concatenated in the given order, streamed in 1 MiB reads."""
    h = hashlib.sha256()
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    return "sha-256:" + h.hexdigest()


def model_digest(weight_files: Iterable[Path | str]) -> str:
    """``model_digest`` over weight files in ascending byte order of their file names.

    File names (not directories) decide the order, compared as the octets the file system
    stores, so the digest is the same on every machine. Two files with one name are ambiguous
    and rejected.
    """
    paths = [Path(p) for p in weight_files]
    if not paths:
        raise DescriptorError("model_digest needs at least one weight file")
    names = [os.fsencode(p.name) for p in paths]
    if len(set(names)) != len(names):
        raise DescriptorError("weight files must have distinct file names")
    return file_digest(p for _, p in sorted(zip(names, paths, strict=True)))


def tokenizer_digest(tokenizer_file: Path | str) -> str:
    """``tokenizer_digest`` of the tokenizer definition file (e.g. tokenizer.json)."""
    return file_digest([Path(tokenizer_file)])
