"""``kvsp index ingest``: the KV event streams of unmodified vLLM pods, read into the IS.

One task per pod reads its ZMQ PUB socket (``PodStream``); ``kvevents/pods.py`` turns each
batch into record changes, which are written to the IS in batches once the socket has been idle
for 5 ms (or 2,000 changes are pending), and written again before their TTL runs out (a
third of it), so a pod whose stream stops is forgotten within one TTL. A write goes while the
stream reads on, one write at a time, in order.

On start, a stream reads what the pod's replay buffer holds before any message: an ingest that
starts, or restarts, beside an idle pod knows its blocks without waiting for its next batch.

Sequence numbers decide what the records can be trusted for. On the first message, and after
the sequence went back (the pod restarted) or the topic changed (a kvsp instance's epoch), the
pod's records are dropped and whatever the pod's replay buffer still holds is read from 0:
history that starts late can only leave blocks out, never keep a removed one. A gap is filled
from the replay buffer; when the buffer no longer holds the first missing batch, the batches in
between are lost, a removal among them could leave a stale record, and so the pod's records
are dropped and rebuilt from what follows.
"""

from __future__ import annotations

import asyncio
import logging
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from kvsp.core.config import config_table
from kvsp.core.problems import ConfigurationError, KvspError
from kvsp.core.records import ReplicaRef
from kvsp.index.client import IndexClient
from kvsp.kvevents.pods import PodChanges, PodIndex, PodSource
from kvsp.kvevents.wire import END_SEQ, decode_batch, seq_octets
from kvsp.tenants import Tenants

__all__ = ["PodEndpoint", "PodStream", "ingest", "load_pods"]

log = logging.getLogger("kvsp.kvevents.ingest")
#: changes written to the IS in one request at most, and pending before a write
BATCH_RECORDS = 1_000
FLUSH_CHANGES = 2_000
#: a write goes once the socket has had nothing for this long (a burst goes in few writes)
FLUSH_IDLE_MS = 5
REPLAY_TIMEOUT_S = 5.0
#: batches queued on the SUB socket before ZMQ drops (a gap, then a replay): a burst while
#: the IS is slow fits, as vLLM's publisher sends up to 100,000 batches ahead by default
RECEIVE_BATCHES = 100_000
RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class PodEndpoint:
    name: str
    source: PodSource
    endpoint: str
    replay_endpoint: str | None


