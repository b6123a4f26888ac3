"""Instances as the Placement Controller sees them (KVSP 6.3), pure and Clock-injected.

The PC keeps the latest Instance Status Record of each instance and its lifecycle state. The
state changes only through ``TRANSITIONS`` (one table; any other move is ``IllegalTransition``):

- active -> draining when the PC accepts a sleep request (policy: at least ``min_active``
  instances stay active) or an operator drains the instance;
- draining -> sleeping when the instance reports ``sleeping`` with nothing running;
- sleeping -> active, and draining -> active, only by the PC (``set_state``: a wake);
- any state -> failed when the latest record expires (its ``ttl_ms`` after it arrived);
- failed -> active or sleeping when the instance comes back with a higher epoch (a restart).

A record with an epoch below the highest seen is ``StaleEpoch`` and changes nothing; a record
whose reported state the PC did not grant (an instance that wakes itself, or drains itself
without asking) is ``IllegalTransition`` and changes nothing.

Liveness heals (decision 0014): a status of the epoch the PC marked failed is
``InstanceFailed``, which tells the live process to take a new epoch (its clock in ms, above the
old one), drop the sessions the PC failed over and report again; it rejoins within one status
interval. A new epoch always hands the old epoch's instance to ``expire`` (whether it had
expired or not), so its sessions go to failover at once. An epoch more than
``max_epoch_ahead_ms`` ahead of the PC's clock is refused: a counter epoch is small, a start
time is now, and an epoch of 10^30 would lock the real process out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvsp.core.clock import Clock
from kvsp.core.deadlines import Deadlines
from kvsp.core.problems import (
    ConfigurationError,
    IllegalTransition,
    InstanceFailed,
    NotFound,
    RecordError,
    StaleEpoch,
)
from kvsp.core.records import InstanceState, InstanceStatusRecord
from kvsp.core.urls import canonical_url

__all__ = ["TRANSITIONS", "InstancePolicy", "InstanceTable", "TrackedInstance"]

A, D, S, F = (
    InstanceState.ACTIVE,
    InstanceState.DRAINING,
    InstanceState.SLEEPING,
    InstanceState.FAILED,
)

#: (from, to) -> why the move is allowed. Nothing else is.
TRANSITIONS: dict[tuple[InstanceState, InstanceState], str] = {
    (A, D): "sleep request accepted, or drained by an operator",
    (D, S): "draining instance reports it has no sessions left",
    (D, A): "woken by the PC before it slept",
    (S, A): "woken by the PC",
    (A, F): "status expired",
    (D, F): "status expired",
    (S, F): "status expired",
    (F, A): "restarted with a higher epoch",
    (F, S): "restarted with a higher epoch, asleep",
}


@dataclass(frozen=True, slots=True)
class InstancePolicy:
    #: active instances that must remain when granting a sleep request
    min_active: int = 1
    #: how far ahead of the PC's clock (ms since the Unix epoch) an epoch may be
    max_epoch_ahead_ms: int = 86_400_000

    def __post_init__(self) -> None:
        if self.min_active < 0:
            raise ConfigurationError("min_active must be >= 0")
        if self.max_epoch_ahead_ms < 0:
            raise ConfigurationError("max_epoch_ahead_ms must be >= 0")


@dataclass(slots=True)
class TrackedInstance:
    url: str
    status: InstanceStatusRecord
    state: InstanceState
    epoch: int
    expires_at: int


class InstanceTable:
    def __init__(self, clock: Clock, policy: InstancePolicy | None = None) -> None:
        self.clock = clock
        self.policy = policy or InstancePolicy()
        self._instances: dict[str, TrackedInstance] = {}
        self._deadlines: Deadlines[str] = Deadlines()
        #: failures noticed but not yet handed out by ``expire``
        self._failed: list[TrackedInstance] = []

    def __iter__(self) -> Iterator[TrackedInstance]:
        return iter(list(self._instances.values()))

    def get(self, url: str) -> TrackedInstance:
        found = self._instances.get(canonical_url(url))
        if found is None:
            raise NotFound(f"no instance {url} has reported")
        return found

    def active(self) -> list[TrackedInstance]:
        """Instances that may receive requests and prefetch directives (KVSP 6.3)."""
        self._notice_expired()
        return [i for i in self._instances.values() if i.state is A]

    def sleeping(self) -> list[TrackedInstance]:
        self._notice_expired()
        return [i for i in self._instances.values() if i.state is S]

    @staticmethod
    def _move(instance: TrackedInstance, to: InstanceState) -> None:
        if instance.state is to:
            return
        if (instance.state, to) not in TRANSITIONS:
            raise IllegalTransition(f"{instance.url}: {instance.state} -> {to} is not allowed")
        instance.state = to

    def put_status(self, status: InstanceStatusRecord) -> InstanceState:
        """Take a status; returns the state the PC answers with (``{"state": ...}``)."""
        self._notice_expired()
        now = self.clock.now_ms()
        url = canonical_url(status.instance)
        known = self._instances.get(url)
        if known is not None and status.epoch < known.epoch:
            raise StaleEpoch(f"epoch {status.epoch} of {url} is below {known.epoch}, already seen")
        if status.epoch > self.clock.wall_ms() + self.policy.max_epoch_ahead_ms:
            raise RecordError(
                f"epoch {status.epoch} of {url} is more than {self.policy.max_epoch_ahead_ms} ms "
                "ahead of the controller's clock"
            )
        reported = status.state
        if known is None or status.epoch > known.epoch:
            # a (re)started instance: it begins active or asleep, never mid-drain or failed
            if reported not in (A, S):
                raise IllegalTransition(f"{url}: a new epoch must start active or sleeping")
            if known is not None:
                self._move(known, F)  # the old epoch is gone: its sessions fail over now
                if all(f is not known for f in self._failed):
                    self._failed.append(known)
                self._move(known, reported)
            state = reported
        else:
            state = self._next_state(known, status)
        entry = TrackedInstance(url, status, state, status.epoch, now + status.ttl_ms)
        if known is not None:
            known.status, known.epoch, known.expires_at = status, status.epoch, entry.expires_at
            self._move(known, state)
        else:
            self._instances[url] = entry
        self._deadlines.set(url, entry.expires_at)
        return state

    def _next_state(self, known: TrackedInstance, status: InstanceStatusRecord) -> InstanceState:
        """The PC's state after a status of the same epoch (checked before anything changes)."""
        current, reported = known.state, status.state
        if current is F:
            raise InstanceFailed(
                f"{known.url}: epoch {known.epoch} was marked failed (its status expired) and its "
                "sessions failed over; report again with a higher epoch"
            )
        if current is A:
            if reported is not A:
                raise IllegalTransition(f"{known.url}: reports {reported} without the PC's consent")
            if status.requested_state is S and self._may_sleep(known):
                return D
            return A
        if current is D:
            if reported is S and status.running == 0:
                return S
            if reported in (A, D):  # still finishing its sessions
                return D
            raise IllegalTransition(f"{known.url}: cannot sleep with {status.running} running")
        # sleeping: only the PC wakes it
        if reported is not S:
            raise IllegalTransition(f"{known.url}: a sleeping instance is woken only by the PC")
        return S

    def _may_sleep(self, candidate: TrackedInstance) -> bool:
        others = sum(1 for i in self._instances.values() if i.state is A and i is not candidate)
        return others >= self.policy.min_active

    def check_set_state(self, url: str, to: InstanceState) -> TrackedInstance:
        """Whether the PC may make ``url`` ``to`` now (raises if not); changes nothing, so the
        adapter can tell the instance first and ``set_state`` after."""
        self._notice_expired()
        instance = self.get(url)
        if to not in (A, D):
            raise IllegalTransition("the PC can only wake (active) or drain an instance")
        if instance.state is not to and (instance.state, to) not in TRANSITIONS:
            raise IllegalTransition(f"{instance.url}: {instance.state} -> {to} is not allowed")
        return instance

    def set_state(self, url: str, to: InstanceState) -> TrackedInstance:
        """A change the PC makes (wake, or drain), once the instance has been told."""
        instance = self.check_set_state(url, to)
        self._move(instance, to)
        return instance

    def restore(self, entries: Sequence[TrackedInstance]) -> None:
        """Replace every instance with ``entries`` (a new leader's load). Each gets a full
        status TTL from now: statuses sent while no controller led were lost, and an
        instance that is really gone expires one TTL later. One stored as failed is handed to
        ``expire`` again, so sessions whose failover the old leader did not finish move."""
        self._instances.clear()
        self._deadlines = Deadlines()
        self._failed = []
        now = self.clock.now_ms()
        for entry in entries:
            entry.expires_at = now + entry.status.ttl_ms
            self._instances[entry.url] = entry
            if entry.state is F:
                self._failed.append(entry)
            else:
                self._deadlines.set(entry.url, entry.expires_at)

    def expire(self) -> list[TrackedInstance]:
        """Instances whose latest status has expired become failed; returns every instance
        that failed since the last call (also those noticed while handling other calls), so
        the caller can fail their sessions over."""
        self._notice_expired()
        failed, self._failed = self._failed, []
        return failed

    def _notice_expired(self) -> None:
        for url in self._deadlines.due(self.clock.now_ms()):
            instance = self._instances.get(url)
            if instance is not None and instance.state is not F:
                self._move(instance, F)
                self._failed.append(instance)
