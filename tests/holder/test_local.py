"""Reading a holder in this process from another thread (the vLLM connector reading its
instance's own holder): the octets the store holds, taken under the store's lock; nothing for a
block it does not hold; the registry finds a holder by its URL only while registered."""

from __future__ import annotations

import asyncio

import pytest

from kvsp.core.container import Container
from kvsp.holder import local
from kvsp.holder.store import BlockRead
from tests.holder.env import holder_env
from tests.holder.factories import block_id, container

pytestmark = pytest.mark.anyio


def octets(read: BlockRead) -> bytes:
    return b"".join(bytes(p) for p in read.parts)


async def test_a_held_block_is_read_in_process_and_a_missing_one_is_not() -> None:
    async with holder_env(host_blocks=2) as env:
        service = env.service
        await service.store_block(block_id(1), container(1).tobytes())
        loop = asyncio.get_running_loop()
        read = await loop.run_in_executor(None, service.read_in_process, block_id(1), octets)
        whole = container(1).tobytes()
        assert read is not None
        assert whole.endswith(read)  # the layer sections, after the header
        assert (
            await loop.run_in_executor(None, service.read_in_process, block_id(2), octets) is None
        )
        local.register(service)
        assert local.find(service.url.removesuffix("/")) is service  # as records name it
        local.unregister(service)
        assert local.find(service.url) is None


async def test_a_container_is_stored_as_its_octets_would_be() -> None:
    """Given parsed (a block this process verified, its digests known) or built (its sections
    joined), a container is held with the record and octets its bytes would have."""
    async with holder_env(host_blocks=4) as env:
        service = env.service
        by_octets = await service.store_block(block_id(1), container(1).tobytes())
        parsed = Container.parse(container(2).tobytes())
        parsed.sha256()
        by_parsed = await service.store_block(block_id(2), parsed)
        by_built = await service.store_block(block_id(3), container(3))
        for n, record in ((1, by_octets), (2, by_parsed), (3, by_built)):
            assert record.digest_octets == container(n).digest()
            loop = asyncio.get_running_loop()
            read = await loop.run_in_executor(None, service.read_in_process, block_id(n), octets)
            assert read == bytes(container(n).data())
