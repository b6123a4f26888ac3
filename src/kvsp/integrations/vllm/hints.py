"""KvHints on the requests a stock ``vllm serve`` runs with ``KVSPConnector``.

There, vLLM keeps its own pages (G1, seen through its KV events) and kvsp's tier is the holder
the connector saves to (G2). A router attaches an envelope to a request as vLLM's own
``kv_hints`` (vLLM 0.32's ``KvHintsEnvelope``) or as Dynamo's vLLM bridge does, in
``kv_transfer_params["kv_hint"]``; the connector honours them only with the setting
``request_hints`` (vLLM's server passes ``kv_transfer_params`` on from clients).

The actions run once vLLM has finished the request and the blocks it saved have landed, on the
connector's loop (never on vLLM's threads), one at a time per request; each outcome is logged as
one JSON line (``kvsp hint outcome {...}``), as SGLang and Dynamo report theirs. Targets: exact
block keys in the request's tenant's scopes, or a session: the blocks of the requests vLLM
served under that ``session_id`` for that tenant (the latest ``_SESSIONS`` sessions). Against
what the blocks' copies really are:

- pin: a KVSP lease (6.6) at the holder on the blocks it holds, TTL as the holder grants it
  (``over-limits`` when it grants less, ``pin-limit`` past its lease quota);
- retain: ``rejected`` (``not-implemented``): a holder keeps no retention priority; a pin
  leases the blocks there;
- demote: counts the blocks whose verified copy the holder holds;
- prefetch: counts the blocks in vLLM's pages; with a ``destination``, a share to it;
- share: each block fetched from the holder (verified) and PUT to the destination.

vLLM offers no call that keeps, frees or loads its pages, so every action that would act on
them says so with code ``engine-g1`` (``kvsp.instance.hints.engine_kept``), as on the
vLLM-backed instance.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import msgspec

from kvsp.core.container import Container
from kvsp.core.hints import (
    HintAction,
    HintOutcome,
    HintPayload,
    KvHints,
    Outcome,
    Reason,
    read_action,
    rejection,
)
from kvsp.core.problems import KvspError, LeaseQuotaExceeded, ServiceUnavailable
from kvsp.core.records import LeaseRequest, LookupRequest, ReplicaRecord
from kvsp.holder.blocks import BlockId
from kvsp.holder.client import HolderClient
from kvsp.index.client import IndexClient
from kvsp.instance.hints import engine_kept, engine_prefetch, held_first
from kvsp.instance.share import share_blocks
from kvsp.integrations.vllm.g1 import G1Pages
from kvsp.tenants import Tenant

__all__ = ["ConnectorHints", "Planned", "request_hints"]

log = logging.getLogger("kvsp.vllm.hints")
#: sessions whose blocks are remembered for session targets, the latest first, and the blocks
#: kept per session (the latest ones: a session's requests may name their own session ids)
_SESSIONS = 4096
_SESSION_BLOCKS = 4096
#: how long hints wait for the request's last block to be saved and published
_SETTLE_S = 2.0
#: router hint key of Dynamo's vLLM bridge
DYNAMO_KEY = "kv_hint"


def request_hints(
    native: Any, params: Mapping[str, Any] | None
) -> tuple[KvHints | None, str | None]:
    """The envelope a request carries (vLLM's ``kv_hints``, else Dynamo's ``kv_hint``), and
    why it was refused if it does not parse."""
    raw: Any = None
    if native is not None:
        raw = msgspec.to_builtins(native)  # the same members as ours
    elif params is not None:
        raw = params.get(DYNAMO_KEY)
    if raw is None:
        return None, None
    try:
        return KvHints.model_validate(raw), None
    except ValueError as exc:
        return None, str(exc).splitlines()[0]


@dataclass(frozen=True)
class Planned:
    """One action of a finished request, resolved on vLLM's scheduler thread."""

    action: HintAction
    name: str
    payload: HintPayload
    blocks: tuple[BlockId, ...]
    #: the target blocks in vLLM's pages when the request finished
    in_g1: frozenset[BlockId]


