"""Inference instances as real processes on the real model, with a real Index Service, a holder
that keeps a copy of every block, and (for failover) a real controller.

- a cached prefix, from G2 here or fetched from another instance, gives exactly the tokens of a
  full recompute;
- a prefetch whose deadline passes reports partial, and the request is still correct;
- an instance SIGKILLed mid-generation: the controller resumes the session elsewhere with a new
  epoch, every index is delivered once, and the output equals an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.controller.reshard import plan_reshard
from kvsp.core.container import Container
from kvsp.core.ids import parse_compat_id
from kvsp.core.keys import block_keys, scope_id
from kvsp.core.records import Sampler, ShardMap
from kvsp.instance.engine import Engine, KvState
from tests.integration.instances import (
    PROMPT,
    SCOPE_KEY,
    Cluster,
    eventually,
    generate,
    instance_threads,
    residency,
)
from tests.servers import running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_cached_prefixes_local_and_remote_give_the_recomputed_tokens(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat)
    a, b = cluster.instance(), cluster.instance()
    with running(cluster.index, cluster.holder, a, b):
        cold = await generate(a.base_url, PROMPT, 24)
        assert cold["tokens"] == reference
        assert cold["summary"]["cached_tokens"] == 0
        warm = await generate(a.base_url, PROMPT, 24)  # another session: blocks from G1
        assert warm["tokens"] == reference
        assert warm["summary"]["cached"] == {"g1": 48}
        for _ in range(50):  # the blocks' records reach the IS
            remote = await generate(b.base_url, PROMPT, 24)
            if remote["summary"]["cached_tokens"]:
                break
            await asyncio.sleep(0.1)
        assert remote["tokens"] == reference
        assert remote["summary"]["cached"] == {"remote": 48}  # from A or the holder
        assert [x["index"] for x in remote["lines"]] == list(range(len(reference)))
        async with httpx.AsyncClient() as http:
            status = (await http.get(b.base_url + "status")).json()
        links = {link["holder"]: link for link in status["links"]}
        assert set(links) & {a.base_url, cluster.holder_url}  # where the blocks came from
        for link in links.values():  # a measured transfer rate and round trip
            assert link["mbit_per_s"] > 0
            assert 0 < link["rtt_us"] < 1_000_000
            assert link["rtt_us"] != 200.0  # not the default for an unmeasured link
    for service in (a, b):
        assert service.log.count(b"Traceback") == 0


async def test_a_prefetch_past_its_deadline_is_partial_and_the_request_still_correct(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat)
    a, b = cluster.instance(), cluster.instance()
    with running(cluster.index, cluster.holder, a, b):
        await generate(a.base_url, PROMPT, 1)
        compat_id = parse_compat_id(compat)
        keys = [k.hex() for k in block_keys(bytes.fromhex(SCOPE_KEY), compat_id, PROMPT[:48], 16)]
        directive = {
            "directive": str(uuid.uuid4()),
            "scope_id": scope_id(bytes.fromhex(SCOPE_KEY)).hex(),
            "compat_id": compat,
            "blocks": [{"block_key": k, "sources": [a.base_url]} for k in keys],
            "deadline_ms": 1,
            "lease_ms": 5_000,
        }
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(50):  # A's records reach the IS first
                sent = await http.post(b.base_url + "prefetch", json=directive)
                assert sent.status_code == 202
                location = sent.headers["location"]
                await asyncio.sleep(0.2)
                status = (await http.get(httpx.URL(b.base_url).join(location))).json()
                if status["state"] in ("partial", "failed"):
                    break
                directive["directive"] = str(uuid.uuid4())
            assert status["state"] in ("partial", "failed")
            assert len(status["loaded"]) < len(keys)
        after = await generate(b.base_url, PROMPT, 24)
        assert after["tokens"] == reference


async def _delivered(
    http: httpx.AsyncClient, base: str, session: str, start: int, into: dict[int, tuple[int, int]]
) -> dict[str, Any]:
    """Read a session's token stream, keeping each index once (a higher epoch wins)."""
    async with http.stream("GET", f"{base}sessions/{session}/tokens", params={"from": start}) as r:
        async for line in r.aiter_lines():
            doc = json.loads(line)
            if "done" in doc:
                return doc
            seen = into.get(doc["index"])
            if seen is None or doc["epoch"] > seen[0]:
                into[doc["index"]] = (doc["epoch"], doc["token"])
    return {}


