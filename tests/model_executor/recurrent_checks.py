"""Checks shared by the tests of models with recurrent layers (Qwen3-Next / Qwen3.5's Gated
DeltaNet, the Mamba2 hybrids): a step through ``forward`` with a ``RecurrentBatch`` over
real pools, a prompt fed in chunks and decodes equal to its whole forward, and a mixed step
(a fresh prefill over a stale slot between decodes) equal to each sequence alone."""

from __future__ import annotations

import functools
import shutil

import torch
from safetensors.torch import save_file

from tests.tiny_models import load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.layers.recurrent import RecurrentBatch, allocate_states


@functools.cache
def runner_for(path, dtype: str = "float32"):
    """Our CPU runner of the checkpoint at ``path`` (128 positions), one a path and dtype."""
    return load_cpu_runner(ModelConfig(model=str(path), max_model_len=128, dtype=dtype))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits of one prompt ``ids``."""
    with torch.inference_mode():
        return hf(input_ids=ids[None]).logits[0].float()


def close(got: torch.Tensor, want: torch.Tensor, what: object = "") -> None:
    assert torch.allclose(got, want, atol=1e-4), (what, (got - want).abs().max())


def run_step(model, runner, seqs, pools) -> torch.Tensor:
    """One forward over ``seqs``: per sequence in row order (its tokens' first position,
    its token ids, its block table, its slot, fresh) -> the step's fp32 logits."""
    meta = runner.metadata_builder.build_metadata([(s[0], len(s[1]), s[2]) for s in seqs])
    positions = torch.cat([torch.arange(s[0], s[0] + len(s[1])) for s in seqs])
    batch = RecurrentBatch([len(s[1]) for s in seqs], [s[4] for s in seqs],
                           [s[3] for s in seqs], pools)  # fmt: skip
    with torch.inference_mode():
        hidden = model(torch.cat([s[1] for s in seqs]), positions, meta, runner.kv_caches,
                       recurrent=batch)  # fmt: skip
        return model.compute_logits(hidden)


def check_chunks_continue(runner, ids: torch.Tensor, chunks: tuple[int, ...]) -> torch.Tensor:
    """``ids`` fed in ``chunks`` (a chunk of 1 after the first: a decode) in slot 2 of 4:
    each step's last row is the whole forward's row, and no other slot is written.
    Returns the whole forward's logits."""
    model = runner.model
    whole = runner_logits(runner, ids)
    pools = allocate_states(model.recurrent_state_specs(torch.float32), 4, "cpu")
    table = list(range(1, 9))
    start = 0
    for n in chunks:
        seq = (start, ids[start : start + n], table, 2, start == 0)
        last = run_step(model, runner, [seq], pools)[-1]
        start += n
        close(last, whole[start - 1], start)
    untouched = [p[[0, 1, 3]] for layer in pools for p in layer]
    assert all(not t.any() for t in untouched)  # only slot 2 was written
    return whole


