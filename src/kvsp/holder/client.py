"""Async client of holders: verified block GETs (whole or streamed layer by layer), PUT, leases.

Verification follows KVSP 6.7 and never hands out octets that failed it: when the container
comes in the replica's codec, each layer is checked against the record's layer digests as soon
as it has arrived (before ``stream`` yields it), ``Repr-Digest`` over every octet once the last
one is in, and a whole block against the replica digest. A mismatch is a ``DigestError``.
``stream`` can only check ``Repr-Digest`` at the end, so its final step raises if that fails,
after the (already layer-verified) layers were handed over.

Block octets are received in place (``kvsp.web.http1``): the response body lands in the buffer
the container is parsed from, which a caller can also provide and reuse.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

from kvsp.core.container import Container, ContainerParser, LayerSections
from kvsp.core.digests import verify_repr_digest
from kvsp.core.problems import ContainerLengthError, DigestError, ServiceUnavailable
from kvsp.core.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord
from kvsp.core.registries import BLOCK_MEDIA_TYPE, JSON_MEDIA_TYPE
from kvsp.core.urls import canonical_url
from kvsp.holder.blocks import BlockId, block_ref
from kvsp.web.client import ClosingClient, auth_headers, problem_for
from kvsp.web.http1 import BodyTooLarge, Http1Client, ProtocolError, Response

__all__ = ["BlockReceiver", "HolderClient"]

#: the most octets of a problem document or JSON answer read from a holder
_JSON_OCTETS = 1 << 20


class BlockReceiver:
    """Checks one block response whose octets land in ``buffer`` (sans-IO: say how far it is
    filled, as often as wanted, then finish). ``buffer`` is the caller's when it is large
    enough, else a new one. With ``whole_digest`` the step that completes the container hashes
    all of it for ``Repr-Digest`` beside its last layers (one pass for both, where ``finish``
    runs them all at once); without, ``finish`` does (a caller handing layers over as they
    arrive, on its event loop, keeps the whole-container pass for the worker thread)."""

    def __init__(
        self,
        record: ReplicaRecord,
        layers: tuple[int, int] | None,
        repr_digest: str | None,
        length: int | None,
        buffer: memoryview | None = None,
        whole_digest: bool = True,
    ) -> None:
        self.record = record
        self.layers = layers or (0, record.layer_count - 1)
        self._repr_digest = repr_digest
        size = record.size if length is None else length
        if size > record.size:
            raise ContainerLengthError(f"{size} octets is above the replica's {record.size}")
        if buffer is None or len(buffer) < size:
            buffer = memoryview(bytearray(size))
        self.buffer = buffer[:size]
        expected = record.layer_digest_octets() or None
        self._parser = ContainerParser(
            max_octets=record.size, expected_digests=expected, whole_digest=whole_digest
        )

    def received(self, filled: int) -> list[LayerSections]:
        """The layers completed since the last call, each checked against its digest."""
        layers = self._parser.received(self.buffer, filled)
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

    def finish(self, filled: int) -> Container:
        """The whole container once ``filled`` octets have arrived: the layers not checked yet,
        then ``Repr-Digest`` and, for a whole block, the replica digest."""
        self.received(filled)
        container = self._parser.finish()
        verify_repr_digest(self._repr_digest, container.sha256())
        whole = self.layers == (0, self.record.layer_count - 1)
        if whole and container.digest() != self.record.digest_octets:
            raise DigestError("the block does not match the replica digest")
        return container


class HolderClient(ClosingClient):
    """Talks to any holder (records name their holder's base URL) with one bearer token, over
    at most ``connections`` kept-alive connections per holder."""

    def __init__(
        self, token: str | None = None, timeout_s: float = 30.0, connections: int = 64
    ) -> None:
        self._timeout_s = timeout_s
        self._http = Http1Client(connections, auth_headers(token))

    async def aclose(self) -> None:
        await self._http.aclose()

    @asynccontextmanager
    async def _request(
        self,
        method: str,
        holder: str,
        path: str,
        *,
        body: Sequence[bytes | memoryview] = (),
        headers: Mapping[str, str] | None = None,
        params: dict[str, str] | None = None,
        sink: memoryview | None = None,
    ) -> AsyncIterator[Response]:
        """A 2xx response (problem documents are raised as kvsp errors); a holder that cannot
        be reached, or goes away mid-answer, is ``ServiceUnavailable``."""
        url = canonical_url(holder) + path
        problem = None
        try:
            async with self._http.request(
                method,
                url,
                params=params,
                headers=headers,
                body=body,
                timeout_s=self._timeout_s,
                sink=sink,
            ) as response:
                if 200 <= response.status < 300:
                    yield response
                else:  # read whole, so the connection stays usable
                    content = await response.read(_JSON_OCTETS)
                    problem = problem_for(response.status, content, f"{method} {url}")
        except BodyTooLarge as exc:
            raise ContainerLengthError(f"{method} {url}: {exc}") from None
        except (OSError, ProtocolError) as exc:
            raise ServiceUnavailable(f"holder {holder} unreachable: {exc!r}") from None
        except ValueError as exc:  # a holder URL no request can be made to
            raise ServiceUnavailable(f"holder {holder} cannot be asked: {exc}") from None
        if problem is not None:
            raise problem

    @asynccontextmanager
    async def _receiver(
        self,
        record: ReplicaRecord,
        layers: tuple[int, int] | None,
        buffer: memoryview | None = None,
        whole_digest: bool = True,
    ) -> AsyncIterator[tuple[Response, BlockReceiver, memoryview | None]]:
        """The response, its receiver, and the sink to name when filling (None: the body
        arrives in the caller's ``buffer`` from the head on)."""
        block = (record.compat_id, record.scope_id, record.block_key)
        params = None if layers is None else {"layers": f"{layers[0]}-{layers[1]}"}
        path = block_ref(block)
        async with self._request("GET", record.holder, path, params=params, sink=buffer) as r:
            digest = r.headers.get("repr-digest")
            receiver = BlockReceiver(record, layers, digest, r.content_length, buffer, whole_digest)
            yield r, receiver, None if r.in_request_sink else receiver.buffer

    async def get(
        self,
        record: ReplicaRecord,
        layers: tuple[int, int] | None = None,
        buffer: memoryview | None = None,
    ) -> Container:
        """The block (or layers ``a..b``) of ``record`` from its holder, fully verified. The
        octets land in ``buffer`` when it can hold them (the container views it); every check
        runs on a worker thread once they are all in, so the event loop only receives."""
        async with self._receiver(record, layers, buffer) as (response, receiver, sink):
            filled = await response.receive(sink)
            return await asyncio.to_thread(receiver.finish, filled)

    async def stream(
        self,
        record: ReplicaRecord,
        layers: tuple[int, int] | None = None,
        buffer: memoryview | None = None,
    ) -> AsyncIterator[LayerSections]:
        """Each layer as soon as it has arrived and matched its layer digest. The octets land
        in ``buffer`` when it can hold them (the layers view it: the caller reuses it only
        after it is done with them)."""
        receiving = self._receiver(record, layers, buffer, whole_digest=False)
        async with receiving as (r, receiver, sink):
            filled = 0
            async for filled in r.fill(sink):
                for layer in receiver.received(filled):
                    yield layer
            await asyncio.to_thread(receiver.finish, filled)

    async def get_container(self, base: str, path: str, max_octets: int) -> Container:
        """Any container resource (a token range of a sharded cache, say) with no Replica Record
        to check against: verified with ``Repr-Digest`` only, then parsed."""
        async with self._request("GET", base, path) as response:
            body = await response.read(max_octets)
            verify_repr_digest(response.headers.get("repr-digest"), hashlib.sha256(body).digest())
            return Container.parse(body, max_octets=max_octets)

    async def round_trip_us(self, holder: str) -> float:
        """Microseconds for a ``GET healthz`` at ``holder``: its round trip, as a link measure."""
        start = time.perf_counter()
        async with self._request("GET", holder, "healthz") as response:
            await response.read(_JSON_OCTETS)
        return (time.perf_counter() - start) * 1e6

    async def put(self, holder: str, block: BlockId, container: Container) -> ReplicaRecord:
        """Store a whole block at ``holder``; ``AlreadyStored`` if it holds the key already."""
        headers = {"content-type": BLOCK_MEDIA_TYPE, "if-none-match": "*"}
        body = container.parts
        async with self._request("PUT", holder, block_ref(block), body=body, headers=headers) as r:
            return ReplicaRecord.parse(await r.read(_JSON_OCTETS))

    async def _json(self, method: str, holder: str, path: str, body: bytes | None = None) -> bytes:
        headers = {"content-type": JSON_MEDIA_TYPE} if body is not None else None
        parts = () if body is None else (body,)
        async with self._request(method, holder, path, body=parts, headers=headers) as r:
            return await r.read(_JSON_OCTETS)

    async def lease(self, holder: str, request: LeaseRequest) -> LeaseGrant:
        body = request.model_dump_json().encode()
        return LeaseGrant.parse(await self._json("POST", holder, "leases", body))

    async def renew(self, holder: str, lease: str, ttl_ms: int) -> LeaseGrant:
        body = LeaseRenewal(ttl_ms=ttl_ms).model_dump_json().encode()
        return LeaseGrant.parse(await self._json("PUT", holder, f"leases/{lease}", body))

    async def release(self, holder: str, lease: str) -> None:
        await self._json("DELETE", holder, f"leases/{lease}")
