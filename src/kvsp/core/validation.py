"""Pydantic validation mapped onto kvsp errors.

Descriptors and records are pydantic models; callers want one kvsp error with one line that
names every offending member, whatever the input form (JSON text, octets or a decoded object).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kvsp.core.problems import InvalidInput, KvspError

__all__ = ["MAX_LISTED_ERRORS", "decimal", "format_validation_error", "parse_model"]

M = TypeVar("M", bound=BaseModel)

_DECIMAL = re.compile(r"[0-9]{1,18}")
#: offending members a message names at most: a batch of thousands of bad records is refused
#: with a detail (and a log line) of a few hundred octets, not one line per member
MAX_LISTED_ERRORS = 8


def decimal(text: str) -> int | None:
    """``text`` as a non-negative integer of 1 to 18 ASCII digits; None for anything else.

    Every query parameter and numeric field is read through this: ``str.isdigit`` also accepts
    superscripts and other scripts' digits, which ``int`` then refuses (an internal error) or
    reads as a number the client never wrote."""
    return int(text) if _DECIMAL.fullmatch(text) else None


def format_validation_error(exc: ValidationError) -> str:
    """One line naming the offending members (the first ``MAX_LISTED_ERRORS``, then how many
    more), for problem details and CLI errors."""
    errors = exc.errors()
    parts = []
    for err in errors[:MAX_LISTED_ERRORS]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        msg = "unknown member" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{where}: {msg}")
    if len(errors) > MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - MAX_LISTED_ERRORS} more")
    return "; ".join(parts)


def parse_model(
    model: type[M],
    data: str | bytes | Mapping[str, Any],
    error: type[InvalidInput],
    label: str,
    too_long: type[KvspError] | None = None,
) -> M:
    """Validate JSON text, octets or a decoded object as ``model``; failures raise ``error``,
    or ``too_long`` where a top-level member holds more items than the model allows."""
    try:
        if isinstance(data, str | bytes):
            return model.model_validate_json(data)
        return model.model_validate(data)
    except ValidationError as exc:
        failed: type[KvspError] = error
        if too_long is not None and any(
            e["type"] == "too_long" and len(e["loc"]) == 1 for e in exc.errors()
        ):
            failed = too_long
        raise failed(f"invalid {label}: {format_validation_error(exc)}") from None
