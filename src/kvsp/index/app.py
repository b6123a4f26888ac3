"""HTTP adapter of the Index Service (Starlette): the routes of docs/api.md, nothing else.

Each route authenticates, reads and validates its body or path, and calls ``IndexService``;
errors become problem documents through ``kvsp.web.server``. ``POST lookup`` is a bare ASGI
endpoint (``AsgiEndpoint``), its body decoded by ``index.queries``.
Plain Starlette routes, not FastAPI's: kvsp validates bodies with its own record models, and
FastAPI's per-request dependency machinery cost more than the lookup itself (decision 0006).
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvsp.auth import Principals
from kvsp.core.compat import CompatibilityDescriptor
from kvsp.core.ids import parse_block_key, parse_compat_id, parse_scope_id
from kvsp.core.problems import NotFound, RecordError
from kvsp.core.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    ReplicaBatch,
    ReplicaRecord,
    ReplicaRef,
)
from kvsp.index.queries import decode_lookup
from kvsp.index.rules import (
    DESCRIPTOR_ROLES,
    LOOKUP_ROLES,
    PUBLISH_ROLES,
    STATUS_ROLES,
    check_path,
)
from kvsp.index.service import IndexService
from kvsp.index.wire import published_json
from kvsp.web.openapi import ANYONE, Op, obj, principal_of, routes_of
from kvsp.web.probes import metrics_op, probe_ops
from kvsp.web.server import (
    AsgiEndpoint,
    install_problem_handlers,
    json_response,
    lifespan_of,
    read_body,
    read_json_body,
    send_json,
)

__all__ = ["DEFAULT_MAX_BODY_OCTETS", "create_app"]

log = logging.getLogger("kvsp.index")

#: A body is parsed in one go on the event loop, about 13 ns an octet: 5 MiB holds the longest
#: lookup (65,536 keys, 4.4 MB) and a full batch of ordinary records (4,096 of about 470
#: octets), and keeps the longest parse near 70 ms.
DEFAULT_MAX_BODY_OCTETS = 5 << 20
BASE = "/kvsp/"


def _block_path(request: Request) -> tuple[str, str, str]:
    """The (compat, scope, block_key) of a block resource path, each checked as hex."""
    params = request.path_params
    compat, scope, block_key = params["compat"], params["scope"], params["block_key"]
    parse_compat_id(compat)
    parse_scope_id(scope)
    parse_block_key(block_key)
    return compat, scope, block_key


_PUBLISHED = obj(["created", "ttl_ms"], created={"type": "boolean"}, ttl_ms={"type": "integer"})
_REGISTERED = obj(["created"], created={"type": "boolean"})
_BATCH_ANSWER = obj(
    ["put", "delete"],
    put={"type": "array", "items": _PUBLISHED},
    delete={
        "type": "array",
        "items": obj(["withdrawn"], withdrawn={"type": "boolean"}),
    },
)


def create_app(
    service: IndexService,
    principals: Principals,
    max_body_octets: int = DEFAULT_MAX_BODY_OCTETS,
) -> Starlette:
    async def publish(request: Request) -> Response:
        compat, scope, block_key = _block_path(request)
        principal = principal_of(request.scope)
        record = ReplicaRecord.parse(await read_json_body(request, max_body_octets))
        check_path(record, compat, scope, block_key)
        (outcome,) = await service.publish(principal, [record])
        body = published_json(outcome.created, outcome.ttl_ms)
        return json_response(body, 201 if outcome.created else 200)

    async def withdraw(request: Request) -> Response:
        compat, scope, block_key = _block_path(request)
        principal = principal_of(request.scope)
        holder = request.query_params.get("holder")
        if holder is None:
            raise RecordError("DELETE needs ?holder=URL naming the replica's holder")
        named = {"compat_id": compat, "scope_id": scope, "block_key": block_key, "holder": holder}
        namespace = request.query_params.get("moqt_namespace")  # a moqt holder's publisher
        ref = ReplicaRef.parse(
            named if namespace is None else {**named, "moqt_namespace": namespace}
        )
        (removed,) = await service.withdraw(principal, [ref])
        if not removed:
            raise NotFound("no such replica record")
        return Response(status_code=204)

    async def batch(request: Request) -> Response:
        principal = principal_of(request.scope)
        body = await read_json_body(request, max_body_octets)
        return json_response(await service.batch_body(principal, body))

    async def lookup(scope: Scope, receive: Receive, send: Send) -> None:
        """The hottest route, as a bare ASGI endpoint: no request or response objects."""
        principal = principal_of(scope)
        query = decode_lookup(await read_body(scope, receive, max_body_octets))
        await send_json(send, await service.lookup(principal, query))

    async def register(request: Request) -> Response:
        compat = request.path_params["compat"]
        parse_compat_id(compat)
        body = await read_json_body(request, max_body_octets)
        created = await service.register(principal_of(request.scope), compat, body)
        return json_response(b'{"created":%s}' % (b"true" if created else b"false"),
                             201 if created else 200)  # fmt: skip

    async def status(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = InstanceStatusRecord.parse(await read_json_body(request, max_body_octets))
        await service.put_status(principal, parsed)
        return json_response(b'{"accepted":true}')

    async def healthz(_: Request) -> Response:
        await service.store.ping()
        return json_response(b'{"status":"ok","store":"%s"}' % service.store.name.encode())

    block = "replicas/{compat}/{scope}/{block_key}"
    publisher = "the record's scope and holder"
    ops = [
        Op("PUT", block, publish, "publish a Replica Record (KVSP 6.1)", PUBLISH_ROLES,
           publisher, ReplicaRecord, {200: _PUBLISHED, 201: _PUBLISHED}),
        Op("DELETE", block, withdraw, "withdraw a replica (KVSP 6.1)", PUBLISH_ROLES, publisher,
           answers={204: None},
           query={"holder": {"type": "string"}, "moqt_namespace": {"type": "string"}}),
        Op("POST", "replicas", batch, "publish and withdraw many (extension)", PUBLISH_ROLES,
           "each entry's scope and holder", ReplicaBatch, {200: _BATCH_ANSWER}),
        Op("POST", "lookup", AsgiEndpoint(lookup), "prefix lookup (KVSP 6.2)", LOOKUP_ROLES,
           "the query's scope", LookupRequest, {200: LookupResponse}),
        Op("PUT", "descriptors/{compat}", register,
           "what a Compatibility ID stands for (KVSP 4.1; extension), verified", DESCRIPTOR_ROLES,
           body=CompatibilityDescriptor,
           answers={200: _REGISTERED, 201: _REGISTERED}),
        Op("PUT", "status", status, "an instance's status, for estimates (extension)",
           STATUS_ROLES, "the instance's URL in its holders", InstanceStatusRecord,
           {200: obj(["accepted"], accepted={"type": "boolean"})}),
        *probe_ops("index", service.readiness),
        Op("GET", "healthz", healthz, "liveness and the store's", ANYONE,
           answers={200: obj(["status"], status={"type": "string"})}),
        metrics_op(service.metrics.registry, service.refresh_gauges),
    ]  # fmt: skip
    app = Starlette(
        routes=routes_of(BASE, "kvsp Index Service", ops, principals),
        lifespan=lifespan_of(service.store.start, service.store.close),
    )
    install_problem_handlers(app, log, lambda slug: service.metrics.rejected.labels(slug).inc())
    return app
