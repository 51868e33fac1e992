"""scrape_metrics reads Prometheus text the way our benchmarks and tests need it."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import requests

from vllm.benchmarks.metrics_reader import scrape_labelled, scrape_metrics

TEXT = b"""# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# HELP vllm:pins_total KV pins placed.
# TYPE vllm:pins_total counter
vllm:pins_total{model_name="m"} 7.0
# HELP vllm:request_success_total Finished requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{finished_reason="length",model_name="m"} 2.0
# HELP vllm:e2e_request_latency_seconds End-to-end latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 5.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 5.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 3.5
# HELP vllm:prompt_tokens_total Prefill tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="a"} 10.0
vllm:prompt_tokens_total{model_name="b"} 5.0
# HELP vllm:context_serve_decisions_total Verdicts.
# TYPE vllm:context_serve_decisions_total counter
vllm:context_serve_decisions_total{engine="0",layer="rules",model_name="m",speed="slow"} 4.0
vllm:context_serve_decisions_total{engine="1",layer="rules",model_name="m",speed="slow"} 1.0
vllm:context_serve_decisions_total{engine="0",layer="bayes",model_name="m",speed="fast"} 6.0
"""


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = TEXT if self.path == "/metrics" else b"not found"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_url():
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_scrape_keeps_values_and_sums_and_drops_buckets(metrics_url):
    m = scrape_metrics(metrics_url + "/")
    assert m["vllm:kv_cache_usage_perc"] == 0.25
    assert m["vllm:pins_total"] == 7.0
    assert m["vllm:prompt_tokens_total"] == 15.0  # label sets summed
    assert m["vllm:e2e_request_latency_seconds_sum"] == 3.5
    assert m["vllm:e2e_request_latency_seconds_count"] == 5.0
    assert "vllm:e2e_request_latency_seconds_bucket" not in m
    assert "vllm:request_success_total" not in m  # per-reason counters are left out


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_scrape_accepts_the_root_and_the_openai_base_url(metrics_url, suffix):
    # An OpenAI user writes http://host:port/v1; /metrics is at the root either way.
    assert scrape_metrics(metrics_url + suffix)["vllm:pins_total"] == 7.0


def test_scrape_raises_on_an_http_error_instead_of_parsing_the_page(metrics_url):
    with pytest.raises(requests.HTTPError):
        scrape_metrics(metrics_url + "/elsewhere")


def test_scrape_labelled_keeps_label_sets_apart(metrics_url):
    m = scrape_labelled(metrics_url, "vllm:context_serve_")
    assert m == {
        "vllm:context_serve_decisions_total{layer=rules,speed=slow}": 5.0,  # both engines
        "vllm:context_serve_decisions_total{layer=bayes,speed=fast}": 6.0,
    }
    assert scrape_metrics(metrics_url)["vllm:context_serve_decisions_total"] == 11.0
