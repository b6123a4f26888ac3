"""Does each hand-made piece pay? Paired measurements of the end-to-end figure it serves, with
the piece and without it, in interleaved rounds of one run. Prints one JSON line.

- ``_sha256`` (two SHA-256 lanes at a time, hashing as octets arrive) serves block GETs: a
  client fetching a 737,780-octet block from ``kvsp holder serve``, every digest verified,
  MB/s. Without it: ``hashlib``, the fallback a build without a C compiler uses.
- the compiled block table (``index/_keytable.c``, with ``pack_keys`` and the key checks),
  ``pack_keys`` alone (a JSON key-array scanner in C) and the held writes of
  ``kvsp.web.serving`` (a response's head and body in one send) serve Index Service lookups
  over HTTP: 64-key lookups that all
  hit, a million records loaded, ``wrk`` with 32 connections (as ``index_lookup.py`` drives
  it), lookups per second. Without each: its fallback (``DictKeyTable`` and Python's checks;
  msgspec and ``bytes.fromhex``; uvicorn's own writes).

Each server or client runs in a process of its own, started with or without the piece; the
rounds alternate between the two, and the figure is the median of the paired ratios
(with / without). A piece is worth keeping at a gain of 1.10 or more (the noise on these
machines is about 10 %). The limit named: the same figure without the piece, same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROUNDS = 5
ROUND_S = 2
KEEP_AT = 1.10
RECORDS = 1_000_000

#: how each piece is taken away in a process of its own (before kvsp is imported)
WITHOUT = {
    "sha256": "import sys; sys.modules['kvsp.core._sha256'] = None",
    "pack_keys": "import kvsp.index.queries as q; q.pack_keys = lambda raw: None",
    "keytable": "import sys; sys.modules['kvsp.index._keytable'] = None",
    "held_writes": "import kvsp.web.serving as s; s.HeldWrites = lambda transport, loop: transport",
}


def _python(piece: str | None, *args: str) -> list[str]:
    prelude = "pass" if piece is None else WITHOUT[piece]
    script = f"{prelude}; import runpy, sys; sys.argv = {[__file__, *args]!r}; "
    script += f"runpy.run_path({__file__!r}, run_name='__main__')"
    return [sys.executable, "-c", script]


# -- the block GET figure -----------------------------------------------------------------------


async def _get_rate(records_file: str) -> float:
    from kvsp.core.records import ReplicaRecord
    from kvsp.holder.client import HolderClient

    records = [ReplicaRecord.parse(r) for r in json.loads(Path(records_file).read_text())]
    async with HolderClient() as client:
        await client.get(records[0])  # the connection, and the first allocations
        octets, start, n = 0, time.perf_counter(), 0
        while time.perf_counter() - start < ROUND_S:
            octets += (await client.get(records[n % len(records)])).size
            n += 1
        elapsed = time.perf_counter() - start
    return octets / elapsed / 1e6


async def _store_blocks(base: str, path: Path) -> None:
    from benchmarks.holder_transfer import COMPAT, SCOPE, SHAPES, make_container
    from kvsp.holder.client import HolderClient

    _, layers, section = SHAPES[0]
    records = []
    async with HolderClient() as client:
        for n in range(16):
            container = make_container(n, layers, section)
            block = (COMPAT, SCOPE, container.sha256().hex())
            record = await client.put(base, block, container)
            records.append(record.model_dump_json(exclude_none=True))
    path.write_text(json.dumps(records))


def block_gets() -> float:
    """The median gain of ``_sha256`` on block GETs."""
    from benchmarks.holder_transfer import holder_service

    holder = holder_service()
    try:
        with tempfile.TemporaryDirectory() as folder:
            records = Path(folder) / "records.json"
            asyncio.run(_store_blocks(holder.base_url, records))
            ratios = []
            for _ in range(ROUNDS):
                with_it, without = (
                    float(subprocess.run(_python(piece, "get", str(records)), check=True,
                                         capture_output=True, text=True).stdout)
                    for piece in (None, "sha256")
                )  # fmt: skip
                ratios.append(with_it / without)
            return statistics.median(ratios)
    finally:
        holder.stop()


# -- the lookup figure --------------------------------------------------------------------------


def _serve_index(port: int) -> None:
    import uvicorn

    from benchmarks.index_lookup import COMPAT, LIMITS, SCOPE, records, template
    from kvsp.auth import Principals
    from kvsp.core.clock import SystemClock
    from kvsp.index.app import create_app
    from kvsp.index.service import IndexService
    from kvsp.index.stores import MemoryReplicaStore
    from kvsp.web.serving import uvicorn_config

    del COMPAT, SCOPE
    store = MemoryReplicaStore(SystemClock(), LIMITS)
    base = template(False)
    for start in range(0, RECORDS, 10_000):
        store.table.publish_many(records(start, start + 10_000, base))
    app = create_app(IndexService(store), Principals.development_mode())
    uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "error", lifespan="on")).run()


def _lookup_rate(port: int, bodies: Path, script: Path) -> float:
    from benchmarks.index_lookup import wrk

    return wrk(port, bodies, script, ROUND_S)


@contextlib.contextmanager
def _index(piece: str | None) -> Iterator[int]:
    from tests.servers import free_port

    port = free_port()
    process = subprocess.Popen(_python(piece, "serve-index", str(port)))
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the index {'without ' + piece if piece else ''} did not start")
            time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(30)


def lookups(piece: str) -> float:
    """The median gain of ``piece`` on lookups over HTTP, ``wrk`` as the load."""
    from benchmarks.index_lookup import WRK_SCRIPT, prompts

    with tempfile.TemporaryDirectory() as folder:
        bodies, script = Path(folder) / "bodies.txt", Path(folder) / "lookup.lua"
        requests = prompts(2_000, RECORDS)
        bodies.write_text("\n".join(r.model_dump_json(exclude_none=True) for r in requests))
        script.write_text(WRK_SCRIPT)
        with _index(None) as with_it, _index(piece) as without:
            _lookup_rate(with_it, bodies, script)  # warm both
            _lookup_rate(without, bodies, script)
            ratios = [
                _lookup_rate(with_it, bodies, script) / _lookup_rate(without, bodies, script)
                for _ in range(ROUNDS)
            ]
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", nargs="?", default="run", choices=["run", "get", "serve-index"])
    parser.add_argument("arg", nargs="?")
    args = parser.parse_args()
    if args.role == "get":
        print(asyncio.run(_get_rate(args.arg)))
        return
    if args.role == "serve-index":
        _serve_index(int(args.arg))
        return
    gains = {"sha256": block_gets()}
    for piece in ("keytable", "pack_keys", "held_writes"):
        gains[piece] = lookups(piece)
    print(
        json.dumps(
            {
                "benchmark": "compiled_pieces",
                "limit": "the same end-to-end figure without the piece, same run, paired rounds",
                "keep_at_gain": KEEP_AT,
                "figures": {
                    "sha256": "block GET MB/s, 737,780-octet block, 1 client, digests verified",
                    "pack_keys": "64-key lookups/s over HTTP, 1 M records, wrk -c32",
                    "keytable": "64-key lookups/s over HTTP, 1 M records, wrk -c32",
                    "held_writes": "64-key lookups/s over HTTP, 1 M records, wrk -c32",
                },
                "gain": {piece: round(gain, 3) for piece, gain in gains.items()},
                "keep": {piece: gain >= KEEP_AT for piece, gain in gains.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
