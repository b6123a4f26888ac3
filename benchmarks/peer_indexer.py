"""KV-event ingest over ZMQ and lookups over HTTP: kvsp's Index Service (fed by
``kvsp index ingest``'s ``PodStream``) against NVIDIA Dynamo's standalone KV indexer
(``python -m dynamo.indexer``), from the same vLLM event stream, under the same ``wrk`` load.
Prints one JSON line.

- ``ingest``: 1,000,000 blocks as vLLM ``BlockStored`` batches (one chain of 64 blocks of 16
  tokens per batch) sent by vLLM's own ``ZmqEventPublisher``, once to each indexer (each
  subscribed to a publisher of its own on an IPC socket); blocks per second from the first
  batch sent to the last chain answering in full. kvsp derives its Block Keys from the tokens
  and publishes replica records to a ``kvsp index serve`` process over HTTP. ``bound``: the
  Block Keys of the same chains derived in process and nothing else, blocks per second, and
  ``is_parse_and_store``: the IS's parse and store of the same records in process, without
  HTTP or the ingest's own work (what each record costs the IS);
- ``lookup``: ``wrk`` (1 thread, 32 connections) sends 64-block prompts, all of one stored chain
  (``full`` hit) or its first 32 blocks and 32 blocks nobody holds (``half``): to kvsp's
  ``POST lookup``, once for every matched block's replica records (``full_records``) and once
  for the compact answer (``"answer": "holders"``: matched blocks per holder, the information
  of Dynamo's answer), and to Dynamo's ``POST query_by_hash`` (matched blocks per worker).
  ``bound`` is the same load on a do-nothing ASGI app under uvicorn as kvsp runs it
  (``benchmarks.index_lookup.minimal_app``): no Python HTTP service here answers faster, so
  its ratio to Dynamo bounds kvsp's. Rounds alternate; figures are medians and each ratio is
  the median of the rounds' ratios.

Dynamo's indexer binds every interface, so it runs in a network namespace of its own
(``tests.servers.DynamoIndexer``) and its ``wrk`` runs in there through ``nsenter``.

Targets: lookups with full replica records >= 0.7 of Dynamo's rate, compact ones >= 1.0
(each met, or shown out of reach by ``bound``); ingest >= 1.0.

Needs ``make peer-deps`` (``make bench-peers`` runs it).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import msgspec
import zmq.asyncio
from tests.servers import DynamoIndexer, Service

from benchmarks._peers import PEERS, PeerDriver, peer_python, report, versus
from benchmarks.index_lookup import DEV, WRK_SCRIPT, Background, minimal_app
from kvsp.core.clock import SystemClock
from kvsp.core.ids import parse_compat_id
from kvsp.core.keys import block_keys
from kvsp.index.client import IndexClient, batch_body
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from kvsp.kvevents.ingest import BATCH_RECORDS, PodEndpoint, PodStream
from kvsp.kvevents.pods import PodChanges, PodIndex, PodSource
from kvsp.kvevents.wire import decode_batch
from kvsp.model import install
from kvsp.tenants import Tenants
from kvsp.web.serving import tune_collector

BLOCKS = 1_000_000
CHAIN = 64
BLOCK_TOKENS = 16
PROMPTS = 2_000
ROUNDS = 3
MODEL = "smollm2"
SCOPE_KEY = "77" * 32
KVSP_JSON = {"content-type": "application/kvsp+json"}


def chain_tokens(first: int, count: int) -> list[int]:
    """The tokens of blocks ``first`` .. ``first + count - 1``: every block's its own."""
    return list(range(first * BLOCK_TOKENS, (first + count) * BLOCK_TOKENS))


def vllm_batches() -> list[Any]:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    return [
        KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=list(range(first + 1, first + CHAIN + 1)), parent_block_hash=None,
            token_ids=chain_tokens(first, CHAIN), block_size=BLOCK_TOKENS, lora_id=None,
            medium="GPU", lora_name=None,
        )])
        for first in range(0, BLOCKS, CHAIN)
    ]  # fmt: skip


