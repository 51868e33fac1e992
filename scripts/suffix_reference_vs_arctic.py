"""Our suffix trees against Arctic Inference's, the implementation vLLM's ``suffix`` method
calls: the same random agent-like workload (prompts that repeat earlier outputs, outputs
that copy earlier text, requests stopped, ids reused, FIFO eviction of the global tree)
goes to both ``SuffixDecodingCache``s, and every draft must be equal: tokens,
probabilities, score and match length.

Needs ``arctic_inference.suffix_decoding`` importable (its suffix tree builds alone from
the sdist's ``csrc/suffix_decoding`` with nanobind and CMake); not part of the test suite.

    PYTHONPATH=/path/to/arctic .venv/bin/python scripts/suffix_reference_vs_arctic.py \
        --seeds 200 [--python]
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np

from vllm.v1.spec_decode.suffix_tree import SuffixDecodingCache


def drive(seed: int, ours: SuffixDecodingCache, theirs, depth: int, steps: int) -> list[int]:
    """Runs one workload through both caches; the drafts compared and the non-empty."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 8, 50])
    corpus: list[list[int]] = [[rng.randrange(vocab) for _ in range(40)]]
    tokens: dict[str, list[int]] = {}
    next_id, compared = 0, [0, 0]
    for _ in range(steps):
        if not tokens or (rng.random() < 0.1 and len(tokens) < 6):
            req = f"r{rng.randrange(next_id + 1)}" if rng.random() < 0.2 else f"r{next_id}"
            next_id += 1
            if req in tokens:
                continue
            for cache in (ours, theirs):  # vLLM's proposer: a reused id starts afresh
                if req in cache.cached_requests:
                    cache.evict_cached_response(req)
            src = rng.choice(corpus)
            start = rng.randrange(len(src))
            prompt = src[start : start + rng.randrange(1, 60)] + [
                rng.randrange(vocab) for _ in range(rng.randrange(0, 10))
            ]
            tokens[req] = list(prompt)
            ours.start_request(req, prompt)
            theirs.start_request(req, np.array(prompt, dtype=np.int32))
            continue
        req = rng.choice(sorted(tokens))
        if rng.random() < 0.05:
            ours.stop_request(req)
            theirs.stop_request(req)
            corpus.append(tokens.pop(req))
            continue
        if rng.random() < 0.5:  # copies text seen before
            src = rng.choice(corpus + list(tokens.values()))
            start = rng.randrange(len(src))
            new = src[start : start + rng.choice([1, 2, 4])]
        else:
            new = [rng.randrange(vocab)]
        tokens[req] += new
        ours.add_active_response(req, new)
        theirs.add_active_response(req, new)
        context = tokens[req][-depth:]
        kwargs = dict(
            max_spec_tokens=rng.choice([1, 4, 8, depth]),
            max_spec_factor=rng.choice([1.0, 0.5, 2.0]),
            max_spec_offset=rng.choice([0.0, 1.0]),
            min_token_prob=rng.choice([0.1, 0.0, 0.4]),
        )
        a = ours.speculate(req, context, **kwargs)
        b = theirs.speculate(req, np.array(context, dtype=np.int32), **kwargs)
        if (a.token_ids, a.probs, a.score, a.match_len) != (
            list(b.token_ids),
            list(b.probs),
            b.score,
            b.match_len,
        ):
            raise AssertionError(f"seed {seed}: ours {a} != arctic's {b} for {kwargs}")
        compared[0] += 1
        compared[1] += bool(a.token_ids)
    return compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--python", action="store_true", help="our Python tree, not the native")
    args = parser.parse_args()
    from arctic_inference.suffix_decoding import SuffixDecodingCache as ArcticCache

    drafts = nonempty = 0
    for seed in range(args.seeds):
        depth = random.Random(-seed).choice([2, 4, 8, 24])
        cached = random.Random(~seed).choice([0, 1, 3, -1])
        ours = SuffixDecodingCache(depth, cached, native=not args.python)
        theirs = ArcticCache(max_tree_depth=depth, max_cached_requests=cached)
        n, m = drive(seed, ours, theirs, depth, args.steps)
        drafts, nonempty = drafts + n, nonempty + m
    tree = "Python" if args.python else "native"
    print(
        f"{args.seeds} workloads, {drafts} drafts ({nonempty} not empty): equal to Arctic "
        f"Inference's ({tree} tree)"
    )


if __name__ == "__main__":
    sys.exit(main())
