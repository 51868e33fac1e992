"""Reading a server's /metrics back: what benchmarks, experiments and tests scrape."""

from __future__ import annotations


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Sample name -> value from ``{base_url}/metrics``.

    Samples of one name with different label sets are summed (one server serves one
    model, so this only merges per-reason counters); histogram buckets (``le``) and the
    per-finish-reason success counters are left out, ``_sum`` and ``_count`` kept.
    """
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels and "finished_reason" not in sample.labels:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out
