"""The inference instance's HTTP adapter: generation and sessions, prefetch, lifecycle, and the
holder routes over its own blocks (docs/api.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from typing import Annotated

from pydantic import Field, StrictInt, StrictStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvsp.auth import Principals, Role
from kvsp.core.digests import repr_digest
from kvsp.core.hints import KvHints
from kvsp.core.problems import InvalidInput
from kvsp.core.records import (
    U32,
    U63,
    InstanceStatusRecord,
    PrefetchDirective,
    PrefetchStatus,
    Record,
    Sampler,
    SessionCheckpoint,
    StateAnswer,
    StateChange,
    TokenId,
    TokenRange,
    Uuid,
)
from kvsp.core.registries import BLOCK_MEDIA_TYPE
from kvsp.core.validation import decimal
from kvsp.holder.app import block_ops
from kvsp.instance.service import InstanceService
from kvsp.instance.sessions import TokenEvent
from kvsp.web.openapi import ANYONE, Op, obj, principal_of, routes_of
from kvsp.web.probes import metrics_op, probe_ops
from kvsp.web.server import (
    install_problem_handlers,
    json_response,
    lifespan_of,
    parse_json_object,
    read_json_body,
)

__all__ = ["GenerateRequest", "ShardLoad", "create_app"]

log = logging.getLogger("kvsp.instance")
_BODY_OCTETS = 8 << 20
NDJSON = "application/x-ndjson"
_RANGE = re.compile(r"([0-9]{1,9})-([0-9]{1,9})")


class ShardLoad(Record):
    version: U63
    tokens: Annotated[tuple[TokenId, ...], Field(min_length=1, max_length=1 << 17)]
    ranges: Annotated[tuple[TokenRange, ...], Field(min_length=1, max_length=64)]


class GenerateRequest(Record):
    tenant: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    tokens: Annotated[tuple[TokenId, ...], Field(min_length=1, max_length=1 << 17)]
    sampler: Sampler = Sampler(method="greedy", deterministic=True)
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 16)] | None = None
    session: Uuid | None = None
    epoch: U32 = 0
    #: KvHints to execute once the request is done (controllers only)
    kv_hints: KvHints | None = None


def _lines(events: AsyncIterator[TokenEvent | dict[str, object]]) -> AsyncIterator[bytes]:
    async def out() -> AsyncIterator[bytes]:
        async for event in events:
            if isinstance(event, TokenEvent):
                doc: dict[str, object] = {
                    "index": event.index,
                    "epoch": event.epoch,
                    "token": event.token,
                }
            else:
                doc = event
            yield json.dumps(doc).encode() + b"\n"

    return out()


def _count(query: Mapping[str, str], name: str, default: int, most: int) -> int:
    """A non-negative integer query parameter, at most ``most``."""
    raw = query.get(name)
    if raw is None:
        return default
    value = decimal(raw)
    if value is None or value > most:
        raise InvalidInput(f"{name} must be an integer from 0 to {most}")
    return value


def create_app(service: InstanceService, principals: Principals) -> Starlette:
    base = "/kvsp/"

    async def body(request: Request) -> bytes:
        return await read_json_body(request, _BODY_OCTETS)

    async def generate(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = GenerateRequest.parse(await body(request))
        session = await service.generate(
            principal,
            parsed.tenant,
            parsed.tokens,
            parsed.sampler,
            parsed.max_tokens,
            parsed.session,
            parsed.epoch,
            parsed.kv_hints,
        )
        headers = {"x-session-id": session.session}
        return StreamingResponse(
            _lines(service.stream(session.session, 0, principal)),
            media_type=NDJSON,
            headers=headers,
        )

    async def tokens(request: Request) -> Response:
        principal = principal_of(request.scope)
        first = _count(request.query_params, "from", 0, 1 << 62)
        events = service.stream(request.path_params["session"], first, principal)
        return StreamingResponse(_lines(events), media_type=NDJSON)

    async def resume(request: Request) -> Response:
        principal = principal_of(request.scope)
        raw = await body(request)
        checkpoint = SessionCheckpoint.parse(raw)
        extra = json.loads(raw)
        limit = extra.get("max_tokens") if isinstance(extra, dict) else None
        session = await service.resume(
            principal, checkpoint, limit if isinstance(limit, int) and limit > 0 else None
        )
        return json_response(
            json.dumps(
                {
                    "session": session.session,
                    "epoch": session.epoch,
                    "cached_tokens": session.cached_tokens,
                }
            ).encode()
        )

    async def prefetch(request: Request) -> Response:
        principal = principal_of(request.scope)
        directive = PrefetchDirective.parse(await body(request))
        await service.prefetch(principal, directive)
        response = json_response(b'{"accepted":true}', 202)
        response.headers["location"] = f"{base}prefetch/{directive.directive}"
        return response

    async def prefetch_status(request: Request) -> Response:
        status = service.prefetch_status(request.path_params["directive"])
        return json_response(status.model_dump_json().encode())

    async def state(request: Request) -> Response:
        principal = principal_of(request.scope)
        change = StateChange.parse(await body(request))
        now = service.set_state(principal, change.state)
        return json_response(json.dumps({"state": now.value}).encode())

    async def load_shard(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = ShardLoad.parse(await body(request))
        map_id = request.path_params["map"]
        await service.load_shard(principal, map_id, parsed.version, parsed.tokens, parsed.ranges)
        return json_response(json.dumps({"map": map_id, "version": parsed.version}).encode())

    async def shard(request: Request) -> Response:
        map_id = request.path_params["map"]
        doc = {
            "map": map_id,
            "version": service.shards.version(map_id),
            "ranges": service.shards.ranges(map_id),
            "transferred_octets": service.shards.transferred,
        }
        return json_response(json.dumps(doc).encode())

    async def shard_kv(request: Request) -> Response:
        match = _RANGE.fullmatch(request.query_params.get("tokens", ""))
        if match is None:
            raise InvalidInput("tokens=a-b (a < b) is required")
        held = service.shards.read(request.path_params["map"], (int(match[1]), int(match[2])))
        octets = held.kv.tobytes()
        headers = {"repr-digest": repr_digest(hashlib.sha256(octets).digest())}
        return Response(octets, media_type=BLOCK_MEDIA_TYPE, headers=headers)

    async def reshard(request: Request) -> Response:
        principal = principal_of(request.scope)
        await service.reshard(principal, parse_json_object(await body(request)))
        return json_response(b'{"ok":true}')

    async def healthz(_: Request) -> Response:
        return json_response(
            json.dumps(
                {
                    "status": "ok",
                    "state": service.state.value,
                    "epoch": service.epoch,
                    "kv_events": service.kv_events_endpoints(),
                }
            ).encode()
        )

    async def hints(request: Request) -> Response:
        principal = principal_of(request.scope)
        envelope = KvHints.parse(await body(request))
        outcomes = await service.hints(principal, envelope)
        answer = {"message_id": envelope.message_id, "outcomes": [o.to_json() for o in outcomes]}
        return json_response(json.dumps(answer).encode())

    async def end_session(request: Request) -> Response:
        principal = principal_of(request.scope)
        released = await service.end_session(principal, request.path_params["session"])
        return json_response(json.dumps({"pins_released": released}).encode())

    async def events(request: Request) -> Response:
        query = request.query_params
        after, limit, wait_ms = (
            _count(query, "after", 0, 1 << 62),
            _count(query, "limit", 1000, 10_000),
            _count(query, "wait_ms", 0, 30_000),
        )
        page = await service.events_after(after, max(limit, 1), wait_ms)
        answer = {
            "epoch": service.epoch,
            "last": page.last,
            "missed": page.missed,
            "events": page.events,
        }
        return json_response(json.dumps(answer).encode())

    async def status(_: Request) -> Response:
        return json_response(service.status().model_dump_json(exclude_none=True).encode())

    controller = (Role.CONTROLLER,)
    peers = (Role.INSTANCE,)
    session_answer = obj(
        ["session", "epoch"], session={"type": "string"}, epoch={"type": "integer"}
    )
    ops = [
        # blocks come in only from peer instances, on the controller's share hint
        *block_ops(service.holder, get_roles=(Role.INSTANCE, Role.CLIENT), put_roles=peers),
        Op("POST", "generate", generate, "generate for a prompt (a stream of tokens)",
           (Role.CONTROLLER, Role.FRONTEND, Role.CLIENT), "the tenant's scope", GenerateRequest,
           {200: NDJSON}),
        Op("GET", "sessions/{session}/tokens", tokens, "a session's tokens from an index",
           (Role.CONTROLLER, Role.FRONTEND), "the session's scope",
           query={"from": {"type": "string"}}, answers={200: NDJSON}),
        Op("POST", "sessions/{session}/resume", resume, "resume a session (KVSP 6.8)",
           controller, "the checkpoint's scope", SessionCheckpoint, {200: session_answer}),
        Op("POST", "prefetch", prefetch, "a prefetch directive (KVSP 6.5)", controller,
           "the directive's scope", PrefetchDirective,
           {202: obj(["accepted"], accepted={"type": "boolean"})}),
        Op("GET", "prefetch/{directive}", prefetch_status, "a directive's progress", controller,
           answers={200: PrefetchStatus}),
        Op("PUT", "state", state, "wake or drain (KVSP 6.3)", controller, body=StateChange,
           answers={200: StateAnswer}),
        Op("POST", "reshard", reshard, "a reshard plan, commit or abort (KVSP 6.9)", controller,
           body={"type": "object"}, answers={200: obj(["ok"], ok={"type": "boolean"})}),
        Op("GET", "shards/{map}", shard, "what this instance holds of a shard map",
           (Role.CONTROLLER, Role.INSTANCE), answers={200: {"type": "object"}}),
        Op("POST", "shards/{map}/load", load_shard, "compute and hold shard ranges", controller,
           body=ShardLoad, answers={200: obj(["map", "version"], map={"type": "string"},
                                             version={"type": "integer"})}),
        Op("GET", "shards/{map}/kv", shard_kv, "the KV of a token range (a peer's reshard)",
           peers, query={"tokens": {"type": "string"}}, answers={200: BLOCK_MEDIA_TYPE}),
        Op("POST", "hints", hints, "KvHints (session-aware KV)", controller,
           "each target's scope", KvHints, {200: {"type": "object"}}),
        Op("DELETE", "sessions/{session}", end_session, "end a session here", controller,
           "the session's scope",
           answers={200: obj(["pins_released"], pins_released={"type": "integer"})}),
        Op("GET", "events", events, "KV events after a sequence number", controller,
           query={"after": {"type": "string"}, "limit": {"type": "string"},
                  "wait_ms": {"type": "string"}}, answers={200: {"type": "object"}}),
        Op("GET", "status", status, "this instance's status record", controller,
           answers={200: InstanceStatusRecord}),
        *probe_ops("instance", service.readiness),
        Op("GET", "healthz", healthz, "liveness", ANYONE, answers={200: {"type": "object"}}),
        metrics_op(service.holder.registry, service.holder.refresh_metrics),
    ]  # fmt: skip
    app = Starlette(
        routes=routes_of(base, "kvsp inference instance", ops, principals),
        lifespan=lifespan_of(service.start, service.close),
    )
    install_problem_handlers(app, log, lambda slug: service.holder.rejected.labels(slug).inc())
    return app