def load_pods(
    path: Path, tenants: Tenants, compat_id: str, block_tokens: int, layers: int
) -> list[PodEndpoint]:
    """The pods file (TOML): ``ttl_ms`` and one ``[pods.NAME]`` table per pod with ``url``,
    ``endpoint``, optional ``replay_endpoint``, ``tenant`` (requests without a cache salt),
    ``salts`` (cache salt -> tenant) and ``compat_id`` (default: the installed model's)."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"cannot read pods file {path}: {exc}") from None
    config_table(doc, "pods file", ("ttl_ms", "pods"))
    ttl = doc.get("ttl_ms", 30_000)
    if not isinstance(ttl, int) or not 1_000 <= ttl <= 600_000:
        raise ConfigurationError("ttl_ms must be an integer from 1000 to 600000")
    pods = config_table(doc.get("pods", {}), "pods", doc.get("pods", {}).keys())
    out = []
    for name, entry in pods.items():
        where = f"pods.{name}"
        table = config_table(
            entry, where, ("url", "endpoint", "replay_endpoint", "tenant", "salts", "compat_id")
        )
        for key in ("url", "endpoint"):
            if not isinstance(table.get(key), str):
                raise ConfigurationError(f"{where}.{key} must be a string")
        salts = table.get("salts", {})
        if not isinstance(salts, dict):
            raise ConfigurationError(f"{where}.salts must be a table of tenant names")
        default = table.get("tenant")
        source = PodSource(
            url=table["url"],
            compat_id=table.get("compat_id", compat_id),
            block_tokens=block_tokens,
            layers=layers,
            tenant=None if default is None else tenants.get(default),
            salts={salt: tenants.get(t) for salt, t in salts.items()},
            ttl_ms=ttl,
        )
        out.append(PodEndpoint(name, source, table["endpoint"], table.get("replay_endpoint")))
    if not out:
        raise ConfigurationError(f"pods file {path} names no pod")
    return out


class PodStream:
    """One pod's events, read and written to the IS until cancelled."""

    def __init__(self, pod: PodEndpoint, index: IndexClient, context: zmq.asyncio.Context) -> None:
        self.pod = pod
        self.index = index
        self.context = context
        self.state = PodIndex(pod.source)
        self.pending = PodChanges()
        self.last: int | None = None
        self.topic: bytes | None = None
        self.batches = 0
        self.resets = 0
        #: writes go one at a time, in the order their changes were taken
        self._writing = asyncio.Lock()
        self._behind: asyncio.Task[None] | None = None

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.set_hwm(RECEIVE_BATCHES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.pod.endpoint)
        refresh = asyncio.create_task(self._refresh())
        try:
            await self._catch_up()
            while True:
                frames = await sub.recv_multipart()
                await self._take(frames)
                pending = len(self.pending.put) + len(self.pending.delete)
                if pending >= FLUSH_CHANGES or not await sub.poll(FLUSH_IDLE_MS):
                    await self._write_behind()
        finally:
            refresh.cancel()
            if self._behind is not None:
                self._behind.cancel()
            sub.close(linger=0)

    async def _write_behind(self) -> None:
        """Write what is pending while the next batches are read (the IS stores one write
        while the stream derives the next one's keys), with one write queued at most."""
        if self._behind is not None:
            await self._behind
        self._behind = asyncio.create_task(self.flush())

    async def _take(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("pod %s sent a message that is not a KV event batch", self.pod.name)
            return
        topic, seq = frames[0], int.from_bytes(frames[1], "big")
        if self.topic is None and self.last is not None:  # caught up from the replay buffer
            if seq <= self.last:  # sent while the buffer was read: applied already
                return
            self.topic = topic
        if self.last is not None and self.topic == topic and seq == self.last + 1:
            self._apply(seq, frames[2])
            return
        # the SUB socket delivers in order and a replay covers only what came before the
        # message at hand: a sequence that goes back is a new publisher
        if self.last is None or self.topic != topic or seq <= self.last:
            self._reset("its first batch" if self.last is None else "it restarted")
            await self._replay(0, seq)
        else:
            await self._replay(self.last + 1, seq)
        self.topic = topic
        self._apply(seq, frames[2])

    def _reset(self, why: str) -> None:
        if self.last is not None:
            self.resets += 1
            log.warning("pod %s: its records are dropped: %s", self.pod.name, why)
        self.state.reset(self.pending)
        self.last = None

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("pod %s: batch %d is not a KV event batch: %s", self.pod.name, seq, exc)
        else:
            self.state.apply(batch, self.pending)
            self.batches += 1
        self.last = seq

    async def _catch_up(self) -> None:
        """Apply what the pod's replay buffer holds, before the first message: an ingest
        started (or restarted) beside an idle pod knows its blocks without waiting for its next
        batch. The buffer names no topic: the first message's is taken as the pod's."""
        got = await self._ask_replay(0)
        if got:
            self._apply_replayed(got[0][0], got[-1][0] + 1, got)
            await self.flush()

    async def _replay(self, start: int, until: int) -> None:
        """Apply batches ``start`` to ``until - 1`` from the pod's replay buffer."""
        got = await self._ask_replay(start) if until > start else []
        self._apply_replayed(start, until, got)

    def _apply_replayed(self, start: int, until: int, got: list[tuple[int, bytes]]) -> None:
        """Apply batches ``start`` to ``until - 1`` of ``got`` (read from the replay buffer);
        drop the pod's records where the buffer no longer held ``start`` (a gap after it)."""
        wanted = [(s, p) for s, p in got if start <= s < until]
        if start and (not wanted or wanted[0][0] != start) and until > start:
            self._reset(f"batches {start} to {until - 1} were lost")
        expected = wanted[0][0] if wanted else until
        for seq, payload in wanted:
            if seq != expected:
                self._reset(f"the replay skipped batch {expected}")
            self._apply(seq, payload)
            expected = seq + 1

    async def _ask_replay(self, start: int) -> list[tuple[int, bytes]]:
        if self.pod.replay_endpoint is None:
            return []
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.pod.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", seq_octets(start)))
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4 or frames[2] == END_SEQ:
                        return out
                    out.append((int.from_bytes(frames[2], "big"), frames[3]))
        except TimeoutError:
            log.warning("pod %s: no answer to a replay request", self.pod.name)
            return out
        finally:
            dealer.close(linger=0)

    async def flush(self) -> None:
        """Write the pending changes; kept for the next flush when the IS fails. Flushes run
        one at a time, so a later change never reaches the IS before an earlier one."""
        async with self._writing:
            await self._write_pending()

    async def _write_pending(self) -> None:
        changes, self.pending = self.pending, PodChanges()
        puts = [self.state.record_json(block, tiers) for block, tiers in changes.put.items()]
        source = self.pod.source
        deletes = [
            ReplicaRef.model_construct(
                compat_id=source.compat_id, scope_id=scope, block_key=key, holder=source.url
            )
            for scope, key in changes.delete
        ]
        try:
            for i in range(0, max(len(puts), len(deletes)), BATCH_RECORDS):
                part = slice(i, i + BATCH_RECORDS)
                await self.index.batch(delete=deletes[part], rendered=puts[part])
        except KvspError as exc:
            log.warning("pod %s: records not written (%s); retrying", self.pod.name, exc.detail)
            for block, tiers in changes.put.items():
                if block not in self.pending.delete and block not in self.pending.put:
                    self.pending.put[block] = tiers
            for block in changes.delete:
                if block not in self.pending.put:
                    self.pending.delete.add(block)
            await asyncio.sleep(RETRY_S)

    async def _refresh(self) -> None:
        """Every record again, well before its TTL runs out."""
        while True:
            await asyncio.sleep(self.pod.source.ttl_ms / 3000)
            for block, tiers in self.state.held():
                if block not in self.pending.delete:
                    self.pending.put[block] = tiers
            await self.flush()


async def ingest(pods: Sequence[PodEndpoint], index_url: str, token: str | None) -> None:
    """Read every pod's events into the IS until cancelled."""
    context = zmq.asyncio.Context.instance()
    index = IndexClient(index_url, token)
    streams = [PodStream(pod, index, context) for pod in pods]
    try:
        async with asyncio.TaskGroup() as group:
            for stream in streams:
                group.create_task(stream.run())
    finally:
        await index.aclose()
