"""One completion is one trace across real processes: every service exports its spans over
OTLP (the SDK's own exporter) to a receiver this test runs, and the spans of the completion —
the front end's request, the placement, the instance's generation, its block GETs from another
instance's holder and their verification, the Index Service's lookup — share one trace id and
form one tree under the client's ``traceparent``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from kvsp.local import LocalCluster, free_port
from kvsp.model import ModelFiles

pytestmark = pytest.mark.slow

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span exported to it, as (service, span) pairs."""

    def __init__(self, port: int) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Export)


class _Export(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        request = trace_service.ExportTraceServiceRequest.FromString(body)
        for resource in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scoped in resource.scope_spans:
                with self.server.lock:
                    self.server.spans += [
                        {"service": attributes["service.name"], "name": s.name,
                         "trace": s.trace_id.hex(), "span": s.span_id.hex(),
                         "parent": s.parent_span_id.hex(),
                         "attributes": {a.key: a.value for a in s.attributes}}
                        for s in scoped.spans
                    ]  # fmt: skip
        answer = trace_service.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *_: Any) -> None:
        return None


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, model_files: ModelFiles
) -> Iterator[tuple[LocalCluster, Receiver]]:
    receiver = Receiver(free_port())
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    patch = pytest.MonkeyPatch()
    patch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.server_port}")
    patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    up = LocalCluster(tmp_path_factory.mktemp("traced") / "c", instances=2, g1_blocks=32,
                      g2_bytes="16M", kv_events=None)  # fmt: skip
    try:
        up.start()
        yield up, receiver
    finally:
        up.stop()
        patch.undo()
        receiver.shutdown()
        receiver.server_close()


def complete(up: LocalCluster, prompt: str, traceparent: str) -> dict[str, Any]:
    answer = httpx.post(
        up.frontend.url + "v1/completions",
        json={"model": "x", "prompt": prompt, "max_tokens": 3, "temperature": 0},
        headers={"authorization": f"Bearer {up.api_key}", "traceparent": traceparent},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["kvsp"])


def test_a_completion_is_one_trace_through_every_service(traced: Any) -> None:
    up, receiver = traced
    prompt = "Trace the blocks of this prompt from one instance to the next one, please. " * 3
    first = complete(up, prompt, f"00-{'a1' * 16}-{'b2' * 8}-01")
    # the second request can only be placed on the other instance: it fetches the blocks
    auth = {"authorization": f"Bearer {up.operator_token}"}
    drain = {"instance": first["instance"], "state": "draining"}
    assert httpx.put(up.controller.url + "instances/state", json=drain, headers=auth).is_success
    trace, root = "c3" * 16, "d4" * 8
    second = complete(up, prompt, f"00-{trace}-{root}-01")
    assert second["instance"] != first["instance"]
    assert second["cached_tokens"] > 0  # loaded from the first instance's holder

    wanted = {
        "kvsp.placement",
        "kvsp.block.get",
        "kvsp.block.verify",
        "POST /kvsp/lookup",
        "POST /kvsp/v1/completions",
        "POST /kvsp/generate",
    }
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with receiver.lock:
            spans = [s for s in receiver.spans if s["trace"] == trace]
        if wanted <= {s["name"] for s in spans}:
            break
        time.sleep(0.2)
    names = {(s["service"], s["name"]) for s in spans}
    assert ("kvsp-controller", "POST /kvsp/v1/completions") in names
    assert ("kvsp-controller", "kvsp.placement") in names
    assert ("kvsp-index", "POST /kvsp/lookup") in names
    assert ("kvsp-instance", "POST /kvsp/generate") in names
    assert ("kvsp-instance", "kvsp.block.get") in names
    assert ("kvsp-instance", "kvsp.block.verify") in names
    # the first instance's holder answered the block GETs, in the same trace
    assert ("kvsp-instance", "GET /kvsp/blocks/{id}/{id}/{id}") in names
    # one tree: every span's parent is a span of the trace, or the client's own span
    ids = {s["span"] for s in spans} | {root}
    assert all(s["parent"] in ids for s in spans), (
        [(s["service"], s["name"], s["parent"]) for s in spans if s["parent"] not in ids],
        [(s["service"], s["name"], s["span"], s["parent"]) for s in spans],
    )
    assert sum(s["parent"] == root for s in spans) == 1  # the front end's request
    wake = {"instance": first["instance"], "state": "active"}
    assert httpx.put(up.controller.url + "instances/state", json=wake, headers=auth).is_success
