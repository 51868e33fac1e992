"""OpenTelemetry traces (--otlp-traces-endpoint): each finished request is one span,
``llm_request``, in the trace its ``traceparent`` header names, with vLLM's gen_ai.*
attributes and the agent's job; exported over OTLP/HTTP to a collector in the test."""

from __future__ import annotations

import http.server
import threading
import time
from types import SimpleNamespace

import pytest
import requests

otel = pytest.importorskip("opentelemetry.sdk.trace", reason="pip install 'vllm-continuum[otel]'")

from vllm.benchmarks.server import RemoteServer  # noqa: E402
from vllm.config import ObservabilityConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.tracing import RequestTracer, SpanAttributes, extract_trace_headers  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_a_span_joins_the_callers_trace():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer = RequestTracer(None, "m", exporter=exporter)
    metrics = SimpleNamespace(
        arrival_time=100.0, first_token_time=100.5, last_token_time=101.0, finished_time=101.0,
        queue_time=0.1, scheduled_time=100.1, num_generation_tokens=8, n=1,
    )  # fmt: skip
    params = SamplingParams(
        temperature=0.5, top_p=0.9, max_tokens=8, extra_args={"job_id": "job-7"}
    )
    headers = extract_trace_headers({"traceparent": TRACEPARENT, "other": "x"})
    assert headers == {"traceparent": TRACEPARENT}
    tracer.emit("cmpl-1", metrics, params, 20, 16, ["length"], headers)
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    assert (span.start_time, span.end_time) == (100_000_000_000, 101_000_000_000)
    a = span.attributes
    assert a[SpanAttributes.GEN_AI_REQUEST_ID] == "cmpl-1"
    assert a[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] == 20
    assert a[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] == 8
    assert a[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] == pytest.approx(0.5)
    assert a[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] == pytest.approx(0.1)
    assert a[SpanAttributes.GEN_AI_LATENCY_E2E] == pytest.approx(1.0)
    assert a[SpanAttributes.JOB_ID] == "job-7" and a[SpanAttributes.CACHED_TOKENS] == 16
    # No trace context: a root span of its own trace.
    tracer.emit("cmpl-2", metrics, params, 20, 0, ["stop"], None)
    assert exporter.get_finished_spans()[1].parent is None
    tracer.shutdown()


def test_detailed_traces_are_refused():
    with pytest.raises(ValueError, match="collect_detailed_traces"):
        ObservabilityConfig(collect_detailed_traces="model")


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Collector.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def received_spans() -> list:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    spans = []
    for body in list(_Collector.bodies):
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                spans.extend(scope.spans)
    return spans


@pytest.mark.slow
def test_vllm_serve_exports_a_span_per_request(tmp_path):
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    try:
        with RemoteServer(
            "--otlp-traces-endpoint", endpoint, "--max-model-len", "512",
            log_path=str(tmp_path / "server.log"), env=env,
        ) as server:  # fmt: skip
            body = {
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 4,
                "temperature": 0,
                "job_id": "agent-job-1",
                "is_last_step": True,
            }
            traced = requests.post(
                f"{server.base}/v1/chat/completions", json=body, timeout=60,
                headers={"traceparent": TRACEPARENT},
            )  # fmt: skip
            assert traced.status_code == 200, traced.text
            plain = requests.post(
                f"{server.base}/v1/completions",
                json={"prompt": "Hello", "max_tokens": 3},
                timeout=60,
            )
            assert plain.status_code == 200, plain.text
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(received_spans()) < 2:
                time.sleep(0.2)
    finally:
        collector.shutdown()
    spans = received_spans()
    assert len(spans) == 2 and {s.name for s in spans} == {"llm_request"}
    traced_span = next(s for s in spans if s.trace_id.hex() == TRACE_ID)
    assert traced_span.parent_span_id.hex() == PARENT_ID
    attrs = {a.key: a.value for a in traced_span.attributes}
    assert attrs[SpanAttributes.JOB_ID].string_value == "agent-job-1"
    assert attrs[SpanAttributes.IS_LAST_STEP].bool_value is True
    assert attrs[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS].int_value == 4
    assert attrs[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN].double_value > 0
    other = next(s for s in spans if s is not traced_span)
    assert other.trace_id.hex() != TRACE_ID and not other.parent_span_id
