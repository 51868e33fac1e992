"""Base-URL forms, the one percentile definition and the quiet-machine wait shared by every
benchmark."""

from __future__ import annotations

import math

import pytest

from vllm.benchmarks.utils import (
    cpu_times,
    openai_base_url,
    percentile,
    server_root,
    wait_until_quiet,
)


@pytest.mark.parametrize(
    "given",
    [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "http://127.0.0.1:8000/v1",
        "http://127.0.0.1:8000/v1/",
        " http://127.0.0.1:8000/v1 ",
    ],
)
def test_both_url_forms_name_the_same_server(given):
    assert server_root(given) == "http://127.0.0.1:8000"
    assert openai_base_url(given) == "http://127.0.0.1:8000/v1"


def test_a_path_prefix_before_v1_is_kept():
    # A server behind a proxy at /llm: only the OpenAI suffix is dropped.
    assert server_root("https://host/llm/v1") == "https://host/llm"
    assert openai_base_url("https://host/llm") == "https://host/llm/v1"
    assert server_root("http://host/v10") == "http://host/v10"


def test_percentile_interpolates_linearly_like_numpy():
    xs = [10.0, 1.0, 4.0, 2.0, 3.0]  # sorted: 1 2 3 4 10
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile(xs, 50) == 3.0
    # P90: rank 0.9 * 4 = 3.6, between 4 and 10
    assert percentile(xs, 90) == pytest.approx(4 + 0.6 * 6)
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))


def test_percentile_matches_numpy_on_random_samples():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    for n in (2, 3, 10, 101):
        xs = rng.exponential(size=n).tolist()
        for q in (50, 90, 95, 99):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_rejects_q_outside_0_100():
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)


def test_upstream_processes_do_not_see_our_checkout(monkeypatch):
    # Upstream vLLM shares the import name `vllm`: our checkout on PYTHONPATH (as the README
    # runs the tests) would shadow it in upstream's server.
    from vllm.benchmarks.upstream_server import CPU_ENV, upstream_env

    monkeypatch.setenv("PYTHONPATH", "/some/checkout")
    monkeypatch.setenv("SOME_OTHER_SETTING", "kept")
    env = upstream_env()
    assert "PYTHONPATH" not in env
    assert env["SOME_OTHER_SETTING"] == "kept"
    assert env["PYTHONSAFEPATH"] == "1" and all(env[k] == v for k, v in CPU_ENV.items())


def fake_cpu(busy_fractions: list[float]):
    """A /proc/stat reader whose successive windows are busy by the given fractions."""
    state = {"busy": 0, "total": 0, "reads": 0}
    fractions = iter(busy_fractions)

    def times() -> tuple[int, int]:
        if state["reads"] % 2 == 1:  # the end of a window
            state["busy"] += round(100 * next(fractions))
            state["total"] += 100
        state["reads"] += 1
        return state["busy"], state["total"]

    return times


def test_wait_until_quiet_waits_out_a_busy_spell():
    waited = wait_until_quiet(
        0.15, 0.5, 30.0, times=fake_cpu([1.0, 0.6, 0.3, 0.1, 0.9]), sleep=lambda s: None
    )
    assert waited == 2.0  # four windows: the fourth is under 15%


def test_wait_until_quiet_gives_up_at_its_timeout():
    busy = fake_cpu([1.0] * 100)
    assert wait_until_quiet(0.15, 0.5, 3.0, times=busy, sleep=lambda s: None) == 3.0


def test_cpu_times_reads_this_machine():
    busy, total = cpu_times()
    assert 0 <= busy <= total and total > 0
