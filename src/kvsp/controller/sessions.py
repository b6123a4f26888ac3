"""Sessions, checkpoints and failover (KVSP 6.8), pure.

A session is opened when its request is placed (with a first checkpoint: its prompt and sampler,
nothing generated yet) and belongs to one instance at one epoch. The serving instance publishes
checkpoints; the PC keeps the one with the highest ``output_offset`` for the current epoch and
acknowledges it (an instance with a non-deterministic sampler releases tokens only up to the
acknowledged offset). A checkpoint with a lower epoch is ``StaleEpoch`` (a message from a failed
instance); one with a higher epoch than the PC issued is refused too. When the instance fails the
PC moves the session: a new instance, the epoch incremented, and the latest checkpoint (carrying
the new epoch) for ``POST sessions/{session}/resume``.

At most ``max_sessions`` sessions are kept; beyond that the least recently used one is forgotten,
so session ids cannot pin memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvsp.auth import Principal
from kvsp.core.problems import (
    ConfigurationError,
    Forbidden,
    InvalidInput,
    NotFound,
    RecordError,
    StaleEpoch,
)
from kvsp.core.records import InstanceStatusRecord, Sampler, SessionCheckpoint
from kvsp.core.urls import canonical_url

__all__ = ["CheckpointAnswer", "Session", "SessionTable", "resumers", "sampler_for"]


def sampler_for(
    sampler: Sampler,
    chosen: InstanceStatusRecord | None,
    eligible: Sequence[InstanceStatusRecord],
) -> Sampler:
    """The sampler a session is served with. KVSP 4.4: ``deterministic`` only if every
    instance eligible to resume it produces bit-identical output tokens from the same state,
    which kvsp takes to mean the same engine identity (an instance that reports none is
    taken for different; so is one launched that has not reported yet, ``chosen`` None).
    Otherwise the flag is cleared, and the session's tokens wait for
    acknowledged checkpoints (6.8): a resumed engine that computes other bits cannot alter
    what was delivered."""
    if not sampler.deterministic:
        return sampler
    engine = None if chosen is None else chosen.engine
    if engine is not None and all(status.engine == engine for status in eligible):
        return sampler
    return sampler.model_copy(update={"deterministic": False})


def resumers(
    session: Session, candidates: Sequence[InstanceStatusRecord]
) -> list[InstanceStatusRecord]:
    """Where ``session`` may resume: anywhere, unless its checkpoint says the sampler is
    deterministic; then only on instances with the engine identity of the one that served it
    (tokens released without an acknowledgement are regenerated there bit for bit)."""
    if not session.checkpoint.sampler.deterministic:
        return list(candidates)
    return [s for s in candidates if s.engine is not None and s.engine == session.engine]


@dataclass(slots=True)
class Session:
    session: str
    scope_id: str
    compat_id: str
    instance: str
    epoch: int
    checkpoint: SessionCheckpoint
    failovers: int = 0
    #: the request's output limit, passed on to a resumed instance (None: the instance's own)
    max_tokens: int | None = None
    #: the current turn was delivered in full: nothing to resume if its instance fails
    turn_done: bool = False
    #: the engine identity of the instance serving it: a deterministic session resumes only
    #: on an instance with the same one (KVSP 4.4)
    engine: str | None = None
    #: its instance failed and its failover is not finished: kept in the store, so a leader
    #: that dies mid-failover leaves the next one to finish it (decision 0019)
    pending: bool = False

    @property
    def acknowledged(self) -> int:
        """The output offset acknowledged: the recorded checkpoint's (KVSP 6.8)."""
        return self.checkpoint.output_offset

    def to_json(self) -> dict[str, object]:
        return {
            "session": self.session,
            "instance": self.instance,
            "epoch": self.epoch,
            "output_offset": self.checkpoint.output_offset,
            "acknowledged": self.acknowledged,
            "failovers": self.failovers,
            "turn_done": self.turn_done,
        }


@dataclass(frozen=True, slots=True)
class CheckpointAnswer:
    recorded: bool
    acknowledged: int
    epoch: int


