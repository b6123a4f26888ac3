"""The KVSP registries (spec 11.2) as kvsp defines them: element types, positional encodings,
codecs, layouts and storage tiers.

The spec leaves the registry contents to IANA; docs/decisions/0001-registries.md records the
entries and the positional parameter syntax chosen here. Everything that decides whether two
caches are interchangeable validates against these tables, so an unknown name is an error rather
than a silently different identity.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Literal, get_args

from kvsp.core.problems import DescriptorError

__all__ = [
    "BLOCK_MEDIA_TYPE",
    "CODECS",
    "CODEC_ENGINE_PAGES",
    "CODEC_RAW",
    "ELEMENT_TYPES",
    "JSON_MEDIA_TYPE",
    "LAYOUTS",
    "LAYOUT_1",
    "POSITIONAL_ENCODINGS",
    "PROBLEM_MEDIA_TYPE",
    "SERVED_CODECS",
    "TIERS",
    "Codec",
    "ElementType",
    "ParamKind",
    "PositionalEncoding",
    "Tier",
    "element_type",
    "layout",
    "parse_positional",
]


@dataclass(frozen=True, slots=True)
class ElementType:
    """A cache element type: its size in octets and the little-endian numpy dtype that stores it.

    ``storage_dtype`` is the dtype kvsp uses for zero-copy views; for types numpy lacks
    (bfloat16, float8) it is the unsigned integer of the same width, which keeps the octets
    exact without interpreting them.
    """

    name: str
    size: int
    storage_dtype: str
    native: bool


ELEMENT_TYPES: Mapping[str, ElementType] = MappingProxyType(
    {
        t.name: t
        for t in (
            ElementType("float32", 4, "<f4", True),
            ElementType("float16", 2, "<f2", True),
            ElementType("bfloat16", 2, "<u2", False),
            ElementType("float8_e4m3fn", 1, "|u1", False),
            ElementType("float8_e5m2", 1, "|u1", False),
            ElementType("int8", 1, "|i1", True),
        )
    }
)


class ParamKind(Enum):
    """Value syntax of a positional parameter; each admits exactly one spelling per value."""

    NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?")
    INTEGER = re.compile(r"(0|[1-9][0-9]*)")
    NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True, slots=True)
class PositionalEncoding:
    name: str
    params: Mapping[str, ParamKind]


POSITIONAL_ENCODINGS: Mapping[str, PositionalEncoding] = MappingProxyType(
    {
        p.name: p
        for p in (
            PositionalEncoding(
                "rope",
                MappingProxyType(
                    {
                        "attention_factor": ParamKind.NUMBER,
                        "beta_fast": ParamKind.NUMBER,
                        "beta_slow": ParamKind.NUMBER,
                        "factor": ParamKind.NUMBER,
                        "high_freq_factor": ParamKind.NUMBER,
                        "low_freq_factor": ParamKind.NUMBER,
                        "original_max_position": ParamKind.INTEGER,
                        "partial_rotary": ParamKind.NUMBER,
                        "scaling": ParamKind.NAME,
                        "theta": ParamKind.NUMBER,
                    }
                ),
            ),
            PositionalEncoding("alibi", MappingProxyType({"max_bias": ParamKind.NUMBER})),
            PositionalEncoding("none", MappingProxyType({})),
        )
    }
)


@dataclass(frozen=True, slots=True)
class Codec:
    code: int
    name: str
    layout: str | None


CODEC_RAW = 0x0001
#: a block held in an engine's own KV pages and not served over KVSP (a vLLM pod whose KV
#: events ``kvsp index ingest`` reads): its record says where a prefix is cached, for placement,
#: and names no representation anyone can fetch (docs/decisions/0001)
CODEC_ENGINE_PAGES = 0x8000
LAYOUT_1 = "kvsp-layout-1"
CODECS: Mapping[int, Codec] = MappingProxyType(
    {
        CODEC_RAW: Codec(CODEC_RAW, "raw", LAYOUT_1),
        CODEC_ENGINE_PAGES: Codec(CODEC_ENGINE_PAGES, "engine-pages", None),
    }
)
#: the codecs a container can be in: what holders store and serve
SERVED_CODECS: frozenset[int] = frozenset({CODEC_RAW})
LAYOUTS: frozenset[str] = frozenset({LAYOUT_1})

#: Storage tiers of a Replica Record's residency, fastest first.
Tier = Literal["device", "host", "disk"]
TIERS: tuple[str, ...] = get_args(Tier)


def element_type(name: str) -> ElementType:
    try:
        return ELEMENT_TYPES[name]
    except KeyError:
        known = ", ".join(sorted(ELEMENT_TYPES))
        raise DescriptorError(f"kv_dtype {name!r} is not registered (known: {known})") from None


def layout(name: str) -> str:
    if name not in LAYOUTS:
        known = ", ".join(sorted(LAYOUTS))
        raise DescriptorError(f"layout {name!r} is not registered (known: {known})")
    return name


def parse_positional(text: str) -> tuple[PositionalEncoding, dict[str, str]]:
    """Split ``name;param=value;...`` and check it against the registry.

    Parameters must be registered for the encoding, appear once, in ascending name order, and
    use the canonical spelling of their kind, so one configuration has exactly one string and
    therefore one Compatibility ID.
    """
    name, *parts = text.split(";")
    encoding = POSITIONAL_ENCODINGS.get(name)
    if encoding is None:
        known = ", ".join(sorted(POSITIONAL_ENCODINGS))
        raise DescriptorError(f"positional encoding {name!r} is not registered (known: {known})")
    params: dict[str, str] = {}
    previous = ""
    for part in parts:
        key, sep, value = part.partition("=")
        kind = encoding.params.get(key)
        if not sep or kind is None:
            raise DescriptorError(f"positional parameter {part!r} is not registered for {name!r}")
        if key <= previous:
            raise DescriptorError(
                f"positional parameters must appear once each in ascending order; {key!r} "
                f"follows {previous!r}"
            )
        if kind.value.fullmatch(value) is None:
            raise DescriptorError(
                f"positional parameter {key}={value!r} is not a canonical {kind.name.lower()}"
            )
        params[key] = value
        previous = key
    return encoding, params


#: KVSP 11.1 and RFC 9457: the media types kvsp services speak.
JSON_MEDIA_TYPE = "application/kvsp+json"
BLOCK_MEDIA_TYPE = "application/kvsp-block"
PROBLEM_MEDIA_TYPE = "application/problem+json"
