"""Suffix decoding (vLLM's ``suffix`` method): its config keys, the proposer's bookkeeping
of what the suffix cache holds, the scheduler's drafts, and whole engines whose greedy
outputs must equal plain decoding's."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm.config import SpeculativeConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

from ..core.conftest import make_request
from ..core.sched.helpers import make_scheduler
from .chat_engines import CODE, chat, check_limits_hold

SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}


# -- config -------------------------------------------------------------------------------
def test_config_defaults_as_vllm(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.config"):
        c = SpeculativeConfig({"method": "suffix"})
    assert c.method == "suffix" and c.num_speculative_tokens == 24  # the tree depth
    assert "num_speculative_tokens defaults to 24" in caplog.text
    assert (
        c.suffix_decoding_max_tree_depth,
        c.suffix_decoding_max_cached_requests,
        c.suffix_decoding_max_spec_factor,
        c.suffix_decoding_min_token_prob,
    ) == (24, 10000, 1.0, 0.1)
    assert not c.uses_draft_model and c.num_lookahead_tokens == 0  # no model, no slots
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.config"):
        c = SpeculativeConfig({**SUFFIX, "suffix_decoding_max_tree_depth": 8})
    assert c.num_speculative_tokens == 3 and c.suffix_decoding_max_tree_depth == 8
    assert "defaults" not in caplog.text
    # Without the key, num_speculative_tokens follows the depth given.
    assert SpeculativeConfig({"method": "suffix", "suffix_decoding_max_tree_depth": 5}) == (
        SpeculativeConfig({**SUFFIX, "num_speculative_tokens": 5,
                           "suffix_decoding_max_tree_depth": 5})
    )  # fmt: skip


def test_ints_are_taken_where_floats_are():
    c = SpeculativeConfig(
        {**SUFFIX, "suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 1}
    )
    assert c.suffix_decoding_max_spec_factor == 2.0 and c.suffix_decoding_min_token_prob == 1.0
    c = SpeculativeConfig(
        {**SUFFIX, "suffix_decoding_max_cached_requests": 0, "suffix_decoding_min_token_prob": 0}
    )
    assert c.suffix_decoding_max_cached_requests == 0  # no global tree


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("suffix_decoding_max_tree_depth", 0),
        ("suffix_decoding_max_tree_depth", -3),
        ("suffix_decoding_max_tree_depth", 2.5),
        ("suffix_decoding_max_tree_depth", True),
        ("suffix_decoding_max_tree_depth", "24"),
        ("suffix_decoding_max_cached_requests", -1),
        ("suffix_decoding_max_cached_requests", 1.5),
        ("suffix_decoding_max_cached_requests", False),
        ("suffix_decoding_max_spec_factor", -0.5),
        ("suffix_decoding_max_spec_factor", float("inf")),
        ("suffix_decoding_max_spec_factor", float("nan")),
        ("suffix_decoding_max_spec_factor", True),
        ("suffix_decoding_max_spec_factor", "1"),
        ("suffix_decoding_min_token_prob", -0.1),
        ("suffix_decoding_min_token_prob", 1.5),
        ("suffix_decoding_min_token_prob", float("nan")),
        ("suffix_decoding_min_token_prob", True),
        ("suffix_decoding_min_token_prob", None),
    ],
)
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=rf"^speculative_config\.{key} "):
        SpeculativeConfig({**SUFFIX, key: value})


@pytest.mark.parametrize("k", [0, 33, True, 2.0])
def test_num_speculative_tokens_stays_in_1_to_32(k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig({**SUFFIX, "num_speculative_tokens": k})


def test_a_tree_deeper_than_32_needs_num_speculative_tokens():
    deep = {"method": "suffix", "suffix_decoding_max_tree_depth": 40}
    with pytest.raises(
        ValueError,
        match=r"num_speculative_tokens must be given .* suffix_decoding_max_tree_depth 40",
    ):
        SpeculativeConfig(deep)
    assert SpeculativeConfig({**deep, "num_speculative_tokens": 8}).num_speculative_tokens == 8


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ({**SUFFIX, "prompt_lookup_min": 2}, "prompt_lookup_min"),
        ({**SUFFIX, "model": "some/draft"}, "model"),
        ({**SUFFIX, "quantization": "fp8"}, "quantization"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8},
            "suffix_decoding_max_tree_depth",
        ),
        (
            {
                "method": "draft_model",
                "model": "d",
                "num_speculative_tokens": 3,
                "suffix_decoding_min_token_prob": 0.5,
            },
            "suffix_decoding_min_token_prob",
        ),  # fmt: skip
    ],
)
def test_keys_of_another_method_are_refused(spec, key):
    with pytest.raises(ValueError, match=rf"speculative_config\.{key} is a key of method"):
        SpeculativeConfig(spec)


def test_the_spec_method_flag_names_suffix():
    from vllm.entrypoints.cli.main import make_parser
    from vllm.entrypoints.cli.serve import build_config

    parse = make_parser().parse_args
    config = build_config(parse(["serve", "--spec-method", "suffix", "--spec-tokens", "4"]))
    spec = config.speculative_config
    assert spec.method == "suffix" and spec.num_speculative_tokens == 4
    assert spec.suffix_decoding_max_tree_depth == 24 and config.draft_model_config is None
    assert SpeculativeConfig(spec_method="suffix") == SpeculativeConfig({"method": "suffix"})


# -- the proposer's bookkeeping, against a cache that records its calls --------------------
class RecordingCache:
    """``SuffixDecodingCache``'s interface; ``speculate`` drafts ``next_draft``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.active: dict[str, None] = {}
        self.cached: dict[str, None] = {}
        self.next_draft = [7, 8, 9, 10]

    @property
    def active_requests(self):
        return self.active.keys()

    @property
    def cached_requests(self):
        return self.cached.keys()

    def start_request(self, req_id, prompt_token_ids):
        assert req_id not in self.active and req_id not in self.cached
        self.active[req_id] = self.cached[req_id] = None
        self.calls.append(("start", req_id, list(prompt_token_ids)))

    def add_active_response(self, req_id, token_ids):
        assert req_id in self.active
        self.calls.append(("add", req_id, list(token_ids)))

    def stop_request(self, req_id):
        del self.active[req_id]
        self.calls.append(("stop", req_id))

    def evict_cached_response(self, req_id):
        del self.cached[req_id]
        self.calls.append(("evict", req_id))

    def speculate(self, req_id, context, max_spec_tokens, max_spec_factor, min_token_prob):
        self.calls.append(("speculate", req_id, list(context), max_spec_tokens,
                           max_spec_factor, min_token_prob))  # fmt: skip
        return SimpleNamespace(token_ids=self.next_draft[:max_spec_tokens])


