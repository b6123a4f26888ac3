"""Where an Index Service keeps its records: in its own memory, or in Redis shared by many IS
processes.

Both stores answer the same async interface (``ReplicaStore``) and the same behavioural tests.

**Redis layout** (every key in one hash slot per script, so it runs on Redis Cluster too):

- ``{p}r:{<compat>:<scope>:<block_key>}``: a hash per block, one field per holder (canonical
  URL), value ``<deadline_ms>|<record JSON as served, after the identity members>`` (the
  block supplies those). All replicas of a block live in one slot; the keys of a prompt spread
  over slots.
- ``{p}x:{<scope>}``: a sorted set per scope, member ``<compat>:<block_key>:<holder>``, score the
  deadline: the expiry queue, and the per-scope record count.
- ``{p}scopes`` (set of scope ids), ``{p}count`` (records), ``{p}expired`` (records expired).
- ``{p}s:{<instance>}``: a hash per instance: highest ``epoch``, latest ``record``, ``deadline``;
  it expires a day after the instance's last status.

Deadlines are read from Redis ``TIME``, so IS processes on different machines agree. A publish is
one script on the block's key (atomic per record); a lookup is one pipeline (``TIME``, one
``HGETALL`` per key and one ``HMGET`` per target: one round trip) that drops entries past their
deadline; every IS process runs an expirer that pops due queue entries (O(expired)) and removes
the field only if it is still due, so a refresh racing the expirer wins and each removal is
counted once. A Redis that is unreachable turns into ``ServiceUnavailable`` (503); redis-py
reconnects on the next call, so the service recovers by itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvsp.core.clock import Clock
from kvsp.core.problems import CapacityExhausted, InvalidInput, ServiceUnavailable, StaleEpoch
from kvsp.core.records import InstanceStatusRecord, ReplicaRecord, ReplicaRef
from kvsp.core.urls import canonical_url
from kvsp.index.packed import Skeletons
from kvsp.index.puts import SharedPuts
from kvsp.index.replicas import (
    Block,
    BlockReplicas,
    PublishOutcome,
    ReplicaTable,
    StoredReplica,
    arrays_of,
    holder_runs,
)
from kvsp.index.rules import IndexLimits
from kvsp.index.statuses import STATUS_RETENTION_MS, StatusTable
from kvsp.index.wire import answer_json, record_tail
from kvsp.redis_pipes import run_pipe
from kvsp.tasks import cancel_all

__all__ = [
    "LookupResult",
    "MemoryReplicaStore",
    "RedisReplicaStore",
    "ReplicaStore",
    "open_store",
]

log = logging.getLogger("kvsp.index")


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Replicas of the matched prefix, the targets' statuses, and the whole answer for given
    estimates (``answer_json``'s octets, as the store renders them: call it before the next
    await, while the matched blocks are as they were)."""

    matched: list[Block]
    statuses: dict[str, InstanceStatusRecord]
    answered: Callable[[bytes], bytes]


