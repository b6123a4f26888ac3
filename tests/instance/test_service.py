"""The instance service in process, on the real model, with a controller stand-in that decides
how far checkpoints are acknowledged: the release gate (KVSP 6.8), resuming a checkpoint that
ends on a block boundary (4.4), no new or resumed session while draining (6.3), the engine's
real queue in the status record (6.4), and a prefetch from a source that never finishes
sending, which must not hold up the requests being served (6.5)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsp.auth import Principal, Principals, Role
from kvsp.core.clock import SystemClock
from kvsp.core.problems import PROBLEM_TYPE_BASE, NotAccepting, RecordError
from kvsp.core.records import (
    InstanceState,
    PrefetchDirective,
    PrefetchState,
    ReplicaRecord,
    Sampler,
    SessionCheckpoint,
)
from kvsp.index.app import create_app as create_index_app
from kvsp.index.client import IndexClient
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from kvsp.instance.app import create_app as create_instance_app
from kvsp.instance.config import InstanceConfig
from kvsp.instance.service import InstanceService
from kvsp.instance.sessions import Session, TokenEvent
from kvsp.model import ModelFiles
from kvsp.tenants import Tenants
from tests.servers import free_port, serving

pytestmark = pytest.mark.anyio

SCOPE_KEY = "77" * 32
#: 32 tokens of a story: exactly two blocks of 16
PROMPT = [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28, 665, 4161, 354,
          1573, 43663, 3365, 8581, 30, 5081, 5738, 384, 13197, 1187, 288, 260, 28899, 28, 12775,
          650]  # fmt: skip
CONTROLLER = Principal("pc", frozenset({Role.CONTROLLER}), frozenset({"*"}), frozenset({"*"}))
TOP_P = Sampler(method="top-p", params={"p": 0.9}, seed=7)


class SlowSource:
    """A holder that grants leases at once and sends no block until ``stop`` is set."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stop = asyncio.Event()
        self.app = Starlette(
            routes=[
                Route("/kvsp/leases", self.lease, methods=["POST"]),
                Route("/kvsp/leases/{lease}", self.release, methods=["DELETE"]),
                Route("/kvsp/blocks/{compat}/{scope}/{key}", self.block, methods=["GET"]),
            ]
        )

    async def lease(self, request: Request) -> Response:
        ttl = json.loads(await request.body())["ttl_ms"]
        self.calls.append("lease")
        return JSONResponse({"lease": "l1", "ttl_ms": ttl}, status_code=201)

    async def release(self, request: Request) -> Response:
        self.calls.append("release")
        return Response(status_code=204)

    async def block(self, request: Request) -> Response:
        self.calls.append("get")
        await self.stop.wait()
        return JSONResponse({"status": 404}, status_code=404)


class Controller:
    """Answers status reports with ``active`` and checkpoints with an acknowledged offset of at
    most ``limit`` (None: everything the checkpoint covers), recording every checkpoint."""

    def __init__(self) -> None:
        self.limit: int | None = 0
        #: answer checkpoints as a controller that failed their sessions over
        self.moved = False
        self.checkpoints: list[dict[str, Any]] = []
        self.app = Starlette(
            routes=[
                Route("/kvsp/status", self.status, methods=["PUT"]),
                Route("/kvsp/sessions/{session}/checkpoint", self.checkpoint, methods=["PUT"]),
            ]
        )

    async def status(self, request: Request) -> Response:
        await request.body()
        return JSONResponse({"state": "active"})

    async def checkpoint(self, request: Request) -> Response:
        doc = json.loads(await request.body())
        self.checkpoints.append(doc)
        if self.moved:
            problem = {"type": PROBLEM_TYPE_BASE + "kvsp-stale-epoch", "status": 409}
            return JSONResponse(problem, 409, media_type="application/problem+json")
        offset = doc["output_offset"]
        acknowledged = offset if self.limit is None else min(offset, self.limit)
        return JSONResponse({"recorded": True, "acknowledged": acknowledged, "epoch": doc["epoch"]})


@pytest.fixture
async def cluster(model_files: ModelFiles) -> AsyncIterator[tuple[InstanceService, Controller]]:
    controller = Controller()
    async with serving(controller.app) as base:
        compat = model_files.compat_id.hex()
        tenants = Tenants.parse(
            f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{compat}"]\n'
        )
        config = InstanceConfig(
            url=f"http://127.0.0.1:{free_port()}/kvsp/",
            tenants=tenants,
            controller_url=base,
            release_batch=2,
            threads=2,
        )
        instance = InstanceService(config, model_files)
        await instance.start()
        try:
            yield instance, controller
        finally:
            await instance.close()


