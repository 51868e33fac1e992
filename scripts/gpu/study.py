"""The `study` step of scripts/gpu/run.sh (issue 28): the agent workload of
``our_experiments`` against a random-weight model served on the GPU, one fresh
``vllm serve`` per policy and load, packed into one tarball for the trip back.

    python scripts/gpu/study.py --out DIR [--shape llama-3.1-8b] [RUN_SWEEP ARGS...]

Serves a random-weight model (``--load-format dummy``: a folder with config.json and the
tokenizer, the weights made by each server on the device; default: the Llama-3.1-8B shape,
bf16 on CUDA, the tiny one on CPU), running
``our_experiments/scripts/run_sweep.py`` with ``--model`` set to it and every other
argument passed through (``--policies``, ``--jps``, ``--num-gpu-blocks``, ``--duration``,
``--drain-timeout``, ``--seed`` ...). The results folder (one JSON per point, the server
logs, the sweep's config) is ``--label`` (default: the card and the shape, e.g.
``h100-llama-3.1-8b``) under ``/tmp/vllm-study-results``, packed into
``DIR/study-LABEL.tar.gz`` every 20 s and at the end, so what finished comes back even when
the step runs out of time, as one file (a device call brings back 8). Random weights are
fine here: the workload appends whatever the model answers to the job's history, and tool
times are the tool tables'.

A study label's ``+offload<k>x`` sizes the tier at k times the pool in the shape's own KV
blocks (``--kv-block-bytes``, computed here from the shape and the served dtype: 2 MiB for
the 8B shape in bf16); ``+autotier`` lets the engine size it.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_smoke import DUMMY, load_benchmark, make_model  # noqa: E402

SWEEP = REPO / "our_experiments" / "scripts" / "run_sweep.py"
COMMITTED = "our_experiments/results"  # where a study's folder is committed


def default_label(shape: str, sweep_args: list[str] = ()) -> str:
    """card-shape, and -MIX for a tool mix other than the fork mix (its points must not
    share a folder, or a name, with the fork mix's)."""
    mix = tool_mix(list(sweep_args))
    suffix = "" if mix == "fork" else f"-{mix}"
    if not torch.cuda.is_available():
        return f"cpu-{shape}{suffix}"
    name = torch.cuda.get_device_name().lower()
    card = next((c for c in ("h200", "h100", "a100", "l40s", "rtx") if c in name), "gpu")
    return f"{card}-{shape}{suffix}"


def tool_mix(sweep_args: list[str]) -> str:
    """The sweep's ``--tool-mix``, as run_sweep's own parser reads it (its default, its
    abbreviations)."""
    sys.path.insert(0, str(REPO))
    from our_experiments.scripts.run_sweep import make_parser

    return make_parser().parse_known_args(sweep_args)[0].tool_mix


def kv_block_bytes(shape: str, block_size: int = 16) -> int:
    """One KV block of ``shape`` in the dtype the servers run it in (bf16 on CUDA, fp32 on
    CPU): K and V of every layer, ``block_size`` tokens."""
    c = load_benchmark().SHAPES[shape]
    itemsize = 2 if torch.cuda.is_available() else 4
    heads_dim = c["num_key_value_heads"] * c["head_dim"]
    return 2 * c["num_hidden_layers"] * block_size * heads_dim * itemsize


def as_committed(results: Path) -> None:
    """Each sweep config of ``results`` names the folder it is committed under
    (``our_experiments/results``), not the device machine's: committed configs name no
    machine path (tests/our_experiments/test_run_sweep.py)."""
    for path in results.glob("sweep_config*.json"):
        config = json.loads(path.read_text())
        if not Path(config.get("results_dir") or COMMITTED).is_absolute():
            continue
        config["results_dir"] = COMMITTED
        path.write_text(json.dumps(config, indent=1) + "\n")


def pack(results: Path, tarball: Path) -> None:
    """``results`` into ``tarball`` (written aside, then renamed: never half a file)."""
    as_committed(results)
    partial = tarball.with_name(tarball.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(results, arcname=results.name)
    partial.replace(tarball)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default=None, help="default: llama-3.1-8b on CUDA, tiny on CPU")
    ap.add_argument("--label", default=None, help="results folder (default: card-shape)")
    args, sweep_args = ap.parse_known_args(argv)
    if any(a.split("=")[0] in ("--machine", "--results-dir") for a in sweep_args):
        ap.error("--label and --out place the results; --machine/--results-dir are set here")
    shape = args.shape or ("llama-3.1-8b" if torch.cuda.is_available() else "tiny")
    label = args.label or default_label(shape, sweep_args)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(shape, Path("/tmp/vllm-study-models"))
    if not any(a.split("=")[0] == "--kv-block-bytes" for a in sweep_args):
        sweep_args = [*sweep_args, "--kv-block-bytes", str(kv_block_bytes(shape))]
    results = Path("/tmp/vllm-study-results")
    cmd = [
        sys.executable, str(SWEEP), "--machine", label, "--results-dir", str(results),
        f"--server-arg=--model={model_dir}", f"--server-arg={DUMMY}",
        "--server-arg=--served-model-name=study",
        *sweep_args,
    ]  # fmt: skip
    print("[study]", " ".join(cmd), flush=True)
    tarball = args.out / f"study-{label}.tar.gz"
    proc = subprocess.Popen(cmd, cwd=REPO)
    # reap.py's SIGTERM at the step's limit: unwind through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stop = threading.Event()

    def pack_while_running() -> None:  # each finished point reaches the tarball
        while not stop.wait(20):
            if (results / label).exists():
                pack(results / label, tarball)

    packer = threading.Thread(target=pack_while_running, daemon=True)
    packer.start()
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted (reap.py's SIGTERM): stop the sweep first
            proc.terminate()
            proc.wait(timeout=60)
        stop.set()
        packer.join()
        if (results / label).exists():
            pack(results / label, tarball)
            print(f"[study] results: {tarball}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
