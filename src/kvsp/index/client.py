"""Async client of the Index Service, used by holders, instances and the controller."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from kvsp.core.compat import CompatibilityDescriptor
from kvsp.core.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    ReplicaRecord,
    ReplicaRef,
)
from kvsp.index.replicas import PublishOutcome
from kvsp.web.client import JsonClient

__all__ = ["IndexClient", "batch_body"]

log = logging.getLogger("kvsp.index")


def batch_body(rendered: Sequence[bytes], delete: Sequence[ReplicaRef] = ()) -> bytes:
    """A ``POST replicas`` body: the records ``rendered`` as JSON already, and ``delete``."""
    deletes = json.dumps([ref.to_json() for ref in delete]).encode()
    return b'{"put":[%s],"delete":%s}' % (b",".join(rendered), deletes)


class IndexClient(JsonClient):
    """Talks to one Index Service base URL (ending in ``/kvsp/``) with one bearer token."""

    peer = "index service"

    async def publish(self, record: ReplicaRecord) -> PublishOutcome:
        path = f"replicas/{record.compat_id}/{record.scope_id}/{record.block_key}"
        response = await self._send("PUT", path, record.model_dump_json(exclude_none=True).encode())
        doc = response.json()
        return PublishOutcome(bool(doc["created"]), int(doc["ttl_ms"]))

    async def withdraw(self, ref: ReplicaRef) -> None:
        path = f"replicas/{ref.compat_id}/{ref.scope_id}/{ref.block_key}"
        params = {"holder": ref.holder}
        if ref.moqt_namespace is not None:
            params["moqt_namespace"] = ref.moqt_namespace
        await self._send("DELETE", path, params=params)

    async def batch(
        self,
        put: Sequence[ReplicaRecord] = (),
        delete: Sequence[ReplicaRef] = (),
        rendered: Sequence[bytes] = (),
    ) -> tuple[list[PublishOutcome], list[bool]]:
        """Publish ``put`` and records ``rendered`` as JSON already (by ``kvsp index ingest``;
        the IS validates both alike), withdraw ``delete``; outcomes in that order."""
        records = [r.model_dump_json(exclude_none=True).encode() for r in put]
        body = batch_body([*records, *rendered], delete)
        doc = (await self._send("POST", "replicas", body)).json()
        return (
            [PublishOutcome(bool(p["created"]), int(p["ttl_ms"])) for p in doc["put"]],
            [bool(d["withdrawn"]) for d in doc["delete"]],
        )

    async def register(self, descriptor: CompatibilityDescriptor) -> bool:
        """Tell the IS what this party's Compatibility ID stands for; True if it was new."""
        path = f"descriptors/{descriptor.compat_id().hex()}"
        return bool((await self._send("PUT", path, descriptor.canonical())).json()["created"])

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        """The IS's answer, kept to what was asked (``LookupResponse.kept_to``)."""
        body = request.model_dump_json(exclude_none=True).encode()
        answer = LookupResponse.parse((await self._send("POST", "lookup", body)).content)
        kept = answer.kept_to(request)
        if kept is not answer:
            log.warning(
                "the index answered blocks not asked for: %d of its %d matched keys kept",
                kept.matched, answer.matched,
            )  # fmt: skip
        return kept

    async def put_status(self, status: InstanceStatusRecord) -> None:
        await self._send("PUT", "status", status.model_dump_json(exclude_none=True).encode())

    async def health(self) -> dict[str, str]:
        doc: dict[str, str] = (await self._send("GET", "healthz")).json()
        return doc

    async def metrics(self) -> str:
        return (await self._send("GET", "metrics")).text
