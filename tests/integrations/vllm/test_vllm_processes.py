"""vLLM with KVSPConnector, in real processes beside a real Index Service, holder and reference
(transformers) instance:

- a second vLLM process gets its prefix from KVSP (cached tokens reported, output equal), and a
  tenant never hits another tenant's blocks;
- vLLM reuses blocks the reference instance wrote and the reference reuses vLLM's, with the
  same greedy tokens;
- a block served corrupted, gone from its holder after the lookup, or cut off mid-load is
  recomputed with the no-cache output (vllm#49250's path), or, when another holder has it, taken
  from that holder (the range that failed, whole); a wrong Repr-Digest over layers that all
  match their layer digests is refused too (KVSP 6.7: clients MUST verify it), so that block is
  recomputed; the output is correct in every case;
- KvHints on the requests of a stock vLLM with the connector (vLLM's own ``kv_hints``, Dynamo's
  ``kv_transfer_params.kv_hint``) run against vLLM's pages and the connector's holder, each
  outcome saying what it reached; vLLM's own KV event publisher carries the connector's stores
  at the holder (``take_events``);
- the controller routes a session to a vLLM instance and, after a SIGKILL, resumes it on another
  vLLM instance, every token index once, equal to the reference, greedy or sampled (vLLM
  samples by kvsp's rule, so the resumed instance draws what the killed one would have).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvsp.core.container import Container
from kvsp.core.digests import repr_digest_of
from kvsp.core.ids import parse_compat_id, tenant_session
from kvsp.core.keys import block_keys, scope_id
from kvsp.core.records import ReplicaRecord, Sampler
from kvsp.holder.blocks import BlockMeta
from kvsp.index.client import IndexClient
from kvsp.instance.engine import Engine, KvState
from kvsp.model import ModelFiles
from tests.integration.instances import (
    PROMPT,
    SCOPE_KEY,
    Cluster,
    active,
    eventually,
    generate,
)
from tests.integration.test_session_hints_processes import envelope
from tests.servers import Service, free_port, running, serving

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

#: a longer prompt: two whole vLLM pages and part of a third
LONG = (PROMPT * 6)[:300]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_files: ModelFiles) -> Iterator[Cluster]:
    """An IS and a holder, shared by the tests of this module."""
    cluster = Cluster(tmp_path_factory.mktemp("vllm"), model_files.compat_id.hex())
    with running(cluster.index, cluster.holder):
        yield cluster


async def offline(
    cluster: Cluster,
    model_files: ModelFiles,
    prompts: list[Any],
    max_tokens: int = 16,
    log: list[str] | None = None,
    options: dict[str, Any] | None = None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """Prompts through vLLM with KVSPConnector (``extra``: its settings) in a process of its
    own (``options``: more of the spec; its log lines go to ``log``)."""
    spec = {
        "model_dir": str(model_files.folder),
        "connector": "KVSPConnector",
        "extra_config": {
            "index_url": cluster.index.base_url,
            "holder_url": cluster.holder_url,
            "tenants_file": str(cluster.tenants),
            "tenant": "acme",
            **extra,
        },
        "prompts": prompts,
        "max_tokens": max_tokens,
        **(options or {}),
    }
    path = cluster.tenants.with_name(f"spec-{uuid.uuid4().hex[:8]}.json")
    path.write_text(json.dumps(spec))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp.integrations.vllm.offline", str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    path.with_suffix(".log").write_bytes(err)
    assert process.returncode == 0, err.decode()[-4000:]
    if log is not None:
        log += err.decode(errors="replace").splitlines()
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


class Published:
    """Every KV event a vLLM process publishes on ``endpoint``, read on a thread of its own
    (connected before vLLM binds: ZMQ connects once it does) and decoded by vLLM's classes."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen)

    def __enter__(self) -> Published:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _listen(self) -> None:
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.endpoint)
        decode = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if socket.poll(100):
                self.events.extend(decode.decode(socket.recv_multipart()[2]).events)
        socket.close(linger=0)


