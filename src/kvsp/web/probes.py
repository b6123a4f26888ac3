"""What an orchestrator and a scraper ask every service: ``GET livez`` (does the process
serve? a failed answer gets it restarted), ``GET readyz`` (should it get traffic now? a
failed answer takes it out of the load balancer and nothing more), and ``GET metrics``.

One ``healthz`` could not answer both: an instance that drains or sleeps, a controller that
stands by or an Index Service whose Redis is gone is alive (restarting it would lose state or
only repeat the wait) but should get no requests. ``readyz`` answers 503 with a
``kvsp-not-ready`` problem document naming the reasons, and logs only when the answer
changes: a probe every few seconds must not write a line each time.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvsp.core.problems import NotReady
from kvsp.core.registries import PROBLEM_MEDIA_TYPE
from kvsp.web.openapi import ANYONE, HEALTH, METRICS_ROLES, Op
from kvsp.web.server import json_response

__all__ = ["Readiness", "metrics_op", "probe_ops"]

log = logging.getLogger("kvsp.probes")

#: the reasons a service should get no traffic now; empty when it should
Readiness = Callable[[], Awaitable[list[str]]]


class _ReadyProbe:
    """``readyz``: asks ``readiness`` and logs each change of its answer once."""

    def __init__(self, service: str, readiness: Readiness) -> None:
        self._service = service
        self._readiness = readiness
        self._last: list[str] | None = None

    async def __call__(self, request: Request) -> Response:
        reasons = await self._readiness()
        if reasons != self._last:
            if reasons:
                log.warning("%s not ready: %s", self._service, "; ".join(reasons))
            elif self._last is not None:
                log.info("%s ready", self._service)
            self._last = reasons
        if not reasons:
            return json_response(b'{"status":"ready"}')
        problem = NotReady("; ".join(reasons), reasons=reasons)
        return JSONResponse(
            problem.to_problem(instance=request.url.path),
            status_code=problem.status,
            media_type=PROBLEM_MEDIA_TYPE,
        )


async def _alive(_: Request) -> Response:
    return json_response(b'{"status":"ok"}')


def probe_ops(service: str, readiness: Readiness) -> list[Op]:
    """``GET livez`` and ``GET readyz`` for ``service`` (named in the log), open to anyone:
    a kubelet carries no token, and the answers say nothing a scope owns."""
    return [
        Op("GET", "livez", _alive, "liveness: the process serves", ANYONE,
           answers={200: HEALTH}),
        Op("GET", "readyz", _ReadyProbe(service, readiness),
           "readiness: it should get traffic (503 kvsp-not-ready names why not)", ANYONE,
           answers={200: HEALTH}),
    ]  # fmt: skip


def metrics_op(
    registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]] | None = None
) -> Op:
    """``GET metrics``: ``registry`` in Prometheus text, after ``refresh`` (gauges read at
    scrape time); role metrics, since series name scopes and tenants."""

    async def metrics(_: Request) -> Response:
        if refresh is not None:
            await refresh()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Op("GET", "metrics", metrics, "Prometheus text", METRICS_ROLES,
              answers={200: "text/plain"})  # fmt: skip
