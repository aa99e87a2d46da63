"""OpenTelemetry spans for the server's own steps, under the caller's trace.

The MCP SDK makes a span per request, continued from the ``traceparent`` in the request's
``_meta``; the spans here nest under it (anyio's tasks inherit the context, so a run that goes on in
the service's task group stays in the trace of the call that started it). Attributes carry no user
data: no code, output, paths or ids, only kinds and sizes; an error is recorded by its type's name
only (its message may quote the user's code or paths).

The API is a no-op until a tracer provider is installed: ``configure_from_environment`` installs the
SDK's, with an OTLP exporter, when the ``otel`` extra is installed and ``OTEL_*`` variables ask for it.
Without the extra, and without the API, every span here is a no-op.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")
Attribute = str | bool | int | float

try:
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - the MCP SDK depends on the API; kept no-op without it anyway
    _trace = None  # type: ignore[assignment]

TRACER_NAME = "mcp_code_exec"


@contextmanager
def span(name: str, **attributes: Attribute) -> Iterator[None]:
    """A span around a step; an exception marks it failed with its type's name, nothing more."""
    if not recording():
        yield  # the API's no-op span would cost microseconds a step on every call, for nothing
        return
    tracer = _trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as current:
        try:
            yield
        except BaseException as exc:
            current.set_status(_trace.Status(_trace.StatusCode.ERROR))
            current.set_attribute("error.type", type(exc).__name__)
            raise


def recording() -> bool:
    """Whether a tracer provider is installed (by ``configure_from_environment``, or by whoever
    embeds the service). Without one there is nothing to record: the trace id of an incoming
    ``traceparent`` stays current all the same, for the log lines."""
    if _trace is None:
        return False
    return not isinstance(_trace.get_tracer_provider(), _trace.ProxyTracerProvider | _trace.NoOpTracerProvider)


def traced(name: str, **attributes: Attribute) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """``@traced("mcpx.step")`` on an async function: its call is a span (one line at the call site)."""

    def decorate(function: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(function)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            with span(name, **attributes):
                return await function(*args, **kwargs)

        return wrapper

    return decorate


def current_trace_id() -> str | None:
    """The trace id of the span now current (32 hex digits), or None outside any trace."""
    if _trace is None:
        return None
    context = _trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None


def configure_from_environment(environ: dict[str, str] | None = None) -> bool:
    """Install the SDK's tracer provider with an OTLP/HTTP exporter when the standard variables ask
    for traces (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, and
    ``OTEL_TRACES_EXPORTER`` not ``none``; ``OTEL_SERVICE_NAME`` and the rest are read by the SDK).
    False when not asked, or when the ``otel`` extra is missing (said once in the log)."""
    env = os.environ if environ is None else environ
    asked = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not asked or env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none" or _trace is None:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* variables ask for traces, but the otel extra is missing: pip install mcp-code-exec[otel]")
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "mcp-code-exec")}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _trace.set_tracer_provider(provider)
    return True


def shutdown() -> None:
    """Flush spans still buffered (at exit)."""
    if _trace is None:
        return
    provider: Any = _trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()