async def released(instance: InstanceService, session: Session) -> list[int]:
    """Every token the session releases, until its stream ends."""
    out = []
    async for event in instance.stream(session.session, 0, CONTROLLER):
        if isinstance(event, TokenEvent):
            out.append(event.token)
    return out


async def until(condition: Any, what: str, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)
    assert condition(), what


async def test_no_token_of_a_non_deterministic_sampler_is_released_before_its_ack(
    cluster: tuple[InstanceService, Controller],
) -> None:
    instance, controller = cluster
    got = {}
    for limit in (0, 5, None):  # the controller acknowledges nothing, 5 tokens, everything
        controller.limit = limit
        session = await instance.generate(CONTROLLER, "acme", PROMPT, TOP_P, 8)
        got[limit] = await released(instance, session)
        assert len(session.generated) == 8
        assert session.error is None
        offsets = [c["output_offset"] for c in controller.checkpoints]
        assert offsets[-1] == 8  # its checkpoints covered every token
        controller.checkpoints.clear()
    # the same seed draws the same tokens; each stream stops where the acknowledgement does
    assert len(got[None]) == 8
    assert got[0] == []
    assert got[5] == got[None][:5]


async def test_a_session_whose_checkpoint_finds_its_epoch_over_ends_as_moved(
    cluster: tuple[InstanceService, Controller],
) -> None:
    """The controller failed the session over before this instance heard of it: the stream
    ends saying the session moved (the front end follows it), not with tokens that no
    controller acknowledged."""
    instance, controller = cluster
    controller.moved = True
    session = await instance.generate(CONTROLLER, "acme", PROMPT, TOP_P, 4)
    events = [e async for e in instance.stream(session.session, 0, CONTROLLER)]
    summary = events[-1]
    assert isinstance(summary, dict)
    assert (summary["moved"], summary["error"]) == (True, None)
    assert controller.checkpoints


async def test_a_checkpoint_on_a_block_boundary_resumes_to_the_same_tokens(
    cluster: tuple[InstanceService, Controller],
) -> None:
    instance, controller = cluster
    controller.limit = None
    greedy = Sampler(method="greedy", deterministic=True)
    first = await instance.generate(CONTROLLER, "acme", PROMPT, greedy, 6)
    expected = await released(instance, first)
    assert len(expected) == 6
    # the prompt of 32 tokens is two blocks and an empty tail (KVSP 4.4)
    start = instance.sessions[first.session].checkpoint(instance.compat_id)
    assert start.output_offset == 6
    assert start.prompt_tail == ()
    boundary = start.model_copy(
        update={"epoch": 1, "generated": (), "output_offset": 0, "last_block": None}
    )
    boundary = SessionCheckpoint.parse(boundary.to_json())
    assert len(boundary.prompt_blocks) == 2
    with pytest.raises(RecordError, match="last_block"):  # the text's members alone
        await instance.resume(CONTROLLER, boundary, 6)
    boundary = boundary.model_copy(update={"last_block": tuple(PROMPT[16:])})
    resumed = await instance.resume(CONTROLLER, boundary, 6)
    assert await released(instance, resumed) == expected
    assert resumed.cached.get("g1", 0) + resumed.cached.get("g2", 0) == 16  # block 0 reused
    # its checkpoints keep the prompt as the text writes it
    latest = controller.checkpoints[-1]
    assert (latest["epoch"], latest["prompt_tail"], latest["output_offset"]) == (1, [], 6)


async def test_a_draining_instance_takes_no_new_or_resumed_session(
    cluster: tuple[InstanceService, Controller],
) -> None:
    instance, controller = cluster
    controller.limit = None
    session = await instance.generate(CONTROLLER, "acme", PROMPT, TOP_P, 40)
    assert instance.set_state(CONTROLLER, InstanceState.DRAINING) is InstanceState.DRAINING
    resume = session.checkpoint(instance.compat_id).model_copy(update={"epoch": 1})
    with pytest.raises(NotAccepting) as refused:
        await instance.resume(CONTROLLER, resume, 4)
    assert refused.value.status == 409
    assert refused.value.to_problem()["type"].endswith("#kvsp-not-accepting")
    with pytest.raises(NotAccepting):
        await instance.generate(CONTROLLER, "acme", PROMPT, TOP_P, 4)
    await until(lambda: session.done, "the session in flight completes")
    assert len(session.generated) == 40
    assert session.error is None


