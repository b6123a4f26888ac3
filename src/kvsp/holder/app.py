"""The holder's HTTP adapter (KVSP 6.6, 6.7): block resources, leases, health and metrics.

``GET blocks/...`` is a bare ASGI endpoint that writes the header and then each stored buffer
as it is, so serving a block copies nothing in Python; ``Repr-Digest`` comes from the digest
computed when the block was stored (for a whole block) or from one pass over the range.
A ``codec`` other than the stored one cannot be produced (this holder does not transcode):
the block is served in its stored codec, which the container header names, so a client that
asked for a codec can tell (docs/decisions/0007-holder.md).
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvsp.auth import Principals, Role
from kvsp.core.digests import repr_digest
from kvsp.core.ids import parse_block_key, parse_compat_id, parse_scope_id
from kvsp.core.problems import InvalidInput, PreconditionRequired
from kvsp.core.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord
from kvsp.core.registries import BLOCK_MEDIA_TYPE, SERVED_CODECS
from kvsp.core.validation import decimal
from kvsp.holder.blocks import BlockId
from kvsp.holder.service import HolderService
from kvsp.web.openapi import ANYONE, HEALTH, Op, principal_of, routes_of
from kvsp.web.probes import metrics_op, probe_ops
from kvsp.web.server import (
    AsgiEndpoint,
    InflightOctets,
    install_problem_handlers,
    json_response,
    lifespan_of,
    read_body,
    read_json_body,
)

__all__ = ["HOLDER_BLOCK_ROLES", "block_ops", "create_app", "parse_block_query"]

log = logging.getLogger("kvsp.holder")

BASE = "/kvsp/"
BLOCK = BASE + "blocks/{compat}/{scope}/{block_key}"
_LAYERS = re.compile(r"([0-9]{1,9})-([0-9]{1,9})")
_JSON_BODY_OCTETS = 1 << 20


def _block_of(params: dict[str, str]) -> BlockId:
    compat, scope, key = params["compat"], params["scope"], params["block_key"]
    parse_compat_id(compat)
    parse_scope_id(scope)
    parse_block_key(key)
    return compat, scope, key


def parse_block_query(query: bytes) -> tuple[int, int] | None:
    """The ``layers=a-b`` range of a block GET; ``codec=n`` is checked and otherwise ignored
    (the stored codec is served)."""
    if not query:
        return None
    try:
        params = parse_qs(query.decode("ascii"), strict_parsing=True, max_num_fields=4)
    except (UnicodeDecodeError, ValueError):
        raise InvalidInput("the query string is malformed") from None
    unknown = set(params) - {"layers", "codec"}
    if unknown or any(len(v) != 1 for v in params.values()):
        raise InvalidInput("a block GET takes at most one layers=a-b and one codec=n")
    if "codec" in params:
        codec = params["codec"][0]
        if decimal(codec) not in SERVED_CODECS:
            raise InvalidInput(f"codec={codec} is not a registered codec number")
    if "layers" not in params:
        return None
    match = _LAYERS.fullmatch(params["layers"][0])
    if match is None or int(match[1]) > int(match[2]):
        raise InvalidInput("layers must be a-b with a <= b (an inclusive range)")
    return int(match[1]), int(match[2])


#: who may read and lease a standalone holder's blocks, and store them there
HOLDER_BLOCK_ROLES = (Role.CLIENT, Role.INSTANCE, Role.HOLDER)


def block_ops(
    service: HolderService,
    get_roles: tuple[Role, ...] = HOLDER_BLOCK_ROLES,
    put_roles: tuple[Role, ...] = HOLDER_BLOCK_ROLES,
) -> list[Op]:
    """The block and lease routes of a holder. An inference instance mounts them too, with
    narrower roles: only its peers store blocks into it (the share path)."""
    inflight = InflightOctets(service.config.max_inflight_octets)

    async def get_block(scope: Scope, receive: Receive, send: Send) -> None:
        principal = principal_of(scope)
        block = _block_of(scope["path_params"])
        layers = parse_block_query(scope["query_string"])
        read, sha256 = await service.get_block(principal, block, layers)
        header = read.header.encode()
        max_age = max(0, read.remaining_ttl_ms // 1000)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", BLOCK_MEDIA_TYPE.encode()),
                    (b"content-length", b"%d" % read.size),
                    (b"repr-digest", repr_digest(sha256).encode()),
                    (b"cache-control", b"private, immutable, max-age=%d" % max_age),
                ],
            }
        )
        await send({"type": "http.response.body", "body": header, "more_body": True})
        for i, part in enumerate(read.parts):
            more = i + 1 < len(read.parts)
            await send({"type": "http.response.body", "body": part, "more_body": more})

    async def put_block(request: Request) -> Response:
        block = _block_of(request.path_params)
        principal = principal_of(request.scope)
        if request.headers.get("if-none-match", "").strip() != "*":
            raise PreconditionRequired("storing a block needs If-None-Match: *")
        service.check_put(principal, block)  # scope and duplicates before any body octet
        declared = decimal(request.headers.get("content-length", ""))
        limit = service.config.max_block_octets
        with inflight.reserve(limit if declared is None else min(declared, limit)):
            body = await read_body(
                request.scope, request.receive, limit, (BLOCK_MEDIA_TYPE,), service.check_header
            )
            record = await service.put_block(principal, block, body)
        return json_response(record.model_dump_json(exclude_none=True).encode(), 201)

    async def grant_lease(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = LeaseRequest.parse(await read_json_body(request, _JSON_BODY_OCTETS))
        grant = await service.grant_lease(principal, parsed)
        response = json_response(grant.model_dump_json().encode(), 201)
        response.headers["location"] = f"{BASE}leases/{grant.lease}"
        return response

    async def renew_lease(request: Request) -> Response:
        principal = principal_of(request.scope)
        parsed = LeaseRenewal.parse(await read_json_body(request, _JSON_BODY_OCTETS))
        grant = await service.renew_lease(principal, request.path_params["lease"], parsed.ttl_ms)
        return json_response(grant.model_dump_json().encode())

    async def release_lease(request: Request) -> Response:
        principal = principal_of(request.scope)
        await service.release_lease(principal, request.path_params["lease"])
        return Response(status_code=204)

    lease = "leases/{lease}"
    block = BLOCK.removeprefix(BASE)
    layers = {"type": "string", "pattern": "^[0-9]{1,5}-[0-9]{1,5}$"}
    path = "the block's scope"
    mine = "the lease's own principal"
    return [
        Op("GET", block, AsgiEndpoint(get_block), "a block or a layer range (KVSP 6.7)",
           get_roles, path, answers={200: BLOCK_MEDIA_TYPE},
           query={"layers": layers, "codec": {"type": "string"}}),
        Op("PUT", block, put_block, "store a block once (KVSP 6.7; If-None-Match: *)", put_roles,
           path, BLOCK_MEDIA_TYPE, {201: ReplicaRecord}),
        Op("POST", "leases", grant_lease, "lease blocks (KVSP 6.6)", get_roles,
           "the request's scope", LeaseRequest, {201: LeaseGrant}),
        Op("PUT", lease, renew_lease, "renew a lease", get_roles, mine, LeaseRenewal,
           {200: LeaseGrant}),
        Op("DELETE", lease, release_lease, "release a lease", get_roles, mine,
           answers={204: None}),
    ]  # fmt: skip


def create_app(service: HolderService, principals: Principals) -> Starlette:
    async def healthz(_: Request) -> Response:
        return json_response(b'{"status":"ok"}')

    ops = [
        *block_ops(service),
        *probe_ops("holder", service.readiness),
        Op("GET", "healthz", healthz, "liveness", ANYONE, answers={200: HEALTH}),
        metrics_op(service.registry, service.refresh_metrics),
    ]  # fmt: skip
    app = Starlette(
        routes=routes_of(BASE, "kvsp holder", ops, principals),
        lifespan=lifespan_of(service.start, service.close),
    )
    install_problem_handlers(app, log, lambda slug: service.rejected.labels(slug).inc())
    return app