class SessionTable:
    def __init__(self, max_sessions: int = 1_000_000) -> None:
        if max_sessions < 1:
            raise ConfigurationError("max_sessions must be >= 1")
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._evicted: list[Session] = []

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session: str) -> Session:
        found = self._sessions.get(session)
        if found is None:
            raise NotFound(f"no session {session}")
        self._sessions.move_to_end(session)
        return found

    def latest(self, count: int) -> list[Session]:
        """The ``count`` sessions used last, the latest first."""
        out: list[Session] = []
        for session in reversed(self._sessions.values()):
            if len(out) == count:
                break
            out.append(session)
        return out

    def get_for(self, principal: Principal, session: str) -> Session:
        """``session``, if ``principal`` may see its scope; ``NotFound`` otherwise, the same
        answer as for a session nobody has (its existence is its tenant's business)."""
        found = self._sessions.get(session)
        if found is None or not principal.may_access_scope(found.scope_id):
            raise NotFound(f"no session {session}")
        return self.get(session)

    def open(
        self,
        first: SessionCheckpoint,
        instance: str,
        max_tokens: int | None = None,
        engine: str | None = None,
    ) -> Session:
        """Place a session (or its next turn) at ``instance``; the epoch stays. A next turn is
        a new request whose output starts again at offset 0: its checkpoint replaces the last
        turn's, and nothing of it is acknowledged yet."""
        known = self._sessions.get(first.session)
        if known is not None:
            if (known.scope_id, known.compat_id) != (first.scope_id, first.compat_id):
                raise Forbidden("a session keeps its scope and compatibility")
            known.instance = canonical_url(instance)
            known.engine = engine
            known.max_tokens = max_tokens
            known.turn_done = False
            known.pending = False  # a new turn, placed afresh: nothing of the last to resume
            known.checkpoint = first.model_copy(update={"epoch": known.epoch})
            self._sessions.move_to_end(first.session)
            return known
        entry = Session(
            first.session,
            first.scope_id,
            first.compat_id,
            canonical_url(instance),
            first.epoch,
            first,
            max_tokens=max_tokens,
            engine=engine,
        )
        self._sessions[first.session] = entry
        while len(self._sessions) > self.max_sessions:
            self._evicted.append(self._sessions.popitem(last=False)[1])
        return entry

    def take_evicted(self) -> list[Session]:
        """Sessions forgotten for room since the last call (a durable store drops them too)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def restore(self, sessions: Sequence[Session]) -> None:
        """Replace every session with ``sessions`` (a new leader's load), oldest first."""
        self._sessions.clear()
        self._evicted.clear()
        for entry in sessions:
            self._sessions[entry.session] = entry

    def check_checkpoint(self, checkpoint: SessionCheckpoint, instance: str) -> bool:
        """Whether ``checkpoint`` would be recorded; refusals raise (see module doc), and
        nothing changes either way."""
        session = self._sessions.get(checkpoint.session)
        if session is None:
            raise NotFound(f"no session {checkpoint.session}")
        if (checkpoint.scope_id, checkpoint.compat_id) != (session.scope_id, session.compat_id):
            raise RecordError("the checkpoint's scope or compatibility is not the session's")
        if checkpoint.epoch < session.epoch:
            raise StaleEpoch(
                f"session {session.session} is at epoch {session.epoch}; "
                f"epoch {checkpoint.epoch} is over"
            )
        if checkpoint.epoch > session.epoch:
            raise InvalidInput(
                f"session {session.session} is at epoch {session.epoch}; the PC never issued "
                f"epoch {checkpoint.epoch}"
            )
        if canonical_url(instance) != session.instance:
            raise Forbidden(f"{instance} does not serve session {session.session}")
        return checkpoint.output_offset > session.checkpoint.output_offset

    def put_checkpoint(self, checkpoint: SessionCheckpoint, instance: str) -> CheckpointAnswer:
        """Record a checkpoint from ``instance`` (see module doc); refusals change nothing."""
        recorded = self.check_checkpoint(checkpoint, instance)
        session = self.get(checkpoint.session)
        if recorded:
            session.checkpoint = checkpoint
        return CheckpointAnswer(recorded, session.acknowledged, session.epoch)

    def close(self, session: str) -> Session:
        """Forget a session that is over (``NotFound`` if unknown)."""
        entry = self.get(session)
        del self._sessions[session]
        return entry

    def served_by(self, instance: str) -> list[Session]:
        url = canonical_url(instance)
        return [s for s in self._sessions.values() if s.instance == url]

    def orphan(self, instance: str) -> list[Session]:
        """The open turns of ``instance`` (failed or restarted), marked pending until their
        failover is over (a delivered turn has nothing left to resume)."""
        orphans = [s for s in self.served_by(instance) if not s.turn_done]
        for entry in orphans:
            entry.pending = True
        return orphans

    def pending(self) -> list[Session]:
        """Sessions whose failover a leader began and did not finish."""
        return [s for s in self._sessions.values() if s.pending]

    def settle(self, session: str) -> Session | None:
        """The failover of ``session`` is over (resumed, or nowhere to go); None if gone."""
        entry = self._sessions.get(session)
        if entry is not None:
            entry.pending = False
        return entry

    def resume_point(
        self, session: str, epoch: int, latest: SessionCheckpoint | None = None
    ) -> SessionCheckpoint:
        """The checkpoint to resume ``session`` from at ``epoch`` (above its own), changing
        nothing: the table's, or ``latest`` (the durable store's, which has the same epoch
        rules) when it records more output."""
        entry = self.get(session)
        if epoch <= entry.epoch:
            raise InvalidInput(f"session {session} is at epoch {entry.epoch} already")
        best = entry.checkpoint
        if latest is not None and latest.output_offset > best.output_offset:
            best = latest
        return best.model_copy(update={"epoch": epoch})

    def move(
        self, session: str, instance: str, resumed: SessionCheckpoint | None = None
    ) -> SessionCheckpoint:
        """Fail a session over to ``instance``, resumed from ``resumed`` (by default the
        next epoch's ``resume_point``): every later message with an older epoch is refused.
        Each epoch skipped counts as a failover (a resume that was refused)."""
        entry = self.get(session)
        resumed = resumed or self.resume_point(session, entry.epoch + 1)
        entry.failovers += resumed.epoch - entry.epoch
        entry.epoch, entry.instance, entry.checkpoint = (
            resumed.epoch,
            canonical_url(instance),
            resumed,
        )
        return resumed
