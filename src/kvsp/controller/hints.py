"""The controller's KvHint policy, pure: what to tell the instance holding a session's KV when
the session's life moves on, and what to learn from the outcomes.

The controller sees what no instance can: a turn that ended in a tool call (the session will
come back after the tool runs), a session that is over, a session placed on another instance.
The instance sees what the controller cannot: its exact G1/G2 state. So the controller sends
intent (KvHints) and the instance executes, clips, defers or refuses it (``instance.hints``).

``PinOrDemote`` (the default policy):

- a turn ends in a tool call: Pin the session's blocks for the expected gap (the caller's
  estimate, else the session's own history of gaps, else a prior), with a margin; a gap longer
  than pins may last, or a session whose pins were refused for limits, gets Demote instead (the
  KV waits in G2, G1 is free for others);
- a turn ends waiting for the user: Retain (a priority bias, still evictable) for about twice
  the expected gap;
- the session ends: Demote, and the instance forgets it (its pins go);
- the session is placed on another instance: Share from the one holding its KV.

Policies are pluggable (``HintPolicy``) and observable: every planned hint, outcome and gap is
kept per session (``SessionHints``) and counted in the controller's metrics.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsp.core.hints import ActionType, Reason

__all__ = [
    "GapEstimator",
    "HintPolicy",
    "PinOrDemote",
    "PlannedHint",
    "SessionHintTable",
    "SessionHints",
]


@dataclass(frozen=True)
class PlannedHint:
    """One action for one instance."""

    instance: str
    action_type: ActionType
    payload: dict[str, Any]


@dataclass
class SessionHints:
    session: str
    instance: str
    #: when the last turn ended (ms), and whether it ended in a tool call
    turn_ended_ms: int | None = None
    tool_call: bool = False
    #: the last pin was refused or cut for the instance's limits: demote instead
    pin_refused: bool = False
    gaps_ms: list[int] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "tool_call": self.tool_call,
            "pin_refused": self.pin_refused,
            "recent_gaps_ms": self.gaps_ms[-8:],
            "outcomes": dict(self.outcomes),
        }


class GapEstimator:
    """Expected gap between a turn's end and the next turn: an exponentially weighted mean of
    the session's observed gaps, or a prior until it has one."""

    def __init__(self, prior_ms: int = 30_000, weight: float = 0.5) -> None:
        self.prior_ms = prior_ms
        self.weight = weight

    def estimate(self, hints: SessionHints) -> int:
        value = float(self.prior_ms)
        for i, gap in enumerate(hints.gaps_ms[-16:]):
            value = gap if i == 0 else (1 - self.weight) * value + self.weight * gap
        return int(value)


class HintPolicy(Protocol):
    def turn_ended(
        self, hints: SessionHints, tool_call: bool, expected_gap_ms: int | None
    ) -> list[PlannedHint]: ...

    def session_ended(self, hints: SessionHints) -> list[PlannedHint]: ...

    def moved(self, hints: SessionHints, old: str, new: str) -> list[PlannedHint]: ...

    def outcome(self, hints: SessionHints, hint: PlannedHint, outcome: dict[str, Any]) -> None: ...


