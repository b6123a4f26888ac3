"""The hint policy's planned KvHints, sent to the instances that hold the sessions' KV, each
outcome counted and fed back to the policy (which learns from refusals and deferrals).

An instance that does not answer, or answers with something that is not one outcome, defers
the action (reason ``unreachable``): the policy then treats it as not done, never as done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

from prometheus_client import Counter

from kvsp.controller.client import InstanceClient
from kvsp.controller.hints import PlannedHint, SessionHints, SessionHintTable
from kvsp.core.hints import HintOutcome, Reason, envelope
from kvsp.core.hints import Outcome as HintResult
from kvsp.core.problems import KvspError

__all__ = ["HintSender"]


class HintSender:
    def __init__(self, peers: InstanceClient, table: SessionHintTable, outcomes: Counter) -> None:
        self._peers = peers
        #: the hint policy's state per session
        self.table = table
        #: outcomes by action type and outcome (``invalid`` for an answer that is none)
        self._outcomes = outcomes

    async def send(
        self, session: str, planned: Sequence[PlannedHint], entry: SessionHints | None = None
    ) -> list[dict[str, Any]]:
        """One envelope per planned hint; the outcomes, each naming its instance. ``entry``:
        the session's policy state when the table no longer has it (the session ended)."""
        entry = entry or self.table.get(session)
        outcomes: list[dict[str, Any]] = []
        for hint in planned:
            sent = envelope([(hint.action_type, hint.payload)])
            try:
                [outcome] = await self._peers.hints(hint.instance, sent)
            except (KvspError, ValueError) as exc:  # unreachable, or not one outcome
                reason = exc.detail if isinstance(exc, KvspError) else str(exc)
                (action,) = sent.actions
                unanswered = HintOutcome(action.action_id, action.action_type, "deferred")
                unanswered.note("deferred", Reason.UNREACHABLE, f"{hint.instance}: {reason}")
                outcome = unanswered.to_json()
            said = outcome.get("outcome")
            known = said if said in get_args(HintResult) else "invalid"
            self._outcomes.labels(hint.action_type, known).inc()
            if entry is not None:
                self.table.outcome(entry, hint, outcome)
            outcomes.append({"instance": hint.instance, **outcome})
        return outcomes
