"""`vllm serve` on a random-weight model: one chat completion with the openai client, then
the same server under ``--scheduling-policy continuum`` with a two-step job (the second
step's prompt extends the first's, whose KV the job's pin keeps).

    python scripts/gpu/serve_smoke.py --out DIR [--shape smollm2-135m]

Serves a random-weight model of a benchmarks/benchmark_gpu.py shape (default: SmolLM2-135M's
on CUDA, the tiny one on CPU) with ``--load-format dummy``, writes ``serve_smoke.json`` and
one server log per run into ``--out``; exit status 1 if a request failed. Each server is
stopped in a ``finally``, also on SIGTERM (scripts/gpu/reap.py kills what survives a
SIGKILL).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RUNS = {"default": [], "continuum": ["--scheduling-policy", "continuum"]}
DUMMY = "--load-format=dummy"  # make_model's folders have no weights


def load_benchmark():
    path = REPO / "benchmarks" / "benchmark_gpu.py"
    spec = importlib.util.spec_from_file_location("benchmark_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_model(shape: str, out: Path) -> Path:
    """A folder of ``shape`` holding config.json and the tokenizer, no weights: the servers
    run it with ``--load-format dummy`` (``DUMMY``), which makes random weights on the
    device in the served dtype (bf16 on CUDA, fp32 on CPU)."""
    bench = load_benchmark()
    return bench.write_config_dir(shape, out / shape, bench.default_tokenizer_dir())


def chat(client, messages: list[dict], **extra) -> tuple[str, dict]:
    start = time.perf_counter()
    resp = client.chat.completions.create(
        model="smoke", messages=messages, max_tokens=16, temperature=0.0, extra_body=extra
    )
    usage = resp.usage.model_dump() if resp.usage else {}
    text = resp.choices[0].message.content or ""
    if not usage.get("completion_tokens"):
        raise RuntimeError(f"no completion tokens: {resp}")
    return text, usage | {"seconds": round(time.perf_counter() - start, 3)}


def exercise(server, name: str) -> dict:
    client = server.client(timeout=60)
    first = [{"role": "user", "content": "Write one sentence about the sea. " * 8}]
    if name != "continuum":
        text, usage = chat(client, first, ignore_eos=True)
        return {"ok": True, "text": text, "usage": usage}
    text, usage1 = chat(client, first, ignore_eos=True, job_id="smoke", is_last_step=False)
    pinned = server.metrics().get("vllm:num_pinned_requests")
    second = first + [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Now one about the sky."},
    ]
    _, usage2 = chat(client, second, ignore_eos=True, job_id="smoke", is_last_step=True)
    cached = (usage2.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ok": True, "usage": [usage1, usage2], "pinned_after_first": pinned,
            "second_step_cached_tokens": cached}  # fmt: skip


def run(name: str, model_dir: Path, out: Path, timeout_s: float) -> dict:
    from vllm.benchmarks.server import RemoteServer

    args = ["--model", str(model_dir), DUMMY, "--served-model-name", "smoke",
            "--max-model-len", "1024"]  # fmt: skip
    start = time.perf_counter()
    server = RemoteServer(
        *args, *RUNS[name], timeout_s=timeout_s, log_path=str(out / f"serve-{name}.log"),
        wait=False,
    )  # fmt: skip
    try:
        server.wait_healthy()
        started = time.perf_counter() - start
        return exercise(server, name) | {"startup_s": round(started, 1)}
    except Exception as e:  # noqa: BLE001 - reported, and the next run still goes
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    default_shape = "smollm2-135m" if torch.cuda.is_available() else "tiny"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default=default_shape)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="each server's start-up")
    ap.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    args = ap.parse_args(argv)
    # SIGTERM (timeout, reap.py) unwinds through the finally that stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(args.shape, Path("/tmp/vllm-serve-smoke"))
    results = {"shape": args.shape, "device": "cuda" if torch.cuda.is_available() else "cpu"}
    for name in args.runs:
        results[name] = run(name, model_dir, args.out, args.timeout_s)
        print(f"serve-smoke {name}: {json.dumps(results[name])}", flush=True)
        (args.out / "serve_smoke.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(results[n]["ok"] for n in args.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
