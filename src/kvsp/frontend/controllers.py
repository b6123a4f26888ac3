"""What the front end asks of the controller, and the two ways to ask it: in the controller's
own process (``kvsp controller serve --frontend``), or over HTTP from a front end of its own
(``kvsp frontend serve``) to several controllers sharing one state, so that a controller's
death never cuts a stream (decision 0019)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvsp.auth import Principal, Role
from kvsp.controller.service import ControllerService, Placement
from kvsp.core.problems import NotFound
from kvsp.core.records import Sampler
from kvsp.tenants import Tenant
from kvsp.web.client import JsonClient

__all__ = ["Controller", "InProcessController", "Placed", "RemoteController"]


@dataclass(frozen=True, slots=True)
class Placed:
    """A placement as the front end uses it."""

    session: str
    #: the chosen instance (None: nothing could take the request, ``reason`` says why)
    instance: str | None
    epoch: int
    sampler: Sampler | None
    decision: str
    reason: str

    @classmethod
    def of(cls, doc: dict[str, Any]) -> Placed:
        sampler = doc.get("sampler")
        return cls(
            str(doc["session"]),
            doc.get("instance"),
            int(doc.get("session_epoch") or 0),
            None if sampler is None else Sampler.parse(sampler),
            str(doc["decision"]),
            str(doc.get("reason", "")),
        )


class Controller(Protocol):
    async def place(
        self,
        tenant: Tenant,
        compat_id: str,
        tokens: Sequence[int],
        session: str,
        sampler: Sampler,
        max_tokens: int,
    ) -> Placed: ...

    async def where(self, tenant: Tenant, session: str) -> tuple[int, str] | None:
        """The session's epoch and instance (None: the controller does not know it)."""
        ...

    async def report_ttft(self, tenant: Tenant, decision: str, ttft_us: float) -> None: ...

    async def turn_ended(
        self, tenant: Tenant, session: str, tool_call: bool, expected_gap_ms: int | None
    ) -> None: ...

    async def forget(self, tenant: Tenant, session: str) -> None: ...

    async def abandon(self, tenant: Tenant, session: str) -> None: ...

    async def aclose(self) -> None: ...


def _client_of(tenant: Tenant) -> Principal:
    return Principal(
        f"tenant:{tenant.name}", frozenset({Role.CLIENT}), frozenset({tenant.scope_id}),
        frozenset(),
    )  # fmt: skip


class InProcessController:
    """The controller of this process, called directly, as the tenant."""

    def __init__(self, service: ControllerService) -> None:
        self.service = service

    async def place(
        self,
        tenant: Tenant,
        compat_id: str,
        tokens: Sequence[int],
        session: str,
        sampler: Sampler,
        max_tokens: int,
    ) -> Placed:
        placement: Placement = await self.service.place(
            _client_of(tenant), tenant.name, compat_id, tokens, session, sampler,
            max_tokens=max_tokens,
        )  # fmt: skip
        return Placed.of(placement.to_json())

    async def where(self, tenant: Tenant, session: str) -> tuple[int, str] | None:
        try:
            doc = self.service.session_view(_client_of(tenant), session)
        except NotFound:
            return None
        return int(doc["epoch"]), str(doc["instance"])

    async def report_ttft(self, tenant: Tenant, decision: str, ttft_us: float) -> None:
        await self.service.observe_ttft(_client_of(tenant), decision, ttft_us)

    async def turn_ended(
        self, tenant: Tenant, session: str, tool_call: bool, expected_gap_ms: int | None
    ) -> None:
        await self.service.turn_ended(_client_of(tenant), session, tool_call, expected_gap_ms)

    async def forget(self, tenant: Tenant, session: str) -> None:
        await self.service.forget_session(_client_of(tenant), session)

    async def abandon(self, tenant: Tenant, session: str) -> None:
        await self.service.abandon_turn(_client_of(tenant), session)

    async def aclose(self) -> None:
        return None


class RemoteController(JsonClient):
    """Controllers over HTTP, as the front end's principal (role ``frontend`` in every
    tenant's scope): whichever of ``urls`` leads answers."""

    peer = "controller"

    def __init__(self, urls: Sequence[str], token: str | None, failover_s: float = 10.0) -> None:
        super().__init__(urls, token, timeout_s=30.0, failover_s=failover_s)

    async def _json(self, method: str, path: str, doc: dict[str, Any] | None = None) -> Any:
        body = None if doc is None else json.dumps(doc).encode()
        return (await self._send(method, path, body)).json()

    async def place(
        self,
        tenant: Tenant,
        compat_id: str,
        tokens: Sequence[int],
        session: str,
        sampler: Sampler,
        max_tokens: int,
    ) -> Placed:
        doc = {"tenant": tenant.name, "compat_id": compat_id, "tokens": list(tokens),
               "session": session, "sampler": sampler.to_json(),
               "max_tokens": max_tokens}  # fmt: skip
        return Placed.of(await self._json("POST", "place", doc))

    async def where(self, tenant: Tenant, session: str) -> tuple[int, str] | None:
        try:
            doc = await self._json("GET", f"sessions/{session}")
        except NotFound:
            return None
        return int(doc["epoch"]), str(doc["instance"])

    async def report_ttft(self, tenant: Tenant, decision: str, ttft_us: float) -> None:
        await self._json("PUT", f"decisions/{decision}/ttft", {"ttft_us": ttft_us})

    async def turn_ended(
        self, tenant: Tenant, session: str, tool_call: bool, expected_gap_ms: int | None
    ) -> None:
        doc: dict[str, Any] = {"tool_call": tool_call}
        if expected_gap_ms is not None:
            doc["expected_gap_ms"] = expected_gap_ms
        await self._json("POST", f"sessions/{session}/turns", doc)

    async def forget(self, tenant: Tenant, session: str) -> None:
        await self._json("POST", f"sessions/{session}/forget")

    async def abandon(self, tenant: Tenant, session: str) -> None:
        await self._json("POST", f"sessions/{session}/abandon")
