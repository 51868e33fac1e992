"""What an image costs a request: time to first token of a prompt with one image against the
same number of prompt tokens of text, in the same run, on a random-weight model of a
named shape (no weights are downloaded: the workload's timing does not depend on them).

For each image size it runs, with ``max_tokens=1`` (so the time is the prefill's):

- ``text``: a prompt of as many tokens as the image prompt expands to, text only;
- ``image``: the image prompt (the vision encoder over the image's tiles, then the prefill);
- ``cached``: the same image prompt again (its blocks from the prefix cache: the image's
  identifier is in their hashes, so neither the encoder nor the prefill runs again);

and prints milliseconds (median of ``--repeats``), the image's tiles and tokens, and the
image's cost over text (``image / text``). Shapes: ``smolvlm-256m`` (SmolVLM-256M:
a 12-layer SigLIP-style tower of 768, 512-pixel tiles of 64 tokens, SmolLM2-135M's text
model).

    .venv/bin/python benchmarks/benchmark_images.py --sizes 512x512 1024x768 --repeats 3

Figures on the machine it runs on (it prints the CPU and its vector extensions); run it
on a quiet machine.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from benchmark_gpu import cpu_model, vector_extensions  # noqa: E402

MARKERS = ["<fake_token_around_image>", "<global-img>", "<image>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
SHAPES = {
    "smolvlm-256m": {
        "text": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                     max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True),
        "vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, image_size=512, patch_size=16),
        "scale_factor": 4,
        "processor": dict(max_image_size={"longest_edge": 512},
                          size={"longest_edge": 2048}),
    },
    # For the benchmark's test: 32-pixel tiles of 4 tokens, a 2-layer text model.
    "tiny": {
        "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=8192),
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, image_size=32, patch_size=8),
        "scale_factor": 2,
        "processor": dict(max_image_size={"longest_edge": 32}, size={"longest_edge": 64}),
    },
}  # fmt: skip


def build(shape: str, folder: Path) -> None:
    """The shape's random-weight checkpoint (bf16 on disk), SmolLM2's tokenizer with the
    image markers added, and the image processor, in ``folder``."""
    import transformers

    from tests.utils import copy_benchmark_tokenizer

    spec = SHAPES[shape]
    copy_benchmark_tokenizer(folder, chat_template=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(folder)
    config = transformers.SmolVLMConfig(
        text_config={**spec["text"], "model_type": "llama", "vocab_size": len(tokenizer)},
        vision_config=spec["vision"], scale_factor=spec["scale_factor"],
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.SmolVLMForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    transformers.SmolVLMImageProcessorPil(**spec["processor"]).save_pretrained(folder)


def timed(llm, request, params, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(request, params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smolvlm-256m", choices=sorted(SHAPES))
    parser.add_argument("--sizes", nargs="+", default=["512x512", "1024x768"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out")
    args = parser.parse_args()

    from PIL import Image

    from vllm import LLM, SamplingParams

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else cpu_model()
    print(f"machine: {where} ({vector_extensions()}), torch {torch.__version__}")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    spec = SHAPES[args.shape]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(args.shape, folder)
        image_id = json.loads((folder / "config.json").read_text())["image_token_id"]
        llm = LLM(model=str(folder), max_model_len=8192, max_num_batched_tokens=8192)
        prompt = "Describe <image> in one word."
        try:
            llm.generate("warm up", params)
            for i, size in enumerate(args.sizes):
                w, h = (int(v) for v in size.split("x"))
                rng = np.random.RandomState(i)
                img = Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8))
                request = {"prompt": prompt, "multi_modal_data": {"image": img}}
                first = llm.generate(request, params)[0]  # also its tokens' count
                cached_ms = timed(llm, request, params, args.repeats)  # while it is cached
                n = len(first.prompt_token_ids)
                image_tokens = first.prompt_token_ids.count(image_id)
                per_tile = (spec["vision"]["image_size"] // spec["vision"]["patch_size"]) ** 2
                tiles = image_tokens // (per_tile // spec["scale_factor"] ** 2)
                texts = [
                    [int(t) for t in np.random.RandomState(100 * i + r).randint(100, 40000, n)]
                    for r in range(args.repeats)
                ]  # another prompt each time: no prefix hit
                text_ms = statistics.median(
                    timed(llm, {"prompt_token_ids": t}, params, 1) for t in texts
                )
                image_ms = statistics.median(
                    timed(
                        llm,
                        {**request, "multi_modal_data": {"image": img.rotate(r + 1)}},
                        params,
                        1,
                    )  # fmt: skip
                    for r in range(args.repeats)  # another image each time: no prefix hit
                )
                tokens = n
                row = dict(size=size, prompt_tokens=tokens, tiles=tiles,
                           text_ms=round(text_ms, 1),
                           image_ms=round(image_ms, 1), cached_ms=round(cached_ms, 1),
                           image_over_text=round(image_ms / text_ms, 2))  # fmt: skip
                rows.append(row)
                print(
                    f"{size:>10} {tiles:>2} tiles {tokens:>6} tokens  text "
                    f"{text_ms:8.1f} ms  image {image_ms:8.1f} ms  cached {cached_ms:7.1f} ms  "
                    "image/text "
                    f"{image_ms / text_ms:5.2f}x"
                )
        finally:
            llm.shutdown()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": where, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
