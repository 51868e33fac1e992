"""Check tests/v1/spec_decode/test_eagle.py's plain-torch EAGLE reference against upstream
vLLM's own counters.

The test checks that our engine proposes exactly the reference's drafts. This script
closes the loop: it steps the reference as upstream vLLM 0.32 steps (always k drafts a
step, counted when verified, the request cut at max_tokens) over the checkpoints and
prompts of ``scripts/upstream_eagle_parity.py`` and compares, per prompt, the output and
the counters upstream recorded (drafts, draft tokens, accepted, accepted per position).

    .venv-upstream/bin/python scripts/upstream_eagle_parity.py --out-dir DIR \\
        --json-out DIR/upstream.json
    .venv/bin/python scripts/eagle_reference_vs_upstream.py DIR/upstream.json

Exits 1 on any difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_as_upstream(head, argmaxes, prompt: list[int], k: int, max_tokens: int):
    """Greedy speculative decoding of ``prompt`` as upstream vLLM 0.32 steps it: k drafts
    from ``head.drafts(tokens, k)`` every step, counted when verified against
    ``argmaxes(tokens)`` (the target's argmax at every position), the output cut at
    ``max_tokens``. Returns (output, upstream's counters for it)."""
    tokens = list(prompt) + [argmaxes(prompt)[-1]]
    counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
              "accepted_per_pos": [0] * k}  # fmt: skip
    while len(tokens) - len(prompt) < max_tokens:
        drafts = head.drafts(tokens, k)
        best = argmaxes(tokens + drafts)[len(tokens) - 1 :]
        kept = 0
        while kept < k and drafts[kept] == best[kept]:
            counts["accepted_per_pos"][kept] += 1
            kept += 1
        counts["num_drafts"] += 1
        counts["num_draft_tokens"] += k
        counts["num_accepted_tokens"] += kept
        tokens += drafts[:kept] + [best[kept]]
    return tokens[len(prompt) :][:max_tokens], counts


def main(path: str) -> int:
    from transformers import LlamaForCausalLM

    from tests.v1.spec_decode.test_eagle import RefHead

    torch.set_num_threads(1)
    up = json.loads(Path(path).read_text())
    k, max_tokens = up["k"], up["max_tokens"]
    target = LlamaForCausalLM.from_pretrained(up["target"]["path"], dtype=torch.float32).eval()

    def argmaxes(tokens: list[int]) -> list[int]:
        with torch.no_grad():
            return target(torch.tensor([tokens])).logits[0].argmax(-1).tolist()

    failed = False
    for name, variant in up["variants"].items():
        # A speculators-format draft: the reference reads the same head in EAGLE's format.
        folder = variant.get("reference_draft", variant["draft"])
        head = RefHead(Path(folder), target, variant["method"])
        ours = [step_as_upstream(head, argmaxes, p, k, max_tokens) for p in up["prompts"]]
        theirs = variant["one_by_one"]["metrics"]
        same_out = [o for o, _ in ours] == variant["outputs"]
        same = [c == u for (_, c), u in zip(ours, theirs, strict=True)]
        print(f"{name}: outputs equal {same_out}; counters equal per prompt {same}")
        for (_, c), u in zip(ours, theirs, strict=True):
            if c != u:
                print(f"  reference {c}\n  upstream  {u}")
        failed |= not (same_out and all(same))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
