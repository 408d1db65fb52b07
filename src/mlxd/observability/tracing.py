"""OpenTelemetry traces over OTLP/HTTP, off unless an endpoint is configured.

Nothing of OpenTelemetry is imported until :func:`setup` gets an endpoint, so a server
without one (or without the ``otel`` extra) pays nothing. Each process (front end, engine
core) has its own provider and batch exporter; the trace crosses the process boundary as
a W3C ``traceparent`` string on the engine-core message. The core's spans are built after
the sequence ends from timestamps the engine keeps (explicit start and end times): no
span per token, nothing on the device thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)

_provider: Any = None
_tracer: Any = None


def setup(endpoint: str | None, service: str, version: str = "") -> bool:
    """Export spans to ``endpoint`` (OTLP/HTTP, the full ``.../v1/traces`` URL); False
    (and nothing imported) when it is unset, or when the ``otel`` extra is missing."""
    global _provider, _tracer
    if not endpoint or _tracer is not None:
        return _tracer is not None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.error(
            "observability.otlp_traces_endpoint is set but OpenTelemetry's SDK is not "
            "installed (pip install 'mlxd[otel]'): no traces are exported"
        )
        return False
    provider = TracerProvider(
        resource=Resource.create({"service.name": "mlxd", "service.version": version})
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider, _tracer = provider, provider.get_tracer(f"mlxd.{service}", version)
    log.info("tracing: OTLP/HTTP spans to %s", endpoint)
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown(timeout_s: float = 5.0) -> None:
    """Export what is queued, then stop (the process is about to exit)."""
    global _provider, _tracer
    if _provider is None:
        return
    try:
        _provider.force_flush(int(timeout_s * 1000))
        _provider.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway: an unreachable collector loses spans
        log.warning("tracing: could not flush the last spans")
    _provider = _tracer = None


def _parent(traceparent: str | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent or ""})


def start_server_span(name: str, traceparent: str | None, attributes: dict[str, Any]) -> Any:
    """A SERVER span for one HTTP request, the child of the client's ``traceparent`` when it
    sent a valid one; None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(
        name, context=_parent(traceparent), kind=SpanKind.SERVER, attributes=attributes
    )


def traceparent_of(span: Any) -> str | None:
    """The W3C ``traceparent`` naming ``span`` as the parent (for the engine core)."""
    if span is None:
        return None
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def end_span(span: Any, name: str, attributes: dict[str, Any], error: str | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.update_name(name)
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def core_spans(
    traceparent: str | None,
    phases: list[tuple[str, float, float]],
    attributes: dict[str, Any],
) -> None:
    """Spans under ``traceparent`` for a finished sequence's phases: (name, start, end) in
    ``time.monotonic()`` seconds; a phase that did not happen (end <= 0) is left out."""
    if _tracer is None or not traceparent:
        return
    parent = _parent(traceparent)
    offset = _epoch_offset()
    for name, start, end in phases:
        if start <= 0 or end <= 0:
            continue
        span = _tracer.start_span(
            name,
            context=parent,
            start_time=int(start * 1e9) + offset,
            attributes={k: v for k, v in attributes.items() if v is not None},
        )
        span.end(end_time=int(max(end, start) * 1e9) + offset)


def _epoch_offset() -> int:
    """Nanoseconds from ``time.monotonic()`` to the epoch: the wall clock read between two
    monotonic readings, the closest pair of a few (a thread preempted between the readings
    of one pair would shift every span it converts by the time it lost)."""
    best: tuple[int, int] | None = None
    for _ in range(5):
        a = time.monotonic_ns()
        wall = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, wall - (a + b) // 2)
    assert best is not None
    return best[1]
