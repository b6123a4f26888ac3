"""``kvsp.web.context``: a request's ids come from what it carried when valid, and every call a
service makes while serving it carries the same trace and request id to the next service."""

from __future__ import annotations

import json
import re
import subprocess
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvsp.web import context
from kvsp.web.client import JsonClient
from kvsp.web.serving import RequestContext
from tests.servers import KVSP, free_port, serving

HEX = re.compile(r"[0-9a-f]+")


@given(st.text(max_size=80), st.text(max_size=80))
def test_ids_are_the_carried_ones_when_valid_and_well_formed_new_ones_otherwise(
    request_id: str, traceparent: str
) -> None:
    ids = context.request_ids(request_id, traceparent)
    assert 1 <= len(ids.request_id) <= 64
    assert ids.request_id.isprintable()
    assert len(ids.trace_id) == 32
    assert HEX.fullmatch(ids.trace_id)
    assert len(ids.span_id) == 16
    assert HEX.fullmatch(ids.span_id)
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]", ids.traceparent())


def test_a_valid_traceparent_keeps_its_trace_and_sampling_flag() -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    ids = context.request_ids("req-1", f"00-{trace}-00f067aa0ba902b7-00")
    assert (ids.request_id, ids.trace_id, ids.sampled) == ("req-1", trace, False)
    assert ids.span_id != "00f067aa0ba902b7"  # this service's own span, a child
    zero = context.request_ids(None, f"00-{'0' * 32}-00f067aa0ba902b7-01")
    assert zero.trace_id != "0" * 32
    assert context.outgoing_headers() == {}  # outside a request, nothing is carried


@pytest.mark.anyio
async def test_a_call_made_while_serving_carries_the_request_and_its_trace() -> None:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({k: request.headers.get(k) for k in ("x-request-id", "traceparent")})

    async with serving(RequestContext(Starlette(routes=[Route("/kvsp/echo", echo)]))) as peer:
        client = JsonClient(peer)

        async def relay(_: Request) -> JSONResponse:
            return JSONResponse((await client._send("GET", "echo")).json())

        app = RequestContext(Starlette(routes=[Route("/kvsp/relay", relay)]))
        async with serving(app) as front, httpx.AsyncClient() as http:
            trace = "4bf92f3577b34da6a3ce929d0e0e4736"
            sent = {"traceparent": f"00-{trace}-00f067aa0ba902b7-01", "x-request-id": "r-7"}
            answer = await http.get(front + "relay", headers=sent)
            carried = answer.json()
            assert answer.headers["x-request-id"] == "r-7"
            assert carried["x-request-id"] == "r-7"
            assert carried["traceparent"].startswith(f"00-{trace}-")
            assert not carried["traceparent"].endswith("00f067aa0ba902b7-01")
            fresh = await http.get(front + "relay")
            assert fresh.headers["x-request-id"] == fresh.json()["x-request-id"]
        await client.aclose()


def test_a_service_logs_json_lines_with_its_name_and_the_request_and_trace_ids() -> None:
    port = free_port()
    command = [str(KVSP), "index", "serve", "--port", str(port), "--log-format", "json"]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        try:
            url = f"http://127.0.0.1:{port}/kvsp/"
            trace = "0af7651916cd43dd8448eb211c80319c"
            headers = {
                "traceparent": f"00-{trace}-b7ad6b7169203331-01",
                "x-request-id": "not valid",
            }
            for _ in range(600):
                try:
                    httpx.get(url + "livez")
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            answer = httpx.put(url + "status", content=b"{", headers=headers)
            assert answer.status_code == 415, answer.text
            request_id = answer.headers["x-request-id"]
            assert request_id != "not valid"
        finally:
            process.terminate()
            _, err = process.communicate(timeout=15)
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert all({"time", "level", "service", "logger", "message"} <= set(d) for d in lines)
    assert {d["service"] for d in lines} == {"index"}
    rejected = [d for d in lines if d.get("request_id") == request_id]
    assert len(rejected) == 1, lines
    assert rejected[0]["trace_id"] == trace
    assert any(d["logger"].startswith("uvicorn") for d in lines)  # uvicorn's lines too


def test_an_unknown_log_format_is_refused() -> None:
    done = subprocess.run([str(KVSP), "index", "serve", "--log-format", "xml"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "--log-format must be one of text, json" in done.stderr