def check_stored_at_holder(events: list[Any], prompts: list[list[int]]) -> None:
    """``KVSPConnector.take_events()`` announced, through vLLM's own publisher and under vLLM's
    own page hash, each page the connector stored at the holder: medium CPU, locality REMOTE,
    ownership kvsp, with the page's tokens and parent."""
    stored = [e for e in events if isinstance(e, BlockStored)]
    vllm_pages = {
        h: e.token_ids[128 * i : 128 * (i + 1)]
        for e in stored if e.medium == "GPU" for i, h in enumerate(e.block_hashes)
    }  # fmt: skip
    at_holder = [e for e in stored if e.ownership == "kvsp"]
    assert at_holder, "no page announced as stored at the holder"
    for event in at_holder:
        assert (event.medium, event.locality, event.block_size) == ("CPU", "REMOTE", 128)
        (page,) = event.block_hashes
        assert page in vllm_pages  # vLLM's own hash of the same page
        assert event.token_ids == vllm_pages[page]
    # a chain's first page has no parent, and is a prompt's first page (a prompt whose blocks
    # the holder had already is loaded, not stored, and so not announced)
    firsts = [p[:128] for p in prompts]
    assert all(e.token_ids in firsts for e in at_holder if e.parent_block_hash is None)


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return list(engine.generate(KvState(), prompt, Sampler(method="greedy"), n))


async def test_a_second_vllm_process_gets_its_prefix_from_kvsp_for_its_tenant_only(
    cluster: Cluster, model_files: ModelFiles
) -> None:
    first, stored = await offline(cluster, model_files, [LONG], options={"metrics": True})
    assert first["cached_tokens"] == 0
    # the connector's counts in vLLM's own Prometheus series (its KV-connector stats; vLLM's
    # reader names a counter without the _total its /metrics text adds)
    # 300 prompt and 16 output tokens: 19 whole blocks
    assert stored["metrics"]["vllm:kvsp_blocks_stored"] == 19
    block_octets = stored["metrics"]["vllm:kvsp_bytes_stored"] / 19
    assert stored["metrics"]["vllm:kvsp_blocks_loaded"] == 0

    def asking(tenant: str | None) -> dict[str, Any]:
        params = None if tenant is None else {"kvsp": {"tenant": tenant}}
        return {"tokens": LONG, "kv_transfer_params": params}

    # a front end names the tenant of each request; a request naming none gets no KVSP
    answers = await offline(
        cluster,
        model_files,
        [asking("acme"), asking("other"), asking(None), asking("nobody")],
        request_tenants=True,
        tenant=None,
        options={"metrics": True},
    )
    counts = answers.pop()["metrics"]
    assert counts["vllm:kvsp_blocks_loaded"] == 18  # acme's 288 tokens
    assert counts["vllm:kvsp_bytes_loaded"] <= 18 * block_octets
    assert counts["vllm:kvsp_load_failures"] == 0
    hit = answers[0]
    assert hit["cached_tokens"] == 288  # every whole block but the one of the last token
    assert hit["kv_transfer_params"] == {"kvsp": {"loaded_tokens": 288}}
    assert hit["tokens"] == first["tokens"]
    # tenant "other" misses (and stores its own copy); without a known tenant, no KVSP at all
    assert [a["cached_tokens"] for a in answers[1:]] == [0, 0, 0]
    assert [a["kv_transfer_params"] for a in answers[1:]] == [
        {"kvsp": {"loaded_tokens": 0}},
        None,
        None,
    ]
    assert all(a["tokens"] == first["tokens"] for a in answers)


async def test_vllm_and_the_reference_instance_reuse_each_others_blocks(
    cluster: Cluster, model_files: ModelFiles, engine: Engine
) -> None:
    prompt = (PROMPT * 4)[:150]
    later = (PROMPT * 5)[10:200]
    with running(instance := cluster.instance()):
        reference = await generate(instance.base_url, prompt, 16)
        assert reference["tokens"] == greedy(engine, prompt, 16)
        # vLLM loads what the reference wrote, and stores a prompt of its own
        answer, stored = await offline(cluster, model_files, [prompt, later])
        assert answer["cached_tokens"] == 144
        assert answer["tokens"] == reference["tokens"]
        assert stored["cached_tokens"] == 0
        # the reference instance loads what vLLM wrote
        again = await generate(instance.base_url, later, 16)
    assert again["summary"]["cached"] == {"remote": 176}
    assert again["tokens"] == stored["tokens"] == greedy(engine, later, 16)