#: SIGKILLs per sampler mode, each at a random point of the generation (KVSP_KILLS=20 for a
#: longer run); the release rule itself is model-tested in process, every order of tokens,
#: blocks and acknowledgements, in tests/instance/test_release.py
KILLS = int(os.environ.get("KVSP_KILLS", "8"))


async def _until(check: Any, what: str, tries: int = 150) -> Any:
    for _ in range(tries):
        with contextlib.suppress(httpx.HTTPError, KeyError):
            found = await check()
            if found:
                return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("mode", ["deterministic", "checkpoint-ack"])
async def test_sigkill_mid_generation_resumes_elsewhere_exactly_once(
    tmp_path: Path, mode: str, engine: Engine, compat: str
) -> None:
    if mode == "deterministic":
        sampler = Sampler(method="greedy", deterministic=True)
    else:
        sampler = Sampler(method="top-p", params={"p": 0.9}, seed=11)
    expected = list(engine.generate(KvState(), PROMPT, sampler, 32))
    cluster = Cluster(tmp_path, compat, controller=True)
    assert cluster.controller is not None
    pc = cluster.controller.base_url
    rng = random.Random(mode)
    with running(cluster.index, cluster.holder, cluster.controller):
        live = [cluster.instance().start(), cluster.instance().start()]
        try:
            async with httpx.AsyncClient(timeout=120) as http:

                async def active() -> set[str]:
                    view = (await http.get(pc + "instances")).json()["instances"]
                    return {i["instance"] for i in view if i["state"] == "active"}

                for kill in range(KILLS):
                    urls = {s.base_url for s in live}
                    await _until(lambda urls=urls: _all_in(active(), urls), "statuses")
                    session = str(uuid.uuid4())
                    place = {
                        "tenant": "acme", "compat_id": compat, "tokens": PROMPT,
                        "session": session, "sampler": sampler.to_json(), "max_tokens": 32,
                    }  # fmt: skip
                    placed = (await http.post(pc + "place", json=place)).json()
                    session = placed["session"]  # the tenant's name for it, namespaced
                    first = next(s for s in live if s.base_url == placed["instance"])
                    second = next(s for s in live if s is not first)
                    body = {k: place[k] for k in ("tenant", "tokens", "sampler")}
                    body.update(max_tokens=32, session=session)
                    stop_after = rng.randint(1, 28)
                    got: dict[int, tuple[int, int]] = {}
                    async with http.stream("POST", first.base_url + "generate", json=body) as r:
                        async for line in r.aiter_lines():
                            doc = json.loads(line)
                            if "done" in doc:
                                break
                            got[doc["index"]] = (doc["epoch"], doc["token"])
                            if len(got) >= stop_after:
                                first.stop(signal.SIGKILL)
                                break
                    released = {i: t for i, (_, t) in got.items()}
                    replacement = asyncio.create_task(asyncio.to_thread(cluster.instance().start))

                    async def moved(
                        url: str = f"{pc}sessions/{session}", gone: str = first.base_url
                    ) -> str | None:
                        """Where the session went: the other instance, or the replacement when
                        it was up first."""
                        state = (await http.get(url)).json()
                        went = state["instance"]
                        return str(went) if state["epoch"] == 1 and went != gone else None

                    to = await _until(moved, f"failover {kill}")
                    summary = await _delivered(http, to, session, 0, got)
                    assert summary["epoch"] == 1
                    assert sorted(got) == list(range(len(expected))), (kill, stop_after)
                    assert [t for _, (_, t) in sorted(got.items())] == expected
                    assert all(got[i][1] == t for i, t in released.items())
                    live = [second, await replacement]
        finally:
            for service in live:
                service.stop()


async def _all_in(found: Any, wanted: set[str]) -> bool:
    return wanted <= await found


