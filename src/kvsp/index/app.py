"""HTTP adapter of the Index Service (FastAPI): the routes of docs/api.md, nothing else.

Each route authenticates, reads and validates its body or path, and calls ``IndexService``;
errors become problem documents through ``kvsp.web.server``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvsp.auth import Principals
from kvsp.core.ids import parse_block_key, parse_compat_id, parse_scope_id
from kvsp.core.problems import NotFound, PayloadTooLarge, RecordError
from kvsp.core.records import (
    InstanceStatusRecord,
    LookupRequest,
    ReplicaBatch,
    ReplicaRecord,
    ReplicaRef,
)
from kvsp.index.service import IndexService
from kvsp.index.state import check_path
from kvsp.web.server import (
    install_problem_handlers,
    json_response,
    parse_json_object,
    principal_of,
    read_json_body,
)

__all__ = ["DEFAULT_MAX_BODY_OCTETS", "MAX_BATCH_ENTRIES", "create_app"]

log = logging.getLogger("kvsp.index")

DEFAULT_MAX_BODY_OCTETS = 16 << 20
#: Entries (puts plus deletes) in one ``POST replicas``; more is 413.
MAX_BATCH_ENTRIES = 4096
BASE = "/kvsp/"


def _path_ids(compat: str, scope: str, block_key: str) -> None:
    parse_compat_id(compat)
    parse_scope_id(scope)
    parse_block_key(block_key)


def create_app(
    service: IndexService,
    principals: Principals,
    max_body_octets: int = DEFAULT_MAX_BODY_OCTETS,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.store.start()
        try:
            yield
        finally:
            await service.store.close()

    app = FastAPI(
        title="kvsp Index Service",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_problem_handlers(app, log, lambda slug: service.metrics.rejected.labels(slug).inc())

    @app.put(BASE + "replicas/{compat}/{scope}/{block_key}")
    async def publish(compat: str, scope: str, block_key: str, request: Request) -> Response:
        principal = principal_of(request, principals)
        _path_ids(compat, scope, block_key)
        record = ReplicaRecord.parse(await read_json_body(request, max_body_octets))
        check_path(record, compat, scope, block_key)
        (outcome,) = await service.publish(principal, [record])
        body = b'{"created":%s,"ttl_ms":%d}' % (
            b"true" if outcome.created else b"false",
            outcome.ttl_ms,
        )
        return json_response(body, 201 if outcome.created else 200)

    @app.delete(BASE + "replicas/{compat}/{scope}/{block_key}")
    async def withdraw(compat: str, scope: str, block_key: str, request: Request) -> Response:
        principal = principal_of(request, principals)
        _path_ids(compat, scope, block_key)
        holder = request.query_params.get("holder")
        if holder is None:
            raise RecordError("DELETE needs ?holder=URL naming the replica's holder")
        ref = ReplicaRef.parse(
            {"compat_id": compat, "scope_id": scope, "block_key": block_key, "holder": holder}
        )
        (removed,) = await service.withdraw(principal, [ref])
        if not removed:
            raise NotFound("no such replica record")
        return Response(status_code=204)

    @app.post(BASE + "replicas")
    async def batch(request: Request) -> Response:
        principal = principal_of(request, principals)
        doc = parse_json_object(await read_json_body(request, max_body_octets))
        entries = sum(len(v) for k in ("put", "delete") if isinstance(v := doc.get(k), list))
        if entries > MAX_BATCH_ENTRIES:
            raise PayloadTooLarge(f"{entries} entries; a batch holds at most {MAX_BATCH_ENTRIES}")
        return json_response(await service.batch(principal, ReplicaBatch.parse(doc)))

    @app.post(BASE + "lookup")
    async def lookup(request: Request) -> Response:
        principal = principal_of(request, principals)
        parsed = LookupRequest.parse(await read_json_body(request, max_body_octets))
        return json_response(await service.lookup(principal, parsed))

    @app.put(BASE + "status")
    async def status(request: Request) -> Response:
        principal = principal_of(request, principals)
        parsed = InstanceStatusRecord.parse(await read_json_body(request, max_body_octets))
        await service.put_status(principal, parsed)
        return json_response(b'{"accepted":true}')

    @app.get(BASE + "healthz")
    async def healthz() -> Response:
        await service.store.ping()
        return json_response(b'{"status":"ok","store":"%s"}' % service.store.name.encode())

    @app.get(BASE + "metrics")
    async def metrics() -> Response:
        await service.refresh_gauges()
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
