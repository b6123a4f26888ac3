"""Mooncake Store as a peer for block GETs, run under build/peers/mooncake's interpreter.

``load`` starts a ``mooncake_master`` (its HTTP metadata server inside it), one store process
that mounts the memory (this file with ``--store``), and a client here that mounts none, so
every ``get_into`` crosses TCP from the store process, as a vLLM worker's GET does in Mooncake's
standalone-store mode (``serve`` alone starts the master and the store for vLLM's
``MooncakeStoreConnector``). Everything binds to 127.0.0.1 (``MC_TCP_BIND_ADDRESS``; Mooncake
otherwise advertises the first non-loopback address). ``rate`` reads the blocks with
``clients`` threads, each into a registered buffer of its own, reused from block to block."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"

from _driver import serve, threaded_rate
from mooncake.store import MooncakeDistributedStore

STORE_OCTETS = 4 << 30
CLIENT_BUFFER_OCTETS = 256 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connect(metadata: str, master: str, mounted: int) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    status = store.setup("127.0.0.1", metadata, mounted, CLIENT_BUFFER_OCTETS, "tcp", "", master)
    if status != 0:
        raise RuntimeError(f"Mooncake setup answered {status}")
    return store


class Peer:
    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.client: MooncakeDistributedStore | None = None
        self.keys: list[str] = []
        self.sizes: list[int] = []
        self.buffers: list[tuple[bytearray, int]] = []

    def load(self, blobs: str, sizes: list[int], tag: str) -> dict[str, Any]:
        """Store the blobs (``sizes`` octets each, one after another in the file ``blobs``)."""
        if self.client is None:
            served = self.serve()
            self.client = connect(served["metadata_server"], served["master_server_address"], 0)
        for _, address in self.buffers:  # they fit the blocks stored before
            self.client.unregister_buffer(address)
        self.buffers = []
        data = Path(blobs).read_bytes()
        self.keys, self.sizes, offset = [], sizes, 0
        for n, size in enumerate(sizes):
            key = f"{tag}-{n}"
            status = self.client.put(key, data[offset : offset + size])
            if status != 0:
                raise RuntimeError(f"Mooncake put answered {status}")
            self.keys.append(key)
            offset += size
        return {"blocks": len(sizes)}

    def serve(self) -> dict[str, Any]:
        """Start the master and the store process; answers the addresses a client (vLLM's
        ``MooncakeStoreConnector`` among them) is configured with."""
        rpc, http = free_port(), free_port()
        binaries = Path(sys.executable).parent
        log = open(os.environ.get("KVSP_PEER_LOG", os.devnull), "ab")  # noqa: SIM115
        self.processes.append(subprocess.Popen(
            [str(binaries / "mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={http}"],
            stdout=log, stderr=log))  # fmt: skip
        metadata, master = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        wait_for_port(rpc)
        wait_for_port(http)
        self.processes.append(subprocess.Popen(
            [sys.executable, __file__, "--store", metadata, master], stdout=log, stderr=log
        ))  # fmt: skip
        time.sleep(2.0)  # the store's segment is mounted once its setup returns
        return {"metadata_server": metadata, "master_server_address": master}

    def rate(self, clients: int, seconds: float) -> dict[str, Any]:
        assert self.client is not None
        client, largest = self.client, max(self.sizes)
        while len(self.buffers) < clients:
            buffer = bytearray(largest)
            address = ctypes.addressof((ctypes.c_char * largest).from_buffer(buffer))
            if client.register_buffer(address, largest) != 0:
                raise RuntimeError("Mooncake register_buffer failed")
            self.buffers.append((buffer, address))

        def get(i: int, n: int) -> int:
            got = client.get_into(self.keys[n], self.buffers[i][1], self.sizes[n])
            if got != self.sizes[n]:
                raise RuntimeError(f"Mooncake get_into answered {got}")
            return got

        return {"octets_per_s": threaded_rate(get, clients, len(self.keys), seconds)}

    def check(self, blobs: str) -> dict[str, Any]:
        """Whether one GET of each block gives back the octets stored (before any timing)."""
        assert self.client is not None
        data, offset, same = Path(blobs).read_bytes(), 0, True
        for key, size in zip(self.keys, self.sizes, strict=True):
            same = same and self.client.get(key) == data[offset : offset + size]
            offset += size
        return {"same_octets": same}

    def close(self) -> dict[str, Any]:
        for process in self.processes:
            process.kill()
            process.wait()
        return {}


def wait_for_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"no listener on {port}")


def store_process(metadata: str, master: str) -> None:
    """Mount the memory every block lives in, and hold it until killed."""
    store = connect(metadata, master, STORE_OCTETS)
    while store is not None:
        time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--store"]:
        store_process(sys.argv[2], sys.argv[3])
    else:
        peer = Peer()
        serve({
            "serve": peer.serve, "load": peer.load, "rate": peer.rate, "check": peer.check,
            "close": peer.close,
        })  # fmt: skip
