"""A small stand-in for an inference instance: answers the controller's calls (state, prefetch,
resume, reshard) the way KVSP says an instance does, and records them for assertions."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


class StandIn:
    def __init__(self, ack_reshard: bool = True, reshard_delay_s: float = 0.0) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.ack_reshard = ack_reshard
        self.reshard_delay_s = reshard_delay_s
        self.directives: dict[str, list[str]] = {}
        #: answer state changes (wakes, drains) with a 503, as an unreachable instance would
        self.refuse_state = False
        #: answer resumes this late, as an instance stalled mid-failover would
        self.resume_delay_s = 0.0
        self.app = Starlette(
            routes=[
                Route("/kvsp/state", self.state, methods=["PUT"]),
                Route("/kvsp/prefetch", self.prefetch, methods=["POST"]),
                Route("/kvsp/prefetch/{directive}", self.prefetch_status, methods=["GET"]),
                Route("/kvsp/sessions/{session}/resume", self.resume, methods=["POST"]),
                Route("/kvsp/reshard", self.reshard, methods=["POST"]),
            ]
        )

    def of(self, kind: str) -> list[Any]:
        return [body for k, _, body in self.calls if k == kind]

    async def _record(self, kind: str, request: Request) -> Any:
        body = json.loads(await request.body())
        self.calls.append((kind, request.url.path, body))
        return body

    async def state(self, request: Request) -> Response:
        body = await self._record("state", request)
        if self.refuse_state:
            return JSONResponse({"status": 503, "detail": "down"}, status_code=503)
        return JSONResponse({"state": body["state"]})

    async def prefetch(self, request: Request) -> Response:
        body = await self._record("prefetch", request)
        self.directives[body["directive"]] = [b["block_key"] for b in body["blocks"]]
        return Response(status_code=202, headers={"location": f"prefetch/{body['directive']}"})

    async def prefetch_status(self, request: Request) -> Response:
        directive = request.path_params["directive"]
        loaded = self.directives[directive]
        return JSONResponse({"directive": directive, "state": "complete", "loaded": loaded})

    async def resume(self, request: Request) -> Response:
        await self._record("resume", request)
        await asyncio.sleep(self.resume_delay_s)
        return JSONResponse({"resumed": True})

    async def reshard(self, request: Request) -> Response:
        body = await self._record("reshard", request)
        if "from" in body:  # a plan: acknowledge once "loaded"
            await asyncio.sleep(self.reshard_delay_s)
            if not self.ack_reshard:
                return JSONResponse({"detail": "cannot load"}, status_code=503)
        return JSONResponse({"ok": True})
