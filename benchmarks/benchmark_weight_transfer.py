"""What one RL weight-sync round into a running `vllm serve` costs (vllm.distributed.
weight_transfer over gloo), against the way without it, measured in one run.

The server serves the checkpoint densely (``--quantization fp32``) with dev mode and
``--weight-transfer-config '{"backend": "gloo"}'``; a trainer in this process holds
transformers' model of it (fp32) and runs rounds over HTTP: pause, start, update (the
server receives while the trainer broadcasts, packed), finish (the server builds the new
weights on the host and copies them in place), resume. The baseline is what a user does
without weight sync: save the checkpoint (``save_pretrained``), stop the server and start a
new one on the saved folder (until /health answers). Prints the medians over the repeats,
the transfer's MB/s, and the ratio of the baseline to the round.

    .venv/bin/python benchmarks/benchmark_weight_transfer.py [--model PATH] [--repeats 3]
    (default: the embedded SmolLM2-135M)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpu import cpu_model, vector_extensions  # noqa: E402

from vllm.benchmarks.server import RemoteServer  # noqa: E402
from vllm.distributed.weight_transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    HTTPVLLMWeightSyncClient,
    ModuleSource,
)
from vllm.entrypoints.utils import get_open_port  # noqa: E402
from vllm.model_executor.model_loader import resolve_model  # noqa: E402

SERVE = ("--quantization", "fp32", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
         "--weight-transfer-config", '{"backend": "gloo"}')  # fmt: skip
ENV = {"VLLM_SERVER_DEV_MODE": "1"}


class TimedClient(HTTPVLLMWeightSyncClient):
    """The HTTP client, timing the receive and the swap."""

    times: dict[str, float] = {}

    def _post(self, path: str, body=None):
        start = time.perf_counter()
        try:
            return super()._post(path, body)
        finally:
            self.times[path] = time.perf_counter() - start


def serve(model: str, log: str) -> RemoteServer:
    return RemoteServer(model, *SERVE, env=ENV, log_path=log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an HF folder (default: embedded)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    path = args.model or str(resolve_model("SmolLM2-135M-Instruct"))
    trained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    nbytes = sum(p.numel() * p.element_size() for p in trained.parameters())
    work = Path(tempfile.mkdtemp())
    rounds, updates, finishes, saves, restarts = [], [], [], [], []
    try:
        server = serve(path, str(work / "server.log"))
        try:
            client = TimedClient(server.base)
            trainer = GlooTrainerWeightTransferEngine.trainer_init(
                GlooTrainerInitInfo(master_address="127.0.0.1", master_port=get_open_port()),
                client=client, source=ModuleSource(trained),
            )  # fmt: skip
            for i in range(args.repeats):
                start = time.perf_counter()
                requests.post(f"{server.base}/pause", timeout=60).raise_for_status()
                trainer.send_weights(weight_version=f"step-{i}")
                requests.post(f"{server.base}/resume", timeout=60).raise_for_status()
                rounds.append(time.perf_counter() - start)
                updates.append(client.times["update_weights"])
                finishes.append(client.times["finish_weight_update"])
            client._post("shutdown_weight_transfer_engine")
            trainer.shutdown()
        finally:
            server.stop()
        tokenizer_files = [p for p in Path(path).iterdir() if "token" in p.name or
                           p.name.endswith(".jinja")]  # fmt: skip
        for i in range(args.repeats):
            out = work / f"step-{i}"
            start = time.perf_counter()
            trained.save_pretrained(out)
            for file in tokenizer_files:
                shutil.copy(file, out / file.name)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            serve(str(out), str(work / f"restart-{i}.log")).stop()
            restarts.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    round_s, baseline_s = med(rounds), med(saves) + med(restarts)
    print(f"# {cpu_model()} ({vector_extensions()}), {torch.get_num_threads()} threads")
    print(f"# {nbytes / 2**20:.0f} MiB of fp32 parameters ({len(list(trained.parameters()))} "
          "tensors), gloo, packed, over HTTP to `vllm serve`")  # fmt: skip
    print(f"round (pause, start, update, finish, resume): {round_s:.3f} s")
    print(f"  update (the server receives):               {med(updates):.3f} s "
          f"({nbytes / med(updates) / 1e6:.0f} MB/s)")  # fmt: skip
    print(f"  finish (build on the host + copy in):       {med(finishes):.3f} s")
    print(f"baseline: save_pretrained {med(saves):.3f} s + a new server (start, stop) "
          f"{med(restarts):.3f} s = {baseline_s:.3f} s")  # fmt: skip
    print(f"baseline / round: {baseline_s / round_s:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
