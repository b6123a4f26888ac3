"""The Placement Controller's HTTP adapter: statuses, sessions, instances, placement, shard maps,
health and metrics (routes in docs/api.md)."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp.auth import Principals
from kvsp.controller.frontend import FrontEnd, frontend_routes
from kvsp.controller.service import ControllerService
from kvsp.core.records import (
    MAX_KEYS_PER_REQUEST,
    Hex32,
    HttpUrl,
    InstanceState,
    InstanceStatusRecord,
    Record,
    Sampler,
    SessionCheckpoint,
    ShardMap,
    TokenId,
    Uuid,
)
from kvsp.web.server import (
    install_problem_handlers,
    json_response,
    lifespan_of,
    principal_of,
    read_json_body,
)

__all__ = ["InstanceStateChange", "PlaceRequest", "ReshardRequest", "TtftReport", "create_app"]

log = logging.getLogger("kvsp.controller")
_BODY_OCTETS = 16 << 20


class PlaceRequest(Record):
    tenant: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    compat_id: Hex32
    tokens: Annotated[tuple[TokenId, ...], Field(max_length=MAX_KEYS_PER_REQUEST * 16)]
    session: Uuid | None = None
    sampler: Sampler | None = None
    request_ref: Annotated[StrictStr, Field(max_length=256)] | None = None
    wait_prefetch: StrictBool = False
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 16)] | None = None


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


def create_app(
    service: ControllerService, principals: Principals, frontend: FrontEnd | None = None
) -> Starlette:
    """The controller's routes, and the OpenAI-compatible front end when one is given."""

    async def close() -> None:
        if frontend is not None:
            await frontend.aclose()
        await service.close()

    async def body(request: Request) -> bytes:
        return await read_json_body(request, _BODY_OCTETS)

    async def status(request: Request) -> Response:
        principal = principal_of(request, principals)
        parsed = InstanceStatusRecord.parse(await body(request))
        state = await service.put_status(principal, parsed)
        return _json({"state": state.value})

    async def checkpoint(request: Request) -> Response:
        principal = principal_of(request, principals)
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
        principal_of(request, principals)
        name = request.path_params["session"]
        doc = service.sessions.get(name).to_json()
        hints = None if service.session_hints is None else service.session_hints.get(name)
        if hints is not None:
            doc["hints"] = hints.to_json()
        return _json(doc)

    async def turn_ended(request: Request) -> Response:
        principal = principal_of(request, principals)
        turn = TurnEnd.parse(await body(request))
        outcomes = await service.turn_ended(
            principal, request.path_params["session"], turn.tool_call, turn.expected_gap_ms
        )
        return _json({"outcomes": outcomes})

    async def end_session(request: Request) -> Response:
        principal = principal_of(request, principals)
        outcomes = await service.end_session(principal, request.path_params["session"])
        return _json({"outcomes": outcomes})

    async def instances(request: Request) -> Response:
        principal_of(request, principals)
        return _json({"instances": service.instance_view()})

    async def instance_state(request: Request) -> Response:
        principal = principal_of(request, principals)
        parsed = InstanceStateChange.parse(await body(request))
        await service.set_state(principal, parsed.instance, parsed.state)
        return _json({"instance": parsed.instance, "state": parsed.state.value})

    async def place(request: Request) -> Response:
        principal = principal_of(request, principals)
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

    async def ttft(request: Request) -> Response:
        principal = principal_of(request, principals)
        parsed = TtftReport.parse(await body(request))
        predicted = service.observe_ttft(principal, request.path_params["decision"], parsed.ttft_us)
        return _json({"predicted_us": round(predicted, 1), "measured_us": parsed.ttft_us})

    async def register_map(request: Request) -> Response:
        principal = principal_of(request, principals)
        parsed = ShardMap.parse(await body(request))
        service.register_map(principal, parsed)
        return _json({"map": parsed.map, "version": parsed.version}, 201)

    async def get_map(request: Request) -> Response:
        principal_of(request, principals)
        map_id = request.path_params["map"]
        current = service.reshards.current(map_id)
        return _json(
            {
                "map": current.to_json(),
                "in_flight": service.reshards.in_flight(map_id),
            }
        )

    async def reshard(request: Request) -> Response:
        principal = principal_of(request, principals)
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
        return json_response(b'{"status":"ok"}')

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    base = "/kvsp/"
    app = Starlette(
        routes=[
            Route(base + "status", status, methods=["PUT"]),
            Route(base + "sessions/{session}/checkpoint", checkpoint, methods=["PUT"]),
            Route(base + "sessions/{session}", session, methods=["GET"]),
            Route(base + "sessions/{session}", end_session, methods=["DELETE"]),
            Route(base + "sessions/{session}/turns", turn_ended, methods=["POST"]),
            Route(base + "instances", instances, methods=["GET"]),
            Route(base + "instances/state", instance_state, methods=["PUT"]),
            Route(base + "place", place, methods=["POST"]),
            Route(base + "decisions/{decision}/ttft", ttft, methods=["PUT"]),
            Route(base + "shards", register_map, methods=["POST"]),
            Route(base + "shards/{map}", get_map, methods=["GET"]),
            Route(base + "shards/{map}/reshard", reshard, methods=["POST"]),
            Route(base + "healthz", healthz, methods=["GET"]),
            Route(base + "metrics", metrics, methods=["GET"]),
            *([] if frontend is None else frontend_routes(frontend, base, _BODY_OCTETS)),
        ],
        lifespan=lifespan_of(service.start, close),
    )
    install_problem_handlers(app, log, lambda slug: service.rejected.labels(slug).inc())
    return app
