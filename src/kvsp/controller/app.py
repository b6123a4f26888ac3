"""The Placement Controller's HTTP adapter: statuses, sessions, instances, placement, shard maps,
health and metrics (routes in docs/api.md)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Annotated, Any, Self

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from kvsp.auth import Principals, Role
from kvsp.controller.service import OPERATOR_ROLES, ControllerService
from kvsp.core.problems import InvalidInput
from kvsp.core.records import (
    MAX_KEYS_PER_REQUEST,
    Hex32,
    HttpUrl,
    InstanceState,
    InstanceStatusRecord,
    Record,
    Sampler,
    SessionCheckpoint,
    SessionName,
    ShardMap,
    StateAnswer,
    TokenId,
)
from kvsp.web.openapi import ANYONE, HEALTH, Op, obj, principal_of, routes_of
from kvsp.web.probes import metrics_op, probe_ops
from kvsp.web.server import (
    install_problem_handlers,
    json_response,
    lifespan_of,
    read_json_body,
)

__all__ = [
    "InstanceStateChange",
    "PlaceRequest",
    "ReshardRequest",
    "RouterQuery",
    "TtftReport",
    "create_app",
]

log = logging.getLogger("kvsp.controller")
BODY_OCTETS = 16 << 20


class PlaceRequest(Record):
    tenant: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    compat_id: Hex32
    tokens: Annotated[tuple[TokenId, ...], Field(max_length=MAX_KEYS_PER_REQUEST * 16)]
    session: SessionName | None = None
    sampler: Sampler | None = None
    request_ref: Annotated[StrictStr, Field(max_length=256)] | None = None
    wait_prefetch: StrictBool = False
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 16)] | None = None


_MAX_PROMPT = MAX_KEYS_PER_REQUEST * 16


class RouterQuery(Record):
    """Where a prompt's prefix is cached: Mooncake's indexer query (its field names), with the
    tenant whose scope the prompt is in. ``model`` is the Compatibility ID (may be left out
    when the tenant has one); exactly one of ``token_ids`` and ``text``."""

    tenant: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    model: Hex32 | None = None
    token_ids: Annotated[tuple[TokenId, ...], Field(max_length=_MAX_PROMPT)] | None = None
    text: Annotated[StrictStr, Field(max_length=1 << 20)] | None = None
    #: kvsp's caches carry no adapter apart from the Compatibility ID's: null only
    lora_name: None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> Self:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("give exactly one of token_ids and text")
        return self


class TurnEnd(Record):
    """A turn of a session is over: did it end in a tool call, and how long until the next."""

    tool_call: StrictBool = False
    expected_gap_ms: Annotated[StrictInt, Field(ge=0, le=86_400_000)] | None = None


class TtftReport(Record):
    ttft_us: Annotated[StrictFloat | StrictInt, Field(ge=0, le=3.6e9, allow_inf_nan=False)]


class InstanceStateChange(Record):
    instance: HttpUrl
    state: InstanceState


class ReshardRequest(Record):
    to: ShardMap | None = None
    instances: Annotated[tuple[HttpUrl, ...], Field(min_length=1, max_length=4096)] | None = None
    deadline_ms: Annotated[StrictInt, Field(ge=1, le=600_000)] = 2_000


def _json(doc: Any, status: int = 200) -> Response:
    return json_response(json.dumps(doc).encode(), status)


#: the cluster page's files (shipped in the package: no CDN) and their media types
_PAGE = {"": "text/html; charset=utf-8", "ui.js": "text/javascript; charset=utf-8",
         "ui.css": "text/css; charset=utf-8"}  # fmt: skip


def page_ops() -> list[Op]:
    """``GET ui/`` and its script and style: static, open to anyone (the data they show comes
    from ``GET ui/state``, with the operator's token)."""
    folder = resources.files("kvsp.controller") / "ui"
    ops = []
    for name, media in _PAGE.items():
        octets = (folder / (name or "index.html")).read_bytes()

        async def serve(_: Request, octets: bytes = octets, media: str = media) -> Response:
            return Response(octets, media_type=media, headers={"cache-control": "no-cache"})

        ops.append(Op("GET", "ui/" + name, serve, "the live cluster page", ANYONE,
                      answers={200: "text/html" if not name else media.split(";")[0]}))  # fmt: skip
    return ops


def create_app(
    service: ControllerService,
    principals: Principals,
    more: Sequence[Op] = (),
    closing: Sequence[Callable[[], Awaitable[None]]] = (),
    tokenize: Callable[[str], list[int]] | None = None,
) -> Starlette:
    """The controller's routes, and ``more`` served beside them (the OpenAI-compatible front
    end), whose ``closing`` steps run before the service closes; ``tokenize`` turns a router
    query's text into token ids (None: queries must send token ids)."""

    async def close() -> None:
        for step in closing:
            await step()
        await service.close()

    async def body(request: Request) -> bytes:
        return await read_json_body(request, BODY_OCTETS)

    async def status(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = InstanceStatusRecord.parse(await body(request))
        state = await service.put_status(principal, parsed)
        return _json({"state": state.value})

    async def checkpoint(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = SessionCheckpoint.parse(await body(request))
        answer = await service.put_checkpoint(principal, request.path_params["session"], parsed)
        return _json(
            {
                "recorded": answer.recorded,
                "acknowledged": answer.acknowledged,
                "epoch": answer.epoch,
            }
        )

    async def session(request: Request) -> Response:
        principal = principal_of(request.scope)
        name = request.path_params["session"]
        return _json(service.session_view(principal, name))

    async def turn_ended(request: Request) -> Response:
        principal = principal_of(request.scope)
        turn = TurnEnd.parse(await body(request))
        outcomes = await service.turn_ended(
            principal, request.path_params["session"], turn.tool_call, turn.expected_gap_ms
        )
        return _json({"outcomes": outcomes})

    async def end_session(request: Request) -> Response:
        principal = principal_of(request.scope)
        outcomes = await service.end_session(principal, request.path_params["session"])
        return _json({"outcomes": outcomes})

    async def forget_session(request: Request) -> Response:
        principal = principal_of(request.scope)
        await service.forget_session(principal, request.path_params["session"])
        return _json({"forgotten": True})

    async def abandon_turn(request: Request) -> Response:
        principal = principal_of(request.scope)
        await service.abandon_turn(principal, request.path_params["session"])
        return _json({"abandoned": True})

    async def instances(request: Request) -> Response:
        # the role is checked before the endpoint (routes_of)
        return _json({"instances": service.instance_view()})

    async def instance_state(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = InstanceStateChange.parse(await body(request))
        await service.set_state(principal, parsed.instance, parsed.state)
        return _json({"instance": parsed.instance, "state": parsed.state.value})

    async def place(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = PlaceRequest.parse(await body(request))
        placement = await service.place(
            principal,
            parsed.tenant,
            parsed.compat_id,
            parsed.tokens,
            parsed.session,
            parsed.sampler,
            parsed.request_ref,
            parsed.wait_prefetch,
            parsed.max_tokens,
        )
        return _json(placement.to_json())

    async def query(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = RouterQuery.parse(await body(request))
        tokens: Sequence[int] | None = parsed.token_ids
        if tokens is None:
            if tokenize is None:
                raise InvalidInput("this controller has no tokenizer: send token_ids")
            tokens = await asyncio.to_thread(tokenize, parsed.text or "")
        return _json(await service.query_prefix(principal, parsed.tenant, parsed.model, tokens))

    async def ttft(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = TtftReport.parse(await body(request))
        predicted = await service.observe_ttft(
            principal, request.path_params["decision"], parsed.ttft_us
        )
        return _json({"predicted_us": round(predicted, 1), "measured_us": parsed.ttft_us})

    async def register_map(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = ShardMap.parse(await body(request))
        await service.register_map(principal, parsed)
        return _json({"map": parsed.map, "version": parsed.version}, 201)

    async def get_map(request: Request) -> Response:
        # the role is checked before the endpoint (routes_of)
        return _json(service.shard_view(request.path_params["map"]))

    async def reshard(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = ReshardRequest.parse(await body(request))
        result = await service.reshard(
            principal, request.path_params["map"], parsed.to, parsed.instances, parsed.deadline_ms
        )
        return _json(
            {
                "map": result.map,
                "version": result.version,
                "committed": result.commit,
                "reason": result.reason,
            }
        )

    async def healthz(_: Request) -> Response:
        return _json({"status": "ok", **service.lead_view()})

    async def cluster_state(_: Request) -> Response:
        return _json(service.cluster_view())

    base = "/kvsp/"
    pc = (Role.CONTROLLER,)
    operator = OPERATOR_ROLES
    own = "the session's scope"
    outcomes = obj(["outcomes"], outcomes={"type": "array"})
    ops = [
        Op("PUT", "status", status, "an instance's status (KVSP 6.3)", (Role.INSTANCE,),
           "the instance's URL in its holders", InstanceStatusRecord, {200: StateAnswer}),
        Op("PUT", "sessions/{session}/checkpoint", checkpoint, "a session checkpoint (KVSP 6.8)",
           (Role.INSTANCE,), own, SessionCheckpoint,
           {200: obj(["recorded", "acknowledged", "epoch"], recorded={"type": "boolean"},
                     acknowledged={"type": "integer"}, epoch={"type": "integer"})}),
        Op("GET", "sessions/{session}", session, "a session's state", operator, own,
           answers={200: {"type": "object"}}),
        Op("DELETE", "sessions/{session}", end_session, "a session is over", operator, own,
           answers={200: outcomes}),
        Op("POST", "sessions/{session}/turns", turn_ended, "a turn is over (KvHints)", operator,
           own, TurnEnd, {200: outcomes}),
        Op("POST", "sessions/{session}/forget", forget_session,
           "a request's own session is done: forgotten, no hints", operator, own,
           answers={200: obj(["forgotten"], forgotten={"type": "boolean"})}),
        Op("POST", "sessions/{session}/abandon", abandon_turn,
           "the client went away mid-turn: the instance stops", operator, own,
           answers={200: obj(["abandoned"], abandoned={"type": "boolean"})}),
        Op("GET", "instances", instances, "every instance as the controller sees it", pc,
           answers={200: obj(["instances"], instances={"type": "array"})}),
        Op("PUT", "instances/state", instance_state, "wake or drain an instance", pc,
           body=InstanceStateChange, answers={200: obj(["instance", "state"],
                                                       instance={"type": "string"},
                                                       state={"type": "string"})}),
        Op("POST", "place", place, "place a request (KVSP 6.4)", operator, "the tenant's scope",
           PlaceRequest, {200: {"type": "object"}}),
        Op("POST", "query", query, "where a prompt's prefix is cached (the router query)",
           (Role.ROUTER,), "the tenant's scope", RouterQuery,
           {200: obj(["instances", "holders"], instances={"type": "object"},
                     holders={"type": "object"})}),
        Op("PUT", "decisions/{decision}/ttft", ttft, "a placed request's measured TTFT",
           operator, body=TtftReport, answers={200: obj(["predicted_us", "measured_us"],
                                                        predicted_us={"type": "number"},
                                                        measured_us={"type": "number"})}),
        Op("POST", "shards", register_map, "register a shard map (KVSP 6.9)", pc, body=ShardMap,
           answers={201: obj(["map", "version"], map={"type": "string"},
                             version={"type": "integer"})}),
        Op("GET", "shards/{map}", get_map, "a shard map", pc, answers={200: {"type": "object"}}),
        Op("POST", "shards/{map}/reshard", reshard, "reshard a map (KVSP 6.9)", pc,
           body=ReshardRequest, answers={200: {"type": "object"}}),
        *probe_ops("controller", service.readiness),
        *page_ops(),
        Op("GET", "ui/state", cluster_state, "what the cluster page shows", pc,
           answers={200: obj(["instances", "sessions", "placements", "hit_rates", "hints"],
                             instances={"type": "array"}, sessions={"type": "array"},
                             placements={"type": "array"}, hit_rates={"type": "object"},
                             hints={"type": "array"})}),
        Op("GET", "healthz", healthz, "liveness", ANYONE, answers={200: HEALTH}),
        metrics_op(service.metrics.registry),
        *more,
    ]  # fmt: skip
    app = Starlette(
        routes=routes_of(base, "kvsp Placement Controller", ops, principals),
        lifespan=lifespan_of(service.start, close),
    )
    install_problem_handlers(app, log, lambda slug: service.metrics.rejected.labels(slug).inc())
    return app
