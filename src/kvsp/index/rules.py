"""Who may do what at the Index Service (KVSP 6.1-6.4), and the bounds an operator sets on
how much it holds, pure: checked before any state changes, so a refused request leaves none."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvsp.auth import Principal, Role, authorize
from kvsp.core.problems import CapacityExhausted, RecordError
from kvsp.core.records import InstanceStatusRecord, ReplicaRecord, ReplicaRef
from kvsp.quotas import Quotas

__all__ = [
    "DESCRIPTOR_ROLES",
    "LOOKUP_ROLES",
    "PUBLISH_ROLES",
    "STATUS_ROLES",
    "IndexLimits",
    "authorize_holders",
    "authorize_lookup",
    "authorize_replicas",
    "authorize_status",
    "check_path",
]

PUBLISH_ROLES = (Role.HOLDER, Role.INSTANCE, Role.INGEST)
#: who may register a Compatibility Descriptor: the parties whose own caches it describes
DESCRIPTOR_ROLES = (Role.HOLDER, Role.INSTANCE)
LOOKUP_ROLES = (Role.CONTROLLER, Role.INSTANCE, Role.HOLDER, Role.CLIENT)
STATUS_ROLES = (Role.INSTANCE, Role.CONTROLLER)


@dataclass(frozen=True, slots=True)
class IndexLimits:
    """Bounds an operator sets: the TTL cap (6.1) and the record count past which publishing
    answers 507 instead of growing without bound."""

    max_ttl_ms: int = 600_000
    max_records: int = 5_000_000
    max_instances: int = 65_536
    #: Compatibility Descriptors holders and instances may register (KVSP 4.1)
    max_descriptors: int = 4096
    #: records one scope may have where the quotas set none: one tenant cannot fill the index
    max_scope_records: int = 1_000_000
    quotas: Quotas = field(default_factory=Quotas)

    def check_room(
        self, total: int, per_scope: Mapping[str, int], held: Callable[[str], int]
    ) -> None:
        """``CapacityExhausted`` (naming the limit) unless ``per_scope[scope]`` new records of
        each scope fit beside ``total`` records, ``held(scope)`` of each scope."""
        added = sum(per_scope.values())
        if total + added > self.max_records:
            raise CapacityExhausted(
                f"the index holds {total} records; {added} more would pass the limit "
                f"of {self.max_records}"
            )
        for scope, count in per_scope.items():
            most = self.quotas.limit(scope, "records", self.max_scope_records)
            if held(scope) + count > most:
                raise CapacityExhausted(
                    f"scope {scope} has {held(scope)} records; {count} more would pass its "
                    f"records quota of {most}"
                )


def check_path(record: ReplicaRecord, compat: str, scope: str, block_key: str) -> None:
    """A record PUT to a block resource must describe that resource."""
    if (record.compat_id, record.scope_id, record.block_key) != (compat, scope, block_key):
        raise RecordError("the record's compat_id, scope_id and block_key must match the path")


def authorize_replicas(
    principal: Principal, replicas: Iterable[ReplicaRecord] | Iterable[ReplicaRef]
) -> None:
    """KVSP 6.1, for records published and replicas withdrawn: the client is each one's holder
    or may publish for it, and may use its scope; for a moqt holder, the namespace's publisher
    is the holder (4.4)."""
    authorize_holders(principal, ((r.scope_id, r.publisher) for r in replicas))


def authorize_holders(principal: Principal, holders: Iterable[tuple[str, str]]) -> None:
    """``authorize_replicas`` of replicas named by their scopes and publishers. Each distinct
    pair is checked once, in order: a holder's batch names one or two."""
    for scope, holder in dict.fromkeys(holders):
        authorize(principal, PUBLISH_ROLES, scope=scope, holder=holder)


def authorize_lookup(principal: Principal, scope_id: str) -> None:
    """Refused whether or not the scope holds anything, so a refusal reveals nothing."""
    authorize(principal, LOOKUP_ROLES, scope=scope_id)


def authorize_status(principal: Principal, status: InstanceStatusRecord) -> None:
    authorize(principal, STATUS_ROLES, holder=status.instance)
