"""Suffix Decoding's tree on the host: the native path-compressed tree against the Python
trie (the fallback), in the same run.

For a prompt of N tokens (agent-like: a file read, then rewritten with changes, repeated
across turns) it times what the scheduler pays per request: building the request's tree
over the prompt, then per decode step appending one token and speculating (the request's
own tree and a global tree over earlier outputs). It prints milliseconds, nodes, and the
native tree's speedup.

    .venv/bin/python benchmarks/benchmark_suffix_tree.py --prompt-tokens 2000 8000 32000

Figures on the machine it runs on (it prints the CPU and its vector extensions); run it
on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_gpu import cpu_model, vector_extensions  # noqa: E402

from vllm.v1.spec_decode.suffix_tree import SuffixDecodingCache, native_tree_class  # noqa: E402


def agent_prompt(n: int, rng: random.Random, vocab: int = 32000) -> list[int]:
    """``n`` tokens: a file of ~n/4 tokens, then edited copies of it (a line changed here
    and there), as turns of an agent that reads and rewrites it."""
    file = [rng.randrange(vocab) for _ in range(max(n // 4, 16))]
    tokens: list[int] = []
    while len(tokens) < n:
        copy = list(file)
        for _ in range(8):
            at = rng.randrange(len(copy))
            copy[at : at + 10] = [rng.randrange(vocab) for _ in range(10)]
        tokens += copy
        file = copy
    return tokens[:n]


def run(native: bool, prompt: list[int], steps: int, depth: int, k: int) -> dict:
    cache = SuffixDecodingCache(depth, 10000, native=native)
    # Earlier requests' outputs in the global tree (8 of 512 tokens, from the same file).
    rng = random.Random(1)
    for i in range(8):
        start = rng.randrange(max(len(prompt) - 512, 1))
        cache.start_request(f"old{i}", prompt[:16])
        cache.add_active_response(f"old{i}", prompt[start : start + 512])
        cache.stop_request(f"old{i}")
    t0 = time.perf_counter()
    cache.start_request("r", prompt)
    build = time.perf_counter() - t0
    # Decode: the output copies the prompt's last file from a point, as an edit would.
    tokens = list(prompt)
    source = prompt[len(prompt) // 2 :]
    drafted = 0
    t0 = time.perf_counter()
    for i in range(steps):
        tokens.append(source[i % len(source)])
        cache.add_active_response("r", tokens[-1:])
        drafted += len(cache.speculate("r", tokens[-depth:], k).token_ids)
    step = (time.perf_counter() - t0) / steps
    nodes = cache._local["r"].num_nodes()
    return {"build_ms": build * 1e3, "step_us": step * 1e6, "nodes": nodes, "drafted": drafted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[2000, 8000, 32000])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--k", type=int, default=24)
    parser.add_argument("--python-max", type=int, default=32000,
                        help="skip the Python tree above this many prompt tokens")  # fmt: skip
    args = parser.parse_args()
    if native_tree_class() is None:
        sys.exit("the native kernels are not built: make kernels")
    print(f"machine: {cpu_model()} ({vector_extensions()})")
    print(f"depth {args.depth}, k {args.k}, {args.steps} decode steps (append 1 + speculate)")
    for n in args.prompt_tokens:
        prompt = agent_prompt(n, random.Random(n))
        nat = run(True, prompt, args.steps, args.depth, args.k)
        line = (f"N={n:>6}: native build {nat['build_ms']:8.1f} ms, step {nat['step_us']:7.1f} us, "
                f"{nat['nodes']:>8} nodes")  # fmt: skip
        if n <= args.python_max:
            py = run(False, prompt, args.steps, args.depth, args.k)
            assert py["drafted"] == nat["drafted"], "the trees' drafts differ"
            line += (f" | python build {py['build_ms']:9.1f} ms, step {py['step_us']:8.1f} us, "
                     f"{py['nodes']:>8} nodes | native {py['build_ms'] / nat['build_ms']:.0f}x "
                     f"faster to build, {py['step_us'] / nat['step_us']:.1f}x a step")  # fmt: skip
        print(line + f"; {nat['drafted'] / args.steps:.1f} drafts a step")


if __name__ == "__main__":
    main()
