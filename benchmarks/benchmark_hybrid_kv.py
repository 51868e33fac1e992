"""What the hybrid KV cache saves (docs/design.md, "KV cache"): a model with sliding-window
layers keeps only their windows' blocks.

Two parts, each against the cache that keeps every block of every layer:

1. **Bytes a request holds** for real models' shapes (their configs' layer counts, KV
   heads, head sizes, windows and layer patterns, listed in ``SHAPES``), at contexts of
   8k to 128k tokens: the KV cache groups the runner would plan
   (``plan_kv_cache_groups``) and the blocks a request holds at its peak
   (``blocks_for_sequence``, steps of ``--chunk`` tokens), in bf16 and blocks of 16; and
   how many such requests fit ``--kv-gib`` GiB. Computed from the engine's own planning
   code, not measured: no GPU is needed to know a layout's bytes.
2. **Measured on this machine**: the engine on a small random-weight model of gpt-oss's
   pattern (sliding and full layers alternating) in a fixed KV budget, ``--num-requests``
   prompts of ``--prompt-len`` tokens: wall time, output tokens/s, preemptions and the
   mean number of requests running a step, with and without the hybrid cache, in the
   same process.

    python benchmarks/benchmark_hybrid_kv.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark_gpu  # noqa: E402  (the shapes' helpers and machine facts)
import torch  # noqa: E402

from vllm.v1.attention.backends.abstract import kv_cache_bytes, kv_cache_shape  # noqa: E402
from vllm.v1.core.kv_cache_utils import blocks_for_sequence  # noqa: E402
from vllm.v1.worker.kv_cache_groups import plan_kv_cache_groups  # noqa: E402

BLOCK = 16
# Each model's attention shape as its config.json gives it (model_type, layers, KV heads,
# head size, the window and which layers slide).
SHAPES: dict[str, dict] = {
    "gpt-oss-20b": dict(model_type="gpt_oss", num_hidden_layers=24, num_key_value_heads=8,
                        head_dim=64, sliding_window=128, max_position_embeddings=131072),
    "gpt-oss-120b": dict(model_type="gpt_oss", num_hidden_layers=36, num_key_value_heads=8,
                         head_dim=64, sliding_window=128, max_position_embeddings=131072),
    "gemma-3-27b": dict(model_type="gemma3_text", num_hidden_layers=62, num_key_value_heads=16,
                        head_dim=128, sliding_window=1024, max_position_embeddings=131072),
    "gemma-2-9b": dict(model_type="gemma2", num_hidden_layers=42, num_key_value_heads=8,
                       head_dim=256, sliding_window=4096, max_position_embeddings=8192),
    "mistral-7b-v0.1": dict(model_type="mistral", num_hidden_layers=32, num_key_value_heads=8,
                            head_dim=128, sliding_window=4096, max_position_embeddings=32768),
}  # fmt: skip
CONTEXTS = (8192, 32768, 131072)


def layer_windows(shape: str) -> tuple[int | None, ...]:
    """The windows our loader reads from the shape's config (``layer_sliding_windows``)."""
    from transformers import AutoConfig

    from vllm.model_executor.model_loader import layer_sliding_windows

    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return layer_sliding_windows(config)


