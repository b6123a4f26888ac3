"""Where a Placement Controller keeps its state: in its own memory (one process), or in Redis,
shared by several controllers of which one leads at a time (decision 0019).

The tables (``InstanceTable``, ``SessionTable``, ``SessionHintTable``, ``ReshardCoordinator``
and the decisions awaiting a TTFT) stay the leader's working copy. Every change is written
through to the store before it is answered, and a controller that takes the lease loads the
tables from the store. The memory store keeps nothing beside the tables: its writes do nothing
and it always leads.

**Redis layout** (each script touches one hash slot, so it runs on Redis Cluster too; ``{p}``
is the prefix, ``kvsp:pc:`` by default):

- ``{p}{c}:lease``: ``<token>|<controller URL>`` with a PX expiry: who leads, and until when.
- ``{p}{c}:fence``: the fencing token, incremented by every acquisition of the lease.
- ``{p}{c}:instances``, ``:maps``, ``:reshards``, ``:decisions`` (hashes), ``:scopes`` (set):
  instance entries, shard maps, a reshard being committed or aborted, decisions awaiting their
  TTFT, and the scopes that have sessions.
- ``{p}{s:<scope>}:fence``: the fencing token, copied into the scope's slot by each new leader
  before it reads anything; ``:sessions`` (sorted set, score the last use in ms: the tenant's
  sessions index); ``:session:<id>`` (hash: ``epoch``, ``instance``, ``offset``, ``checkpoint``,
  ``failovers``, ``meta``, ``pending`` (1: a failover a new leader finishes), ``hints``).

Every write is a script that first compares the slot's fencing token with the writer's: a
controller that lost the lease (a newer token exists) changes nothing and steps down. A
checkpoint is one script that applies KVSP 6.8's epoch rules itself (stale epochs refused in
Redis, not by a read-then-write), and a failover's move is one script that raises the epoch only
if the session is still where the mover saw it. A new leader copies its token into every scope's
slot before it loads, so a write of the old leader either landed before the load (and is loaded)
or is refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis

from kvsp.controller.hints import SessionHints
from kvsp.controller.instances import TrackedInstance
from kvsp.controller.sessions import Session
from kvsp.core.problems import (
    Forbidden,
    InvalidInput,
    NotFound,
    NotLeader,
    StaleEpoch,
)
from kvsp.core.records import InstanceState, InstanceStatusRecord, SessionCheckpoint, ShardMap
from kvsp.redis_pipes import run_pipe

__all__ = [
    "Change",
    "ControlStore",
    "DropDecision",
    "DropSession",
    "MemoryControlStore",
    "PutDecision",
    "PutHints",
    "PutInstance",
    "PutMap",
    "PutPending",
    "PutReshard",
    "PutSession",
    "RedisControlStore",
    "Snapshot",
    "open_control_store",
]


@dataclass(frozen=True, slots=True)
class PutInstance:
    instance: TrackedInstance


@dataclass(frozen=True, slots=True)
class PutSession:
    session: Session
    last_use_ms: int


@dataclass(frozen=True, slots=True)
class PutPending:
    """Only a session's ``pending`` mark: written beside checkpoints, never over them."""

    session: Session


@dataclass(frozen=True, slots=True)
class PutHints:
    scope_id: str
    hints: SessionHints


@dataclass(frozen=True, slots=True)
class DropSession:
    scope_id: str
    session: str


@dataclass(frozen=True, slots=True)
class PutMap:
    shard_map: ShardMap


@dataclass(frozen=True, slots=True)
class PutReshard:
    """A reshard's outcome still to announce to its members (``None``: announced)."""

    map_id: str
    outcome: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class PutDecision:
    decision: str
    predicted_us: float


@dataclass(frozen=True, slots=True)
class DropDecision:
    decision: str


#: one change a write carries
Change = (
    PutInstance
    | PutSession
    | PutPending
    | PutHints
    | DropSession
    | PutMap
    | PutReshard
    | PutDecision
    | DropDecision
)


@dataclass
class Snapshot:
    """Everything a new leader loads, sessions in order of last use."""

    instances: list[TrackedInstance] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    hints: list[SessionHints] = field(default_factory=list)
    maps: list[ShardMap] = field(default_factory=list)
    reshards: list[dict[str, Any]] = field(default_factory=list)
    decisions: dict[str, float] = field(default_factory=dict)


