"""The Placement Controller over HTTP, in this event loop: a real (in-process) Index Service,
stand-in instances served by uvicorn, and the controller's own routes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvsp.auth import Principals
from kvsp.controller.app import create_app
from kvsp.controller.service import ControllerConfig, ControllerService
from kvsp.controller.stores import ControlStore, RedisControlStore
from kvsp.core.clock import ManualClock
from kvsp.core.ids import tenant_session
from kvsp.core.keys import block_keys
from kvsp.core.records import ReplicaRecord
from kvsp.index.app import create_app as create_index_app
from kvsp.index.client import IndexClient
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from kvsp.tenants import Tenants
from tests.controller.factories import SESSION
from tests.controller.standin import StandIn
from tests.index.factories import COMPAT, H1, replica
from tests.principals import principal
from tests.servers import serving

pytestmark = pytest.mark.anyio

SCOPE_KEY = "11" * 32
TOKENS = list(range(1000, 1080))  # 5 blocks of 16
INDEX = "http://index.test/kvsp/"


def principals(i1: str, i2: str, i3: str) -> str:
    return "\n".join(
        [
            principal("op", ["controller"]),
            principal("scraper", ["metrics"]),
            principal("pc", ["controller"], ["*"]),
            principal("h1", ["holder"], [H1]),
            principal("router", ["router"]),
            principal("i1", ["instance"], [i1]),
            principal("i2", ["instance"], [i2]),
            principal("i3", ["instance"], [i3]),
        ]
    )


class Env:
    def __init__(
        self,
        urls: list[str],
        stand_ins: list[StandIn],
        store: ControlStore | None = None,
        me: str = "",
    ) -> None:
        self.urls = urls
        self.stand_ins = dict(zip(urls, stand_ins, strict=True))
        self.clock = ManualClock()
        self.principals = Principals.parse(principals(*urls))
        index = IndexService(MemoryReplicaStore(self.clock, IndexLimits(max_ttl_ms=600_000)))
        self.index_transport = httpx.ASGITransport(app=create_index_app(index, self.principals))
        tenants = Tenants.parse(
            f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{COMPAT}"]\n'
        )
        self.tenant = tenants.get("acme")
        self.service = ControllerService(
            ControllerConfig(tenants=tenants, url=me, lease_ms=300),
            self.clock,
            IndexClient(INDEX, "pc", transport=self.index_transport),
            store=store,
        )
        self.app = create_app(self.service, self.principals)
        self.http: httpx.AsyncClient

    def keys(self) -> list[str]:
        return [
            k.hex() for k in block_keys(bytes.fromhex(SCOPE_KEY), bytes.fromhex(COMPAT), TOKENS, 16)
        ]  # type: ignore[arg-type]

    async def publish(
        self, blocks: int, holder: str = H1, token: str = "h1", tier: str = "host"
    ) -> None:
        h1 = IndexClient(INDEX, token, transport=self.index_transport)
        residency = [{"tier": tier, "layers": [0, 1]}]
        records = [
            ReplicaRecord.parse(
                {
                    **replica(0, holder).to_json(),
                    "block_key": key,
                    "scope_id": self.tenant.scope_id,
                    "residency": residency,
                }
            )
            for key in self.keys()[:blocks]
        ]
        await h1.batch(put=records)

    async def call(
        self, method: str, path: str, token: str = "op", body: Any = None
    ) -> httpx.Response:
        return await self.http.request(
            method,
            path,
            json=body,
            headers={"authorization": f"Bearer {token}"},
        )

    async def report(self, n: int, **changes: Any) -> httpx.Response:
        doc: dict[str, Any] = {
            "instance": self.urls[n],
            "epoch": 1,
            "state": "active",
            "running": 0,
            "queued": 0,
            "batch_size": 8,
            "kv_utilization": 0.1,
            "prefill_tokens_per_s": 400,
            "decode_tokens_per_s": 15,
            "ttl_ms": 3_000,
            **changes,
        }
        return await self.call("PUT", "status", f"i{n + 1}", doc)

    async def place(self, **extra: Any) -> dict[str, Any]:
        body = {"tenant": "acme", "compat_id": COMPAT, "tokens": TOKENS, **extra}
        response = await self.call("POST", "place", body=body)
        assert response.status_code == 200, response.text
        doc: dict[str, Any] = response.json()
        return doc


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    stand_ins = [StandIn(), StandIn(), StandIn(ack_reshard=False)]
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(s.app)) for s in stand_ins]
        e = Env(urls, stand_ins)
        base = await stack.enter_async_context(serving(e.app))
        e.http = await stack.enter_async_context(httpx.AsyncClient(base_url=base))
        yield e


LINK = [{"holder": H1, "mbit_per_s": 10_000, "rtt_us": 50}]


async def test_status_answers_the_state_and_refuses_stale_epochs(env: Env) -> None:
    assert (await env.report(0, epoch=5)).json() == {"state": "active"}
    stale = await env.report(0, epoch=4)
    assert stale.status_code == 409
    assert stale.json()["type"].endswith("#kvsp-stale-epoch")
    other = await env.call("PUT", "status", "i2", {**(await env.report(1)).json()})
    assert other.status_code == 400  # not a status record at all
    forged = await env.http.put(
        "status",
        json={"instance": env.urls[0], "epoch": 9, "state": "active", "running": 0, "queued": 0,
              "batch_size": 8, "kv_utilization": 0.1, "prefill_tokens_per_s": 400,
              "decode_tokens_per_s": 15, "ttl_ms": 3000},
        headers={"authorization": "Bearer i2"},
    )  # fmt: skip
    assert forged.status_code == 403
    view = (await env.call("GET", "instances")).json()["instances"]
    assert [(i["instance"], i["epoch"]) for i in view] == [(env.urls[0], 5), (env.urls[1], 1)]


async def test_placement_prefers_the_instance_that_can_load_the_prefix_and_prefetches(
    env: Env,
) -> None:
    await env.publish(4)
    await env.report(0, links=LINK)
    await env.report(1)
    doc = await env.place(wait_prefetch=True)
    assert doc["outcome"] == "placed"
    assert doc["instance"] == env.urls[0]
    assert doc["matched_blocks"] == 4
    assert doc["prefetch"] == {
        "directive": doc["prefetch"]["directive"],
        "state": "complete",
        "loaded": 4,
    }
    (directive,) = env.stand_ins[env.urls[0]].of("prefetch")
    assert [b["block_key"] for b in directive["blocks"]] == env.keys()[:4]
    assert directive["blocks"][0]["sources"] == [H1]
    assert directive["scope_id"] == env.tenant.scope_id
    assert env.stand_ins[env.urls[1]].of("prefetch") == []
    costs = {c["instance"]: c["cost_us"] for c in doc["candidates"]}
    assert costs[env.urls[0]] < costs[env.urls[1]] == 200_000  # 80 tokens at 400/s
    measured = await env.call("PUT", f"decisions/{doc['decision']}/ttft", body={"ttft_us": 50_000})
    predicted = costs[env.urls[0]]
    assert measured.json() == {"predicted_us": predicted, "measured_us": 50_000}
    again = await env.call("PUT", f"decisions/{doc['decision']}/ttft", body={"ttft_us": 1})
    assert again.status_code == 404  # reported once
    bad = await env.call("PUT", "decisions/x/ttft", body={"ttft_us": -1})
    assert bad.status_code == 400
    metrics = (await env.call("GET", "metrics", "scraper")).text
    assert 'kvsp_controller_placements_total{outcome="placed"} 1.0' in metrics
    assert "kvsp_controller_measured_ttft_seconds_count 1.0" in metrics
    assert "kvsp_controller_ttft_measured_over_predicted_count 1.0" in metrics


async def test_6_3_a_drained_instance_gets_no_requests_and_a_sleeping_one_is_woken(
    env: Env,
) -> None:
    await env.publish(4)
    await env.report(0, links=LINK)
    await env.report(1)
    changed = await env.call(
        "PUT", "instances/state", body={"instance": env.urls[0], "state": "draining"}
    )
    assert changed.status_code == 200
    assert env.stand_ins[env.urls[0]].of("state") == [{"state": "draining"}]
    assert (await env.place())["instance"] == env.urls[1]
    # I2 asks to sleep; it is the last active one, so it must stay
    assert (await env.report(1, requested_state="sleeping")).json() == {"state": "active"}
    await env.report(0, state="sleeping", running=0)  # drained: now asleep
    doc = await env.place(wait_prefetch=True)
    assert doc["instance"] == env.urls[1]
    forbidden = await env.call(
        "PUT", "instances/state", "i1", {"instance": env.urls[0], "state": "active"}
    )
    assert forbidden.status_code == 403


async def test_a_sleeping_instance_is_woken_when_nothing_active_is_acceptable(env: Env) -> None:
    await env.publish(4)
    await env.report(0, state="sleeping", links=LINK)
    doc = await env.place()
    assert doc["outcome"] == "wake"
    assert doc["instance"] == env.urls[0]
    assert env.stand_ins[env.urls[0]].of("state") == [{"state": "active"}]
    assert len(env.stand_ins[env.urls[0]].of("prefetch")) == 1  # sent at once
    assert (await env.report(0, state="active", links=LINK)).json() == {"state": "active"}


async def test_6_8_checkpoints_failover_and_old_epochs(env: Env) -> None:
    await env.report(0)
    await env.report(1, queued=3)
    doc = await env.place(
        session=SESSION, sampler={"method": "top-k", "params": {"k": 5}, "seed": 3}
    )
    assert doc["instance"] == env.urls[0]
    assert doc["session_epoch"] == 0
    sid = doc["session"]  # the tenant's name for it, namespaced
    assert sid == tenant_session(env.tenant.scope_id, SESSION) != SESSION
    sampler = {"method": "top-k", "params": {"k": 5}, "seed": 3, "step": 3}
    checkpoint = {
        "session": sid, "epoch": 0, "compat_id": COMPAT, "scope_id": env.tenant.scope_id,
        "prompt_blocks": env.keys(), "prompt_tail": [], "generated": [5, 6, 7],
        "output_offset": 3, "sampler": sampler,
    }  # fmt: skip
    answer = await env.call("PUT", f"sessions/{sid}/checkpoint", "i1", checkpoint)
    assert answer.json() == {"recorded": True, "acknowledged": 3, "epoch": 0}
    # I1 stops reporting: its status expires and the session moves to I2 with epoch 1
    env.clock.advance(2_000)
    await env.report(1, queued=3)
    env.clock.advance(1_000)
    await env.service.tick()
    (resume,) = env.stand_ins[env.urls[1]].of("resume")
    assert resume["epoch"] == 1
    assert resume["generated"] == [5, 6, 7]
    assert resume["sampler"]["seed"] == 3
    session = (await env.call("GET", f"sessions/{sid}")).json()
    assert (session["instance"], session["epoch"], session["failovers"]) == (env.urls[1], 1, 1)
    late = await env.call(
        "PUT",
        f"sessions/{sid}/checkpoint",
        "i1",
        {**checkpoint, "generated": [5, 6, 7, 8], "output_offset": 4},
    )
    assert late.status_code == 409
    assert late.json()["type"].endswith("#kvsp-stale-epoch")
    fresh = {**checkpoint, "epoch": 1, "generated": [5, 6, 7, 8], "output_offset": 4}
    accepted = await env.call("PUT", f"sessions/{sid}/checkpoint", "i2", fresh)
    assert accepted.json()["epoch"] == 1
    nobody = "00000000-0000-4000-8000-000000000000"
    unknown = await env.call(
        "PUT", f"sessions/{nobody}/checkpoint", "i1", {**checkpoint, "session": nobody}
    )
    assert unknown.status_code == 404
    metrics = (await env.call("GET", "metrics", "scraper")).text
    assert 'kvsp_controller_failovers_total{result="resumed"} 1.0' in metrics


async def test_6_9_reshard_commits_when_all_acknowledge_and_aborts_otherwise(env: Env) -> None:
    i1, i2, i3 = env.urls
    v1 = {"map": "m", "version": 1, "shards": [{"tokens": [0, 100], "instance": i1},
                                               {"tokens": [100, 200], "instance": i2}]}  # fmt: skip
    assert (await env.call("POST", "shards", body=v1)).status_code == 201
    gap = {"map": "g", "version": 1, "shards": [{"tokens": [0, 10], "instance": i1},
                                                {"tokens": [20, 30], "instance": i2}]}  # fmt: skip
    assert (await env.call("POST", "shards", body=gap)).status_code == 400
    done = await env.call(
        "POST", "shards/m/reshard", body={"instances": [i2, i1], "deadline_ms": 2000}
    )
    assert done.json()["committed"] is True
    assert done.json()["version"] == 2
    plans = {u: [b for b in env.stand_ins[u].of("reshard") if "from" in b] for u in (i1, i2)}
    assert all(len(p) == 1 for p in plans.values())
    assert {"map": "m", "commit": 2} in env.stand_ins[i1].of("reshard")
    # a member that cannot load its part: the reshard aborts and version 2 stays
    failing = await env.call("POST", "shards/m/reshard", body={"instances": [i1, i2, i3]})
    assert failing.json()["committed"] is False
    assert {"map": "m", "abort": 3} in env.stand_ins[i1].of("reshard")
    current = (await env.call("GET", "shards/m")).json()
    assert current["map"]["version"] == 2
    assert current["in_flight"] is None


async def test_bad_requests_are_problems(env: Env) -> None:
    assert (
        await env.call(
            "POST", "place", body={"tenant": "nobody", "compat_id": COMPAT, "tokens": [1]}
        )
    ).status_code == 403  # as for a tenant the principal may not act for: names stay hidden
    other_compat = {"tenant": "acme", "compat_id": "ab" * 32, "tokens": [1]}
    assert (await env.call("POST", "place", body=other_compat)).status_code == 403
    assert (
        await env.call(
            "POST", "place", "i1", {"tenant": "acme", "compat_id": COMPAT, "tokens": [1]}
        )
    ).status_code == 403
    assert (await env.http.post("place", json={})).status_code == 401
    assert (
        await env.call(
            "POST", "place", body={"tenant": "acme", "compat_id": COMPAT, "tokens": [-1]}
        )
    ).status_code == 400
    assert (await env.call("GET", f"sessions/{SESSION}")).status_code == 404


class Launcher:
    """Starts an instance by handing out the URL of a stand-in that is already serving."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.launched = 0

    async def launch(self) -> str | None:
        self.launched += 1
        return self.url


