"""OpenTelemetry traces of a request's path: the gateway's admission, queue wait, each routing attempt and the
relay, then the replica's prefill and decode, in one trace (the replica continues the gateway's trace from the
W3C `traceparent` header). Exported over OTLP/HTTP when the standard variables name a collector
(OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER work too);
otherwise OpenTelemetry's no-op tracer answers, which costs a few microseconds per span and exports nothing.
A module of its own, like logs.py, so that any process can set it up without loading the HTTP stack."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar

from opentelemetry import propagate, trace
from opentelemetry.context import Context

log = logging.getLogger(__name__)
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracer(component: str) -> trace.Tracer:
    """A component's tracer, to keep (one per module): a proxy that follows whatever provider is set up, now or
    later, and once there is one, answers with its tracer without looking it up again."""
    return trace.get_tracer(f"tokenfleet.{component}")


_provider_seen = False  # a provider, once set, stays for the process's life


def recording(parent: trace.Span | None = None) -> bool:
    """Whether a span started now, under `parent` (a span of ours) when given, can be recorded or passed on to the
    next hop: so that callers skip building spans and their attributes when it cannot. Under a parent that is the
    no-op tracer's (no collector configured) it cannot, and finding that out costs an attribute read."""
    global _provider_seen
    if parent is not None:
        return parent.get_span_context().is_valid
    if not _provider_seen:
        _provider_seen = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return _provider_seen


def configure_tracing(service_name: str) -> bool:
    """Exports this process's spans to the OTLP collector that the environment names; False (and nothing set up)
    when it names none. The SDK and exporter are the `tracing` extra: asking for traces without them is an error."""
    if not any(os.environ.get(name) for name in ENDPOINT_VARIABLES):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: "
            'pip install "tokenfleet[tracing]"'
        ) from e
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info(
        "tracing: spans go to the OTLP collector at %s",
        next(os.environ[n] for n in ENDPOINT_VARIABLES if os.environ.get(n)),
    )
    return True


# the trace that the work this task does next continues: set by the gateway for each routing attempt (and sent to
# the replica as `traceparent`), by the replica from that header; an in-process replica reads the gateway's own
_PARENT: ContextVar[Context | None] = ContextVar("tokenfleet_trace_parent", default=None)


def continue_trace(parent: trace.Span | Context) -> None:
    """What this task does from now on (requests it sends, replica work it starts) continues `parent`'s trace."""
    _PARENT.set(parent if isinstance(parent, Context) else trace.set_span_in_context(parent))


def continue_from_headers(headers: Mapping[str, str]) -> None:
    """The caller's trace (its `traceparent`), continued by this task's work; none without one."""
    _PARENT.set(propagate.extract(headers) if "traceparent" in headers else None)


def parent() -> Context | None:
    return _PARENT.get()


def inject(headers: MutableMapping[str, str]) -> None:
    """Adds the trace this task continues (traceparent) to an outgoing request's headers."""
    context = _PARENT.get()
    if context is not None:
        propagate.inject(headers, context=context)


class EpochClock:
    """time.monotonic() instants as the epoch nanoseconds spans are timed in (for spans written after the fact),
    from one reading of both clocks: instants converted by one clock keep their exact differences, so stages that
    meet stay met."""

    def __init__(self) -> None:
        self.now_ns, self.now = time.time_ns(), time.monotonic()

    def __call__(self, monotonic_s: float) -> int:
        return self.now_ns - int((self.now - monotonic_s) * 1e9)


def epoch_ns(monotonic_s: float) -> int:
    """One instant as epoch nanoseconds (see EpochClock for several that must line up)."""
    return EpochClock()(monotonic_s)