class ControlStore(Protocol):
    name: str

    async def acquire(self, me: str, lease_ms: int) -> tuple[int | None, str | None]:
        """Take the lease if nobody holds it: (the new fencing token, me), or (None, the
        holder's URL)."""
        ...

    async def renew(self, token: int, me: str, lease_ms: int) -> bool: ...

    async def release(self, token: int, me: str) -> None: ...

    async def fence(self, token: int, scopes: Sequence[str]) -> None:
        """Copy ``token`` into every scope's slot: older leaders' writes there stop."""
        ...

    async def load(self) -> Snapshot: ...

    async def write(self, token: int, changes: Sequence[Change]) -> None:
        """Apply ``changes`` (one round trip); ``NotLeader`` if ``token`` is fenced out."""
        ...

    async def checkpoint(self, token: int, checkpoint: SessionCheckpoint, instance: str) -> None:
        """Record ``checkpoint`` from ``instance`` if it is the session's highest of its
        epoch; refusals as the table's (KVSP 6.8), decided in the store."""
        ...

    async def move(
        self, token: int, scope_id: str, session: str, failed: str, epoch: int, to: str
    ) -> tuple[bool, SessionCheckpoint | None]:
        """Raise the session's epoch and give it to ``to`` if it is still at ``epoch`` on
        ``failed``: whether it moved, and the store's checkpoint to resume from (None: the
        table's is the one)."""
        ...

    async def close(self) -> None: ...


class MemoryControlStore:
    """One controller's memory: the tables are the state, so there is nothing to write, and
    the single controller always leads."""

    name = "memory"

    async def acquire(self, me: str, lease_ms: int) -> tuple[int | None, str | None]:
        return 0, me

    async def renew(self, token: int, me: str, lease_ms: int) -> bool:
        return True

    async def release(self, token: int, me: str) -> None:
        return None

    async def fence(self, token: int, scopes: Sequence[str]) -> None:
        return None

    async def load(self) -> Snapshot:
        return Snapshot()

    async def write(self, token: int, changes: Sequence[Change]) -> None:
        return None

    async def checkpoint(self, token: int, checkpoint: SessionCheckpoint, instance: str) -> None:
        return None

    async def move(
        self, token: int, scope_id: str, session: str, failed: str, epoch: int, to: str
    ) -> tuple[bool, SessionCheckpoint | None]:
        return True, None

    async def close(self) -> None:
        return None


# -- codecs ------------------------------------------------------------------------------------


def _instance_json(entry: TrackedInstance) -> str:
    status = entry.status.model_dump(mode="json", exclude_none=True)
    return json.dumps({"status": status, "state": entry.state.value, "epoch": entry.epoch})


def _instance_of(url: str, raw: bytes) -> TrackedInstance:
    doc = json.loads(raw)
    status = InstanceStatusRecord.parse(doc["status"])
    return TrackedInstance(url, status, InstanceState(doc["state"]), int(doc["epoch"]), 0)


def _session_fields(entry: Session) -> dict[str, str | int]:
    meta = {
        "scope_id": entry.scope_id,
        "compat_id": entry.compat_id,
        "max_tokens": entry.max_tokens,
        "turn_done": entry.turn_done,
        "engine": entry.engine,
    }
    return {
        "epoch": entry.epoch,
        "instance": entry.instance,
        "offset": entry.checkpoint.output_offset,
        "checkpoint": entry.checkpoint.model_dump_json(),
        "failovers": entry.failovers,
        "meta": json.dumps(meta),
        "pending": int(entry.pending),
    }


def _session_of(name: str, fields: dict[bytes, bytes]) -> Session:
    meta = json.loads(fields[b"meta"])
    epoch = int(fields[b"epoch"])
    checkpoint = SessionCheckpoint.parse(fields[b"checkpoint"]).model_copy(update={"epoch": epoch})
    return Session(
        name,
        meta["scope_id"],
        meta["compat_id"],
        fields[b"instance"].decode(),
        epoch,
        checkpoint,
        failovers=int(fields[b"failovers"]),
        max_tokens=meta["max_tokens"],
        turn_done=bool(meta["turn_done"]),
        engine=meta["engine"],
        pending=fields.get(b"pending") == b"1",
    )


