"""The Index Service client keeps an answer to what it asked: an IS that errs or lies (records
of another block, scope or Compatibility ID, more keys than asked) costs a recompute, never a
wrong block in a cache."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp.core.records import LookupRequest, LookupResponse
from kvsp.index.client import IndexClient
from tests.index.factories import COMPAT, SCOPE_A, SCOPE_B, keys, replica
from tests.servers import serving

pytestmark = pytest.mark.anyio


def lying_index(answer: LookupResponse) -> Starlette:
    async def lookup(request: Request) -> Response:
        return Response(answer.model_dump_json(exclude_none=True), media_type="application/json")

    return Starlette(routes=[Route("/kvsp/lookup", lookup, methods=["POST"])])


async def test_records_the_client_did_not_ask_for_are_never_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answer = LookupResponse(
        matched=4,
        replicas=(
            (replica(0),),
            (replica(7), replica(1)),  # another key first, then the one asked
            (replica(2, scope=SCOPE_B),),  # another tenant's block: the prefix ends here
            (replica(3),),
        ),
    )
    asked = LookupRequest(scope_id=SCOPE_A, compat_id=COMPAT, block_keys=tuple(keys(0, 1, 2, 3)))
    async with serving(lying_index(answer)) as url, IndexClient(url, "pc") as client:
        with caplog.at_level(logging.WARNING, logger="kvsp.index"):
            kept = await client.lookup(asked)
    assert kept.replicas == ((replica(0),), (replica(1),))
    assert [r.getMessage() for r in caplog.records] == [
        "the index answered blocks not asked for: 2 of its 4 matched keys kept"
    ]


async def test_an_answer_that_keeps_to_the_request_is_used_as_it_came() -> None:
    answer = LookupResponse(matched=2, replicas=((replica(0),), (replica(1),)))
    asked = LookupRequest(scope_id=SCOPE_A, compat_id=COMPAT, block_keys=tuple(keys(0, 1, 2)))
    async with serving(lying_index(answer)) as url, IndexClient(url, "pc") as client:
        assert await client.lookup(asked) == answer