async def test_6_3_idle_instances_ask_to_sleep_and_only_the_controller_wakes_them(
    tmp_path: Path, compat: str
) -> None:
    cluster = Cluster(tmp_path, compat, controller=True)
    assert cluster.controller is not None
    pc = cluster.controller.base_url
    a, b = cluster.instance("--sleep-after-s", "0.5"), cluster.instance("--sleep-after-s", "0.5")
    with running(cluster.index, cluster.holder, cluster.controller, a, b):
        async with httpx.AsyncClient(timeout=30) as http:

            async def states() -> dict[str, str]:
                view = (await http.get(pc + "instances")).json()["instances"]
                return {i["instance"]: i["state"] for i in view}

            async def one_asleep() -> dict[str, str] | None:
                found = await states()
                return found if sorted(found.values()) == ["active", "sleeping"] else None

            found = await _until(one_asleep, "one instance asleep")  # min-active 1 keeps one
            asleep = next(url for url, state in found.items() if state == "sleeping")
            health = (await http.get(asleep + "healthz")).json()
            assert health["state"] == "sleeping"
            refused = await http.post(
                asleep + "generate", json={"tenant": "acme", "tokens": PROMPT, "max_tokens": 1}
            )
            assert refused.status_code == 409
            assert refused.json()["type"].endswith("#kvsp-not-accepting")
            woken = await http.put(
                pc + "instances/state", json={"instance": asleep, "state": "active"}
            )
            assert woken.status_code == 200
            assert (await http.get(asleep + "healthz")).json()["state"] == "active"


def _tokens_of(shard_map: dict[str, Any], url: str) -> set[int]:
    return {t for s in shard_map["shards"] if s["instance"] == url for t in range(*s["tokens"])}


async def test_6_9_reshard_keeps_retained_ranges_in_place_and_abort_restores_v(
    tmp_path: Path, compat: str, engine: Engine
) -> None:
    """Three instances hold a 96-token context split by token range; the controller grows,
    shrinks and rebalances it. The union of the shards always equals the context's own KV (layer
    digests of each range), octets move only for ranges that change hands, and an abort (a
    deadline nobody can meet) leaves every member on the old version."""
    context = (PROMPT * 2)[:96]
    source = KvState()
    with instance_threads():
        engine.forward(source, context)
    header = 20 + 16 * 30
    per_token = engine.export_range(source, 0, 1).size - header

    cluster = Cluster(tmp_path, compat, controller=True)
    assert cluster.controller is not None
    pc = cluster.controller.base_url
    members = [cluster.instance(), cluster.instance(), cluster.instance()]
    with running(cluster.index, cluster.holder, cluster.controller, *members):
        urls = [m.base_url for m in members]
        async with httpx.AsyncClient(timeout=60) as http:

            async def get(url: str, **params: str) -> Any:
                response = await http.get(url, params=params)
                assert response.status_code == 200, response.text
                return response

            async def transferred() -> dict[str, int]:
                return {u: (await get(f"{u}shards/ctx")).json()["transferred_octets"] for u in urls}

            async def check(version: int) -> dict[str, Any]:
                current = (await get(f"{pc}shards/ctx")).json()["map"]
                assert current["version"] == version
                for shard in current["shards"]:
                    a, b = shard["tokens"]
                    base = shard["instance"]
                    assert (await get(f"{base}shards/ctx")).json()["version"] == version
                    kv = await get(f"{base}shards/ctx/kv", tokens=f"{a}-{b}")
                    want = engine.export_range(source, a, b).layer_digests()
                    assert Container.parse(kv.content).layer_digests() == want
                return dict(current)

            v1 = {"map": "ctx", "version": 1, "shards": [
                {"tokens": [0, 48], "instance": urls[0]},
                {"tokens": [48, 96], "instance": urls[1]},
            ]}  # fmt: skip
            assert (await http.post(pc + "shards", json=v1)).status_code == 201
            loads = [(urls[0], [0, 48]), (urls[1], [48, 96]), (urls[2], [0, 1])]
            for url, tokens in loads:  # the third member starts at version 1 with a sliver
                load = {"version": 1, "tokens": context, "ranges": [tokens]}
                r = await http.post(f"{url}shards/ctx/load", json=load)
                assert r.status_code == 200, r.text
            await check(1)
            moves = ([urls[0], urls[1], urls[2]], [urls[0], urls[2]], [urls[2], urls[0]])
            for instances in moves:  # grow, shrink, rebalance in another order
                before, old = await transferred(), await check_current(get, pc)
                body = {"instances": instances, "deadline_ms": 20_000}
                done = await http.post(f"{pc}shards/ctx/reshard", json=body)
                assert done.json()["committed"] is True, done.text
                new = await check(old["version"] + 1)
                after = await transferred()
                for url in instances:  # octets arrived only for tokens that changed hands
                    gained = len(_tokens_of(new, url) - _tokens_of(old, url))
                    expected = gained * per_token + header * _pieces(old, new, url)
                    assert after[url] - before[url] == expected, (url, instances)
            last = (await check_current(get, pc))["version"]
            body = {"instances": urls, "deadline_ms": 1}
            failed = await http.post(f"{pc}shards/ctx/reshard", json=body)
            assert failed.json()["committed"] is False
            await check(last)