async def test_6_4_a_new_instance_is_launched_and_sent_a_prefetch_directive_at_once(
    env: Env,
) -> None:
    await env.publish(4)
    launcher = Launcher(env.urls[2])
    env.service.launcher = launcher
    env.service.config = dataclasses.replace(
        env.service.config,
        placement=dataclasses.replace(env.service.config.placement, can_launch=True),
    )
    doc = await env.place()
    assert doc["outcome"] == "launch"
    assert doc["instance"] == env.urls[2]
    assert launcher.launched == 1
    (directive,) = env.stand_ins[env.urls[2]].of("prefetch")
    assert [b["block_key"] for b in directive["blocks"]] == env.keys()[:4]


async def test_a_peer_failing_background_work_is_logged_not_left_in_a_task(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    await env.report(0)
    doc = await env.place(session=SESSION)
    assert doc["instance"] == env.urls[0]
    sid = doc["session"]
    # the stand-in has no session route: ending the session there fails in the background
    assert (await env.call("POST", f"sessions/{sid}/forget")).json() == {"forgotten": True}
    while len(env.service._later):
        await asyncio.sleep(0.01)
    gc.collect()  # an exception nobody retrieved would be reported now
    await asyncio.sleep(0)
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvsp.controller"]
    assert any(f"session {sid} not ended at {env.urls[0]}" in w for w in warnings)
    assert not [r for r in caplog.records if r.name == "asyncio"]


async def test_status_is_answered_without_waiting_for_a_slow_index(env: Env) -> None:
    """The IS hears of statuses in the background, newest first: an IS that hangs never makes
    an instance's status late (which used to make a live instance failed)."""
    forwarder = env.service.forwarder
    assert forwarder is not None
    hang = asyncio.Event()
    sent: list[int] = []

    async def stuck(status: Any) -> None:
        sent.append(status.queued)
        await hang.wait()

    forwarder._send = stuck
    await env.report(0, queued=1)
    for queued in (2, 3, 4):
        started = asyncio.get_running_loop().time()
        assert (await env.report(0, queued=queued)).status_code == 200
        assert asyncio.get_running_loop().time() - started < 1.0
    assert sent == [1]  # the first is being sent; of the rest only the newest waits
    assert len(forwarder) == 1
    hang.set()
    for _ in range(100):
        if sent == [1, 4]:
            break
        await asyncio.sleep(0.01)
    assert sent == [1, 4]


async def test_a_failed_wake_sends_no_work_and_leaves_the_instance_asleep(env: Env) -> None:
    await env.publish(4)
    await env.report(0, state="sleeping", links=LINK)
    sleeper = env.stand_ins[env.urls[0]]
    sleeper.refuse_state = True
    doc = await env.place()
    assert doc["outcome"] == "none"
    assert doc["instance"] is None
    assert "wake" in doc["reason"]
    assert sleeper.of("prefetch") == []
    # the table was never changed: the instance's next sleeping status is accepted
    assert (await env.report(0, state="sleeping")).json() == {"state": "sleeping"}


async def test_a_restart_fails_the_old_epochs_sessions_over_at_once(env: Env) -> None:
    await env.report(0)
    await env.report(1, queued=3)
    doc = await env.place(session=SESSION)
    assert doc["instance"] == env.urls[0]
    sid = doc["session"]
    # I1 restarts (a higher epoch) long before its old status expires
    assert (await env.report(0, epoch=2, queued=5)).json() == {"state": "active"}
    for _ in range(200):  # moved (the epoch written first), then resumed there
        session = (await env.call("GET", f"sessions/{sid}")).json()
        resumed = [s for s in env.stand_ins.values() if s.of("resume")]
        if session["epoch"] == 1 and resumed:
            break
        await asyncio.sleep(0.01)
    assert session["epoch"] == 1
    assert len(resumed) == 1


async def test_a_failover_its_leader_died_in_is_finished_by_the_next_leader(
    redis_url: str,
) -> None:
    """The leader takes a restart, writes the failed epoch's sessions as pending with the new
    epoch, moves one and dies while its resume is unanswered: the next leader moves it on."""
    stand_ins = [StandIn(), StandIn(), StandIn()]
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    stores = [RedisControlStore(redis_url, prefix=prefix) for _ in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(s.app)) for s in stand_ins]
        old, new = (Env(urls, stand_ins, stores[n], f"http://pc{n}.test/kvsp/") for n in (0, 1))
        for e in (old, new):
            e.http = await stack.enter_async_context(
                httpx.AsyncClient(base_url=await stack.enter_async_context(serving(e.app)))
            )
        await old.service.lead.step()
        await old.report(0)
        await old.report(1, queued=3)
        sid = (await old.place(session=SESSION))["session"]
        for s in stand_ins:
            s.resume_delay_s = 2.0
        assert (await old.report(0, epoch=2, queued=5)).json() == {"state": "active"}
        stored = {s.session: s for s in (await stores[2].load()).sessions}
        assert stored[sid].pending  # written with the new epoch, before any move
        while not any(s.of("resume") for s in stand_ins):
            await asyncio.sleep(0.01)
        for task in old.service._tasks:  # dies mid-resume: no renewal, its lease runs out
            task.cancel()
        await old.service._later.cancel()
        for s in stand_ins:
            s.resume_delay_s = 0.0
        for _ in range(100):
            await new.service.lead.step()
            if new.service.lead.leading():
                break
            await asyncio.sleep(0.05)
        for _ in range(200):
            doc = (await new.call("GET", f"sessions/{sid}")).json()
            if doc["epoch"] == 2:
                break
            await asyncio.sleep(0.01)
        assert doc["epoch"] == 2  # moved on from the old leader's move, once
        assert sum(len(s.of("resume")) for s in stand_ins) == 2
        for _ in range(100):
            stored = {s.session: s for s in (await stores[2].load()).sessions}
            if not stored[sid].pending:
                break
            await asyncio.sleep(0.01)
        assert not stored[sid].pending
        assert (stored[sid].epoch, stored[sid].instance) == (2, doc["instance"])
    for store in stores:
        await store.close()