def _recording_proposer(
    k: int = 3, depth: int = 4
) -> tuple[SuffixDecodingProposer, RecordingCache]:
    proposer = SuffixDecodingProposer.__new__(SuffixDecodingProposer)
    proposer.k, proposer.max_tree_depth = k, depth
    proposer.max_spec_factor, proposer.min_token_prob = 1.5, 0.2
    proposer.cache, proposer._num_appended = RecordingCache(), {}
    return proposer, proposer.cache


def test_the_prompt_is_started_then_only_new_outputs_are_appended():
    proposer, cache = _recording_proposer(k=3, depth=4)
    tokens = [1, 2, 3, 4, 5, 6, 40]  # a prompt of 6, one output
    assert proposer.propose("r", tokens, limit=5, num_prompt_tokens=6) == [7, 8, 9]
    assert cache.calls == [
        ("start", "r", [1, 2, 3, 4, 5, 6]),
        ("add", "r", [40]),
        ("speculate", "r", [4, 5, 6, 40], 3, 1.5, 0.2),  # the last depth tokens, min(k, limit)
    ]
    cache.calls.clear()
    tokens += [41, 42]  # two tokens in one step (a draft kept)
    assert proposer.propose("r", tokens, limit=2, num_prompt_tokens=6) == [7, 8]
    assert cache.calls == [("add", "r", [41, 42]), ("speculate", "r", [6, 40, 41, 42], 2, 1.5, 0.2)]
    cache.calls.clear()
    tokens.append(43)  # no room for drafts: the token is still appended
    assert proposer.propose("r", tokens, limit=0, num_prompt_tokens=6) == []
    assert cache.calls == [("add", "r", [43])]
    cache.calls.clear()
    assert proposer.propose("r", tokens, limit=1, num_prompt_tokens=6) == [7]  # nothing new
    assert cache.calls == [("speculate", "r", [40, 41, 42, 43], 1, 1.5, 0.2)]