def _hints_json(hints: SessionHints) -> str:
    return json.dumps(
        {
            "instance": hints.instance,
            "turn_ended_ms": hints.turn_ended_ms,
            "tool_call": hints.tool_call,
            "pin_refused": hints.pin_refused,
            "gaps_ms": hints.gaps_ms[-64:],
            "outcomes": dict(hints.outcomes),
        }
    )


def _hints_of(name: str, raw: bytes) -> SessionHints:
    doc = json.loads(raw)
    hints = SessionHints(
        name, doc["instance"], doc["turn_ended_ms"], doc["tool_call"], doc["pin_refused"]
    )
    hints.gaps_ms = [int(g) for g in doc["gaps_ms"]]
    hints.outcomes.update(doc["outcomes"])
    return hints


# -- scripts -----------------------------------------------------------------------------------

# KEYS[1] lease, KEYS[2] fence; ARGV: me, lease_ms. {token, me} or {0, holder}.
_ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if held then return {0, held} end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token .. '|' .. ARGV[1], 'PX', ARGV[2])
return {token, ARGV[1]}
"""
# KEYS[1] lease; ARGV: '<token>|<me>', lease_ms. 1 if still ours (and renewed).
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""
# KEYS[1] a scope's fence; ARGV: token. Raised, never lowered.
_FENCE = """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""
_FENCED = "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -9 end\n"
# KEYS[1] fence, KEYS[2..] keys of the slot; ARGV: token, then groups of
# (command, key index, argument count, arguments...); HSETXX sets fields of a hash only if
# it exists (a session's hints never recreate a dropped session). 1, or -9 when fenced out.
_BATCH = (
    _FENCED
    + """
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i + 2])
  local key = KEYS[tonumber(ARGV[i + 1])]
  local args = {}
  for j = 1, n do args[j] = ARGV[i + 2 + j] end
  if ARGV[i] ~= 'HSETXX' then
    redis.call(ARGV[i], key, unpack(args))
  elseif redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, unpack(args))
  end
  i = i + 3 + n
end
return 1
"""
)
# KEYS[1] fence, KEYS[2] session; ARGV: token, epoch, instance, offset, checkpoint.
# {outcome, acknowledged, epoch}: 1 recorded, 0 kept, -1 stale, -2 ahead, -3 another instance,
# -4 no session, -9 fenced out.
_CHECKPOINT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {-9, 0, 0} end
local s = redis.call('HMGET', KEYS[2], 'epoch', 'instance', 'offset')
if not s[1] then return {-4, 0, 0} end
local epoch, offset, e = tonumber(s[1]), tonumber(s[3]), tonumber(ARGV[2])
if e < epoch then return {-1, offset, epoch} end
if e > epoch then return {-2, offset, epoch} end
if s[2] ~= ARGV[3] then return {-3, offset, epoch} end
if tonumber(ARGV[4]) > offset then
  redis.call('HSET', KEYS[2], 'offset', ARGV[4], 'checkpoint', ARGV[5])
  return {1, tonumber(ARGV[4]), epoch}
end
return {0, offset, epoch}
"""
# KEYS[1] fence, KEYS[2] session; ARGV: token, failed instance, epoch, new instance.
# {new epoch, checkpoint}; {-1} moved meanwhile, {-4} no session, {-9} fenced out.
_MOVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {-9} end
local s = redis.call('HMGET', KEYS[2], 'epoch', 'instance', 'checkpoint')
if not s[1] then return {-4} end
if tonumber(s[1]) ~= tonumber(ARGV[3]) or s[2] ~= ARGV[2] then return {-1} end
local epoch = tonumber(s[1]) + 1
redis.call('HSET', KEYS[2], 'epoch', epoch, 'instance', ARGV[4])
redis.call('HINCRBY', KEYS[2], 'failovers', 1)
return {epoch, s[3]}
"""

#: sessions read per round trip when a new leader loads
LOAD_BATCH = 512


def _fenced_out(token: int) -> NotLeader:
    return NotLeader(f"this controller's lease (fencing token {token}) was taken over")