async def test_4_4_a_greedy_session_is_deterministic_only_among_identical_engines(
    env: Env,
) -> None:
    same = "kvsp 0.1.0; transformers 4.57.1; torch 2.13.0; cpu float32; threads 2"
    other = "kvsp 0.1.0; vllm 0.32.0; torch 2.13.0; cpu float32 eager; pages 16"
    await env.report(0, engine=same)
    await env.report(1, engine=same, queued=3)
    doc = await env.place(session=SESSION)  # greedy, deterministic as asked
    assert (doc["sampler"]["method"], doc["sampler"]["deterministic"]) == ("greedy", True)
    await env.report(2, engine=other, queued=3)  # a different engine could now resume it
    gated = await env.place(session="another-session")
    assert (gated["sampler"]["method"], gated["sampler"]["deterministic"]) == ("greedy", False)
    # the deterministic session fails over only to the identical engine, never to the other
    env.clock.advance(2_000)
    await env.report(1, engine=same, queued=3)
    await env.report(2, engine=other)
    env.clock.advance(1_000)
    await env.service.tick()
    moved = (await env.call("GET", f"sessions/{doc['session']}")).json()
    assert moved["instance"] == env.urls[1]  # busier, but the same engine
    resumed_at_other = [r["session"] for r in env.stand_ins[env.urls[2]].of("resume")]
    assert resumed_at_other == [gated["session"]]  # its tokens waited for acks: it may go