def test_forget_stops_the_request_and_a_reused_id_starts_afresh():
    proposer, cache = _recording_proposer()
    proposer.propose("r", [1, 2, 3, 9], limit=3, num_prompt_tokens=3)
    proposer.forget("r")
    assert "r" not in cache.active_requests and "r" in cache.cached_requests  # kept
    proposer.forget("r")  # a second finish, or one never proposed for: nothing
    proposer.forget("never")
    cache.calls.clear()
    proposer.propose("r", [5, 6, 7], limit=3, num_prompt_tokens=3)  # the id reused
    assert cache.calls[:2] == [("evict", "r"), ("start", "r", [5, 6, 7])]
    assert ("add", "r", []) not in cache.calls  # no output yet: nothing appended


def test_a_shorter_sequence_restarts_the_request():
    proposer, cache = _recording_proposer()
    proposer.propose("r", [1, 2, 3, 9, 9, 9], limit=3, num_prompt_tokens=3)
    cache.calls.clear()
    proposer.propose("r", [1, 2, 3, 4], limit=3, num_prompt_tokens=3)
    assert cache.calls[:4] == [
        ("stop", "r"),
        ("evict", "r"),
        ("start", "r", [1, 2, 3]),
        ("add", "r", [4]),
    ]


def test_the_draft_is_cut_to_the_limit():
    proposer, cache = _recording_proposer(k=4)
    cache.speculate = lambda *args, **kwargs: SimpleNamespace(token_ids=[1, 2, 3, 4, 5])
    assert proposer.propose("r", [1, 2], limit=2, num_prompt_tokens=1) == [1, 2]


# -- the proposer over the real suffix trees ----------------------------------------------
def _proposer(k: int = 3, depth: int = 24, cached: int = 100) -> SuffixDecodingProposer:
    return SuffixDecodingProposer(k, depth, cached, max_spec_factor=1.0, min_token_prob=0.1)


def test_drafts_come_from_the_prompt():
    proposer = _proposer(k=3)
    prompt = list(range(100, 120))
    # The output so far repeats the prompt's start: 4 tokens matched, 1.0 draft per token.
    assert proposer.propose("r", [*prompt, 100, 101, 102, 103], 8, len(prompt)) == [104, 105, 106]
    assert proposer.propose("r", [*prompt, 100, 101, 102, 103], 1, len(prompt)) == [104]
    assert proposer.propose("q", [*prompt, 7, 8], 8, len(prompt)) == []  # nothing matches


def test_a_phrase_repeated_in_the_output_is_drafted():
    proposer = _proposer(k=3, cached=0)
    prompt = [1, 2, 3]
    tokens = [*prompt]
    for t in [50, 51, 52, 53, 54, 60, 50, 51, 52]:  # one output token a step
        tokens.append(t)
        draft = proposer.propose("r", tokens, 3, len(prompt))
    assert draft == [53, 54, 60]


def test_a_past_response_drafts_for_a_new_request():
    # The global tree: a finished request's response drafts for another request with a
    # different prompt, unless max_cached_requests is 0.
    response = [70, 71, 72, 73, 74, 75, 76]
    for cached, want in ((10, [72, 73]), (0, [])):  # "70 71" matched: two drafts
        proposer = _proposer(k=3, cached=cached)
        proposer.propose("a", [1, 2, *response], 3, 2)
        proposer.forget("a")
        assert proposer.propose("b", [9, 9, 70, 71], 3, 2) == want, cached


def test_reused_ids_and_restarts_keep_the_cache_consistent():
    proposer = _proposer(k=3)
    proposer.propose("r", [1, 2, 3, 4, 5, 1, 2], 3, 5)
    proposer.forget("r")
    assert "r" in proposer.cache.cached_requests
    # A new request under the same id: its own tree, "8 9" matched, two drafts.
    assert proposer.propose("r", [8, 9, 10, 8, 9], 3, 3) == [10, 8]
    assert proposer.propose("r", [8, 9, 10, 8], 3, 3) == [9]  # shorter: started again
    proposer.forget("r")
    assert not proposer.cache.active_requests