class ReplicaStore(Protocol):
    name: str

    async def publish(self, records: Sequence[ReplicaRecord]) -> list[PublishOutcome]: ...

    async def publish_shared(self, puts: SharedPuts) -> list[PublishOutcome]:
        """``publish`` of a split batch's records (``puts.records()``)."""
        ...

    async def withdraw(self, refs: Sequence[ReplicaRef]) -> list[bool]: ...

    async def lookup(
        self, compat: str, scope: str, block_keys: Sequence[str], targets: Sequence[str]
    ) -> LookupResult: ...

    async def answer(self, compat: str, scope: str, block_keys: Sequence[str]) -> tuple[int, bytes]:
        """The matched count and the lookup answer without estimates (``answer_json``)."""
        ...

    async def holders(
        self, compat: str, scope: str, block_keys: Sequence[str]
    ) -> tuple[int, list[tuple[str, int]]]:
        """The matched count and ``holder_runs`` of the matched blocks (the compact answer)."""
        ...

    async def put_status(self, status: InstanceStatusRecord) -> None: ...

    async def put_descriptor(self, compat: str, canonical: bytes) -> bool:
        """Keep a verified descriptor (its RFC 8785 form) under its ID; True if new. A known
        ID keeps what it has (an ID names one descriptor); beyond ``max_descriptors`` new
        ones are ``CapacityExhausted``."""
        ...

    async def descriptor(self, compat: str) -> bytes | None:
        """The registered descriptor of ``compat``, if any."""
        ...

    async def counts_by_scope(self) -> dict[str, int]: ...

    async def expired_total(self) -> int: ...

    async def ping(self) -> None: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class MemoryReplicaStore:
    """The embedded store: the pure ``ReplicaTable`` and ``StatusTable`` behind the interface."""

    name = "memory"

    def __init__(self, clock: Clock, limits: IndexLimits) -> None:
        self.table = ReplicaTable(clock, limits)
        self.statuses = StatusTable(clock, limits)
        self.limits = limits
        self.descriptors: dict[str, bytes] = {}

    async def publish(self, records: Sequence[ReplicaRecord]) -> list[PublishOutcome]:
        return self.table.publish_many(records)

    async def publish_shared(self, puts: SharedPuts) -> list[PublishOutcome]:
        return self.table.publish_shared(puts)

    async def withdraw(self, refs: Sequence[ReplicaRef]) -> list[bool]:
        return [self.table.withdraw(ref) for ref in refs]

    async def lookup(
        self, compat: str, scope: str, block_keys: Sequence[str], targets: Sequence[str]
    ) -> LookupResult:
        matched = self.table.lookup(compat, scope, block_keys)
        statuses = {}
        for target in targets:
            status = self.statuses.get(target)
            if status is not None:
                statuses[canonical_url(target)] = status
        table = self.table
        return LookupResult(
            matched,
            statuses,
            lambda estimates: table.answered(compat, scope, block_keys, estimates),
        )

    async def answer(self, compat: str, scope: str, block_keys: Sequence[str]) -> tuple[int, bytes]:
        return self.table.answer(compat, scope, block_keys)

    async def holders(
        self, compat: str, scope: str, block_keys: Sequence[str]
    ) -> tuple[int, list[tuple[str, int]]]:
        return self.table.holders(compat, scope, block_keys)

    async def put_status(self, status: InstanceStatusRecord) -> None:
        self.statuses.put(status)

    async def put_descriptor(self, compat: str, canonical: bytes) -> bool:
        if compat in self.descriptors:
            return False
        if len(self.descriptors) >= self.limits.max_descriptors:
            raise CapacityExhausted(_descriptors_full(self.limits))
        self.descriptors[compat] = canonical
        return True

    async def descriptor(self, compat: str) -> bytes | None:
        return self.descriptors.get(compat)

    async def counts_by_scope(self) -> dict[str, int]:
        return self.table.counts_by_scope()

    async def expired_total(self) -> int:
        self.table.expire()
        return self.table.expired_total

    async def ping(self) -> None:
        return None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS[1] block hash; ARGV: holder, ttl_ms, body. Returns {created, deadline}.
_PUBLISH = (
    _NOW_MS
    + """
local deadline = now + tonumber(ARGV[2])
local created = redis.call('HSET', KEYS[1], ARGV[1], deadline .. '|' .. ARGV[3])
return {created, deadline}
"""
)
# KEYS[1] block hash; ARGV: holder. Removes the field only if its deadline has passed.
_EXPIRE_FIELD = (
    _NOW_MS
    + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local deadline = tonumber(string.sub(v, 1, string.find(v, '|', 1, true) - 1))
if deadline > now then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""
)
# KEYS[1] expiry queue; ARGV: member. Removes the entry only if still due.
_DEQUEUE = (
    _NOW_MS
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0
"""
)
# KEYS[1] status hash; ARGV: epoch, record JSON, ttl_ms, retention_ms. {-1, epoch} when stale.
_STATUS = (
    _NOW_MS
    + """
local highest = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '-1')
local epoch = tonumber(ARGV[1])
if epoch < highest then return {-1, highest} end
redis.call('HSET', KEYS[1], 'epoch', epoch, 'record', ARGV[2],
           'deadline', now + tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, epoch}