async def test_the_router_query_answers_each_instances_longest_prefix_per_medium(
    env: Env,
) -> None:
    await env.publish(4)  # the offload holder: host memory
    await env.publish(3, env.urls[0], "i1", "device")
    await env.publish(2, env.urls[1], "i2", "host")
    await env.report(0, links=LINK)
    await env.report(1, links=LINK)
    body = {"tenant": "acme", "token_ids": TOKENS}
    response = await env.call("POST", "query", "router", body)
    assert response.status_code == 200, response.text
    doc = response.json()
    assert (doc["model"], doc["block_tokens"], doc["prompt_tokens"]) == (COMPAT, 16, 80)
    assert doc["matched_blocks"] == 4
    i1, i2 = doc["instances"][env.urls[0]], doc["instances"][env.urls[1]]
    # tokens, cumulative (gpu <= cpu <= disk), as Mooncake's indexer API and Dynamo answer
    assert {k: i1[k] for k in ("longest_matched", "gpu", "cpu", "disk")} == {
        "longest_matched": 48, "gpu": 48, "cpu": 48, "disk": 48
    }  # fmt: skip
    assert (i2["gpu"], i2["cpu"], i2["disk"], i2["dp"]) == (0, 32, 32, {"0": 0})
    # and what serving it there would cost: i1 has 3 blocks, loads the 4th from H1
    assert 0 < i1["fetch_us"] < i2["fetch_us"]
    assert i1["recompute_us"] == 40_000  # 16 tokens at 400/s
    assert doc["holders"] == {H1: {"longest_matched": 64, "gpu": 0, "cpu": 64, "disk": 64}}
    # text needs a tokenizer (this controller has none); a bad body is a problem
    text = await env.call("POST", "query", "router", {"tenant": "acme", "text": "hello"})
    assert text.status_code == 400
    both = await env.call("POST", "query", "router", {**body, "text": "x"})
    assert both.status_code == 400
    # only the router role may ask
    assert (await env.call("POST", "query", "op", body)).status_code == 403
