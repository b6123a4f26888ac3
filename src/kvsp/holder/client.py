"""Async client of holders: verified block GETs (whole or streamed layer by layer), PUT, leases.

Verification follows KVSP 6.7 and never hands out octets that failed it: ``Repr-Digest`` is
checked over every octet received; when the container comes in the replica's codec, each layer
is checked against the record's layer digests as soon as it has arrived (before ``stream``
yields it), and a whole block is checked against the replica digest. A mismatch is a
``DigestError``. ``stream`` can only check ``Repr-Digest`` once the last octet is in, so its
final step raises if that fails, after the (already layer-verified) layers were handed over.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType

import httpx

from kvsp.core.container import Container, ContainerParser, LayerSections
from kvsp.core.digests import verify_repr_digest
from kvsp.core.problems import DigestError, ServiceUnavailable
from kvsp.core.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord
from kvsp.core.urls import canonical_url
from kvsp.holder.blocks import BLOCK_MEDIA_TYPE, BlockId, block_ref
from kvsp.web.client import auth_headers, raise_for_problem, transport_errors
from kvsp.web.server import JSON_MEDIA_TYPE

__all__ = ["BlockReceiver", "HolderClient"]


class BlockReceiver:
    """Checks one block response as its octets arrive (sans-IO: feed chunks, then finish)."""

    def __init__(
        self, record: ReplicaRecord, layers: tuple[int, int] | None, repr_digest: str | None
    ) -> None:
        self.record = record
        self.layers = layers or (0, record.layer_count - 1)
        self._repr_digest = repr_digest
        self._sha256 = hashlib.sha256()
        expected = record.layer_digest_octets() or None
        self._parser = ContainerParser(max_octets=record.size, expected_digests=expected)

    def feed(self, chunk: bytes) -> list[LayerSections]:
        self._sha256.update(chunk)
        layers = self._parser.feed(chunk)
        header = self._parser.header
        if header is not None and layers and layers[0].layer == header.first_layer:
            if header.codec != self.record.codec:
                raise DigestError(
                    f"holder sent codec {header.codec}; the replica's codec is {self.record.codec}"
                )
            if (header.first_layer, header.last_layer) != self.layers:
                raise DigestError(
                    f"holder sent layers {header.first_layer}-{header.last_layer}, "
                    f"asked for {self.layers[0]}-{self.layers[1]}"
                )
        return layers

    def finish(self) -> Container:
        container = self._parser.finish()
        verify_repr_digest(self._repr_digest, self._sha256.digest())
        whole = self.layers == (0, self.record.layer_count - 1)
        if whole and container.digest() != self.record.digest_octets:
            raise DigestError("the block does not match the replica digest")
        return container


class HolderClient:
    """Talks to any holder (records name their holder's base URL) with one bearer token."""

    def __init__(
        self,
        token: str | None = None,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            headers=auth_headers(token),
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    async def __aenter__(self) -> HolderClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @staticmethod
    def _url(holder: str, path: str) -> str:
        return canonical_url(holder) + path

    async def _send(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self._http.send(request)
        except transport_errors as exc:
            raise ServiceUnavailable(f"holder unreachable: {exc!r}") from None
        raise_for_problem(response)
        return response

    @asynccontextmanager
    async def _receiver(
        self, record: ReplicaRecord, layers: tuple[int, int] | None
    ) -> AsyncIterator[tuple[httpx.Response, BlockReceiver]]:
        block = (record.compat_id, record.scope_id, record.block_key)
        params = {} if layers is None else {"layers": f"{layers[0]}-{layers[1]}"}
        request = self._http.build_request(
            "GET", self._url(record.holder, block_ref(block)), params=params
        )
        try:
            response = await self._http.send(request, stream=True)
        except transport_errors as exc:
            raise ServiceUnavailable(f"holder unreachable: {exc!r}") from None
        try:
            if not response.is_success:
                await response.aread()
                raise_for_problem(response)
            yield response, BlockReceiver(record, layers, response.headers.get("repr-digest"))
        finally:
            await response.aclose()

    async def get(self, record: ReplicaRecord, layers: tuple[int, int] | None = None) -> Container:
        """The block (or layers ``a..b``) of ``record`` from its holder, fully verified."""
        async with self._receiver(record, layers) as (response, receiver):
            try:
                async for chunk in response.aiter_raw():
                    receiver.feed(chunk)
            except transport_errors as exc:
                raise ServiceUnavailable(f"holder went away mid-block: {exc!r}") from None
            return receiver.finish()

    async def stream(
        self, record: ReplicaRecord, layers: tuple[int, int] | None = None
    ) -> AsyncIterator[LayerSections]:
        """Each layer as soon as it has arrived and matched its layer digest."""
        async with self._receiver(record, layers) as (response, receiver):
            try:
                async for chunk in response.aiter_raw():
                    for layer in receiver.feed(chunk):
                        yield layer
            except transport_errors as exc:
                raise ServiceUnavailable(f"holder went away mid-block: {exc!r}") from None
            receiver.finish()

    async def put(self, holder: str, block: BlockId, container: Container) -> ReplicaRecord:
        """Store a whole block at ``holder``; ``AlreadyStored`` if it holds the key already."""
        request = self._http.build_request(
            "PUT",
            self._url(holder, block_ref(block)),
            content=container.tobytes(),
            headers={"content-type": BLOCK_MEDIA_TYPE, "if-none-match": "*"},
        )
        return ReplicaRecord.parse((await self._send(request)).content)

    async def _json(self, method: str, url: str, body: bytes | None = None) -> httpx.Response:
        headers = {"content-type": JSON_MEDIA_TYPE} if body is not None else {}
        return await self._send(
            self._http.build_request(method, url, content=body, headers=headers)
        )

    async def lease(self, holder: str, request: LeaseRequest) -> LeaseGrant:
        body = request.model_dump_json().encode()
        response = await self._json("POST", self._url(holder, "leases"), body)
        return LeaseGrant.parse(response.content)

    async def renew(self, holder: str, lease: str, ttl_ms: int) -> LeaseGrant:
        body = LeaseRenewal(ttl_ms=ttl_ms).model_dump_json().encode()
        response = await self._json("PUT", self._url(holder, f"leases/{lease}"), body)
        return LeaseGrant.parse(response.content)

    async def release(self, holder: str, lease: str) -> None:
        await self._json("DELETE", self._url(holder, f"leases/{lease}"))
