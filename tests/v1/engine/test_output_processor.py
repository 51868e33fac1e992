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