def prompt_tokens(hit: str) -> list[list[int]]:
    rng, unknown, out = random.Random(5), 2 * BLOCKS, []
    for _ in range(PROMPTS):
        first = rng.randrange(BLOCKS // CHAIN) * CHAIN
        if hit == "full":
            out.append(chain_tokens(first, CHAIN))
        else:
            out.append(chain_tokens(first, CHAIN // 2) + chain_tokens(unknown, CHAIN // 2))
            unknown += CHAIN // 2
    return out


#: seconds a subscriber is given to connect to a new publisher (ZMQ's PUB drops what it sends
#: before then)
CONNECT_S = 1.0


def publisher_for(endpoint: str, replay: str, batches: list[Any]) -> Any:
    """vLLM's publisher on ``endpoint``, its replay buffer holding every one of ``batches``."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher(
        0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=len(batches),
        max_queue_size=len(batches),
    )  # fmt: skip


def as_i64(hashes: list[int]) -> list[int]:
    """Local block hashes (u64) as ``query_by_hash`` takes them: the same 64 bits as i64."""
    return [h - (1 << 64) if h >= 1 << 63 else h for h in hashes]


def until(check: Any, what: str, timeout_s: float = 600.0) -> float:
    """Seconds until ``check()`` holds."""
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(what)
        time.sleep(0.05)
    return time.perf_counter() - start


def wrk(url: str, bodies: Path, script: Path, inside: DynamoIndexer | None = None) -> float:
    """Requests/s of ``wrk`` posting ``bodies`` to ``url`` (in Dynamo's namespace: ``inside``)."""
    argv = ["wrk", "-t1", "-c32", "-d5s", "-s", str(script), url, "--", str(bodies)]
    done = (
        subprocess.run(argv, capture_output=True, check=True)
        if inside is None
        else inside.inside(argv)
    )
    out = done.stdout.decode()
    match = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    if match is None or "Non-2xx" in out:
        raise RuntimeError(f"wrk failed: {out}")
    return float(match.group(1))


class Peers:
    """kvsp's IS and Dynamo's indexer, the hashes Dynamo's client side computes, and a folder
    for sockets and request bodies."""

    def __init__(self, index: Service, dynamo: DynamoIndexer, hashes: PeerDriver, folder: Path):
        self.index, self.dynamo, self.hashes, self.folder = index, dynamo, hashes, folder
        files = install()
        self.files, self.compat = files, files.compat_id.hex()
        tenant = Tenants.parse(
            f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{self.compat}"]\n'
        ).get("acme")
        assert tenant is not None
        self.tenant = tenant

    def dynamo_queries(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        local = self.hashes.call("local_hashes", prompts=prompts, block_tokens=BLOCK_TOKENS)
        return [{"block_hashes": as_i64(h), "model_name": MODEL} for h in local["hashes"]]

    def kvsp_query(self, prompt: list[int], **extra: str) -> dict[str, Any]:
        keys = block_keys(self.tenant.scope_key, parse_compat_id(self.compat), prompt, BLOCK_TOKENS)
        return {"scope_id": self.tenant.scope_id, "compat_id": self.compat,
                "block_keys": [k.hex() for k in keys], **extra}  # fmt: skip

    def keys_rate(self) -> float:
        """Blocks/s of deriving every chain's Block Keys from its tokens, in this process: the
        least an ingest of vLLM's events does per block (their hashes are vLLM's own), so
        kvsp's ingest bound."""
        scope_key, compat = self.tenant.scope_key, parse_compat_id(self.compat)
        start = time.perf_counter()
        for first in range(0, BLOCKS, CHAIN):
            block_keys(scope_key, compat, chain_tokens(first, CHAIN), BLOCK_TOKENS)
        return BLOCKS / (time.perf_counter() - start)

    def pod_source(self) -> PodSource:
        """The pod kvsp's ingest reads, as ``kvsp index ingest`` would be told of it."""
        return PodSource(
            "http://pod.bench/", self.compat, BLOCK_TOKENS, self.files.descriptor.geometry.layers,
            self.tenant, ttl_ms=600_000,
        )  # fmt: skip

    def store_rate(self, batches: list[Any]) -> float:
        """Records/s the IS's ``POST replicas`` takes in this process (``IndexService.batch_body``,
        as its route calls it), for the records ``kvsp index ingest`` writes for every chain
        (rendered as it renders them, in its writes of ``BATCH_RECORDS``): what the IS spends
        per record, without HTTP or the ingest's own work."""
        tune_collector()
        pod, encoder = PodIndex(self.pod_source()), msgspec.msgpack.Encoder()
        limits = IndexLimits(max_records=4 * BLOCKS, max_scope_records=4 * BLOCKS)
        service = IndexService(MemoryReplicaStore(SystemClock(), limits))
        per_write = BATCH_RECORDS // CHAIN

        async def publish_all() -> float:
            elapsed = 0.0
            for first in range(0, len(batches), per_write):
                changes = PodChanges()
                for batch in batches[first : first + per_write]:
                    pod.apply(decode_batch(encoder.encode(batch)), changes)
                body = batch_body([pod.record_json(b, tiers) for b, tiers in changes.put.items()])
                start = time.perf_counter()
                await service.batch_body(DEV, body)
                elapsed += time.perf_counter() - start
            return BLOCKS / elapsed

        return asyncio.run(publish_all())

    def dynamo_matched(self, query: dict[str, Any]) -> int:
        """Blocks of the query Dynamo's indexer says worker 1 holds."""
        scores = self.dynamo.call("POST", "query_by_hash", query)["scores"]
        return int(scores.get("1", {}).get("0", 0)) // BLOCK_TOKENS

    def dynamo_ingest(self, batches: list[Any]) -> float:
        """Blocks/s from the first batch sent until the last chain and 32 others answer in full
        (Dynamo has no count to ask for)."""
        endpoint, replay = f"ipc://{self.folder}/dyn", f"ipc://{self.folder}/dyn-replay"
        self.dynamo.call("POST", "register", {
            "instance_id": 1, "endpoint": endpoint, "replay_endpoint": replay,
            "model_name": MODEL, "block_size": BLOCK_TOKENS,
        })  # fmt: skip
        sample = [BLOCKS - CHAIN, *random.Random(3).sample(range(0, BLOCKS, CHAIN), 32)]
        queries = self.dynamo_queries([chain_tokens(first, CHAIN) for first in sample])
        publisher = publisher_for(endpoint, replay, batches)
        time.sleep(CONNECT_S)
        start = time.perf_counter()
        for batch in batches:
            publisher.publish(batch)
        until(lambda: all(self.dynamo_matched(q) == CHAIN for q in queries), "Dynamo's ingest")
        elapsed = time.perf_counter() - start
        publisher.shutdown()
        return BLOCKS / elapsed

    def lookups(self, hit: str) -> dict[str, Any]:
        """``wrk`` rounds against kvsp (both answers), the bound and Dynamo, alternating, after
        a check that all match alike."""
        prompts = prompt_tokens(hit)
        full, compact = self.folder / f"kvsp-{hit}.txt", self.folder / f"holders-{hit}.txt"
        theirs = self.folder / f"dynamo-{hit}.txt"
        full.write_text("\n".join(json.dumps(self.kvsp_query(p)) for p in prompts))
        compact.write_text(
            "\n".join(json.dumps(self.kvsp_query(p, answer="holders")) for p in prompts)
        )
        dynamo_queries = self.dynamo_queries(prompts)
        theirs.write_text("\n".join(json.dumps(q) for q in dynamo_queries))
        self.check_alike(prompts[0], dynamo_queries[0], hit)
        kvsp_script, dynamo_script = self.folder / "kvsp.lua", self.folder / "dynamo.lua"
        kvsp_script.write_text(WRK_SCRIPT)
        dynamo_script.write_text(WRK_SCRIPT.replace("/kvsp/lookup", "/query_by_hash"))
        dynamo_url = f"http://127.0.0.1:{DynamoIndexer.PORT}/query_by_hash"
        rates: dict[str, list[float]] = {"full": [], "holders": [], "bound": [], "dynamo": []}
        with Background(minimal_app) as bare:
            bare_url = f"http://127.0.0.1:{bare.port}/kvsp/lookup"
            for _ in range(ROUNDS):
                rates["full"].append(wrk(self.index.base_url + "lookup", full, kvsp_script))
                rates["holders"].append(wrk(self.index.base_url + "lookup", compact, kvsp_script))
                rates["bound"].append(wrk(bare_url, compact, kvsp_script))
                rates["dynamo"].append(wrk(dynamo_url, theirs, dynamo_script, self.dynamo))
        dynamo = rates["dynamo"]
        return {
            "full_records": {**versus(rates["full"], dynamo, ("kvsp_per_s", "dynamo_per_s")),
                             "target": 0.7},
            "holders": {**versus(rates["holders"], dynamo, ("kvsp_per_s", "dynamo_per_s")),
                        "target": 1.0},
            "bound": versus(rates["bound"], dynamo, ("do_nothing_app_per_s", "dynamo_per_s")),
        }  # fmt: skip

    def check_alike(self, prompt: list[int], dynamo_query: dict[str, Any], hit: str) -> None:
        """Both of kvsp's answers and Dynamo's name the same matched blocks."""
        url = self.index.base_url + "lookup"
        full = httpx.post(url, json=self.kvsp_query(prompt), headers=KVSP_JSON).json()
        compact = httpx.post(
            url, json=self.kvsp_query(prompt, answer="holders"), headers=KVSP_JSON
        ).json()
        matched = sum(1 for replicas in full["replicas"] if replicas)
        held = max((h["blocks"] for h in compact["holders"]), default=0)
        if not matched == held == self.dynamo_matched(dynamo_query):
            raise RuntimeError(f"{hit} hit: kvsp's answers and Dynamo's matched other blocks")


def targeted(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures with a target, at the top level or one down (a lookup's answers)."""
    found = []
    for figure in results.values():
        if isinstance(figure, dict):
            found += [figure] if "target" in figure else targeted(figure)
    return found


def main() -> None:
    batches = vllm_batches()
    index = Service(
        "index", "serve", "--log-level", "warning", "--max-scope-records", str(4 * BLOCKS),
    ).start()  # fmt: skip
    dynamo = DynamoIndexer(peer_python("dynamo"), PEERS / "dynamo-indexer.log")
    results: dict[str, Any] = {"blocks": BLOCKS, "prompt_blocks": CHAIN}
    try:
        with tempfile.TemporaryDirectory() as tmp, PeerDriver("dynamo", "dynamo_radix") as hashes:
            peers = Peers(index, dynamo, hashes, Path(tmp))
            theirs = peers.dynamo_ingest(batches)
            ours = asyncio.run(ingest_kvsp(peers, batches))
            keyed, stored = peers.keys_rate(), peers.store_rate(batches)
            results["ingest"] = {
                "kvsp_blocks_per_s": round(ours),
                "dynamo_blocks_per_s": round(theirs),
                "ratio": round(ours / theirs, 3),
                "target": 1.0,
                "bound": {"keys_only_blocks_per_s": round(keyed),
                          "ratio": round(keyed / theirs, 3)},
                "is_parse_and_store": {"records_per_s": round(stored),
                                       "ratio": round(stored / theirs, 3)},
            }  # fmt: skip
            for hit in ("full", "half"):
                results[f"lookup_{hit}_hit"] = peers.lookups(hit)
    finally:
        dynamo.stop()
        index.stop()
    meets = all(figure["ratio"] >= figure["target"] for figure in targeted(results))
    peer = "ai-dynamo 1.6.1 python -m dynamo.indexer (ZMQ in, HTTP query_by_hash)"
    report("peer_indexer", {"dynamo": peer}, meets, results)


async def records_held(http: httpx.AsyncClient, base: str) -> int:
    """The IS's ``kvsp_index_records``, summed over scopes."""
    scrape = (await http.get(base + "metrics")).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in scrape.splitlines()
        if line.startswith("kvsp_index_records{")
    )


async def ingest_kvsp(peers: Peers, batches: list[Any]) -> float:
    """Blocks/s from the first batch sent until the IS holds every block's record, through a
    ``PodStream`` (as ``kvsp index ingest`` runs it, its collector tuned alike) from a
    publisher of its own."""
    tune_collector()
    base, folder = peers.index.base_url, peers.folder
    source = peers.pod_source()
    pod = PodEndpoint("bench", source, f"ipc://{folder}/kvsp", f"ipc://{folder}/kvsp-replay")
    client = IndexClient(base, "ingest")
    stream = PodStream(pod, client, zmq.asyncio.Context.instance())
    task = asyncio.create_task(stream.run())
    publisher = publisher_for(pod.endpoint, f"ipc://{folder}/kvsp-replay", batches)
    await asyncio.sleep(CONNECT_S)  # the stream's task runs: its socket connects
    start = time.perf_counter()
    for batch in batches:
        publisher.publish(batch)
    async with httpx.AsyncClient() as http:
        while await records_held(http, base) < BLOCKS:
            await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - start
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    publisher.shutdown()
    await client.aclose()
    return BLOCKS / elapsed


if __name__ == "__main__":
    main()
