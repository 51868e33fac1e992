"""Reading a server's /metrics back: what benchmarks, experiments and tests scrape."""

from __future__ import annotations

from vllm.benchmarks.utils import server_root


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Sample name -> value from the server's ``/metrics``.

    ``base_url`` is the server's root or its OpenAI base URL (``.../v1``): /metrics is
    served at the root either way. Samples of one name with different label sets are
    summed (one server serves one model, so this merges per-reason counters and, with
    data-parallel engines, the engines' samples: their usage fractions add up too);
    histogram buckets (``le``) and the per-finish-reason success counters are left out,
    ``_sum`` and ``_count`` kept. An HTTP error raises ``requests.HTTPError``.
    """
    out: dict[str, float] = {}
    for family in _families(base_url, timeout_s):
        for sample in family.samples:
            if "le" not in sample.labels and "finished_reason" not in sample.labels:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def scrape_labelled(base_url: str, prefix: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The samples whose name starts with ``prefix``, one per label set, keyed
    ``name{label=value,...}`` (labels sorted, ``model_name`` and ``engine`` left out: the
    engines' samples are summed), e.g.
    ``vllm:context_serve_decisions_total{layer=rules,speed=slow}``. Histogram buckets are
    left out, and so are ``_created`` timestamps. What ``scrape_metrics`` sums, this keeps
    apart."""
    out: dict[str, float] = {}
    for family in _families(base_url, timeout_s):
        for sample in family.samples:
            if not sample.name.startswith(prefix) or "le" in sample.labels:
                continue
            if sample.name.endswith("_created"):
                continue  # a series' creation time, not a value
            labels = ",".join(
                f"{k}={v}"
                for k, v in sorted(sample.labels.items())
                if k not in ("model_name", "engine")
            )
            key = f"{sample.name}{{{labels}}}"
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _families(base_url: str, timeout_s: float):
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    resp = requests.get(server_root(base_url) + "/metrics", timeout=timeout_s)
    # Without this a 404 page reaches the Prometheus parser and fails as "Invalid labels".
    resp.raise_for_status()
    return list(text_string_to_metric_families(resp.text))
