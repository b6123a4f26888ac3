"""Instance statuses at the Index Service, pure and Clock-injected: the latest record per
instance with the epoch rule of KVSP 6.3, and the estimates a lookup with targets answers
(6.2, 6.4) from them and the matched replicas."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvsp.core.clock import Clock
from kvsp.core.cost import FetchPlanner, recompute_us
from kvsp.core.problems import CapacityExhausted, StaleEpoch
from kvsp.core.records import InstanceStatusRecord, TargetEstimate
from kvsp.core.urls import canonical_url
from kvsp.index.replicas import Block, summary_of
from kvsp.index.rules import IndexLimits

__all__ = ["STATUS_RETENTION_MS", "StatusTable", "estimate_targets"]

#: How long the highest epoch of a silent instance is remembered.
STATUS_RETENTION_MS = 86_400_000


@dataclass(slots=True)
class _InstanceEntry:
    epoch: int
    seen_at: int
    expires_at: int
    status: InstanceStatusRecord


class StatusTable:
    """Latest Instance Status Record per instance; a lower epoch than the highest seen is stale.

    The highest epoch of an instance is remembered for ``STATUS_RETENTION_MS`` after its last
    status (a restarted instance has a higher epoch anyway), and at most
    ``IndexLimits.max_instances`` instances are tracked, so statuses cannot pin memory.
    """

    def __init__(self, clock: Clock, limits: IndexLimits) -> None:
        self.clock = clock
        self._limits = limits
        self._entries: OrderedDict[str, _InstanceEntry] = OrderedDict()  # oldest put first

    def _forget_old(self, now: int) -> None:
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.seen_at + STATUS_RETENTION_MS > now:
                return
            self._entries.popitem(last=False)

    def put(self, status: InstanceStatusRecord) -> None:
        now = self.clock.now_ms()
        self._forget_old(now)
        instance = canonical_url(status.instance)
        entry = self._entries.get(instance)
        if entry is not None and status.epoch < entry.epoch:
            raise StaleEpoch(
                f"epoch {status.epoch} of {status.instance} is below {entry.epoch}, already seen"
            )
        if entry is None and len(self._entries) >= self._limits.max_instances:
            raise CapacityExhausted(
                f"the index tracks {len(self._entries)} instances, the configured maximum"
            )
        self._entries[instance] = _InstanceEntry(status.epoch, now, now + status.ttl_ms, status)
        self._entries.move_to_end(instance)

    def get(self, instance: str) -> InstanceStatusRecord | None:
        entry = self._entries.get(canonical_url(instance))
        if entry is None or entry.expires_at <= self.clock.now_ms():
            return None
        return entry.status


def estimate_targets(
    targets: Sequence[str],
    statuses: Mapping[str, InstanceStatusRecord],
    matched: Sequence[Block],
    block_tokens: int | None,
) -> list[TargetEstimate]:
    """``fetch_us`` and ``recompute_us`` for each target the IS knows (KVSP 6.2, 6.4).

    ``fetch_us`` makes the usable matched prefix resident at the target; ``fetch_blocks`` says
    how many blocks that prefix holds (fewer than ``matched`` when a block has no source the
    target has a link to). ``recompute_us`` prefills the same tokens at the target.
    """
    if block_tokens is None:
        return []
    planner = FetchPlanner(
        [[summary_of(replica) for replica in block.replicas] for block in matched]
    )
    out = []
    for target in targets:
        status = statuses.get(canonical_url(target))
        if status is None:
            continue
        plan = planner.plan(status)
        out.append(
            TargetEstimate(
                target=target,
                fetch_us=plan.fetch_us,
                recompute_us=recompute_us(len(matched) * block_tokens, status.prefill_tokens_per_s),
                fetch_blocks=plan.usable_blocks,
            )
        )
    return out
