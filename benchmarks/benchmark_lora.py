"""What serving LoRA adapters costs: generation with and without adapters, in one process.

Two engines on the same model, built side by side: one without ``enable_lora`` (the
baseline) and one with ``enable_lora`` (``max_loras`` = ``--adapters``). For each batch
size, the same prompts (random token ids, greedy, ``ignore_eos``) run as:

    base       the engine without LoRA
    no-adapter the LoRA engine, no request naming an adapter (the layers add nothing)
    one        the LoRA engine, every request with the same adapter
    mixed      the LoRA engine, requests spread over ``--adapters`` adapters (and one in
               ``--adapters + 1`` on the base model): one batch mixing them all

Adapters are random PEFT checkpoints of rank ``--rank`` on every projection of every
layer (q/k/v/o, gate/up/down), the heaviest case. Runs are alternated and the median of
``--repeats`` is kept (this VM's speed drifts 10-20% over minutes). Prints output tok/s
and each case's ratio to ``base``, naming the machine.

    .venv/bin/python benchmarks/benchmark_lora.py [--batch 1 8] [--adapters 4] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpu import cpu_model, vector_extensions  # noqa: E402

TARGETS = {  # PEFT target -> (block, out size key, in size key)
    "q_proj": ("self_attn", "q", "hidden"),
    "k_proj": ("self_attn", "kv", "hidden"),
    "v_proj": ("self_attn", "kv", "hidden"),
    "o_proj": ("self_attn", "hidden", "q"),
    "gate_proj": ("mlp", "inter", "hidden"),
    "up_proj": ("mlp", "inter", "hidden"),
    "down_proj": ("mlp", "hidden", "inter"),
}


def write_adapters(model_dir: str, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` random PEFT adapters for the model in ``model_dir``, every target."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    sizes = {"hidden": c.hidden_size, "inter": c.intermediate_size, "q": q, "kv": kv}
    paths = []
    for n in range(count):
        g = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(c.num_hidden_layers):
            for target, (block, out_key, in_key) in TARGETS.items():
                key = f"base_model.model.model.layers.{layer}.{block}.{target}"
                a = torch.randn(rank, sizes[in_key], generator=g) * 0.01
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(sizes[out_key], rank, generator=g) * 0.01
                )
        path = out / f"adapter{n}"
        path.mkdir()
        save_file(tensors, path / "adapter_model.safetensors")
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                  "target_modules": list(TARGETS)}  # fmt: skip
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths


def timed(llm, prompts, params, loras) -> float:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--quantization", default=None, help="gguf / fp32 (default: auto)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)

    import torch

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.model_executor.model_loader import resolve_model

    machine = f"{cpu_model()} ({vector_extensions()}), {torch.get_num_threads()} threads"
    print(f"machine: {machine}")
    print(f"model: {args.model}, quantization {args.quantization or 'auto'}; {args.adapters} "
          f"adapters of rank {args.rank} on every projection; prompts of {args.prompt_len} "
          f"tokens, {args.max_tokens} generated; median of {args.repeats} alternated "
          "runs")  # fmt: skip
    common = dict(model=args.model, quantization=args.quantization, enforce_eager=True,
                  max_num_seqs=max(args.batch))  # fmt: skip
    report = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(resolve_model(args.model), Path(tmp), args.adapters, args.rank)
        adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        base = LLM(**common)
        lora = LLM(**common, enable_lora=True, max_loras=args.adapters,
                   max_lora_rank=args.rank)  # fmt: skip
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            for batch in args.batch:
                g = torch.Generator().manual_seed(batch)
                prompts = [torch.randint(0, 49152, (args.prompt_len,), generator=g).tolist()
                           for _ in range(batch)]  # fmt: skip
                spread = [(adapters + [None])[i % (args.adapters + 1)] for i in range(batch)]
                cases = {
                    "base": (base, None),
                    "no-adapter": (lora, None),
                    "one": (lora, adapters[0]),
                    "mixed": (lora, spread),
                }
                for llm, loras in cases.values():  # warm-up: adapters loaded, kernels ready
                    timed(llm, prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True),
                          loras if not isinstance(loras, list) else loras[:1])  # fmt: skip
                times: dict[str, list[float]] = {name: [] for name in cases}
                for _ in range(args.repeats):
                    for name, (llm, loras) in cases.items():
                        times[name].append(timed(llm, prompts, params, loras))
                tokens = batch * args.max_tokens
                row = {"batch": batch}
                for name, series in times.items():
                    row[f"{name}_tok_s"] = tokens / statistics.median(series)
                print(f"batch {batch}: " + ", ".join(
                    f"{name} {row[f'{name}_tok_s']:.1f} tok/s "
                    f"({row[f'{name}_tok_s'] / row['base_tok_s']:.2f}x)" for name in cases
                ))  # fmt: skip
                report["rows"].append(row)
        finally:
            base.shutdown()
            lora.shutdown()
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
