"""Spans for OpenTelemetry, when an operator asks for them: with the ``kvsp[otel]`` extra
installed and ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set,
each service exports its spans over OTLP (``OTEL_EXPORTER_OTLP_PROTOCOL``: ``http/protobuf``,
the default, or ``grpc``); every other standard ``OTEL_*`` variable (service name, resource
attributes, batch delays, headers, sampling) is the SDK's own. Otherwise nothing is imported
and ``span`` costs one check.

The trace context is ``kvsp.web.context``'s: a request's server span takes the arriving
``traceparent`` as its parent, and ``span`` makes a child of the current span and makes it
current, so a call made inside it carries it as the parent. One completion is then one trace:
the front end's request, the controller's placement and prefetch, the instance's generation,
its block GETs and their verification, the holder's answers.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from kvsp.web import context

__all__ = ["configure_tracing", "server_span", "span"]

log = logging.getLogger("kvsp.tracing")

_tracer: Any = None


def configure_tracing(service: str) -> bool:
    """Export this process's spans if the environment asks for it; whether it does."""
    global _tracer
    wanted = any(os.environ.get(v) for v in ("OTEL_EXPORTER_OTLP_ENDPOINT",
                                             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))  # fmt: skip
    if not wanted or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but kvsp[otel] is not installed")
        return False
    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    name = os.environ.get("OTEL_SERVICE_NAME") or f"kvsp-{service}"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _tracer = provider.get_tracer("kvsp")
    log.info("exporting spans as %s", name)
    return True


def _parent(ids: context.RequestIds, parent_id: str | None) -> Any:
    """The OpenTelemetry context whose span is ``parent_id`` of ``ids``' trace (None: a new
    trace, the span a root)."""
    from opentelemetry import trace

    if parent_id is None:
        return None
    parent = trace.SpanContext(int(ids.trace_id, 16), int(parent_id, 16), is_remote=True,
                               trace_flags=trace.TraceFlags(int(ids.sampled)))  # fmt: skip
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


@contextmanager
def _child(
    name: str,
    kind: str,
    ids: context.RequestIds,
    parent_id: str | None,
    attributes: dict[str, Any],
) -> Iterator[Any]:
    from opentelemetry import trace

    kind_of = getattr(trace.SpanKind, kind)
    with _tracer.start_as_current_span(
        name, context=_parent(ids, parent_id), kind=kind_of, attributes=attributes
    ) as current:
        made = current.get_span_context()
        mine = replace(ids, trace_id=f"{made.trace_id:032x}", span_id=f"{made.span_id:016x}")
        with context.using(mine):
            yield current


#: a path segment that names one thing (a key, a UUID, a Scope ID): span names keep the route
_ID_SEGMENT = re.compile(r"/(?=[0-9a-fA-F-]{16,}(?:/|$))[0-9a-fA-F-]+")


@contextmanager
def server_span(method: str, path: str, ids: context.RequestIds) -> Iterator[context.RequestIds]:
    """Serve a request for ``method`` ``path`` under ``ids`` (its parent the span that called),
    as a server span when spans are exported (named by the route, not the ids in the path);
    yields the ids the request is served with."""
    if _tracer is None:
        with context.using(ids):
            yield ids
        return
    name = f"{method} {_ID_SEGMENT.sub('/{id}', path)}"
    attributes = {"http.request.method": method, "url.path": path}
    with _child(name, "SERVER", ids, ids.parent_id, attributes):
        current = context.current()
        assert current is not None
        yield current


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A child span of the current one (in a request only, and only when spans are
    exported); calls made inside it carry it as their parent."""
    ids = context.current()
    if _tracer is None or ids is None:
        yield
        return
    with _child(name, "INTERNAL", ids, ids.span_id, attributes):
        yield