def request_bytes(shape: str, chunk: int, kv_gib: float) -> list[dict]:
    """Per context: one request's KV bytes at its peak, both ways, and how many fit."""
    f = SHAPES[shape]
    windows = layer_windows(shape)
    one_block = kv_cache_shape(1, BLOCK, f["num_key_value_heads"], f["head_dim"], latent=False)
    layer_block = kv_cache_bytes(one_block, torch.bfloat16, 1)  # one layer's K and V
    uniform = plan_kv_cache_groups(windows, hybrid=False)
    hybrid = plan_kv_cache_groups(windows)
    rows = []
    for context in CONTEXTS:
        if context > f["max_position_embeddings"]:
            continue
        full = blocks_for_sequence(context, BLOCK, uniform.windows, chunk)
        full_bytes = full * uniform.num_tensors * layer_block
        held = blocks_for_sequence(context, BLOCK, hybrid.windows, chunk)
        held_bytes = held * hybrid.num_tensors * layer_block
        # Decoding past its prompt (steps of one token), a request holds only the windows.
        decoding = blocks_for_sequence(context, BLOCK, hybrid.windows, 1)
        decoding_bytes = decoding * hybrid.num_tensors * layer_block
        budget = kv_gib * 2**30
        rows.append(
            dict(
                shape=shape,
                context=context,
                groups=hybrid.describe(),
                uniform_gib=full_bytes / 2**30,
                hybrid_gib=held_bytes / 2**30,
                hybrid_decoding_gib=decoding_bytes / 2**30,
                ratio=full_bytes / held_bytes,
                decoding_ratio=full_bytes / decoding_bytes,
                uniform_fit=int(budget // full_bytes),
                hybrid_fit=int(budget // held_bytes),
                hybrid_decoding_fit=int(budget // decoding_bytes),
            )
        )
    return rows


def run_engine(model_dir: Path, args: argparse.Namespace, kv_mib: float, hybrid: bool) -> dict:
    """The engine on ``model_dir`` (random weights) with ``kv_mib`` MiB of KV."""
    from vllm import LLM, SamplingParams

    kinds = ("sliding_attention", "full_attention")  # gpt-oss's alternation
    overrides = {
        "num_hidden_layers": args.layers,
        "sliding_window": args.window,
        "layer_types": [kinds[i % 2] for i in range(args.layers)],
    }
    llm = LLM(
        model=str(model_dir), load_format="dummy", hf_overrides=overrides, dtype="float32",
        kv_cache_memory=f"{kv_mib}MiB", max_model_len=args.prompt_len + args.max_tokens,
        max_num_batched_tokens=args.chunk_tokens, enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=not hybrid, seed=0,
    )  # fmt: skip
    try:
        sched = llm.engine_core.scheduler
        seen = {"steps": 0, "running": 0, "preempted": 0}
        schedule = sched.schedule

        def counted():
            out = schedule()
            seen["steps"] += 1
            seen["running"] += len(sched.running)
            seen["preempted"] += len(out.preempted_req_ids)
            return out

        sched.schedule = counted
        g = torch.Generator().manual_seed(0)
        vocab = 49152
        prompts = [
            {"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()}
            for _ in range(args.num_requests)
        ]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        seen.update(steps=0, running=0, preempted=0)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        kv = sched.kv_cache_manager
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return dict(
            kv_mib=kv_mib,
            hybrid=hybrid,
            windows=list(kv.windows),
            num_blocks=kv.block_pool.num_gpu_blocks,
            wall_s=wall,
            output_tok_s=tokens / wall,
            preemptions=seen["preempted"],
            mean_running=seen["running"] / max(seen["steps"], 1),
            steps=seen["steps"],
        )
    finally:
        llm.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--chunk", type=int, default=8192, help="a step's tokens (part 1)")
    ap.add_argument("--kv-gib", type=float, default=64.0, help="the KV budget of part 1")
    ap.add_argument("--skip-engine", action="store_true", help="part 1 only")
    ap.add_argument("--layers", type=int, default=4, help="the measured model's layers")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--kv-mib", type=float, nargs="+", default=[2.0, 2.5, 4.0],
                    help="the measured engine's KV budgets")  # fmt: skip
    ap.add_argument("--json-out", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = benchmark_gpu.machine_info(torch.device("cpu"))
    result: dict = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"Part 1 (computed): one request's KV in GiB, bf16, blocks of {BLOCK}: keeping "
          f"every block; hybrid at its peak (a prefill step of {args.chunk} tokens) and "
          f"decoding (windows only); requests that fit {args.kv_gib:g} GiB")  # fmt: skip
    print(f"{'shape':<16} {'context':>8} {'every':>7} {'peak':>7} {'ratio':>6} {'decode':>7} "
          f"{'ratio':>6} {'fit: every/peak/decode':>23}")  # fmt: skip
    rows = []
    for shape in SHAPES:
        for r in request_bytes(shape, args.chunk, args.kv_gib):
            rows.append(r)
            print(f"{shape:<16} {r['context']:>8} {r['uniform_gib']:>7.2f} "
                  f"{r['hybrid_gib']:>7.2f} {r['ratio']:>5.2f}x "
                  f"{r['hybrid_decoding_gib']:>7.2f} {r['decoding_ratio']:>5.2f}x "
                  f"{r['uniform_fit']:>9} / {r['hybrid_fit']} / "
                  f"{r['hybrid_decoding_fit']}")  # fmt: skip
    for shape in SHAPES:
        print(f"  {shape}: {plan_kv_cache_groups(layer_windows(shape)).describe()}")
    result["request_bytes"] = rows
    if not args.skip_engine:
        info["vector_extensions"] = benchmark_gpu.vector_extensions()
        cpu = f"{info['cpu']}, {info['cpu_count']} cores ({info['vector_extensions']})"
        print(f"\nPart 2, measured on {cpu}: {args.layers} layers of gpt-oss's pattern "
              f"(window {args.window}), random weights, fp32, {args.num_requests} x "
              f"{args.prompt_len}-token prompts, {args.max_tokens} tokens each, steps of "
              f"{args.chunk_tokens} tokens")  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = benchmark_gpu.write_config_dir(
                "tiny-gpt-oss", Path(tmp) / "model", benchmark_gpu.default_tokenizer_dir()
            )
            runs = [
                run_engine(model_dir, args, kv_mib, hybrid)
                for kv_mib in args.kv_mib
                for hybrid in (False, True)
            ]
        print(f"{'KV MiB':>7} {'KV cache':<12} {'blocks':>7} {'wall s':>8} {'tok/s':>8} "
              f"{'preempted':>10} {'running':>8} {'tok/s ratio':>12}")  # fmt: skip
        for r in runs:
            name = "hybrid" if r["hybrid"] else "every block"
            base = next(b for b in runs if b["kv_mib"] == r["kv_mib"] and not b["hybrid"])
            r["ratio"] = r["output_tok_s"] / base["output_tok_s"]
            print(f"{r['kv_mib']:>7g} {name:<12} {r['num_blocks']:>7} {r['wall_s']:>8.2f} "
                  f"{r['output_tok_s']:>8.1f} {r['preemptions']:>10} "
                  f"{r['mean_running']:>8.2f} {r['ratio']:>11.2f}x")  # fmt: skip
        result["engine"] = runs
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