def _corrupting_holder(
    blocks: dict[str, Container],
    bad: Collection[str] = (),
    asked: list[tuple[str, str | None]] | None = None,
    bad_repr: Collection[str] = (),
    gone: Collection[str] = (),
    cut: Collection[str] = (),
) -> Starlette:
    """A holder that serves the ``bad`` blocks with a byte flipped in their layer 12 (and a
    Repr-Digest that matches what it sends, so only the layer digests can tell), the
    ``bad_repr`` blocks intact under a wrong Repr-Digest, the ``gone`` blocks not at all (404:
    evicted after the lookup), and the ``cut`` blocks halfway before the connection drops (the
    holder died mid-load); ``asked`` collects the (block, layers) of every GET."""

    async def get(request: Request) -> Response:
        key = request.path_params["key"]
        if key in gone:
            return Response(status_code=404)
        container = blocks[key]
        layers = request.query_params.get("layers")
        if asked is not None:
            asked.append((key, layers))
        if layers:
            first, last = (int(x) for x in layers.split("-"))
            container = container.slice(first, last)
        body = bytearray(container.tobytes())
        if key in bad and container.header.first_layer <= 12 <= container.header.last_layer:
            body[container.header.offset_of(12) + 5] ^= 0x40
        headers = {"repr-digest": repr_digest_of(body + b"!" if key in bad_repr else body)}
        if key in cut:

            async def half() -> AsyncIterator[bytes]:
                yield bytes(body[: len(body) // 2])
                raise ConnectionResetError("the holder went away mid-load")

            return StreamingResponse(half(), media_type="application/kvsp-block", headers=headers)
        return Response(bytes(body), media_type="application/kvsp-block", headers=headers)

    return Starlette(routes=[Route("/kvsp/blocks/{compat}/{scope}/{key}", get)])


async def test_a_corrupted_vanished_or_cut_block_is_recomputed(
    cluster: Cluster, model_files: ModelFiles, engine: Engine
) -> None:
    compat = model_files.compat_id.hex()
    scope_key = bytes.fromhex("66" * 32)  # tenant "other" of the cluster
    scope = scope_id(scope_key).hex()
    blocks: dict[str, Container] = {}

    def keys_of(prompt: list[int]) -> list[str]:
        """The prompt's blocks from the reference engine, kept in ``blocks``."""
        state = KvState()
        engine.forward(state, prompt)
        keys = [k.hex() for k in block_keys(scope_key, parse_compat_id(compat), prompt[:256], 16)]
        blocks.update({key: engine.export_block(state, i) for i, key in enumerate(keys)})
        return keys

    def record(key: str, holder: str) -> ReplicaRecord:
        meta = BlockMeta.of(blocks[key])
        return ReplicaRecord.parse(
            {
                "block_key": key, "compat_id": compat, "scope_id": scope, "holder": holder,
                "codec": 1, "size": meta.size, "digest": meta.digest_text,
                "layer_digests": list(meta.layer_digests_hex),
                "residency": [{"tier": "host", "layers": [0, 29], "read_mbit_per_s": 8000}],
                "ttl_ms": 600_000,
            }
        )  # fmt: skip

    first, second = (PROMPT[5:] * 6)[:260], (PROMPT[7:] * 6)[:260]
    third, fourth = (PROMPT[9:] * 7)[:260], (PROMPT[11:] * 7)[:260]
    fifth = (PROMPT[13:] * 7)[:260]
    first_keys, second_keys, third_keys = keys_of(first), keys_of(second), keys_of(third)
    fourth_keys, fifth_keys = keys_of(fourth), keys_of(fifth)
    asked: list[tuple[str, str | None]] = []
    corrupting = _corrupting_holder(
        blocks,
        bad={first_keys[9], second_keys[9]},
        bad_repr={third_keys[9]},
        gone={fourth_keys[9]},
        cut={fifth_keys[9]},
    )
    async with (
        serving(corrupting) as evil,
        serving(_corrupting_holder(blocks, asked=asked)) as honest,
        IndexClient(cluster.index.base_url) as index,
    ):
        for key in blocks:
            await index.publish(record(key, evil))
        # only the corrupting holder has them: blocks 0-8 load; block 9 fails, so vLLM
        # recomputes from its page (token 128) on
        answer, intact, evicted, dropped = await offline(
            cluster, model_files, [first, third, fourth, fifth], tenant="other"
        )
        assert answer["kv_transfer_params"] == {"kvsp": {"loaded_tokens": 128}}
        assert answer["tokens"] == greedy(engine, first, 16)  # what vLLM and the reference give
        # a wrong Repr-Digest over layers that all match their layer digests: the holder's
        # answer is refused (logged) and none of its layers is used, so block 9 is recomputed
        assert intact["kv_transfer_params"] == {"kvsp": {"loaded_tokens": 128}}
        assert intact["tokens"] == greedy(engine, third, 16)
        # a block gone from its holder after the lookup, or cut off mid-load: recomputed, and
        # the output is the no-cache output (vllm#49250 is about exactly this path: a rejected
        # synchronous load under kv_load_failure_policy=recompute)
        for out, prompt in ((evicted, fourth), (dropped, fifth)):
            assert out["kv_transfer_params"] == {"kvsp": {"loaded_tokens": 128}}
            assert out["tokens"] == greedy(engine, prompt, 16)

        # another holder has block 9 too: the range that failed comes from it, whole (a range is
        # used only once its Repr-Digest matched, so nothing of the failed one was)
        await index.publish(record(second_keys[9], honest))
        (answer,) = await offline(cluster, model_files, [second], tenant="other")
        assert answer["kv_transfer_params"] == {"kvsp": {"loaded_tokens": 256}}
        assert answer["tokens"] == greedy(engine, second, 16)
        ((key, layers),) = asked
        assert key == second_keys[9]
        assert layers == "0-29"


#: a sampled session's request, and the same sampler as kvsp names it
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
SAMPLED_AS = Sampler(method="top-p", params={"p": 0.95, "temperature": 0.8}, seed=11)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
async def test_controller_resumes_a_vllm_session_on_another_vllm_instance(
    tmp_path: Path, model_files: ModelFiles, engine: Engine, sampled: bool
) -> None:
    cluster = Cluster(tmp_path, model_files.compat_id.hex(), controller=True, frontend=True)
    pc = cluster.pc
    a, b = cluster.instance("--engine", "vllm"), cluster.instance("--engine", "vllm")
    # vLLM samples by kvsp's rule (step n from the seed and n alone), as the reference does
    sampler = SAMPLED_AS if sampled else Sampler(method="greedy")
    expected = list(engine.generate(KvState(), PROMPT, sampler, 40))
    session = str(uuid.uuid4())
    # the controller keeps the tenant's session under its namespaced UUID
    placed_as = tenant_session(scope_id(bytes.fromhex(SCOPE_KEY)).hex(), session)
    killed: list[str] = []
    chunks: list[dict[str, Any]] = []
    with running(cluster.index, cluster.holder, cluster.controller, a, b):
        await eventually(lambda: active(pc), {a.base_url, b.base_url})
        body = {
            "prompt": PROMPT,
            "max_tokens": 40,
            "session": session,
            "stream": True,
            **(SAMPLED if sampled else {"temperature": 0}),
        }
        headers = {"authorization": "Bearer key-acme"}
        async with (
            httpx.AsyncClient(timeout=180) as http,
            http.stream("POST", pc + "v1/completions", json=body, headers=headers) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[6:]))
                if chunks[-1].get("kvsp", {}).get("index") == 19 and not killed:
                    view = await http.get(f"{pc}sessions/{placed_as}")
                    serving_now = view.json()["instance"]
                    victim = a if serving_now == a.base_url else b
                    victim.stop(signal.SIGKILL)
                    killed.append(serving_now)
        survivor = b if killed[0] == a.base_url else a
        async with httpx.AsyncClient() as http:  # vLLM holds no sequence-sharded caches
            body = {"version": 1, "tokens": [1, 2, 3], "ranges": [[0, 2]]}
            refused = await http.post(survivor.base_url + "shards/m1/load", json=body)
        assert refused.status_code == 405
        assert refused.json()["type"].endswith("kvsp-method-not-allowed")
    assert killed
    tokens = [c["kvsp"] for c in chunks[:-1]]
    assert [t["index"] for t in tokens] == list(range(40))
    assert [t["token"] for t in tokens] == expected
    assert {t["epoch"] for t in tokens} == {0, 1}
    summary = chunks[-1]["kvsp"]
    assert summary["resumed"] == 1
    assert summary["instance"] != killed[0]


def hint_outcomes(log: list[str], envelope: dict[str, Any]) -> list[dict[str, Any]]:
    """The outcomes the connector logged for the envelope's actions, in order."""
    marker = "kvsp hint outcome "
    found = [json.loads(line.split(marker, 1)[1]) for line in log if marker in line]
    mine = {o["action_id"]: o for o in found if o["message_id"] == envelope["message_id"]}
    return [mine[a["action_id"]] for a in envelope["actions"]]


async def test_a_stock_vllm_runs_the_hints_its_requests_carry_against_its_pages_and_holder(
    cluster: Cluster, model_files: ModelFiles, tmp_path: Path
) -> None:
    """vLLM's own ``kv_hints`` and Dynamo's ``kv_transfer_params.kv_hint``, on the requests of
    an offline vLLM with the connector (as under ``vllm serve``): session targets resolve to the
    blocks vLLM served for that session, and each outcome says what it reached."""
    compat = model_files.compat_id.hex()
    acme = scope_id(bytes.fromhex(SCOPE_KEY)).hex()
    first = (PROMPT[3:] * 7)[:300]  # 300 tokens and 16 more: 19 blocks
    keys = [k.hex() for k in block_keys(bytes.fromhex(SCOPE_KEY), parse_compat_id(compat),
                                        first[:288], 16)]  # fmt: skip
    other = scope_id(bytes.fromhex("66" * 32)).hex()
    destination_port = free_port()
    destination_url = f"http://127.0.0.1:{destination_port}/kvsp/"
    destination = Service("holder", "serve", "--url", destination_url, "--host-bytes", "64M",
                          "--log-level", "warning", port=destination_port)  # fmt: skip
    me = {"target": {"session": "conversation-1"}}
    native = envelope(
        ("kv.pin", {**me, "ttl_ms": 60_000}),
        ("kv.retain", {**me, "ttl_ms": 60_000}),
        ("kv.demote", me),
        ("kv.prefetch", me),
        ("kv.share", {**me, "destination": destination_url}),
        (
            "kv.fetch",
            {"source_control_endpoint": "tcp://127.0.0.1:9", "block_hashes": [3], "mode": "copy"},
        ),
        ("kv.pin", {"target": {"scope_id": other, "block_keys": keys[:1]}, "ttl_ms": 1_000}),
    )
    dynamo = envelope(
        ("kv.pin", {"target": {"scope_id": acme, "block_keys": keys[:2]}, "ttl_ms": 1_000})
    )
    log: list[str] = []
    kv_events = f"ipc://{tmp_path}/kv-events"
    with running(destination), Published(kv_events) as published:
        served, carried, bridged = await offline(
            cluster,
            model_files,
            [
                {"tokens": first, "session_id": "conversation-1"},
                {"tokens": LONG[:40], "kv_hints": native},
                {"tokens": LONG[40:80], "kv_transfer_params": {"kv_hint": dynamo}},
            ],
            log=log,
            tenant="acme",
            request_hints=True,
            options={"prefix_caching": True, "kv_events": kv_events},
        )
        async with httpx.AsyncClient() as http:
            copied = [
                (await http.get(f"{destination_url}blocks/{compat}/{acme}/{key}")).status_code
                for key in keys
            ]
    check_stored_at_holder(published.events, [first, LONG[:40], LONG[40:80]])
    assert carried["kv_transfer_params"]["kvsp"]["kv_hints"] == {
        "message_id": native["message_id"],
        "actions": 7,
    }
    pin, retain, demote, prefetch, share, fetch, foreign = hint_outcomes(log, native)
    # vLLM holds the first two pages (16 blocks); the holder all 19: pins and demote reach the
    # holder's copies and say what stays in vLLM's pages
    for o in (pin, demote):
        assert (o["outcome"], o["code"], o["blocks"]) == ("clipped", "engine-g1", 19), o
    assert pin["ttl_ms"] == 60_000
    assert (retain["outcome"], retain["code"]) == ("rejected", "not-implemented")
    assert (prefetch["outcome"], prefetch["code"], prefetch["blocks"]) == (
        "clipped",
        "engine-g1",
        16,
    )
    assert (share["outcome"], share["blocks"]) == ("accepted", 19)
    assert copied[:18] == [200] * 18
    assert (fetch["outcome"], fetch["code"]) == ("rejected", "not-implemented")
    assert "kv.fetch version 1.0" in fetch["reason"]
    assert (foreign["outcome"], foreign["code"]) == ("rejected", "forbidden")
    # Dynamo's bridge field: the same envelope, the same executor
    assert bridged["kv_transfer_params"]["kvsp"]["kv_hints"]["actions"] == 1
    [leased] = hint_outcomes(log, dynamo)
    assert (leased["outcome"], leased["code"], leased["blocks"]) == ("clipped", "engine-g1", 2), (
        leased
    )
    assert "kv_hints" not in served["kv_transfer_params"]["kvsp"]