async def check_current(get: Any, pc: str) -> dict[str, Any]:
    return dict((await get(f"{pc}shards/ctx")).json()["map"])


def _pieces(old: dict[str, Any], new: dict[str, Any], url: str) -> int:
    """How many fetch ranges ``url`` receives going from ``old`` to ``new`` (one container each)."""
    plans = plan_reshard(ShardMap.parse(old), ShardMap.parse(new), 1)
    return len(plans[url].fetch) if url in plans else 0


async def test_a_sessions_next_turn_reuses_its_blocks_from_g1(
    tmp_path: Path, engine: Engine, compat: str
) -> None:
    greedy = Sampler(method="greedy", deterministic=True)
    cluster = Cluster(tmp_path, compat)
    a = cluster.instance()
    session = str(uuid.uuid4())
    with running(cluster.index, cluster.holder, a):
        first = await generate(a.base_url, PROMPT, 20, session=session)
        turn = PROMPT + first["tokens"] + [13, 1073, 314]  # the reply, then the user goes on
        expected = list(engine.generate(KvState(), turn, greedy, 8))
        second = await generate(a.base_url, turn, 8, session=session)
        assert second["tokens"] == expected
        # the first turn computed 69 tokens: its 4 whole blocks, output included, come from G1
        assert second["summary"]["cached"] == {"g1": 64}


async def test_g1_pages_first_layersresidency_and_lru_demotion_to_g2(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    """G1 of 4 blocks keeping layers 0-19 (the rest in G2): the records say so; another
    prompt's blocks push the first ones to G2 (records updated), and they are still reused."""
    cluster = Cluster(tmp_path, compat)
    a = cluster.instance("--g1-blocks", "4", "--g1-layers", "20")
    other = [PROMPT[0] + 1, *PROMPT[1:]]  # every block key differs
    with running(cluster.index, cluster.holder, a):
        cold = await generate(a.base_url, PROMPT, 24)
        assert cold["tokens"] == reference
        assert cold["summary"]["cached"] == {}
        held = lambda: residency(cluster.index.base_url, compat, PROMPT, a.base_url)  # noqa: E731
        await eventually(held, [["device", [0, 19]], ["host", [20, 29]]])
        warm = await generate(a.base_url, PROMPT, 24)
        assert warm["tokens"] == reference
        assert warm["summary"]["cached"] == {"g1": 48}
        await generate(a.base_url, other, 24)  # 4 new blocks: G1's least recent go to G2
        await eventually(held, [["host", [0, 29]]])
        again = await generate(a.base_url, PROMPT, 24)
        assert again["tokens"] == reference
        assert again["summary"]["cached"] == {"g2": 48}
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(a.base_url + "metrics")).text
        assert 'kvsp_holder_demotions_total{tier="device"}' in metrics
    assert a.log.count(b"Traceback") == 0


async def _first_token_seconds(base: str, tokens: list[int]) -> tuple[float, dict[str, Any]]:
    """Seconds until the first token line of a generate arrives, and the final summary."""
    body = {"tenant": "acme", "tokens": tokens, "max_tokens": 2}
    async with httpx.AsyncClient(timeout=120) as http:
        start = asyncio.get_running_loop().time()
        first = None
        async with http.stream("POST", base + "generate", json=body) as response:
            async for line in response.aiter_lines():
                first = first or asyncio.get_running_loop().time() - start
                doc = json.loads(line)
        return first or 0.0, doc


async def test_a_remotely_cached_prefix_is_faster_than_recomputing_it(
    tmp_path: Path, compat: str
) -> None:
    long_prompt = (PROMPT * 8)[:400]
    cluster = Cluster(tmp_path, compat)
    a, b = cluster.instance(), cluster.instance()
    with running(cluster.index, cluster.holder, a, b):
        cold, summary = await _first_token_seconds(a.base_url, long_prompt)
        assert summary["cached_tokens"] == 0
        for _ in range(50):  # the blocks' records reach the IS
            warm, summary = await _first_token_seconds(b.base_url, long_prompt)
            if summary["cached_tokens"]:
                break
            await asyncio.sleep(0.1)
        assert summary["cached_tokens"] == 384
        assert warm < 0.5 * cold, (warm, cold)  # a ratio within one run, not a time