class ConnectorHints:
    def __init__(
        self,
        compat_id: str,
        holder_url: str | None,
        g1: G1Pages,
        index: IndexClient,
        holders: HolderClient,
    ) -> None:
        self.compat_id = compat_id
        self.holder_url = holder_url
        self.g1 = g1
        self.index = index
        self.holders = holders
        #: (tenant scope, session) -> its blocks, root first (scheduler thread only)
        self._sessions: OrderedDict[tuple[str, str], tuple[BlockId, ...]] = OrderedDict()

    # -- on vLLM's scheduler thread -------------------------------------------------------------

    def served(self, tenant: Tenant, session: str, blocks: Sequence[BlockId]) -> None:
        """A request of ``session`` ended with these blocks (its whole context, root first)."""
        key = (tenant.scope_id, session)
        known = self._sessions.pop(key, ())
        self._sessions[key] = tuple(dict.fromkeys((*known, *blocks)))[-_SESSION_BLOCKS:]
        while len(self._sessions) > _SESSIONS:
            self._sessions.popitem(last=False)

    def plan(self, tenant: Tenant, hints: KvHints) -> list[Planned | HintOutcome]:
        """Each action resolved to its blocks, or the outcome refusing it."""
        scopes = {tenant.scope_id, *(s.scope_id for s in tenant.shared)}
        out: list[Planned | HintOutcome] = []
        for action in hints.actions:
            read = read_action(action)
            if isinstance(read, HintOutcome):
                out.append(read)
                continue
            name, payload = read
            target = payload.target
            if target.session is not None:
                blocks = self._sessions.get((tenant.scope_id, target.session), ())
            elif target.scope_id in scopes and target.block_keys is not None:
                blocks = tuple((self.compat_id, target.scope_id, k) for k in target.block_keys)
            else:
                theirs = "the target's scope is not one of the request's tenant"
                out.append(rejection(action, Reason.FORBIDDEN, theirs))
                continue
            in_g1 = frozenset(b for b in blocks if self.g1.holds(b))
            out.append(Planned(action, name, payload, blocks, in_g1))
        return out

    # -- on the connector's loop ----------------------------------------------------------------

    async def run(
        self, message_id: str, planned: Sequence[Planned | HintOutcome], last: BlockId | None
    ) -> list[HintOutcome]:
        """Once the request's last saved block (``last``) is published, or after
        ``_SETTLE_S``, every action; each outcome logged."""
        if last is not None:
            deadline = time.monotonic() + _SETTLE_S
            while not await self._held([last]) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        outcomes = []
        for item in planned:
            outcome = item if isinstance(item, HintOutcome) else await self._act(item)
            log.info("kvsp hint outcome %s", json.dumps({"message_id": message_id,
                                                          **outcome.to_json()}))  # fmt: skip
            outcomes.append(outcome)
        return outcomes

    async def _act(self, p: Planned) -> HintOutcome:
        if p.name == "retain":
            no = "a holder keeps no retention priority; kv.pin leases the blocks there"
            return rejection(p.action, Reason.NOT_IMPLEMENTED, no)
        if p.name == "pin" and p.payload.ttl_ms is None:
            return rejection(p.action, Reason.INVALID, "a pin needs ttl_ms")
        held = await self._held(p.blocks)
        if p.name == "prefetch" and p.payload.destination is None:
            return engine_prefetch(p.action, p.blocks, p.in_g1, held)
        outcome, blocks = held_first(p.action, p.payload, p.blocks, held)
        if p.name in ("share", "prefetch"):
            destination = p.payload.destination
            if destination is None:
                return rejection(p.action, Reason.INVALID, "share needs a destination")
            return await share_blocks(
                self.holders, destination, outcome, self._read(blocks, held, outcome), _copied
            )
        if blocks and p.name == "pin":
            await self._lease(outcome, blocks, p.payload)
        elif p.name == "demote":
            outcome.blocks = len(blocks)  # each has its verified copy at the holder
        return engine_kept(p.name, outcome, p.in_g1)

    async def _held(self, blocks: Sequence[BlockId]) -> dict[BlockId, ReplicaRecord]:
        """The holder's record of each target block it holds, by the Index Service."""
        held: dict[BlockId, ReplicaRecord] = {}
        if self.holder_url is None:
            return held
        for scope, run in groupby(blocks, key=lambda b: b[1]):
            keys = tuple(b[2] for b in run)
            query = LookupRequest(scope_id=scope, compat_id=self.compat_id, block_keys=keys)
            try:
                answer = await self.index.lookup(query)
            except KvspError as exc:
                log.warning("hint lookup failed: %s", exc.detail)
                continue
            for key, records in zip(keys, answer.replicas, strict=False):
                mine = [r for r in records if r.holder == self.holder_url]
                if mine:
                    held[(self.compat_id, scope, key)] = mine[0]
        return held

    async def _read(
        self,
        blocks: Sequence[BlockId],
        held: Mapping[BlockId, ReplicaRecord],
        outcome: HintOutcome,
    ) -> AsyncIterator[tuple[BlockId, Container]]:
        """The blocks from the holder, verified; one it no longer serves is listed missing."""
        for block in blocks:
            try:
                yield block, await self.holders.get(held[block])
            except KvspError as exc:
                outcome.missing.append(block[2])
                outcome.note("clipped", _reason(exc), f"{block[2]}: {exc.detail}")

    async def _lease(
        self, outcome: HintOutcome, blocks: Sequence[BlockId], payload: HintPayload
    ) -> None:
        """Lease the blocks at the holder, one lease per scope."""
        holder, ttl = self.holder_url, payload.ttl_ms
        assert holder is not None, "a pin has blocks held only where there is a holder"
        assert ttl is not None, "checked by _act"
        for scope, run in groupby(blocks, key=lambda b: b[1]):
            keys = tuple(b[2] for b in run)
            asked = LeaseRequest(
                block_keys=keys, ttl_ms=ttl, compat_id=self.compat_id, scope_id=scope
            )
            try:
                grant = await self.holders.lease(holder, asked)
            except LeaseQuotaExceeded as exc:
                said: Outcome = "clipped" if outcome.blocks else "rejected"
                outcome.note(said, Reason.PIN_LIMIT, exc.detail)
                return
            except KvspError as exc:  # the lease is all or nothing
                said = "clipped" if outcome.blocks else "deferred"
                outcome.note(said, _reason(exc), exc.detail)
                return
            outcome.blocks += len(keys)
            outcome.ttl_ms = grant.ttl_ms
            if grant.ttl_ms < ttl:
                outcome.note("clipped", Reason.OVER_LIMITS, f"the holder granted {grant.ttl_ms} ms")


def _reason(exc: KvspError) -> Reason:
    """Why the holder did not act on a block: it could not be asked (``unreachable``: worth
    sending again), or it no longer holds the block (it went meanwhile)."""
    return Reason.UNREACHABLE if isinstance(exc, ServiceUnavailable) else Reason.NOT_HELD


def _copied(block: BlockId, octets: int) -> None:
    log.debug("block %s shared (%d octets)", block[2][:16], octets)
