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
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from kvsp.core.container import Container, ContainerParser, LayerSections
from kvsp.core.digests import verify_repr_digest
from kvsp.core.problems import ContainerLengthError, DigestError, ServiceUnavailable
from kvsp.core.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord
from kvsp.core.registries import BLOCK_MEDIA_TYPE, JSON_MEDIA_TYPE
from kvsp.core.urls import canonical_url
from kvsp.holder.blocks import BlockId, block_ref
from kvsp.web.client import ClosingClient, auth_headers, problem_for

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


class HolderClient(ClosingClient):
    """Talks to any holder (records name their holder's base URL) with one bearer token.

    Block octets travel over aiohttp, whose C parser moves large bodies several times faster
    than httpx on the same machine (docs/decisions/0007-holder.md); the session is opened on
    first use, inside the running event loop.
    """

    def __init__(
        self, token: str | None = None, timeout_s: float = 30.0, connections: int = 64
    ) -> None:
        self._headers = auth_headers(token)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @asynccontextmanager
    async def _request(
        self,
        method: str,
        holder: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A 2xx response (problem documents are raised as kvsp errors); a holder that cannot
        be reached, or goes away mid-answer, is ``ServiceUnavailable``."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=self._connections),
            )
        url = canonical_url(holder) + path
        try:
            async with self._session.request(
                method, url, data=body, headers=headers, params=params
            ) as response:
                if not 200 <= response.status < 300:
                    raise problem_for(response.status, await response.read(), f"{method} {url}")
                yield response
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ServiceUnavailable(f"holder {holder} unreachable: {exc!r}") from None

    @asynccontextmanager
    async def _receiver(
        self, record: ReplicaRecord, layers: tuple[int, int] | None
    ) -> AsyncIterator[tuple[aiohttp.ClientResponse, BlockReceiver]]:
        block = (record.compat_id, record.scope_id, record.block_key)
        params = None if layers is None else {"layers": f"{layers[0]}-{layers[1]}"}
        async with self._request("GET", record.holder, block_ref(block), params=params) as r:
            yield r, BlockReceiver(record, layers, r.headers.get("repr-digest"))

    async def get(self, record: ReplicaRecord, layers: tuple[int, int] | None = None) -> Container:
        """The block (or layers ``a..b``) of ``record`` from its holder, fully verified."""
        async with self._receiver(record, layers) as (response, receiver):
            async for chunk in response.content.iter_any():
                receiver.feed(chunk)
            return receiver.finish()

    async def stream(
        self, record: ReplicaRecord, layers: tuple[int, int] | None = None
    ) -> AsyncIterator[LayerSections]:
        """Each layer as soon as it has arrived and matched its layer digest."""
        async with self._receiver(record, layers) as (response, receiver):
            async for chunk in response.content.iter_any():
                for layer in receiver.feed(chunk):
                    yield layer
            receiver.finish()

    async def get_container(self, base: str, path: str, max_octets: int) -> Container:
        """Any container resource (a token range of a sharded cache, say) with no Replica Record
        to check against: verified with ``Repr-Digest`` only, then parsed."""
        async with self._request("GET", base, path) as response:
            declared = response.content_length
            if declared is not None and declared > max_octets:
                raise ContainerLengthError(f"{declared} octets is above {max_octets}")
            chunks, received = [], 0
            async for chunk in response.content.iter_any():
                received += len(chunk)
                if received > max_octets:
                    raise ContainerLengthError(f"answer above {max_octets} octets")
                chunks.append(chunk)
            body = b"".join(chunks)
            verify_repr_digest(response.headers.get("repr-digest"), hashlib.sha256(body).digest())
            return Container.parse(body, max_octets=max_octets)

    async def round_trip_us(self, holder: str) -> float:
        """Microseconds for a ``GET healthz`` at ``holder``: its round trip, as a link measure."""
        start = time.perf_counter()
        async with self._request("GET", holder, "healthz") as response:
            await response.read()
        return (time.perf_counter() - start) * 1e6

    async def put(self, holder: str, block: BlockId, container: Container) -> ReplicaRecord:
        """Store a whole block at ``holder``; ``AlreadyStored`` if it holds the key already."""
        headers = {"content-type": BLOCK_MEDIA_TYPE, "if-none-match": "*"}
        body = container.tobytes()
        async with self._request("PUT", holder, block_ref(block), body=body, headers=headers) as r:
            return ReplicaRecord.parse(await r.read())

    async def _json(self, method: str, holder: str, path: str, body: bytes | None = None) -> bytes:
        headers = {"content-type": JSON_MEDIA_TYPE} if body is not None else None
        async with self._request(method, holder, path, body=body, headers=headers) as r:
            return await r.read()

    async def lease(self, holder: str, request: LeaseRequest) -> LeaseGrant:
        body = request.model_dump_json().encode()
        return LeaseGrant.parse(await self._json("POST", holder, "leases", body))

    async def renew(self, holder: str, lease: str, ttl_ms: int) -> LeaseGrant:
        body = LeaseRenewal(ttl_ms=ttl_ms).model_dump_json().encode()
        return LeaseGrant.parse(await self._json("PUT", holder, f"leases/{lease}", body))

    async def release(self, holder: str, lease: str) -> None:
        await self._json("DELETE", holder, f"leases/{lease}")