def check_mixed_step(hf, runner, vocab: int) -> None:
    """One step of [decode of b, a fresh 11-token prompt a, decode of c], a's slot holding
    a stale state; then a decode-only step of all three in another order: every row equals
    transformers' logits of its sequence alone."""
    model = runner.model
    runner.initialize_kv_cache(1 + 3 * 4)
    tables = {n: list(range(1 + 4 * i, 5 + 4 * i)) for i, n in enumerate("abc")}
    slots = {"a": 3, "b": 0, "c": 2}
    g = torch.Generator().manual_seed(2)
    seqs = {
        n: torch.randint(0, vocab, (k,), generator=g)
        for n, k in zip("abc", (12, 14, 9), strict=True)
    }
    pools = allocate_states(model.recurrent_state_specs(torch.float32), 4, "cpu")
    for n in "bc":  # their prompts, but the last token, alone
        run_step(model, runner, [(0, seqs[n][:-2], tables[n], slots[n], True)], pools)
    for pool in (p for layer in pools for p in layer):
        pool[slots["a"]] = torch.randn(pool.shape[1:], generator=g) * 10  # stale
    b, a, c = seqs["b"], seqs["a"], seqs["c"]
    first = [(len(b) - 2, b[-2:-1], tables["b"], slots["b"], False),
             (0, a[:-1], tables["a"], slots["a"], True),
             (len(c) - 2, c[-2:-1], tables["c"], slots["c"], False)]  # fmt: skip
    logits = run_step(model, runner, first, pools)
    for row, name in ((0, "b"), (len(a), "c")):
        close(logits[row], hf_logits(hf, seqs[name][:-1])[-1], name)
    close(logits[1 : len(a)], hf_logits(hf, a[:-1]), "a")
    second = [(len(seqs[n]) - 1, seqs[n][-1:], tables[n], slots[n], False) for n in "cab"]
    logits = run_step(model, runner, second, pools)
    for row, name in enumerate("cab"):
        close(logits[row], hf_logits(hf, seqs[name])[-1], name)


def resaved(path, out, state: dict[str, torch.Tensor]):
    """The checkpoint of ``path`` copied to ``out`` with ``state`` for its tensors."""
    shutil.copytree(path, out)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def oracle_proposer(truth: list[list[int]], k: int = 3):
    """A ``propose`` for the scheduler's n-gram proposer that drafts each sequence's true
    continuation (``truth``: prompt and transformers' greedy answer, by prompt), wrong from
    a position that changes every call (none, the first, ..., the k-th): a random model
    repeats nothing for a real lookup to find, and this way every number of drafts kept
    occurs."""
    calls = [0]

    def propose(req_id, token_ids, limit, num_prompt_tokens=0):
        full = next(t for t in truth if list(token_ids) == t[: len(token_ids)])
        drafts = full[len(token_ids) : len(token_ids) + min(k, limit)]
        calls[0] += 1
        wrong = calls[0] % (k + 1) - 1  # -1: all right
        if 0 <= wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 1000
        return drafts

    return propose


def check_engine_turns(hf, path, vocab: int, monkeypatch) -> None:
    """Through ``vllm.LLM`` (``hf`` saved at ``path`` with a tokenizer of ``vocab``): three
    prompts at once in 16-token steps (fresh chunks, continued chunks and decodes in one
    batch), then a job's next turn (the first prompt, its answer and a tool's output),
    whose prefix hit restores a checkpoint of the recurrent states; then the same prompts
    with drafts verified (speculative decoding, ``oracle_proposer``'s drafts, the states
    rolled back to the tokens kept). Every answer is transformers' greedy one."""
    from tests.tiny_models import hf_greedy
    from tests.utils import copy_benchmark_tokenizer
    from vllm import LLM, SamplingParams

    hf.save_pretrained(path)
    copy_benchmark_tokenizer(path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (5, 23, 41)]
    tool = torch.randint(0, vocab, (7,), generator=g).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = hf_greedy(hf, prompts, 12)
    llm = LLM(model=str(path), kv_cache_memory="16MiB", max_num_batched_tokens=16,
              enable_prefix_caching=True)  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        answers = [list(o.outputs[0].token_ids) for o in outs]
        second = prompts[2] + answers[2] + tool
        turn = llm.generate({"prompt_token_ids": second}, params)[0]
        llm.engine_core.scheduler.check_invariants()
    finally:
        llm.shutdown()
    assert answers == expected
    assert turn.num_cached_tokens > 0
    assert list(turn.outputs[0].token_ids) == hf_greedy(hf, [second], 12)[0]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(model=str(path), kv_cache_memory="16MiB", speculative_config=spec)
    try:
        truth = [p + e for p, e in zip(prompts, expected, strict=True)]
        monkeypatch.setattr(llm.engine_core.scheduler.proposer, "propose", oracle_proposer(truth))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine_core.scheduler.check_invariants()
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