async def test_the_status_reports_the_sessions_waiting_for_the_engine(
    cluster: tuple[InstanceService, Controller],
) -> None:
    instance, controller = cluster
    controller.limit = None
    long_prompt = PROMPT * 12  # a few engine steps of prefill each
    sessions = [
        await instance.generate(CONTROLLER, "acme", long_prompt[i:], TOP_P, 4) for i in range(4)
    ]
    status = instance.status()
    assert status.running == 4
    assert status.queued + status.batch_size == 4
    assert status.queued >= 1  # one engine thread: not all four can have begun yet
    await until(lambda: all(s.done for s in sessions), "done")
    status = instance.status()
    assert (status.running, status.queued, status.batch_size) == (0, 0, 0)


async def test_a_prefetch_that_stalls_does_not_hold_up_the_requests_being_served(
    model_files: ModelFiles,
) -> None:
    source = SlowSource()
    store = MemoryReplicaStore(SystemClock(), IndexLimits())
    index = IndexService(store)
    index_app = create_index_app(index, Principals.development_mode())
    async with serving(source.app) as holder, serving(index_app) as index_url:
        compat = model_files.compat_id.hex()
        tenants = Tenants.parse(
            f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{compat}"]\n'
        )
        scope = tenants.get("acme").scope_id
        key = "ab" * 32
        record = ReplicaRecord.parse(
            {
                "block_key": key, "compat_id": compat, "scope_id": scope, "holder": holder,
                "codec": 1, "size": 1000, "digest": "sha-256:" + "00" * 32,
                "residency": [{"tier": "host", "layers": [0, 29]}], "ttl_ms": 60_000,
            }
        )  # fmt: skip
        async with IndexClient(index_url) as publisher:
            await publisher.publish(record)
        config = InstanceConfig(
            url=f"http://127.0.0.1:{free_port()}/kvsp/",
            tenants=tenants,
            index_url=index_url,
            threads=2,
        )
        instance = InstanceService(config, model_files)
        await instance.start()
        try:
            # it tells the IS what its Compatibility ID stands for (KVSP 4.1, for 6.2's estimates)
            await until(lambda: compat in store.descriptors, "the descriptor is registered")
            directive = PrefetchDirective.model_validate(
                {
                    "directive": str(uuid.uuid4()),
                    "scope_id": scope,
                    "compat_id": compat,
                    "blocks": [{"block_key": key, "sources": [holder]}],
                    "deadline_ms": 20_000,
                    "lease_ms": 20_000,
                }
            )
            await instance.prefetch(CONTROLLER, directive)
            await until(lambda: "get" in source.calls, "the prefetch is loading")
            greedy = Sampler(method="greedy", deterministic=True)
            session = await instance.generate(CONTROLLER, "acme", PROMPT, greedy, 8)
            async with asyncio.timeout(15):  # far inside the directive's deadline
                tokens = await released(instance, session)
            assert len(tokens) == 8
            # the directive is still loading, under a lease at its source (KVSP 6.5)
            assert instance.prefetch_status(directive.directive).state is PrefetchState.PENDING
            assert source.calls == ["lease", "get"]
        finally:
            source.stop.set()
            await instance.close()


@pytest.mark.parametrize(
    "query",
    ["events?wait_ms=%C2%B2", "events?after=%D9%A1", "events?limit=-1", "events?after=1e3",
     "sessions/s1/tokens?from=%C2%B2", "sessions/s1/tokens?from=x"],
)  # fmt: skip
async def test_a_number_in_the_query_is_ascii_digits_or_a_400(
    cluster: tuple[InstanceService, Controller], query: str
) -> None:
    """Superscripts and other scripts' digits pass ``str.isdigit``: they must not reach ``int``
    (an internal error) nor be read as a number nobody wrote."""
    instance, _ = cluster
    app = create_instance_app(instance, Principals.development_mode())
    async with serving(app) as base, httpx.AsyncClient() as http:
        response = await http.get(base + query)
    assert response.status_code == 400, response.text
    assert response.json()["type"].endswith("#kvsp-invalid-input")