class RedisControlStore:
    """Control state in Redis, shared by every controller with the same URL and prefix."""

    name = "redis"

    def __init__(self, url: str, prefix: str = "kvsp:pc:", timeout_s: float = 1.0) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._p = prefix
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)
        self._fence = self._redis.register_script(_FENCE)
        self._batch = self._redis.register_script(_BATCH)
        self._checkpoint = self._redis.register_script(_CHECKPOINT)
        self._move = self._redis.register_script(_MOVE)

    # keys
    def _g(self, name: str) -> str:
        return f"{self._p}{{c}}:{name}"

    def _s(self, scope: str, name: str) -> str:
        return f"{self._p}{{s:{scope}}}:{name}"

    async def _run(self, pipe: Any) -> list[Any]:
        return await run_pipe(pipe, "the controller's Redis state")

    def _pipe(self) -> Any:
        return self._redis.pipeline(transaction=False)

    # leadership
    async def acquire(self, me: str, lease_ms: int) -> tuple[int | None, str | None]:
        pipe = self._pipe()
        await self._acquire(keys=[self._g("lease"), self._g("fence")], args=[me, lease_ms],
                            client=pipe)  # fmt: skip
        ((token, holder),) = await self._run(pipe)
        if int(token) == 0:
            return None, bytes(holder).decode().partition("|")[2]
        return int(token), me

    async def renew(self, token: int, me: str, lease_ms: int) -> bool:
        pipe = self._pipe()
        await self._renew(keys=[self._g("lease")], args=[f"{token}|{me}", lease_ms], client=pipe)
        (kept,) = await self._run(pipe)
        return int(kept) == 1

    async def release(self, token: int, me: str) -> None:
        pipe = self._pipe()
        await self._release(keys=[self._g("lease")], args=[f"{token}|{me}"], client=pipe)
        await self._run(pipe)

    async def fence(self, token: int, scopes: Sequence[str]) -> None:
        pipe = self._pipe()
        pipe.smembers(self._g("scopes"))
        (stored,) = await self._run(pipe)
        every = sorted(set(scopes) | {s.decode() for s in stored})
        pipe = self._pipe()
        for scope in every:
            await self._fence(keys=[self._s(scope, "fence")], args=[token], client=pipe)
        if every:
            await self._run(pipe)

    # loading
    async def load(self) -> Snapshot:
        pipe = self._pipe()
        for name in ("instances", "maps", "reshards", "decisions"):
            pipe.hgetall(self._g(name))
        pipe.smembers(self._g("scopes"))
        instances, maps, reshards, decisions, scopes = await self._run(pipe)
        snapshot = Snapshot(
            instances=[_instance_of(url.decode(), raw) for url, raw in instances.items()],
            maps=[ShardMap.parse(raw) for raw in maps.values()],
            reshards=[json.loads(raw) for raw in reshards.values()],
            decisions={d.decode(): float(cost) for d, cost in decisions.items()},
        )
        named: list[tuple[float, str, str]] = []
        for raw_scope in scopes:
            scope = raw_scope.decode()
            pipe = self._pipe()
            pipe.zrange(self._s(scope, "sessions"), 0, -1, withscores=True)
            (members,) = await self._run(pipe)
            named.extend((score, scope, member.decode()) for member, score in members)
        named.sort()
        for start in range(0, len(named), LOAD_BATCH):
            part = named[start : start + LOAD_BATCH]
            pipe = self._pipe()
            for _, scope, name in part:
                pipe.hgetall(self._s(scope, f"session:{name}"))
            for (_, _, name), fields in zip(part, await self._run(pipe), strict=True):
                if b"meta" not in fields:
                    continue  # dropped between the index read and this one
                snapshot.sessions.append(_session_of(name, fields))
                if b"hints" in fields:
                    snapshot.hints.append(_hints_of(name, fields[b"hints"]))
        return snapshot

    # writing
    async def write(self, token: int, changes: Sequence[Change]) -> None:
        """One fenced batch per slot touched, all in one pipeline."""
        slots: dict[str, tuple[list[str], list[str | int | float]]] = {}

        def op(fence: str, command: str, key: str, *args: str | int | float) -> None:
            keys, argv = slots.setdefault(fence, ([fence], [token]))
            if key not in keys:
                keys.append(key)
            argv.extend([command, keys.index(key) + 1, len(args), *args])

        g = self._g("fence")
        for change in changes:
            match change:
                case PutInstance(entry):
                    op(g, "HSET", self._g("instances"), entry.url, _instance_json(entry))
                case PutSession(entry, last_use):
                    s = entry.scope_id
                    fields = [x for kv in _session_fields(entry).items() for x in kv]
                    op(self._s(s, "fence"), "HSET", self._s(s, f"session:{entry.session}"), *fields)
                    op(self._s(s, "fence"), "ZADD", self._s(s, "sessions"), last_use, entry.session)
                    op(g, "SADD", self._g("scopes"), s)
                case PutPending(entry):
                    key = self._s(entry.scope_id, f"session:{entry.session}")
                    pending = int(entry.pending)
                    op(self._s(entry.scope_id, "fence"), "HSETXX", key, "pending", pending)
                case PutHints(scope, hints):
                    key = self._s(scope, f"session:{hints.session}")
                    op(self._s(scope, "fence"), "HSETXX", key, "hints", _hints_json(hints))
                case DropSession(scope, name):
                    op(self._s(scope, "fence"), "DEL", self._s(scope, f"session:{name}"))
                    op(self._s(scope, "fence"), "ZREM", self._s(scope, "sessions"), name)
                case PutMap(shard_map):
                    op(g, "HSET", self._g("maps"), shard_map.map, shard_map.model_dump_json())
                case PutReshard(map_id, outcome):
                    if outcome is None:
                        op(g, "HDEL", self._g("reshards"), map_id)
                    else:
                        op(g, "HSET", self._g("reshards"), map_id, json.dumps(outcome))
                case PutDecision(decision, predicted):
                    op(g, "HSET", self._g("decisions"), decision, repr(predicted))
                case DropDecision(decision):
                    op(g, "HDEL", self._g("decisions"), decision)
        if not slots:
            return
        pipe = self._pipe()
        for keys, argv in slots.values():
            await self._batch(keys=keys, args=argv, client=pipe)
        if any(int(r) == -9 for r in await self._run(pipe)):
            raise _fenced_out(token)

    async def checkpoint(self, token: int, checkpoint: SessionCheckpoint, instance: str) -> None:
        s = checkpoint.scope_id
        keys = [self._s(s, "fence"), self._s(s, f"session:{checkpoint.session}")]
        args: list[str | int] = [token, checkpoint.epoch, instance, checkpoint.output_offset,
                                 checkpoint.model_dump_json()]  # fmt: skip
        pipe = self._pipe()
        await self._checkpoint(keys=keys, args=args, client=pipe)
        ((outcome, _, epoch),) = await self._run(pipe)
        name, outcome = checkpoint.session, int(outcome)
        if outcome == -9:
            raise _fenced_out(token)
        if outcome == -4:
            raise NotFound(f"no session {name}")
        if outcome == -1:
            raise StaleEpoch(
                f"session {name} is at epoch {epoch}; epoch {checkpoint.epoch} is over"
            )
        if outcome == -2:
            raise InvalidInput(
                f"session {name} is at epoch {epoch}; never issued {checkpoint.epoch}"
            )
        if outcome == -3:
            raise Forbidden(f"{instance} does not serve session {name}")

    async def move(
        self, token: int, scope_id: str, session: str, failed: str, epoch: int, to: str
    ) -> tuple[bool, SessionCheckpoint | None]:
        keys = [self._s(scope_id, "fence"), self._s(scope_id, f"session:{session}")]
        pipe = self._pipe()
        await self._move(keys=keys, args=[token, failed, epoch, to], client=pipe)
        ((moved, *rest),) = await self._run(pipe)
        if int(moved) == -9:
            raise _fenced_out(token)
        if int(moved) < 0:
            return False, None
        return True, SessionCheckpoint.parse(rest[0]).model_copy(update={"epoch": int(moved)})

    async def close(self) -> None:
        await self._redis.aclose()


def open_control_store(spec: str) -> ControlStore:
    """``memory`` or a ``redis://HOST:PORT/DB`` URL (``rediss://`` for TLS)."""
    if spec == "memory":
        return MemoryControlStore()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisControlStore(spec)
    raise InvalidInput(f"state must be 'memory' or a redis:// URL, got {spec!r}")
