"""A holder as a real process beside a real Index Service: blocks stored and served over the
network, demotion to disk, a holder SIGKILLed while writing, and a corrupted disk file."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from kvsp.core.problems import KvspError, LeaseQuotaExceeded, NotFound, ServiceUnavailable
from kvsp.core.records import LeaseRequest, LookupRequest, ReplicaRecord
from kvsp.holder.client import HolderClient
from kvsp.index.client import IndexClient
from tests.holder.factories import COMPAT, OTHER_SCOPE, SCOPE, block_id, container
from tests.principals import principal
from tests.servers import Service, free_port, running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

#: 30 layers x 2 x 4 KiB: a block of about 240 KB
LAYERS, SECTION = 30, 4096


def principals(holder_url: str) -> str:
    return (
        principal("holder", ["holder"], [holder_url])
        + principal("client", ["client", "controller"], scopes=[SCOPE])
        + principal("scraper", ["metrics"])
    )


class Cluster:
    def __init__(self, tmp: Path, host_bytes: str, disk_bytes: str = "64M") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/kvsp/"
        auth = tmp / "principals.toml"
        auth.write_text(principals(self.url))
        token = tmp / "holder.token"
        token.write_text("holder\n")
        self.disk = tmp / "disk"
        self.index = Service("index", "serve", "--auth", str(auth), "--log-level", "warning")
        self.args = (
            "holder", "serve", "--url", self.url, "--auth", str(auth),
            "--index", self.index.base_url, "--index-token-file", str(token),
            "--host-bytes", host_bytes, "--disk-dir", str(self.disk), "--disk-bytes", disk_bytes,
            "--log-level", "warning",
        )  # fmt: skip

    def holder(self) -> Service:
        return Service(*self.args, port=self.port)

    async def matched(self, *ns: int) -> int:
        async with IndexClient(self.index.base_url, "client") as pc:
            request = LookupRequest(
                scope_id=SCOPE, compat_id=COMPAT, block_keys=tuple(block_id(n)[2] for n in ns)
            )
            return (await pc.lookup(request)).matched

    async def until_matched(self, expected: int, *ns: int) -> None:
        for _ in range(100):
            if await self.matched(*ns) == expected:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"index never matched {expected} of {ns}")

    async def record(self, n: int) -> ReplicaRecord:
        async with IndexClient(self.index.base_url, "client") as pc:
            request = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=(block_id(n)[2],))
            answer = await pc.lookup(request)
        assert answer.matched == 1
        return answer.replicas[0][0]


def block(n: int):  # type: ignore[no-untyped-def]
    return container(n, layers=LAYERS, section=SECTION)


async def test_store_publish_serve_and_demote_to_disk(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, host_bytes=str(2 * block(0).header.data_octets))
    holder = cluster.holder()
    with running(cluster.index, holder):
        async with HolderClient("client") as client:
            for n in range(3):
                await client.put(cluster.url, block_id(n), block(n))
            await cluster.until_matched(3, 0, 1, 2)
            record = await cluster.record(0)  # the oldest: demoted to disk
            assert [r.tier for r in record.residency] == ["disk"]
            assert (await client.get(record)).tobytes() == block(0).tobytes()
            layers = [layer.layer async for layer in client.stream(record, (10, 12))]
            assert layers == [10, 11, 12]
    assert holder.log.count(b"Traceback") == 0


async def test_sigkill_mid_write_loses_nothing_acknowledged(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, host_bytes="0")  # every block is written to disk
    acknowledged: set[int] = set()
    holder = cluster.holder()
    with running(cluster.index):
        holder.start()
        async with HolderClient("client") as client:

            async def writer(first: int) -> None:
                for n in range(first, first + 200, 4):
                    try:
                        await client.put(cluster.url, block_id(n), block(n))
                    except (ServiceUnavailable, KvspError):
                        return
                    acknowledged.add(n)

            tasks = [asyncio.create_task(writer(i)) for i in range(4)]
            while len(acknowledged) < 12:
                await asyncio.sleep(0.01)
            holder.stop(signal.SIGKILL)
            await asyncio.gather(*tasks)
        assert 12 <= len(acknowledged) < 200

        restarted = cluster.holder()
        with running(restarted):
            async with HolderClient("client") as client:
                for n in range(200):
                    record = ReplicaRecord.parse({**block_record(cluster.url, n), "ttl_ms": 1})
                    try:
                        got = await client.get(record)
                    except NotFound:
                        assert n not in acknowledged, f"acknowledged block {n} was lost"
                        continue
                    assert got.tobytes() == block(n).tobytes()  # verified, and whole
            await cluster.until_matched(1, min(acknowledged))
        assert not list(cluster.disk.rglob("*.tmp-*"))


def block_record(holder: str, n: int) -> dict[str, object]:
    """The Replica Record a holder publishes for ``block(n)`` held on disk."""
    c = block(n)
    compat, scope, key = block_id(n)
    return {
        "block_key": key,
        "compat_id": compat,
        "scope_id": scope,
        "holder": holder,
        "codec": 1,
        "size": c.size,
        "digest": "sha-256:" + c.digest().hex(),
        "layer_digests": [d.hex() for d in c.layer_digests()],
        "residency": [{"tier": "disk", "layers": [0, LAYERS - 1]}],
    }


async def test_a_flipped_byte_on_disk_is_withdrawn_at_restart(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, host_bytes="0")
    with running(cluster.index):
        with running(cluster.holder()):
            async with HolderClient("client") as client:
                for n in range(3):
                    await client.put(cluster.url, block_id(n), block(n))
            await cluster.until_matched(3, 0, 1, 2)
        path = next(p for p in cluster.disk.rglob("*.kvsp") if block_id(1)[2] in p.name)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
        restarted = cluster.holder()
        with running(restarted):
            await cluster.until_matched(1, 0, 1, 2)  # block 1 withdrawn: the prefix stops there
            assert await cluster.matched(2) == 1
            async with HolderClient("client") as client:
                record = ReplicaRecord.parse({**block_record(cluster.url, 1), "ttl_ms": 1})
                with pytest.raises(NotFound):
                    await client.get(record)
                metrics = await _metrics(cluster.url)
                assert "kvsp_holder_digest_failures_total 1.0" in metrics
        assert not path.exists()


async def _metrics(url: str) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(url + "metrics", headers={"authorization": "Bearer scraper"})).text


async def test_a_noisy_tenant_takes_neither_the_room_nor_the_leases_of_another(
    tmp_path: Path,
) -> None:
    """Tenant A floods a 16-block holder with 120 blocks and leases all it may; tenant B's
    blocks all stay, and B still gets its leases."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/kvsp/"
    auth = tmp_path / "principals.toml"
    auth.write_text(
        principal("a", ["client"], scopes=[SCOPE])
        + principal("b", ["client"], scopes=[OTHER_SCOPE])
    )
    size = len(block(0).tobytes())
    room = str(16 * size + 40_000)  # 16 blocks and their metadata
    holder = Service(
        "holder", "serve", "--url", url, "--auth", str(auth), "--host-bytes", room,
        "--lease-quota-bytes", str(4 * size), "--log-level", "warning", port=port,
    )  # fmt: skip
    with running(holder):
        async with HolderClient("a") as a, HolderClient("b") as b:
            mine = [await b.put(url, block_id(n, OTHER_SCOPE), block(n)) for n in range(4)]
            flood = [await a.put(url, block_id(n, SCOPE), block(n)) for n in range(100, 220)]
            for record in mine:  # every one of B's blocks, whole and verified
                assert (await b.get(record)).digest() == record.digest_octets
            for record in flood[-8:]:  # A's latest blocks are there, its oldest gone
                assert (await a.get(record)).digest() == record.digest_octets
            with pytest.raises(NotFound):
                await a.get(flood[0])
            lease = LeaseRequest(
                compat_id=COMPAT, scope_id=SCOPE,
                block_keys=tuple(r.block_key for r in flood[-4:]), ttl_ms=30_000,
            )  # fmt: skip
            await a.lease(url, lease)
            with pytest.raises(LeaseQuotaExceeded):  # A's quota is used up
                await a.lease(url, lease.model_copy(update={"block_keys": lease.block_keys[:1]}))
            theirs = LeaseRequest(
                compat_id=COMPAT, scope_id=OTHER_SCOPE,
                block_keys=tuple(r.block_key for r in mine), ttl_ms=30_000,
            )  # fmt: skip
            assert (await b.lease(url, theirs)).ttl_ms == 30_000  # B's quota is B's own
