"""OpenTelemetry traces of requests (vLLM's ``--otlp-traces-endpoint``).

Each finished request becomes one span, ``llm_request`` (kind SERVER), from its arrival
to its end, with vLLM's attribute names (``gen_ai.*``: the sampling parameters, the
usage, the latencies) and this engine's agent metadata (``vllm_continuum.*``: the job, its
last step, the prompt tokens served from cache). A request whose HTTP headers carry a
W3C trace context (``traceparent``, ``tracestate``) gets its span in that trace, so an
agent framework that traces its own steps sees each model call under the step that made
it. Spans are exported in batches over OTLP: gRPC by default, HTTP with
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` (OpenTelemetry's variable, as
vLLM reads it).

The OpenTelemetry SDK and exporters are optional: ``pip install 'vllm-continuum[otel]'``.
The API server hands each request's headers to the engine through a context variable
(``trace_headers_scope``), so no route needs to pass them along.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's attribute names (from OpenTelemetry's GenAI conventions), and ours."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # This engine's: what an agent's trace wants to see next to each model call.
    JOB_ID = "vllm_continuum.job_id"
    IS_LAST_STEP = "vllm_continuum.is_last_step"
    CACHED_TOKENS = "vllm_continuum.num_cached_tokens"
    FINISH_REASONS = "vllm_continuum.finish_reasons"


_headers: ContextVar[dict[str, str] | None] = ContextVar("vllm_trace_headers", default=None)


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace context among ``headers`` (lower-case names), or None."""
    found = {k: headers[k] for k in TRACE_HEADERS if headers.get(k)}
    return found or None


@contextmanager
def trace_headers_scope(headers: dict[str, str] | None) -> Iterator[None]:
    """While handling one HTTP request: its trace context, for ``current_trace_headers``
    (the tasks it starts inherit it)."""
    token = _headers.set(headers)
    try:
        yield
    finally:
        _headers.reset(token)


def current_trace_headers() -> dict[str, str] | None:
    return _headers.get()


def make_tracer(vllm_config: Any) -> RequestTracer | None:
    """The front end's tracer when --otlp-traces-endpoint is set, else None."""
    endpoint = vllm_config.observability_config.otlp_traces_endpoint
    if endpoint is None:
        return None
    mc = vllm_config.model_config
    model = (mc.served_model_name or (mc.model,))[0]
    return RequestTracer(endpoint, str(model))


_warned_untraced = False


def warn_untraced(headers: dict[str, str] | None) -> None:
    """A request brought a trace context to a server that exports no traces: said once."""
    global _warned_untraced
    if headers and not _warned_untraced:
        _warned_untraced = True
        logger.warning(
            "A request carries a trace context (traceparent) but tracing is off: start the "
            "server with --otlp-traces-endpoint to export request spans"
        )


def is_otel_available() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def _exporter(endpoint: str):
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be 'grpc' or 'http/protobuf', got {protocol!r}"
    )


class RequestTracer:
    """Exports one span per finished request. ``exporter``: a span exporter to use
    instead of OTLP's (tests); spans then go out at once rather than in batches."""

    def __init__(self, endpoint: str | None, model: str, exporter: Any = None) -> None:
        if not is_otel_available():
            raise ValueError(
                "--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporters: "
                "pip install 'vllm-continuum[otel]'"
            )
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create(
            {
                "service.name": os.environ.get("OTEL_SERVICE_NAME", "vllm"),
                "vllm.process_id": str(os.getpid()),
            }  # fmt: skip
        )
        self.provider = TracerProvider(resource=resource)
        if exporter is None:
            self.provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("vllm.v1.engine")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = SpanKind.SERVER
        self.model = model

    def emit(
        self,
        request_id: str,
        metrics: Any,
        params: Any,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        finish_reasons: list[str],
        headers: dict[str, str] | None,
    ) -> None:
        """One finished request's span (``metrics``: its ``RequestMetrics``, wall-clock
        seconds; ``params``: its first sequence's ``SamplingParams``)."""
        S = SpanAttributes
        end = metrics.finished_time or metrics.last_token_time or metrics.arrival_time
        attrs: dict[str, Any] = {
            S.GEN_AI_RESPONSE_MODEL: self.model,
            S.GEN_AI_REQUEST_ID: request_id,
            S.GEN_AI_REQUEST_N: metrics.n,
            S.GEN_AI_USAGE_NUM_SEQUENCES: metrics.n,
            S.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
            S.GEN_AI_USAGE_COMPLETION_TOKENS: metrics.num_generation_tokens,
            S.GEN_AI_LATENCY_E2E: end - metrics.arrival_time,
            S.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            S.GEN_AI_REQUEST_TOP_P: params.top_p,
            S.CACHED_TOKENS: num_cached_tokens,
            S.FINISH_REASONS: finish_reasons,
            S.IS_LAST_STEP: params.is_last_step,
        }
        if params.max_tokens is not None:
            attrs[S.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        if params.job_id is not None:
            attrs[S.JOB_ID] = params.job_id
        if metrics.queue_time is not None:
            attrs[S.GEN_AI_LATENCY_TIME_IN_QUEUE] = metrics.queue_time
        first, scheduled = metrics.first_token_time, metrics.scheduled_time
        if first is not None:
            attrs[S.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first - metrics.arrival_time
            attrs[S.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = (
                metrics.last_token_time or first
            ) - first
            if scheduled is not None:
                attrs[S.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first - scheduled
        if scheduled is not None and metrics.last_token_time is not None:
            attrs[S.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = metrics.last_token_time - scheduled
        context = self.propagator.extract(headers) if headers else None
        span = self.tracer.start_span(
            SPAN_NAME,
            context=context,
            kind=self.kind,
            attributes=attrs,
            start_time=int(metrics.arrival_time * 1e9),
        )
        span.end(end_time=int(end * 1e9))

    def shutdown(self) -> None:
        """Export what is queued, then stop."""
        self.provider.shutdown()
