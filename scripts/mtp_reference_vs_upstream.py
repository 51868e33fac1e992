"""Check tests/v1/spec_decode/test_mtp.py's reference for MTP layers (DeepSeek-V3's,
GLM-4.5's) against upstream vLLM 0.32 (its CPU build, ``make setup-upstream``).

The test checks that our engine proposes exactly the reference's drafts. This script
closes the loop, as ``eagle_reference_vs_upstream.py`` does for EAGLE heads:

1. (our venv) writes the test's tiny target of ``--family`` with an MTP layer into
   ``--out-dir``;
2. (upstream's venv, this file again with ``--upstream``) runs upstream's ``vllm.LLM``
   greedily over six token-id prompts, without speculative decoding and with
   ``{"method": "mtp", "num_speculative_tokens": k}``, each prompt alone, recording the
   outputs and the spec-decode counters (``upstream_eagle_parity.run_engine``);
3. (our venv) steps the reference as upstream steps (k drafts every step, counted when
   verified, the request cut at max_tokens) and compares, prompt by prompt, the outputs
   and the counters (drafts, draft tokens, accepted, accepted per position).

    .venv/bin/python scripts/mtp_reference_vs_upstream.py --out-dir /tmp/mtp-parity \\
        [--family deepseek_v3|glm4_moe] [--k 3]

Exits 1 on any difference. About a minute per engine on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    [3 + (5 * i) % 90 for i in range(30)],
    [7, 8, 9, 10] * 5,
    list(range(40, 57)),
    [11, 50, 50, 50, 2, 80] * 4,
    [60 + (i * 13) % 30 for i in range(45)],
    [5, 6],
]


def build(out_dir: Path, family: str) -> Path:
    """The test's checkpoint; a DeepSeek config names the V3 routing explicitly (upstream
    reads a missing ``topk_method`` as greedy, transformers and we as V3's ``noaux_tc``)."""
    sys.path.insert(0, str(REPO))
    from tests.v1.spec_decode.test_mtp import save_target_with_mtp

    target = out_dir / "target"
    # GLM: upstream's CPU attention takes no head of 16 (the test's), so 32
    overrides = {} if family == "deepseek_v3" else {"head_dim": 32}
    save_target_with_mtp(target, family, own_copies=family == "deepseek_v3", **overrides)
    if family == "deepseek_v3":
        config = json.loads((target / "config.json").read_text())
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def run_upstream(target: Path, k: int, max_tokens: int, json_out: Path) -> None:
    """Upstream's engines (run under .venv-upstream); their outputs and counters."""
    path = REPO / "scripts" / "upstream_eagle_parity.py"
    spec = importlib.util.spec_from_file_location("upstream_eagle_parity", path)
    par = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(par)
    defaults = {
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TOKENIZERS_PARALLELISM": "false",
        # run_engine asks for 512 positions; the tiny model's config says 128 (its yarn
        # table covers them; no prompt and output here pass 128).
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    par.isolate_from_repo()
    import vllm

    if "site-packages" not in (vllm.__file__ or ""):
        raise RuntimeError(f"imported vllm from {vllm.__file__}, not upstream's")
    report = {"upstream_vllm": vllm.__version__, "k": k, "max_tokens": max_tokens}
    report["baseline"] = par.run_engine(target, None, PROMPTS, max_tokens)[2]
    spec = {"method": "mtp", "num_speculative_tokens": k}
    _, _, report["outputs"], report["metrics"], _ = par.run_engine(
        target, spec, PROMPTS, max_tokens
    )
    json_out.write_text(json.dumps(report))


def compare(target: Path, up: dict) -> bool:
    """The reference stepped as upstream steps, against upstream's record."""
    import torch
    from eagle_reference_vs_upstream import step_as_upstream  # this folder's
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.v1.spec_decode.test_mtp import RefMTP

    torch.set_num_threads(1)
    k, max_tokens = up["k"], up["max_tokens"]
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    layer = load_file(str(target / "mtp.safetensors"))
    head = RefMTP(model, {name.removeprefix(prefix): t for name, t in layer.items()})

    def argmaxes(tokens: list[int]) -> list[int]:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].argmax(-1).tolist()

    ours = [step_as_upstream(head, argmaxes, p, k, max_tokens) for p in PROMPTS]
    same_out = [o for o, _ in ours] == up["outputs"] == up["baseline"]
    same = [c == u for (_, c), u in zip(ours, up["metrics"], strict=True)]
    print(
        f"upstream vLLM {up['upstream_vllm']}, {model.config.model_type}, k = {k}, "
        f"{max_tokens} tokens a prompt"
    )
    print(f"outputs equal (reference, upstream with MTP, upstream without): {same_out}")
    print(f"counters equal per prompt: {same}")
    for (_, c), u in zip(ours, up["metrics"], strict=True):
        print(f"  reference {c}" + ("" if c == u else f"\n  upstream  {u}"))
    return same_out and all(same)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--family", choices=["deepseek_v3", "glm4_moe"], default="deepseek_v3")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = args.out_dir.resolve()
    record = out_dir / "upstream.json"
    if args.upstream:  # step 2, in upstream's venv
        run_upstream(out_dir / "target", args.k, args.max_tokens, record)
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    target = build(out_dir, args.family)
    python = REPO / ".venv-upstream" / "bin" / "python"
    cmd = [str(python), __file__, "--upstream", "--out-dir", str(out_dir), "--k", str(args.k)]
    cmd += ["--max-tokens", str(args.max_tokens)]
    subprocess.run(cmd, check=True, cwd=out_dir)
    return 0 if compare(target, json.loads(record.read_text())) else 1


if __name__ == "__main__":
    sys.exit(main())