@dataclass
class PinOrDemote:
    estimator: GapEstimator = field(default_factory=GapEstimator)
    #: the longest pin worth asking for (an instance clips longer ones anyway)
    max_pin_ms: int = 300_000
    #: pin for the expected gap times this, plus ``slack_ms``
    margin: float = 1.5
    slack_ms: int = 2_000
    retain_priority: int = 10

    def _target(self, hints: SessionHints) -> dict[str, Any]:
        return {"target": {"session": hints.session}}

    def turn_ended(
        self, hints: SessionHints, tool_call: bool, expected_gap_ms: int | None
    ) -> list[PlannedHint]:
        gap = expected_gap_ms if expected_gap_ms is not None else self.estimator.estimate(hints)
        ttl = int(gap * self.margin) + self.slack_ms
        if not tool_call:
            payload = {**self._target(hints), "ttl_ms": 2 * ttl, "priority": self.retain_priority}
            return [PlannedHint(hints.instance, ActionType.RETAIN, payload)]
        if ttl <= self.max_pin_ms and not hints.pin_refused:
            pin = {**self._target(hints), "ttl_ms": ttl}
            return [PlannedHint(hints.instance, ActionType.PIN, pin)]
        return [PlannedHint(hints.instance, ActionType.DEMOTE, self._target(hints))]

    def session_ended(self, hints: SessionHints) -> list[PlannedHint]:
        return [PlannedHint(hints.instance, ActionType.DEMOTE, self._target(hints))]

    def moved(self, hints: SessionHints, old: str, new: str) -> list[PlannedHint]:
        share = {**self._target(hints), "destination": new}
        return [PlannedHint(old, ActionType.SHARE, share)]

    def outcome(self, hints: SessionHints, hint: PlannedHint, outcome: dict[str, Any]) -> None:
        """A refused pin, or one the pin limits cut (its ``code``), makes the policy demote
        for this session until a pin is accepted again."""
        if hint.action_type is ActionType.PIN:
            said = outcome.get("outcome")
            limited = said == "clipped" and outcome.get("code") == Reason.PIN_LIMIT
            hints.pin_refused = said == "rejected" or limited


class SessionHintTable:
    """What the controller knows of each session's turns and hints (the latest ``limit``)."""

    def __init__(self, policy: HintPolicy, limit: int = 100_000) -> None:
        self.policy = policy
        self.limit = limit
        self._sessions: OrderedDict[str, SessionHints] = OrderedDict()

    def get(self, session: str) -> SessionHints | None:
        return self._sessions.get(session)

    def restore(self, entries: Sequence[SessionHints]) -> None:
        """Replace every session's state with ``entries`` (a new leader's load)."""
        self._sessions = OrderedDict((e.session, e) for e in entries[-self.limit :])

    def _entry(self, session: str, instance: str) -> SessionHints:
        entry = self._sessions.get(session)
        if entry is None:
            entry = self._sessions[session] = SessionHints(session, instance)
            while len(self._sessions) > self.limit:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session)
        return entry

    def turn_started(self, session: str, instance: str, now_ms: int) -> list[PlannedHint]:
        """A new turn of ``session`` was placed on ``instance``: the gap since its last turn
        is learnt, and a move to another instance asks the policy what to do."""
        entry = self._sessions.get(session)
        if entry is None:
            self._entry(session, instance)
            return []
        planned: list[PlannedHint] = []
        if entry.turn_ended_ms is not None and entry.tool_call:
            entry.gaps_ms.append(max(0, now_ms - entry.turn_ended_ms))
            del entry.gaps_ms[:-16]
        entry.turn_ended_ms = None
        if entry.instance != instance:
            planned = self.policy.moved(entry, entry.instance, instance)
            entry.instance = instance
        self._entry(session, instance)
        return planned

    def turn_ended(
        self,
        session: str,
        instance: str,
        now_ms: int,
        tool_call: bool,
        expected_gap_ms: int | None = None,
    ) -> list[PlannedHint]:
        entry = self._entry(session, instance)
        entry.instance, entry.turn_ended_ms, entry.tool_call = instance, now_ms, tool_call
        return self.policy.turn_ended(entry, tool_call, expected_gap_ms)

    def ended(self, session: str) -> tuple[SessionHints | None, list[PlannedHint]]:
        entry = self._sessions.pop(session, None)
        return entry, ([] if entry is None else self.policy.session_ended(entry))

    def forget(self, session: str) -> None:
        self._sessions.pop(session, None)

    def outcome(self, entry: SessionHints, hint: PlannedHint, outcome: dict[str, Any]) -> None:
        entry.outcomes[f"{hint.action_type}:{outcome.get('outcome')}"] += 1
        self.policy.outcome(entry, hint, outcome)
