"""OutputProcessor: output kinds, n>1 fan-in, stop strings, timings (no engine needed)."""

from __future__ import annotations

import pytest

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.outputs import TokenLogprobs

TEXT = "Hello world, this is a test."


def make_request(request_id: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, [1, 2, 3], SamplingParams(**params), arrival_wall_time=100.0
    )


def token_outputs(tokenizer, request_id: str, text: str = TEXT, finish=FinishReason.LENGTH):
    """One engine output per token, the last one finished with ``finish``."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    outs = [EngineCoreOutput(request_id, [t]) for t in ids]
    outs[-1].finish_reason = finish
    return outs


def run(processor, outputs) -> list:
    results = []
    for out in outputs:
        step_results, _ = processor.process_outputs([out])
        results.extend(step_results)
    return results


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(tokenizer, kind):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", "prompt", [make_request("r", output_kind=kind)])
    results = run(processor, token_outputs(tokenizer, "r"))
    assert results[-1].finished and not processor.has_unfinished_requests()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(results) == 1
    else:
        assert len(results) == len(ids) and not any(r.finished for r in results[:-1])
    if kind == RequestOutputKind.DELTA:
        assert "".join(r.outputs[0].text for r in results) == TEXT
        assert [t for r in results for t in r.outputs[0].token_ids] == ids
    else:
        assert results[-1].outputs[0].text == TEXT and results[-1].outputs[0].token_ids == ids
    assert results[-1].outputs[0].finish_reason == "length"
    assert results[-1].prompt == "prompt" and results[-1].prompt_token_ids == [1, 2, 3]


def test_stop_string_asks_the_engine_to_stop_the_request(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [make_request("r", stop=["this"])])
    outs = token_outputs(tokenizer, "r")
    aborts = []
    for out in outs:
        results, to_abort = processor.process_outputs([out])
        aborts += to_abort
        if results and results[-1].finished:
            break
    final = results[-1].outputs[0]
    assert aborts == ["r"]
    assert final.text == "Hello world, " and final.finish_reason == "stop"
    assert final.stop_reason == "this"
    # Late outputs of the aborted request are ignored.
    assert processor.process_outputs([EngineCoreOutput("r", [5])]) == ([], [])


def test_no_abort_when_the_engine_finished_the_same_step(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [make_request("r", stop=["test."])])
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    out = EngineCoreOutput("r", ids, finish_reason=FinishReason.LENGTH)
    results, to_abort = processor.process_outputs([out])
    assert to_abort == []
    assert results[0].outputs[0].finish_reason == "stop"
    assert results[0].outputs[0].text == "Hello world, this is a "


def test_n_children_gathered_in_one_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    kids = [make_request(f"{i}_r", output_kind=RequestOutputKind.DELTA) for i in range(2)]
    processor.add_request("r", None, kids)
    assert processor.child_ids("r") == ["0_r", "1_r"]
    a = token_outputs(tokenizer, "0_r", "Yes.", FinishReason.STOP)  # 2 tokens
    b = token_outputs(tokenizer, "1_r", "No, never.")  # 4 tokens
    results = []
    for step in range(len(b)):
        results += processor.process_outputs(a[step : step + 1] + [b[step]])[0]
    assert len(results) == len(b) and [r.finished for r in results] == [False] * 3 + [True]
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for r in results:
        for c in r.outputs:
            texts[c.index] += c.text
            finishes[c.index].append(c.finish_reason)
    # "." was child 0's stop token: its text is left out. DELTA reports only the child
    # that moved, so child 0's finish is reported exactly once.
    assert texts == {0: "Yes", 1: "No, never."}
    assert finishes == {0: [None, "stop"], 1: [None, None, None, "length"]}


def test_logprobs_and_timing_metrics(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [make_request("r", logprobs=1)])
    outs = token_outputs(tokenizer, "r", "a b c")
    for i, out in enumerate(outs):
        out.new_logprobs = [TokenLogprobs(out.new_token_ids[0], -0.5 * (i + 1), 1)]
    outs[0].queue_time_s = 0.25
    outs[0].num_cached_tokens = 16
    final = run(processor, outs)[-1]
    c = final.outputs[0]
    assert len(c.logprobs) == 3 and c.cumulative_logprob == pytest.approx(-3.0)
    m = final.metrics
    assert m.arrival_time == 100.0  # taken from the EngineCoreRequest
    assert m.arrival_time < m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_generation_tokens == 3 and m.queue_time == 0.25
    assert m.time_to_first_token == m.first_token_time - 100.0
    assert final.num_cached_tokens == 16


def test_inter_token_latencies_once_per_request_and_call(tokenizer, monkeypatch):
    import vllm.v1.engine.output_processor as op

    clock = iter([10.0, 10.5, 11.25])
    monkeypatch.setattr(op.time, "time", lambda: next(clock))
    processor = OutputProcessor(tokenizer)
    kids = [make_request(f"{i}_r", max_tokens=7) for i in range(2)]
    processor.add_request("r", None, kids)
    a, b = token_outputs(tokenizer, "0_r"), token_outputs(tokenizer, "1_r")
    processor.process_outputs([a[0], b[0]])
    assert processor.inter_token_latencies == []  # the first tokens: TTFT, not ITL
    processor.process_outputs([a[1], b[1]])
    assert processor.inter_token_latencies == [0.5]  # one per request, not per sequence
    processor.process_outputs([b[2]])
    assert processor.inter_token_latencies == [0.75]
    m = processor._states["r"].metrics
    assert (m.n, m.max_tokens, m.max_num_generation_tokens) == (2, 7, 3)
    assert m.num_generation_tokens == 5


def test_abort_and_duplicate_ids(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [make_request("0_r"), make_request("1_r")])
    with pytest.raises(ValueError, match="request_id"):
        processor.add_request("r", None, [make_request("r")])
    assert processor.abort_request("r") == ["0_r", "1_r"]
    assert processor.abort_request("r") == []
    assert not processor.has_unfinished_requests()
    assert processor.process_outputs(token_outputs(tokenizer, "0_r")) == ([], [])


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_prompt_logprobs_are_none_first_then_once_in_delta(tokenizer, kind):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [make_request("r", output_kind=kind, prompt_logprobs=1)])
    outs = token_outputs(tokenizer, "r")
    outs[0].new_prompt_logprobs = [TokenLogprobs(2, -1.0, 3), TokenLogprobs(3, -0.5, 1)]
    results = run(processor, outs)
    expected = [None, TokenLogprobs(2, -1.0, 3), TokenLogprobs(3, -0.5, 1)]  # prompt [1, 2, 3]
    assert results[0].prompt_logprobs == expected
    if kind == RequestOutputKind.DELTA:
        assert all(r.prompt_logprobs is None for r in results[1:])  # handed out once
    else:
        assert results[-1].prompt_logprobs == expected


def test_engine_error_finishes_a_sequence_with_finish_reason_error(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [make_request("r")])
    (result,), _ = processor.process_outputs(
        [EngineCoreOutput("r", [], finish_reason=FinishReason.ERROR)]
    )
    assert result.finished and result.outputs[0].finish_reason == "error"
    assert result.prompt_logprobs is None  # not asked for


LONG = "One two three four five six seven eight nine ten eleven twelve thirteen."


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
@pytest.mark.parametrize("engine_interval, request_interval", [(4, None), (1, 4), (4, 2)])
def test_stream_interval_sends_first_every_n_and_last(
    tokenizer, kind, engine_interval, request_interval
):
    # The engine's interval, raised (never lowered) by the request's: the first token at
    # once, then an output each time 4 new tokens are in, and the last one when it ends.
    processor = OutputProcessor(tokenizer, stream_interval=engine_interval)
    params = {"output_kind": kind, "stream_interval": request_interval}
    processor.add_request("r", None, [make_request("r", **params)])
    ids = tokenizer(LONG, add_special_tokens=False).input_ids
    assert len(ids) % 4 != 1  # the last output is a short one
    steps = []  # per engine output: whether it made a RequestOutput
    results = []
    for out in token_outputs(tokenizer, "r", LONG):
        got, _ = processor.process_outputs([out])
        steps.append(bool(got))
        results += got
    expected = [i == 0 or i % 4 == 0 or i == len(ids) - 1 for i in range(len(ids))]
    assert steps == expected
    assert results[-1].finished and not any(r.finished for r in results[:-1])
    if kind == RequestOutputKind.DELTA:
        assert [len(r.outputs[0].token_ids) for r in results[:2]] == [1, 4]
        assert "".join(r.outputs[0].text for r in results) == LONG
        assert [t for r in results for t in r.outputs[0].token_ids] == ids
    else:
        assert [len(r.outputs[0].token_ids) for r in results[:3]] == [1, 5, 9]
        assert results[-1].outputs[0].text == LONG and results[-1].outputs[0].token_ids == ids


def test_stream_interval_outputs_equal_the_unbatched_stream(tokenizer):
    # Logprobs and the first token's prompt logprobs come through batching unchanged.
    def stream(interval):
        processor = OutputProcessor(tokenizer, stream_interval=interval)
        params = {"output_kind": RequestOutputKind.DELTA, "logprobs": 0, "prompt_logprobs": 0}
        processor.add_request("r", None, [make_request("r", **params)])
        outs = token_outputs(tokenizer, "r", LONG)
        for i, out in enumerate(outs):
            out.new_logprobs = [TokenLogprobs(out.new_token_ids[0], -0.1 * i, 1, {})]
        outs[0].new_prompt_logprobs = [TokenLogprobs(2, -1.0, 1, {}), TokenLogprobs(3, -2.0, 1, {})]
        return run(processor, outs)

    one, four = stream(1), stream(4)
    assert len(one) == 14 and len(four) == 5  # tokens 1, 2-5, 6-9, 10-13, 14
    for field_of in (lambda c: c.token_ids, lambda c: c.logprobs):
        assert [x for r in four for x in field_of(r.outputs[0])] == [
            x for r in one for x in field_of(r.outputs[0])
        ]
    assert [r.prompt_logprobs for r in four if r.prompt_logprobs] == [
        r.prompt_logprobs for r in one if r.prompt_logprobs
    ]
    assert four[-1].outputs[0].cumulative_logprob == one[-1].outputs[0].cumulative_logprob


def test_stream_interval_ends_at_a_stop_string_at_once(tokenizer):
    processor = OutputProcessor(tokenizer, stream_interval=16)
    params = {"output_kind": RequestOutputKind.DELTA, "stop": ["five"]}
    processor.add_request("r", None, [make_request("r", **params)])
    results, aborts = [], []
    for out in token_outputs(tokenizer, "r", LONG):
        got, stop = processor.process_outputs([out])
        results += got
        aborts += stop
        if got and got[-1].finished:
            break
    assert len(results) == 2 and aborts == ["r"]
    assert "".join(r.outputs[0].text for r in results) == "One two three four "
    assert results[-1].outputs[0].finish_reason == "stop"


def test_stream_interval_with_n_children(tokenizer):
    # DELTA reports every child that moved since the last output, each child's first
    # tokens and its finish go out at once, and the texts add up.
    processor = OutputProcessor(tokenizer, stream_interval=3)
    kids = [make_request(f"{i}_r", output_kind=RequestOutputKind.DELTA) for i in range(2)]
    processor.add_request("r", None, kids)
    a = token_outputs(tokenizer, "0_r", "Yes, surely.", FinishReason.STOP)
    b = token_outputs(tokenizer, "1_r", LONG)
    assert len(a) < len(b)
    results = []
    for step in range(len(b)):
        results += processor.process_outputs(a[step : step + 1] + [b[step]])[0]
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for r in results:
        for c in r.outputs:
            texts[c.index] += c.text
            finishes[c.index].append(c.finish_reason)
    assert texts == {0: "Yes, surely", 1: LONG}
    assert finishes[0][-1] == "stop" and finishes[0].count("stop") == 1
    assert finishes[1][-1] == "length" and results[-1].finished
    assert len(results) < len(b) / 2 + 2


def test_stream_interval_is_validated():
    from vllm.config import SchedulerConfig

    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            SamplingParams(stream_interval=bad)
        with pytest.raises(ValueError, match="stream_interval"):
            SchedulerConfig(stream_interval=bad)


def test_stream_interval_reports_a_child_held_since_an_earlier_step(tokenizer):
    # Child 0's second token is held; it then gets no output (preempted, say) while child
    # 1's tokens fill the interval: that output carries child 0's held token too.
    processor = OutputProcessor(tokenizer, stream_interval=3)
    kids = [make_request(f"{i}_r", output_kind=RequestOutputKind.DELTA) for i in range(2)]
    processor.add_request("r", None, kids)
    a = token_outputs(tokenizer, "0_r", "Yes, surely not.")
    b = token_outputs(tokenizer, "1_r", LONG)
    first, _ = processor.process_outputs([a[0], b[0]])  # first tokens: at once
    assert [len(c.token_ids) for c in first[0].outputs] == [1, 1]
    assert processor.process_outputs([a[1], b[1]]) == ([], [])
    assert processor.process_outputs([b[2]]) == ([], [])
    (due,), _ = processor.process_outputs([b[3]])
    assert {c.index: len(c.token_ids) for c in due.outputs} == {0: 1, 1: 3}


def test_weight_versions_span_the_tokens_each_version_sampled(tokenizer):
    from vllm.outputs import WeightVersionSpan

    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [make_request("r", stop=["test"])])
    outs = token_outputs(tokenizer, "r")  # "Hello world, this is a test."
    versions = ["default"] * 3 + ["v1"] * 2 + ["v2"] * (len(outs) - 5)
    results = []
    for out, version in zip(outs, versions, strict=True):
        step, _ = processor.process_outputs([out], version)
        results += step
        if results and results[-1].finished:
            break
    final = results[-1].outputs[0]
    assert [r.outputs[0].weight_versions for r in results[:-1]] == [None] * (len(results) - 1)
    assert len(final.token_ids) == 7  # "Hello world, this is a test": the "." never came
    assert final.weight_versions == [
        WeightVersionSpan("default", 0, 3), WeightVersionSpan("v1", 3, 5),
        WeightVersionSpan("v2", 5, 7),
    ]  # fmt: skip
    # An engine that names no version: no spans.
    processor.add_request("q", None, [make_request("q")])
    (unlabelled,) = run(processor, token_outputs(tokenizer, "q"))[-1:]
    assert unlabelled.outputs[0].weight_versions is None
