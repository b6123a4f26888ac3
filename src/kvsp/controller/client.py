"""What the Placement Controller sends to inference instances (KVSP 6.3, 6.5, 6.8, 6.9)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urljoin

import httpx

from kvsp.core.hints import KvHints
from kvsp.core.records import (
    InstanceState,
    PrefetchDirective,
    PrefetchStatus,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    SessionCheckpoint,
    StateChange,
)
from kvsp.core.urls import canonical_url
from kvsp.web.client import JsonClient

__all__ = ["InstanceClient"]


class InstanceClient(JsonClient):
    """Calls any instance (addressed by its base URL) with the controller's bearer token."""

    peer = "instance"

    def __init__(
        self,
        token: str | None = None,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__("", token, timeout_s, transport)

    async def set_state(self, instance: str, state: InstanceState) -> None:
        body = StateChange(state=state).model_dump_json().encode()
        await self._send("PUT", canonical_url(instance) + "state", body)

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> str:
        """Send a directive; returns the URL of its status resource (the Location field)."""
        body = directive.model_dump_json(exclude_none=True).encode()
        response = await self._send("POST", canonical_url(instance) + "prefetch", body)
        location = str(response.headers.get("location") or f"prefetch/{directive.directive}")
        return urljoin(canonical_url(instance), location)

    async def prefetch_status(self, location: str) -> PrefetchStatus:
        return PrefetchStatus.parse((await self._send("GET", location)).content)

    async def resume(
        self, instance: str, checkpoint: SessionCheckpoint, max_tokens: int | None = None
    ) -> None:
        """The latest checkpoint, carrying the new epoch; ``max_tokens`` (an extension member)
        is the request's output limit."""
        path = f"sessions/{checkpoint.session}/resume"
        doc = checkpoint.to_json()
        if max_tokens is not None:
            doc["max_tokens"] = max_tokens
        await self._send("POST", canonical_url(instance) + path, json.dumps(doc).encode())

    async def reshard(
        self,
        instance: str,
        message: ReshardPlan | ReshardCommit | ReshardAbort,
        timeout_s: float | None = None,
    ) -> None:
        """Send a plan (answered 200 once its fetches are loaded), a commit or an abort."""
        body = message.model_dump_json(by_alias=True).encode()
        await self._send("POST", canonical_url(instance) + "reshard", body, timeout_s=timeout_s)

    async def hints(self, instance: str, envelope: KvHints) -> list[dict[str, Any]]:
        """Send a KvHints envelope; the outcome of each action."""
        body = envelope.model_dump_json().encode()
        response = await self._send("POST", canonical_url(instance) + "hints", body)
        outcomes: list[dict[str, Any]] = response.json()["outcomes"]
        return outcomes

    async def end_session(self, instance: str, session: str) -> None:
        await self._send("DELETE", canonical_url(instance) + f"sessions/{session}")
