"""A pipe run for the Redis stores hands its connection back however the call ends, and a Redis
that cannot answer is a 503."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from kvsp.core.problems import ServiceUnavailable
from kvsp.local import free_port
from kvsp.redis_pipes import run_pipe

pytestmark = pytest.mark.anyio


async def _silent_after_setup(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A Redis that answers a connection's set-up and then never answers SCRIPT EXISTS."""
    while (header := await reader.readline()).startswith(b"*"):
        words = []
        for _ in range(int(header[1:])):
            size = int((await reader.readline())[1:])
            words.append((await reader.readexactly(size + 2))[:-2])
        if words[0].upper() == b"SCRIPT":
            await reader.read()
            break
        writer.write(b"-ERR unknown command\r\n" if words[0] == b"HELLO" else b"+OK\r\n")
    writer.close()


@pytest.fixture
async def silent_url() -> AsyncIterator[str]:
    server = await asyncio.start_server(_silent_after_setup, "127.0.0.1", 0)
    yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    server.close()


async def _scripted(client: aioredis.Redis) -> list[object]:
    pipe = client.pipeline(transaction=False)
    await client.register_script("return 1")(client=pipe)
    return await run_pipe(pipe, "the test's Redis")


@pytest.mark.parametrize("cancelled", [True, False])
async def test_a_pipe_cut_short_while_loading_its_scripts_holds_no_connection(
    silent_url: str, cancelled: bool
) -> None:
    """Cancelled (a leader's task stopped) or timed out while the pipe loads its scripts: the
    connection goes back to the pool either way, so nothing warns of an unclosed pipe."""
    client = aioredis.Redis.from_url(silent_url, socket_timeout=0.3)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call = asyncio.create_task(_scripted(client))
            if cancelled:
                await asyncio.sleep(0.1)
                call.cancel()
            with pytest.raises(asyncio.CancelledError if cancelled else ServiceUnavailable):
                await call
            del call
            gc.collect()
        assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        await client.aclose()


async def test_an_unreachable_redis_is_a_503_naming_the_state() -> None:
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.2)
    try:
        with pytest.raises(ServiceUnavailable, match="the test's Redis is unreachable"):
            await _scripted(client)
    finally:
        await client.aclose()


async def test_a_refused_command_is_a_503(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("NO-SUCH-COMMAND")
        with pytest.raises(ServiceUnavailable, match="refused a command"):
            await run_pipe(pipe, "the test's Redis")
        assert await run_pipe(client.pipeline(transaction=False).ping(), "x") == [True]
    finally:
        await client.aclose()
