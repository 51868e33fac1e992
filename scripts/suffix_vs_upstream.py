"""Our engine's suffix decoding against upstream vLLM 0.32's (its CPU build, ``make
setup-upstream``, with Arctic Inference's suffix tree importable), end to end.

1. (our venv) writes a tiny random Llama (tests/eagle_checkpoints.py) into ``--out-dir``;
2. (upstream's venv, this file again with ``--upstream``) runs upstream's ``vllm.LLM``
   greedily over token-id prompts, one engine without speculative decoding and one with
   ``{"method": "suffix", "num_speculative_tokens": k}``, each prompt alone and in order
   (so the global tree holds the earlier prompts' outputs), recording the outputs and
   the spec-decode counters of each;
3. (our venv) does the same with our ``vllm.LLM`` and compares, prompt by prompt, the
   outputs, and step by step the drafts each engine's proposer returned (both engines run
   in-process with their proposer wrapped). One difference is by design: vLLM drafts up
   to k even in a request's last steps and counts drafts past ``max_tokens`` (accepted,
   then cut); ours asks the tree for no more than ``max_tokens`` leaves room for. So the
   drafts of steps where that room is under k are checked only to fit it, and the
   counters (also printed) differ by those tail drafts.

    .venv/bin/python scripts/suffix_vs_upstream.py --out-dir /tmp/suffix-parity \\
        --arctic /path/with/arctic_inference [--k 4]

Arctic Inference is an sdist only; its suffix tree builds alone from the sdist's
``csrc/suffix_decoding`` (nanobind, CMake) into ``arctic_inference/suffix_decoding/_C``.
Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    [7, 8, 9, 10] * 6,
    [200, 13, 13, 13, 45, 99] * 5,
    [3 + (5 * i) % 90 for i in range(30)],
    [7, 8, 9, 10] * 3 + [11, 12],
    list(range(40, 57)) * 2,
    [5, 6],
]


def _parity_module():
    path = REPO / "scripts" / "upstream_eagle_parity.py"
    spec = importlib.util.spec_from_file_location("upstream_eagle_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(target: Path, spec: dict | None, max_tokens: int) -> tuple[list, list, list]:
    """One engine (``vllm`` is whichever this process imports), in this process: each
    prompt alone, in order. Returns (outputs, counters, drafts) per prompt; drafts lists
    each proposal of the suffix proposer as (draft, room), room being what ``max_tokens``
    leaves for drafts (None for upstream, which does not cap by it)."""
    import vllm
    from vllm import LLM, SamplingParams

    upstream = "site-packages" in (vllm.__file__ or "")
    par = _parity_module()
    kwargs = dict(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=512,
        max_num_seqs=1,
    )
    if upstream:  # get_metrics needs its stat loggers; the drafter in this process
        kwargs.update(disable_log_stats=False, distributed_executor_backend="uni")
    if spec is not None:
        kwargs["speculative_config"] = spec
    record: list = []
    if spec is not None and upstream:
        _record_upstream(record)
    llm = LLM(**kwargs)
    if spec is not None and not upstream:
        _record_ours(llm.engine_core.scheduler.proposer, record, max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs, counters, drafts = [], [], []
    try:
        for prompt in PROMPTS:
            before, seen = par.spec_metrics(llm), len(record)
            result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            counters.append(par.delta(par.spec_metrics(llm), before))
            outputs.append(list(result.outputs[0].token_ids))
            drafts.append(record[seen:])
    finally:
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        elif hasattr(llm, "shutdown"):
            llm.shutdown()
    return outputs, counters, drafts


def _record_upstream(record: list) -> None:
    """Upstream's SuffixDecodingProposer.propose, wrapped: each request's draft a step."""
    from vllm.v1.spec_decode import suffix_decoding

    propose = suffix_decoding.SuffixDecodingProposer.propose

    def recorded(self, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kw):
        drafts = propose(self, num_speculative_tokens, input_batch, sampled_token_ids, *args,
                         **kw)  # fmt: skip
        record.extend((list(d), None) for d, s in zip(drafts, sampled_token_ids, strict=True) if s)
        return drafts

    suffix_decoding.SuffixDecodingProposer.propose = recorded


def _record_ours(proposer, record: list, max_tokens: int) -> None:
    propose = proposer.propose

    def recorded(req_id, token_ids, limit, num_prompt_tokens):
        draft = propose(req_id, token_ids, limit, num_prompt_tokens=num_prompt_tokens)
        record.append((list(draft), max_tokens - (len(token_ids) - num_prompt_tokens) - 1))
        return draft

    proposer.propose = recorded


def same_drafts(ours: list, theirs: list, k: int) -> tuple[bool, int]:
    """Whether our proposals are upstream's, step by step (upstream may propose once more
    after the last step); where ``max_tokens`` leaves room for fewer than k drafts, ours
    need only fit it. Returns (equal, steps compared exactly)."""
    if not len(ours) <= len(theirs) <= len(ours) + 1:
        return False, 0
    exact = 0
    for (draft, room), (up, _) in zip(ours, theirs, strict=False):  # theirs: 1 more
        if room >= k:
            if draft != up:
                return False, exact
            exact += 1
        elif len(draft) > max(room, 0):
            return False, exact
    return True, exact


def run_upstream(target: Path, k: int, max_tokens: int, json_out: Path) -> None:
    par = _parity_module()
    defaults = {
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    par.isolate_from_repo()
    import vllm

    if "site-packages" not in (vllm.__file__ or ""):
        raise RuntimeError(f"imported vllm from {vllm.__file__}, not upstream's")
    report = {"upstream_vllm": vllm.__version__, "k": k, "max_tokens": max_tokens}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    report["baseline"], _, _ = run(target, None, max_tokens)
    spec = {"method": "suffix", "num_speculative_tokens": k}
    report["outputs"], report["metrics"], report["drafts"] = run(target, spec, max_tokens)
    json_out.write_text(json.dumps(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--arctic", type=Path, help="a folder holding arctic_inference/")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = args.out_dir.resolve()
    record = out_dir / "upstream.json"
    target = out_dir / "target"
    if args.upstream:  # step 2, in upstream's venv
        run_upstream(target, args.k, args.max_tokens, record)
        return 0
    if args.arctic is None:
        parser.error("--arctic is needed: upstream's suffix method imports arctic_inference")
    sys.path.insert(0, str(REPO))
    from tests.eagle_checkpoints import save_tiny_target

    out_dir.mkdir(parents=True, exist_ok=True)
    save_tiny_target(target)
    python = REPO / ".venv-upstream" / "bin" / "python"
    cmd = [str(python), __file__, "--upstream", "--out-dir", str(out_dir), "--k", str(args.k)]
    cmd += ["--max-tokens", str(args.max_tokens)]
    env = dict(os.environ, PYTHONPATH=str(args.arctic.resolve()))
    started = time.monotonic()
    subprocess.run(cmd, check=True, cwd=out_dir, env=env)
    print(f"upstream: {time.monotonic() - started:.0f} s", file=sys.stderr)
    up = json.loads(record.read_text())
    base, _, _ = run(target, None, args.max_tokens)
    spec = {"method": "suffix", "num_speculative_tokens": args.k}
    outputs, counters, drafts = run(target, spec, args.max_tokens)
    same_out = outputs == up["outputs"] == up["baseline"] == base
    checks = [same_drafts(o, u, args.k) for o, u in zip(drafts, up["drafts"], strict=True)]
    same = [ok for ok, _ in checks]
    print(f"upstream vLLM {up['upstream_vllm']}, suffix decoding, k = {args.k}, "
          f"{args.max_tokens} tokens a prompt, {len(PROMPTS)} prompts in order")  # fmt: skip
    print(f"outputs equal (ours and upstream's, with and without suffix decoding): {same_out}")
    print(f"drafts equal per prompt: {same}; steps compared exactly: {[n for _, n in checks]} "
          f"of {[len(d) for d in drafts]}")  # fmt: skip
    print("counters (differing by the drafts past max_tokens that vLLM proposes and counts):")
    for ours, theirs in zip(counters, up["metrics"], strict=True):
        print(f"  ours     {ours}\n  upstream {theirs}")
    return 0 if same_out and all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