"""
)
# KEYS[1] descriptors hash; ARGV: compat id, canonical descriptor, max descriptors.
# 0 when known (kept as it is), -1 when full, 1 when stored.
_DESCRIPTOR = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def _descriptors_full(limits: IndexLimits) -> str:
    return f"this Index Service keeps at most {limits.max_descriptors} descriptors"


class RedisReplicaStore:
    """Records in Redis, shared by every IS process that uses the same URL and prefix."""

    name = "redis"

    def __init__(
        self,
        url: str,
        limits: IndexLimits,
        prefix: str = "kvsp:",
        expire_interval_s: float = 0.5,
        expire_batch: int = 1000,
    ) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=2.0, health_check_interval=5
        )
        self._limits = limits
        self._p = prefix
        self._interval = expire_interval_s
        self._batch = expire_batch
        self._publish = self._redis.register_script(_PUBLISH)
        self._expire_field = self._redis.register_script(_EXPIRE_FIELD)
        self._dequeue = self._redis.register_script(_DEQUEUE)
        self._status = self._redis.register_script(_STATUS)
        self._descriptor = self._redis.register_script(_DESCRIPTOR)
        self._expirer: asyncio.Task[None] | None = None

    def _block(self, compat: str, scope: str, key: str) -> str:
        return f"{self._p}r:{{{compat}:{scope}:{key}}}"

    def _queue(self, scope: str) -> str:
        return f"{self._p}x:{{{scope}}}"

    @property
    def _descriptors_key(self) -> str:
        return f"{self._p}d"

    def _status_key(self, instance: str) -> str:
        return f"{self._p}s:{{{canonical_url(instance)}}}"

    async def _run(self, pipe: Any) -> list[Any]:
        return await run_pipe(pipe, "the Redis store")

    async def publish_shared(self, puts: SharedPuts) -> list[PublishOutcome]:
        return await self.publish(puts.records())  # a script takes each record whole

    async def publish(self, records: Sequence[ReplicaRecord]) -> list[PublishOutcome]:
        holders = [r.publisher for r in records]
        scopes = sorted({r.scope_id for r in records})
        check = self._redis.pipeline(transaction=False)
        check.get(f"{self._p}count")
        for scope in scopes:
            check.zcard(self._queue(scope))
        for record, holder in zip(records, holders, strict=True):
            check.hexists(self._block(record.compat_id, record.scope_id, record.block_key), holder)
        count, *answers = await self._run(check)
        held = dict(zip(scopes, map(int, answers[: len(scopes)]), strict=True))
        exists = answers[len(scopes) :]
        new = {
            (r.compat_id, r.scope_id, r.block_key, h)
            for r, h, e in zip(records, holders, exists, strict=True)
            if not e
        }
        self._limits.check_room(int(count or 0), Counter(n[1] for n in new), held.__getitem__)
        pipe = self._redis.pipeline(transaction=False)
        ttls = [min(r.ttl_ms, self._limits.max_ttl_ms) for r in records]
        for record, holder, ttl in zip(records, holders, ttls, strict=True):
            block = self._block(record.compat_id, record.scope_id, record.block_key)
            await self._publish(
                keys=[block], args=[holder, ttl, record_tail(record, ttl)], client=pipe
            )
        results = await self._run(pipe)
        created = [bool(r[0]) for r in results]
        queue = self._redis.pipeline(transaction=False)
        for record, holder, (_, deadline) in zip(records, holders, results, strict=True):
            member = f"{record.compat_id}:{record.block_key}:{holder}"
            queue.zadd(self._queue(record.scope_id), {member: int(deadline)})
            queue.sadd(f"{self._p}scopes", record.scope_id)
        if any(created):
            queue.incrby(f"{self._p}count", sum(created))
        await self._run(queue)
        return [PublishOutcome(c, t) for c, t in zip(created, ttls, strict=True)]

    async def withdraw(self, refs: Sequence[ReplicaRef]) -> list[bool]:
        pipe = self._redis.pipeline(transaction=False)
        for ref in refs:
            holder = ref.publisher
            pipe.hdel(self._block(ref.compat_id, ref.scope_id, ref.block_key), holder)
            pipe.zrem(self._queue(ref.scope_id), f"{ref.compat_id}:{ref.block_key}:{holder}")
        results = await self._run(pipe)
        removed = [bool(r) for r in results[0::2]]
        if any(removed):
            fix = self._redis.pipeline(transaction=False)
            fix.decrby(f"{self._p}count", sum(removed))
            await self._run(fix)
        return removed

    async def lookup(
        self, compat: str, scope: str, block_keys: Sequence[str], targets: Sequence[str]
    ) -> LookupResult:
        pipe = self._redis.pipeline(transaction=False)
        pipe.time()
        for key in block_keys:
            pipe.hgetall(self._block(compat, scope, key))
        for target in targets:
            pipe.hmget(self._status_key(target), "record", "deadline")
        results = await self._run(pipe)
        seconds, micros = results[0]
        now = int(seconds) * 1000 + int(micros) // 1000
        matched: list[Block] = []
        space = (compat, scope)
        skeletons = Skeletons()  # the replicas answer as the memory store's do
        for block_key, fields in zip(block_keys, results[1 : 1 + len(block_keys)], strict=True):
            live = []
            for holder, value in fields.items():
                deadline, _, tail = value.partition(b"|")
                if int(deadline) > now:
                    live.append(
                        StoredReplica(
                            space,
                            holder.decode(),
                            int(deadline),
                            skeletons.pack(block_key, tail),
                            packed_by=skeletons,
                        )
                    )
            if not live:
                break
            matched.append(BlockReplicas(tuple(live)))
        statuses = {}
        for target, (record, deadline) in zip(targets, results[1 + len(block_keys) :], strict=True):
            if record is not None and deadline is not None and int(deadline) > now:
                statuses[canonical_url(target)] = InstanceStatusRecord.parse(record)
        return LookupResult(
            matched, statuses, lambda estimates: answer_json(arrays_of(matched), estimates)
        )

    async def answer(self, compat: str, scope: str, block_keys: Sequence[str]) -> tuple[int, bytes]:
        matched = (await self.lookup(compat, scope, block_keys, ())).matched
        return len(matched), answer_json(arrays_of(matched))

    async def holders(
        self, compat: str, scope: str, block_keys: Sequence[str]
    ) -> tuple[int, list[tuple[str, int]]]:
        matched = (await self.lookup(compat, scope, block_keys, ())).matched
        return len(matched), holder_runs(matched)

    async def put_status(self, status: InstanceStatusRecord) -> None:
        pipe = self._redis.pipeline(transaction=False)
        await self._status(
            keys=[self._status_key(status.instance)],
            args=[
                status.epoch,
                status.model_dump_json(exclude_none=True),
                status.ttl_ms,
                STATUS_RETENTION_MS,
            ],
            client=pipe,
        )
        ((accepted, highest),) = await self._run(pipe)
        if int(accepted) < 0:
            raise StaleEpoch(
                f"epoch {status.epoch} of {status.instance} is below {int(highest)}, already seen"
            )

    async def put_descriptor(self, compat: str, canonical: bytes) -> bool:
        pipe = self._redis.pipeline(transaction=False)
        args: list[str | bytes | int] = [compat, canonical, self._limits.max_descriptors]
        await self._descriptor(keys=[self._descriptors_key], args=args, client=pipe)
        (outcome,) = await self._run(pipe)
        if int(outcome) < 0:
            raise CapacityExhausted(_descriptors_full(self._limits))
        return int(outcome) == 1

    async def descriptor(self, compat: str) -> bytes | None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(self._descriptors_key, compat)
        (found,) = await self._run(pipe)
        return None if found is None else bytes(found)

    async def counts_by_scope(self) -> dict[str, int]:
        pipe = self._redis.pipeline(transaction=False)
        pipe.smembers(f"{self._p}scopes")
        (scopes,) = await self._run(pipe)
        names = sorted(s.decode() for s in scopes)
        pipe = self._redis.pipeline(transaction=False)
        for scope in names:
            pipe.zcard(self._queue(scope))
        counts = await self._run(pipe) if names else []
        return {scope: int(n) for scope, n in zip(names, counts, strict=True) if n}

    async def expired_total(self) -> int:
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(f"{self._p}expired")
        (value,) = await self._run(pipe)
        return int(value or 0)

    async def ping(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.ping()
        await self._run(pipe)

    async def expire_due(self) -> int:
        """One expiry round over every scope's queue; returns how many records it removed."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.time()
        pipe.smembers(f"{self._p}scopes")
        (seconds, micros), scopes = await self._run(pipe)
        now = int(seconds) * 1000 + int(micros) // 1000
        names = [s.decode() for s in scopes]
        pipe = self._redis.pipeline(transaction=False)
        for scope in names:
            pipe.zrangebyscore(self._queue(scope), "-inf", now, start=0, num=self._batch)
        due = await self._run(pipe) if names else []
        removed = 0
        for scope, members in zip(names, due, strict=True):
            if not members:
                continue
            pipe = self._redis.pipeline(transaction=False)
            for member in members:
                compat, key, holder = member.decode().split(":", 2)
                await self._expire_field(
                    keys=[self._block(compat, scope, key)], args=[holder], client=pipe
                )
                await self._dequeue(keys=[self._queue(scope)], args=[member], client=pipe)
            results = await self._run(pipe)
            removed += sum(int(r) for r in results[0::2])
        if removed:
            pipe = self._redis.pipeline(transaction=False)
            pipe.decrby(f"{self._p}count", removed)
            pipe.incrby(f"{self._p}expired", removed)
            await self._run(pipe)
        return removed

    async def _expire_forever(self) -> None:
        while True:
            try:
                await self.expire_due()
            except ServiceUnavailable as exc:
                log.warning("expiry round skipped: %s", exc.detail)
            except RedisError:
                log.exception("expiry round failed")
            await asyncio.sleep(self._interval)

    async def start(self) -> None:
        if self._expirer is None:
            self._expirer = asyncio.create_task(self._expire_forever(), name="kvsp-index-expirer")

    async def close(self) -> None:
        if self._expirer is not None:
            await cancel_all([self._expirer])
            self._expirer = None
        await self._redis.aclose()


def open_store(spec: str, limits: IndexLimits, clock: Clock) -> ReplicaStore:
    """``memory`` or a ``redis://HOST:PORT/DB`` URL (``rediss://`` for TLS)."""
    if spec == "memory":
        return MemoryReplicaStore(clock, limits)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisReplicaStore(spec, limits)
    raise InvalidInput(f"store must be 'memory' or a redis:// URL, got {spec!r}")
