"""Async client of holders: verified block GETs (whole or streamed layer by layer), PUT, leases.

Verification follows KVSP 6.7 and never hands out octets that failed it: when the container
comes in the replica's codec, each layer is checked against the record's layer digests as soon
as it has arrived (before ``stream`` yields it), ``Repr-Digest`` over every octet once the last
one is in, and a whole block against the replica digest. A mismatch is a ``DigestError``.
``stream`` can only check ``Repr-Digest`` at the end, so its final step raises if that fails,
after the (already layer-verified) layers were handed over.

Block octets are received in place (``kvsp.web.http1``): the response body lands in the buffer
the container is parsed from, which a caller can also provide and reuse. ``get`` hashes them
while the rest is still arriving (``ArrivalChecks``: on worker threads, or on the loop for a
block received alone), so by the time the last octet is in, most of the checking is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import asynccontextmanager

from kvsp.core.container import Container, ContainerParser, LayerSections
from kvsp.core.digests import verify_repr_digest
from kvsp.core.problems import (
    ContainerError,
    ContainerLengthError,
    DigestError,
    InvalidInput,
    KvspError,
    PeerAnswerTooLarge,
    PeerError,
    ServiceUnavailable,
)
from kvsp.core.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord
from kvsp.core.registries import BLOCK_MEDIA_TYPE, JSON_MEDIA_TYPE, SERVED_CODECS
from kvsp.core.urls import canonical_url
from kvsp.holder.blocks import MAX_BLOCK_OCTETS, BlockId, block_ref
from kvsp.web import tracing
from kvsp.web.client import ClosingClient, auth_headers, problem_for
from kvsp.web.http1 import Http1Client, Response, Transport

__all__ = ["ArrivalChecks", "BlockReceiver", "HolderClient", "MoqtSkips", "fetchable"]

log = logging.getLogger("kvsp.holder.client")

#: the most octets of a problem document or JSON answer read from a holder
_JSON_OCTETS = 1 << 20


def _unreachable(holder: str, method: str, url: str, exc: PeerError) -> KvspError:
    """A transport failure, naming the holder: a body above the limit is the container's
    fault, anything else the holder's (unreachable, too slow, gone mid-answer, not speaking
    HTTP/1.1), of the same class."""
    if isinstance(exc, PeerAnswerTooLarge):
        return ContainerLengthError(f"{method} {url}: {exc}")
    return type(exc)(f"holder {holder} unreachable: {exc.detail}")


class MoqtSkips:
    """Replicas passed over because they are served only through MOQT (a ``moqt`` holder,
    KVSP 4.4), which kvsp's clients do not speak (docs/decisions/0017): counted for the
    metrics, logged the first time only, never an error to the user."""

    def __init__(self) -> None:
        self.total = 0

    def skip(self, record: ReplicaRecord) -> None:
        if not self.total:
            log.warning(
                "passing over replicas served through MOQT (first: %s at %s); kvsp fetches "
                "over HTTP only", record.block_key, record.holder,
            )  # fmt: skip
        self.total += 1


#: every client of this process counts here
MOQT_SKIPS = MoqtSkips()


def fetchable(records: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
    """The replicas a kvsp client can fetch: those of http(s) holders (see ``MoqtSkips``) in a
    codec holders serve (an engine's own pages are not served over KVSP)."""
    out = []
    for record in records:
        if record.codec not in SERVED_CODECS:
            continue
        if record.moqt_namespace is None:
            out.append(record)
        else:
            MOQT_SKIPS.skip(record)
    return out


class BlockReceiver:
    """Checks one block response whose octets land in ``buffer`` (sans-IO: say how far it is
    filled, as often as wanted, then finish). ``buffer`` is the caller's when it is large
    enough, else a new one. Each call hashes what arrived since the last. With
    ``whole_digest`` the whole container is hashed for ``Repr-Digest`` alongside its layers
    (about one pass for both); without, ``finish`` hashes it at the end (a caller handing
    layers over as they arrive, on its event loop, keeps that pass for a worker thread)."""

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
        if size > MAX_BLOCK_OCTETS:  # a record's size alone never makes us allocate
            raise ContainerLengthError(f"{size} octets is above the {MAX_BLOCK_OCTETS} received")
        if buffer is None or len(buffer) < size:
            buffer = memoryview(bytearray(size))
        self.buffer = buffer[:size]
        expected = record.layer_digest_octets() or None
        self._parser = ContainerParser(
            max_octets=record.size, expected_digests=expected, whole_digest=whole_digest
        )
        self._header_checked = False

    def received(self, filled: int) -> list[LayerSections]:
        """The layers completed since the last call, each checked against its digest."""
        layers = self._parser.received(self.buffer, filled)
        self._check_header()
        return layers

    def check(self, filled: int) -> None:
        """``received`` for a caller that wants the whole container only (no layer views)."""
        self._parser.advance(self.buffer, filled)
        self._check_header()

    def _check_header(self) -> None:
        """Once the container's header is in: the replica's codec and the layers asked for."""
        header = self._parser.header
        if header is None or self._header_checked:
            return
        if header.codec != self.record.codec:
            raise DigestError(
                f"holder sent codec {header.codec}; the replica's codec is {self.record.codec}"
            )
        if (header.first_layer, header.last_layer) != self.layers:
            raise DigestError(
                f"holder sent layers {header.first_layer}-{header.last_layer}, "
                f"asked for {self.layers[0]}-{self.layers[1]}"
            )
        self._header_checked = True

    def finish(self, filled: int) -> Container:
        """The whole container once ``filled`` octets have arrived: the layers not checked yet,
        then ``Repr-Digest`` and, for a whole block, the replica digest."""
        self.check(filled)
        container = self._parser.finish()
        verify_repr_digest(self._repr_digest, container.sha256())
        whole = self.layers == (0, self.record.layer_count - 1)
        if whole and container.digest() != self.record.digest_octets:
            raise DigestError("the block does not match the replica digest")
        return container


class ArrivalChecks:
    """A ``BlockReceiver``'s checks, run while the octets arrive.

    The event loop says how far the buffer is filled (``arrived``); at most one job per block
    runs at a time, hashing what is in and going on while more comes; ``done`` starts the final
    checks once every octet is in, and ``result`` awaits the verified container (or the error).
    ``abandon`` stops the work of a block given up on.

    A job runs on a worker thread while other blocks are being received (the loop keeps
    receiving them), and on the loop itself when this block is the only one (``alone``): the
    loop has nothing else to do then, and waking a sleeping worker thread costs more than the
    hashing of a first arrival (100-400 us on virtual machines)."""

    def __init__(
        self, receiver: BlockReceiver, workers: Executor, alone: Callable[[], bool]
    ) -> None:
        self._receiver = receiver
        self._workers = workers
        self._alone = alone
        self._loop = asyncio.get_running_loop()
        self._result: asyncio.Future[Container] = self._loop.create_future()
        self._lock = threading.Lock()
        self._filled = 0
        self._final = False
        self._running = False
        self._abandoned = False

    def arrived(self, filled: int) -> None:
        """On the loop: ``filled`` octets are in (never raises: a failure is the result's)."""
        self._hand_over(filled, final=False)

    def done(self, filled: int) -> None:
        """On the loop: the body is complete with ``filled`` octets."""
        self._hand_over(filled, final=True)

    async def result(self) -> Container:
        return await self._result

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True

    def _hand_over(self, filled: int, final: bool) -> None:
        with self._lock:
            self._filled, self._final = filled, final
            if self._running or self._abandoned:
                return
            self._running = True
        if self._alone():
            self._work(self._settle)
            return
        try:
            self._workers.submit(self._work, self._settle_from_worker)
        except RuntimeError as exc:  # the client is closing
            self._settle(None, exc)

    def _work(self, settle: Callable[[Container | None, Exception | None], None]) -> None:
        """Hash what is in until nothing more has come, then stop (the next arrival starts a
        new job); the final checks once everything is in."""
        while True:
            with self._lock:
                filled, final = self._filled, self._final
                if self._abandoned:
                    self._running = False
                    return
            try:
                if final:
                    settle(self._receiver.finish(filled), None)
                    return
                self._receiver.check(filled)
            except Exception as exc:  # a digest mismatch, a malformed container
                settle(None, exc)
                return
            with self._lock:
                if (self._filled, self._final) == (filled, final):
                    self._running = False
                    return

    def _settle_from_worker(self, container: Container | None, error: Exception | None) -> None:
        self._loop.call_soon_threadsafe(self._settle, container, error)

    def _settle(self, container: Container | None, error: Exception | None) -> None:
        if self._result.done():
            return
        if error is not None:
            self._result.set_exception(error)
        else:
            assert container is not None
            self._result.set_result(container)


class HolderClient(ClosingClient):
    """Talks to any holder (records name their holder's base URL) with one bearer token, over
    at most ``connections`` kept-alive connections per holder. Received blocks are checked on
    a thread per core (hashing is all the work they do, so more would only take turns)."""

    def __init__(
        self,
        token: str | None = None,
        timeout_s: float = 30.0,
        connections: int = 64,
        transport: Transport | None = None,
    ) -> None:
        """``transport``: how connections are made (TCP unless given; ``http1.unix_socket``)."""
        self._timeout_s = timeout_s
        self._http = Http1Client(connections, auth_headers(token), transport)
        self._workers = ThreadPoolExecutor(os.cpu_count() or 1, "kvsp-block-checks")
        #: blocks being received by ``get`` now
        self._receiving = 0
        #: answers refused because a digest did not match or the container was malformed: the
        #: block was not used (and so is neither held nor published again)
        self.refused = 0

    async def aclose(self) -> None:
        await self._http.aclose()
        self._workers.shutdown(wait=False, cancel_futures=True)

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
        be reached, or goes away mid-answer, is ``ServiceUnavailable``. Only the transport's
        own errors are translated: anything else the caller's body raises passes unchanged."""
        url = canonical_url(holder) + path
        async with contextlib.AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(
                    self._http.request(
                        method, url, params=params, headers=headers, body=body,
                        timeout_s=self._timeout_s, sink=sink,
                    )
                )  # fmt: skip
            except InvalidInput as exc:  # a holder URL no request can be made to
                raise ServiceUnavailable(f"holder {holder} cannot be asked: {exc.detail}") from None
            except PeerError as exc:
                raise _unreachable(holder, method, url, exc) from None
            if not 200 <= response.status < 300:
                try:  # read whole, so the connection stays usable
                    content = await response.read(_JSON_OCTETS)
                except PeerError as exc:
                    raise _unreachable(holder, method, url, exc) from None
                raise problem_for(response.status, content, f"{method} {url}")
            try:
                yield response
            except PeerError as exc:  # the answer broke off while being read
                raise _unreachable(holder, method, url, exc) from None

    @asynccontextmanager
    async def _receiver(
        self,
        record: ReplicaRecord,
        layers: tuple[int, int] | None,
        buffer: memoryview | None = None,
        whole_digest: bool = True,
    ) -> AsyncIterator[tuple[Response, BlockReceiver, memoryview | None]]:
        """The response, its receiver, and the sink to name when filling (None: the body
        arrives in the caller's ``buffer`` from the head on). A layer range only of a record
        with layer digests: without them nothing could check the layers before they are used."""
        if layers is not None and record.layer_digests is None:
            raise DigestError(
                f"the record of {record.block_key[:16]} has no layer digests: "
                "it is fetched whole, never by layer range"
            )
        block = (record.compat_id, record.scope_id, record.block_key)
        params = None if layers is None else {"layers": f"{layers[0]}-{layers[1]}"}
        path = block_ref(block)
        async with self._request("GET", record.holder, path, params=params, sink=buffer) as r:
            try:
                digest = r.headers.get("repr-digest")
                receiver = BlockReceiver(
                    record, layers, digest, r.content_length, buffer, whole_digest
                )
                yield r, receiver, None if r.in_request_sink else receiver.buffer
            except (DigestError, ContainerError):
                self.refused += 1
                raise

    async def get(
        self,
        record: ReplicaRecord,
        layers: tuple[int, int] | None = None,
        buffer: memoryview | None = None,
    ) -> Container:
        """The block (or layers ``a..b``) of ``record`` from its holder, fully verified. The
        octets land in ``buffer`` when it can hold them (the container views it); the checks
        run as they arrive (``ArrivalChecks``)."""
        async with self._receiver(record, layers, buffer) as (response, receiver, sink):
            checks = ArrivalChecks(receiver, self._workers, lambda: self._receiving == 1)
            self._receiving += 1
            try:
                checks.done(await response.receive(sink, checks.arrived))
                with tracing.span("kvsp.block.verify", octets=record.size):
                    return await checks.result()
            finally:
                self._receiving -= 1
                checks.abandon()

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
            await asyncio.get_running_loop().run_in_executor(self._workers, receiver.finish, filled)

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
