"""The KvHints vocabulary, pure: the envelope, the action types, each action's payload, and the
outcomes with machine-readable reason codes. The controller and the simulator build envelopes
and read outcomes with it; instances (``kvsp.instance.hints``) answer with it.

The envelope is the one vLLM merged and SGLang and Dynamo mirror, so one orchestrator can
address any of them: ``{"protocol_version": "0.1", "message_id", "actions": [{"action_id",
"action_type", "action_version", "payload"}]}``. Our action types are ``kv.share``,
``kv.prefetch``, ``kv.demote``, ``kv.pin`` and ``kv.retain`` (the bare names are accepted too),
version ``1.x``; their payload (docs/api.md) names a target, a session or exact block keys, and
bounds. An action we do not implement, or cannot parse, is answered ``rejected`` with the
reason; it never fails the envelope.

Outcomes: ``accepted`` (done as asked), ``clipped`` (done, but less than asked: a shorter TTL, a
lower priority, fewer blocks because of a limit or because some are not held, listed in
``missing``), ``deferred`` (nothing done now because of a passing condition: no room that is not
protected, a destination that did not answer; it may be sent again), ``rejected`` (invalid or
not allowed), ``missing`` (none of the target blocks is held here). Every outcome other than
``accepted`` carries a ``code`` (``Reason``) for programs and a ``reason`` for people.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvsp.core.records import Hex16, Hex32, HttpUrl, Record

__all__ = [
    "ACTIONS",
    "ActionType",
    "HintAction",
    "HintOutcome",
    "HintPayload",
    "KvHints",
    "Outcome",
    "Reason",
    "Target",
    "action_name",
    "envelope",
    "parse_payload",
    "read_action",
    "rejection",
]


class ActionType(StrEnum):
    SHARE = "kv.share"
    PREFETCH = "kv.prefetch"
    DEMOTE = "kv.demote"
    PIN = "kv.pin"
    RETAIN = "kv.retain"


#: the actions' bare names, as ``action_name`` gives them
ACTIONS = tuple(a.value.removeprefix("kv.") for a in ActionType)
Outcome = Literal["accepted", "clipped", "deferred", "rejected", "missing"]


class Reason(StrEnum):
    """Why an action was not done (entirely) as asked."""

    #: some or all target blocks are not held here (or were dropped to make room)
    NOT_HELD = "not-held"
    #: the payload's ``limit_blocks`` cut the blocks acted on
    LIMIT_BLOCKS = "limit-blocks"
    #: a TTL or priority above the instance's limits was lowered
    OVER_LIMITS = "over-limits"
    #: the pin octet limits (session, scope, total) are reached
    PIN_LIMIT = "pin-limit"
    #: no room that is not protected
    NO_ROOM = "no-room"
    #: the share destination (or the instance, or its holder) could not be asked or did not
    #: take it
    UNREACHABLE = "unreachable"
    INVALID = "invalid"
    NOT_IMPLEMENTED = "not-implemented"
    FORBIDDEN = "forbidden"
    #: a session target on an instance that keeps no SessionPrefixIndex
    NO_SESSION_INDEX = "no-session-index"
    #: the part that would move or protect pages of the engine's own cache (vLLM's G1): the
    #: engine offers no way to, and its pages follow its own eviction
    ENGINE_G1 = "engine-g1"


class HintAction(Record):
    action_id: Annotated[str, Field(min_length=1, max_length=256)]
    action_type: Annotated[str, Field(min_length=1, max_length=64)]
    action_version: Annotated[str, Field(min_length=1, max_length=16)]
    payload: dict[str, Any]


class KvHints(Record):
    """The envelope. Only protocol version 0.1 exists; another is refused whole."""

    protocol_version: Literal["0.1"]
    message_id: Annotated[str, Field(min_length=1, max_length=256)]
    actions: Annotated[list[HintAction], Field(max_length=256)]


class Target(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    scope_id: Hex16 | None = None
    block_keys: Annotated[tuple[Hex32, ...], Field(min_length=1, max_length=4096)] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Target:
        if (self.session is None) == (self.block_keys is None):
            raise ValueError("a target is a session or block keys, not both")
        if self.block_keys is not None and self.scope_id is None:
            raise ValueError("block keys need their scope_id")
        return self


class HintPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: Target
    ttl_ms: Annotated[int, Field(gt=0)] | None = None
    priority: Annotated[int, Field(ge=0)] | None = None
    destination: HttpUrl | None = None
    tier: Literal["g1", "g2"] | None = None
    #: resource limit: act on at most this many blocks, root first
    limit_blocks: Annotated[int, Field(gt=0)] | None = None


@dataclass
class HintOutcome:
    action_id: str
    action_type: str
    outcome: Outcome
    reason: str | None = None
    #: why, for programs: set with ``reason`` whenever the outcome is not ``accepted``
    code: Reason | None = None
    #: blocks the action was carried out on
    blocks: int = 0
    missing: list[str] = field(default_factory=list)
    ttl_ms: int | None = None
    priority: int | None = None

    def note(self, outcome: Outcome, code: Reason, reason: str) -> None:
        """The action was not done (entirely) as asked: how, why for programs, why for people."""
        self.outcome, self.code, self.reason = outcome, code, reason

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "action_id": self.action_id,
            "action_type": self.action_type,
            "outcome": self.outcome,
            "blocks": self.blocks,
        }
        for name in ("reason", "code", "ttl_ms", "priority"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.missing:
            out["missing"] = self.missing
        return out


def action_name(action: HintAction) -> str | None:
    """Our name for the action (``kv.pin`` and ``pin`` are the same), or None if we do not
    implement it in this version."""
    name = action.action_type.removeprefix("kv.")
    if name not in ACTIONS or action.action_version.split(".")[0] != "1":
        return None
    return name


def parse_payload(action: HintAction) -> HintPayload | str:
    """The payload, or the reason it is invalid."""
    try:
        return HintPayload.model_validate(action.payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "payload"
        return f"{where}: {first['msg']}"


def rejection(action: HintAction, code: Reason, reason: str) -> HintOutcome:
    return HintOutcome(action.action_id, action.action_type, "rejected", reason, code)


def read_action(action: HintAction) -> tuple[str, HintPayload] | HintOutcome:
    """Our name for the action and its payload, or the outcome refusing it: an action type or
    version we do not implement (named), or a payload that does not parse."""
    name = action_name(action)
    if name is None:
        unknown = f"{action.action_type} version {action.action_version} is not implemented here"
        return rejection(action, Reason.NOT_IMPLEMENTED, unknown)
    payload = parse_payload(action)
    if isinstance(payload, str):
        return rejection(action, Reason.INVALID, payload)
    return name, payload


def envelope(actions: Sequence[tuple[ActionType, dict[str, Any]]]) -> KvHints:
    """An envelope of version-1.0 actions, each with a fresh id."""
    return KvHints(
        protocol_version="0.1",
        message_id=str(uuid.uuid4()),
        actions=[
            HintAction(
                action_id=str(uuid.uuid4()),
                action_type=action,
                action_version="1.0",
                payload=payload,
            )
            for action, payload in actions
        ],
    )