# -- the scheduler --------------------------------------------------------------------------
def test_the_scheduler_schedules_suffix_drafts_and_forgets_finished_requests():
    sched = make_scheduler(speculative=SUFFIX)
    assert isinstance(sched.proposer, SuffixDecodingProposer)
    req = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], temperature=0, max_tokens=3)
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput([req.request_id], {req.request_id: [1]}))
    so = sched.schedule()
    # Known: 1..9 then 1: "1" was followed by "2" (one token matched: one draft).
    assert so.scheduled_spec_decode_tokens == {req.request_id: [2]}
    out = sched.update_from_output(
        so, ModelRunnerOutput([req.request_id], {req.request_id: [2, 3]})
    )
    stats = out.scheduler_stats.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 1, 1)
    assert req.is_finished()  # max_tokens 3
    sched.schedule()  # the finished request's tree goes with the next step's output
    assert not sched.proposer.cache.active_requests
    assert req.request_id in sched.proposer.cache.cached_requests
    sched.check_invariants()


# -- whole engines ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    from vllm import LLM

    plain = LLM(max_num_seqs=4)
    fast = LLM(max_num_seqs=4, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    yield plain, fast
    plain.shutdown()
    fast.shutdown()


def _counted(llm, *args):
    """``_chat``'s result and the step's spec-decode counters summed: (drafts, draft
    tokens, accepted), and how many steps it took."""
    step, seen = llm.engine_core.step, []

    def counting():
        out = step()
        spec = out.scheduler_stats.spec_decoding_stats if out.scheduler_stats else None
        seen.append(spec)
        return out

    llm.engine_core.step = counting
    try:
        got = chat(llm, *args)
    finally:
        llm.engine_core.step = step
    stats = [s for s in seen if s is not None]
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    totals = tuple(sum(getattr(s, name) for s in stats) for name in names)
    return got, totals, len(seen)


def test_greedy_outputs_equal_plain_decoding(engines):
    plain, fast = engines
    params = SamplingParams(temperature=0, max_tokens=80)
    texts = (
        "Repeat this code exactly:\n" + CODE,
        "Copy this list: red, green, blue, red, green, blue, cyan",
        "What is the capital of France?",
    )
    base = chat(plain, params, *texts)
    got, (drafts, draft_tokens, accepted), steps = _counted(fast, params, *texts)
    assert got == base
    assert drafts > 0 and 20 < accepted <= draft_tokens  # the copying turns took drafts
    assert steps < max(len(ids) for ids, _, _ in base)  # fewer steps than tokens


def test_a_repeated_request_drafts_from_its_past_response(engines):
    # An agent sends the same kind of turn again: the global tree holds the first
    # response, so the second is drafted from it (a turn that copies nothing).
    plain, fast = engines
    params = SamplingParams(temperature=0, max_tokens=40)
    text = "Name three animals that live in the sea and say one thing about each."
    base = chat(plain, params, text)
    first, (_, _, accepted_first), _ = _counted(fast, params, text)
    second, (_, _, accepted_second), _ = _counted(fast, params, text)
    assert first == second == base
    assert accepted_second > accepted_first and accepted_second >= len(base[0][0]) // 2


def test_limits_hold_with_drafts(engines):
    check_limits_hold(*engines)


def test_sampled_requests_take_suffix_drafts_by_rejection_sampling(engines):
    # A temperature just above greedy's threshold: the distribution is (all but) the
    # argmax, so the drafts, kept as point masses, give plain greedy decoding's tokens.
    plain, fast = engines
    text = "Repeat this code exactly:\n" + CODE
    greedy = chat(plain, SamplingParams(temperature=0, max_tokens=60), text)
    nearly = SamplingParams(temperature=2e-5, max_tokens=60, seed=0)
    got, (_, _, accepted), _ = _counted(fast, nearly, text)
    assert got == greedy and accepted > 10


@pytest.mark.slow
def test_server_counts_suffix_drafts(tmp_path):
    from tests.utils import RemoteServer

    server = RemoteServer(
        "--speculative-config", '{"method": "suffix"}', log_path=str(tmp_path / "log")
    )
    try:
        for _ in range(2):  # the second time drafted from the first's output too
            reply = server.client().chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": "Repeat this code exactly:\n" + CODE}],
                max_tokens=60,
                temperature=0,
            )
            assert "def area" in reply.choices[0].message.content
        metrics = server.metrics()
        assert metrics["vllm:spec_decode_num_drafts_total"] > 0
        proposed = metrics["vllm:spec_decode_num_draft_tokens_total"]
        accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= proposed
    finally:
        server.stop()
