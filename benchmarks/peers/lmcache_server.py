"""LMCache's remote cache server (``lmcache_server HOST PORT cpu``) as a peer for block GETs,
run under build/peers/lmcache's interpreter.

The requests are LMCache's own wire messages (``lmcache.v1.protocol``'s ``ClientMetaMessage``
and ``ServerMetaMessage``), sent as its ``LMServerConnector`` sends them: a header, the reply
header, then the octets received with ``recv_into``, here into a buffer of each client's own,
reused from block to block, on one connection per client thread."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _driver import serve, threaded_rate
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import (
    ClientCommand,
    ClientMetaMessage,
    ServerMetaMessage,
    ServerReturnCode,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def message(command: ClientCommand, key: CacheEngineKey, length: int) -> bytes:
    return ClientMetaMessage(
        command, key, length, MemoryFormat(1), torch.uint8, torch.Size([length, 0, 0, 0])
    ).serialize()


class Peer:
    def __init__(self) -> None:
        self.server: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.keys: list[CacheEngineKey] = []
        self.requests: list[bytes] = []
        self.sizes: list[int] = []
        self.connections: list[tuple[socket.socket, memoryview]] = []

    def connect(self) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", self.port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def load(self, blobs: str, sizes: list[int], tag: str) -> dict[str, Any]:
        if self.server is None:
            self.port = free_port()
            server = Path(sys.executable).parent / "lmcache_server"
            self.server = subprocess.Popen(
                [str(server), "127.0.0.1", str(self.port), "cpu"],
                stdout=subprocess.DEVNULL,
                stderr=sys.stderr,
            )
            deadline = time.monotonic() + 60
            while True:
                try:
                    self.connect().close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        for conn, _ in self.connections:  # their buffers fit the blocks stored before
            conn.close()
        self.connections = []
        data = Path(blobs).read_bytes()
        writer, offset = self.connect(), 0
        self.keys, self.requests, self.sizes = [], [], sizes
        for n, size in enumerate(sizes):
            key = CacheEngineKey("kvsp-bench-" + tag, 1, 0, n, torch.uint8)
            writer.sendall(message(ClientCommand.PUT, key, size))
            writer.sendall(data[offset : offset + size])
            self.keys.append(key)
            self.requests.append(message(ClientCommand.GET, key, 0))
            offset += size
        # a request on the same connection answers only after the puts before it are stored
        writer.sendall(message(ClientCommand.EXIST, self.keys[-1], 0))
        reply = ServerMetaMessage.deserialize(self.reply(writer))
        writer.close()
        if reply.code != ServerReturnCode.SUCCESS:
            raise RuntimeError("lmcache_server did not store the blocks")
        return {"blocks": len(sizes)}

    @staticmethod
    def reply(conn: socket.socket) -> bytes:
        return conn.recv(ServerMetaMessage.packlength(), socket.MSG_WAITALL)

    def get(self, i: int, n: int) -> int:
        conn, view = self.connections[i]
        conn.sendall(self.requests[n])
        meta = ServerMetaMessage.deserialize(self.reply(conn))
        if meta.code != ServerReturnCode.SUCCESS or meta.length != self.sizes[n]:
            raise RuntimeError(f"lmcache_server answered {meta}")
        got, size = 0, meta.length
        while got < size:
            got += conn.recv_into(view[got:size], size - got)
        return got

    def rate(self, clients: int, seconds: float) -> dict[str, Any]:
        while len(self.connections) < clients:
            view = memoryview(bytearray(max(self.sizes)))
            self.connections.append((self.connect(), view))
        return {"octets_per_s": threaded_rate(self.get, clients, len(self.keys), seconds)}

    def check(self, blobs: str) -> dict[str, Any]:
        self.rate(1, 0.0)
        data, offset, same = Path(blobs).read_bytes(), 0, True
        for n, size in enumerate(self.sizes):
            self.get(0, n)
            same = same and bytes(self.connections[0][1][:size]) == data[offset : offset + size]
            offset += size
        return {"same_octets": same}

    def close(self) -> dict[str, Any]:
        for conn, _ in self.connections:
            conn.close()
        if self.server is not None:
            self.server.kill()
            self.server.wait()
        return {}


if __name__ == "__main__":
    peer = Peer()
    serve({"load": peer.load, "rate": peer.rate, "check": peer.check, "close": peer.close})
