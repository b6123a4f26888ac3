"""How kvsp runs its services' ASGI apps: uvicorn, each response sent in one write.

uvicorn writes a response's status line and fields as soon as the app sends
``http.response.start`` and the body when it sends ``http.response.body``; under uvloop each
write is a send of its own, so every answer costs two system calls and leaves as two segments.
Profiled under load on an index lookup (a 30 KB answer), the send of the head alone took a fifth
of the server's time, more than the lookup (decision 0006). ``HttpProtocol`` hands uvicorn a
transport that holds writes until the end of the event loop's step, when they go out together
in one ``writelines``; uvicorn's parsing, flow control and keep-alive rules are its own,
unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE, LifespanType
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HELD_OCTETS_LIMIT", "HeldWrites", "HttpProtocol", "serve", "uvicorn_config"]

#: Held writes reaching this many octets go out at once, so that a response streamed in many
#: chunks within one step never sits outside the real transport's flow control.
HELD_OCTETS_LIMIT = 64 * 1024


class HeldWrites(asyncio.Transport):
    """A transport that passes everything to ``transport`` but holds writes until the end of
    the loop's step (or until ``HELD_OCTETS_LIMIT`` octets are held), then writes them in
    order with one ``writelines``. Closing sends what is held first; aborting drops it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes | bytearray | memoryview] = []
        self._held_octets = 0
        self._flush_scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._held.append(data)
        self._held_octets += len(data)
        if self._held_octets >= HELD_OCTETS_LIMIT:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._scheduled_flush)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Write what is held now (dropped if the connection is already closing)."""
        held, self._held, self._held_octets = self._held, [], 0
        if held and not self._transport.is_closing():
            self._transport.writelines(held)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held, self._held_octets = [], 0
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._held_octets

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through ``HeldWrites``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeldWrites(transport, self.loop))


def uvicorn_config(
    app: Any, host: str, port: int, log_level: str = "info", lifespan: LifespanType = "auto"
) -> uvicorn.Config:
    """The uvicorn configuration every kvsp service runs with."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=HttpProtocol,
        lifespan=lifespan,
        log_level=log_level,
        access_log=False,
    )


def serve(app: Any, host: str, port: int, log_level: str = "info") -> None:
    """Run ``app`` until the process is stopped, as ``uvicorn.run`` would: a server that could
    not start (its port taken) ends the process with uvicorn's startup-failure status."""
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
