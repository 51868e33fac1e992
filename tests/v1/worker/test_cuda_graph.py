"""CUDA graphs of decode steps (``vllm/v1/worker/cuda_graph.py``, ``ModelRunner.capture_model``).

On the CPU the graphs are stood in for by ``ReplayingGraph``, which runs the captured
function again at each replay: it reads the same buffers a real replay reads, so what is
checked here is the plumbing around the graph (the capture ladder, padding a batch to a
captured size, the metadata and inputs copied into the fixed buffers, the output taken
from the shared buffer, which steps replay and which run eagerly), on a tiny random Llama
with TORCH_FLASH_ATTN's decode path (the Triton kernel replaced by a float64 emulation
that checks its contract, as in ``tests/v1/attention/test_triton_decode.py``). A graph
replays what it recorded, not the Python around it, which no stand-in shows: the same
steps are captured with real CUDA graphs in ``tests/cuda/test_cuda_graph_cuda.py``.
"""

from __future__ import annotations

import logging
import random
from itertools import pairwise

import pytest
import torch

from tests.tiny_models import TINY_LLAMA, load_cpu_runner, save_tiny_llama
from tests.v1.attention.test_torch_flash import install, ref_varlen_attn
from tests.v1.attention.test_triton_decode import emulated_kernel
from tests.v1.worker.test_model_runner_inputs import new_req, sched_out
from vllm.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends import triton_decode
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend
from vllm.v1.worker.cuda_graph import DecodeGraphs, cudagraph_capture_sizes
from vllm.v1.worker.model_runner import DeferredOutput, ModelRunner

BLOCK = 4
NUM_BLOCKS = 64
MAX_LEN = 96


class ReplayingGraph:
    """A CPU stand-in for a CUDA graph: ``replay`` runs the captured function again and
    checks that its output is the captured output's memory (a graph's output tensor is
    fixed)."""

    def __init__(self) -> None:
        self.fn = None
        self.out: torch.Tensor | None = None
        self.replays = 0

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        out = self.fn()
        assert out.data_ptr() == self.out.data_ptr() and out.shape == self.out.shape
        self.replays += 1


# -- the ladder -----------------------------------------------------------------------------
def test_capture_sizes_are_vllms_ladder():
    sizes = cudagraph_capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[-1] == 512 and 248 in sizes and 256 in sizes and 264 not in sizes
    assert sizes[3:34] == list(range(8, 256, 8))
    assert all(b - a == 16 for a, b in pairwise(sizes[34:]))
    # Never above max_num_seqs, which is captured when it is off the ladder.
    assert cudagraph_capture_sizes(100) == [1, 2, 4, *range(8, 100, 8), 100]
    assert cudagraph_capture_sizes(3) == [1, 2, 3]
    assert cudagraph_capture_sizes(128, 16) == [1, 2, 4, 8, 16]
    assert cudagraph_capture_sizes(300, 600)[-3:] == [272, 288, 300]
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        cudagraph_capture_sizes(8, 0)


def test_flags():
    config = EngineArgs(enforce_eager=True, max_cudagraph_capture_size=64).create_engine_config()
    assert config.model_config.enforce_eager
    assert config.model_config.max_cudagraph_capture_size == 64
    assert not EngineArgs().create_engine_config().model_config.enforce_eager
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be >= 1"):
        ModelConfig(max_cudagraph_capture_size=0)


# -- a tiny model on the Triton decode path ---------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-graphs")
    save_tiny_llama(path)
    return path


def make_runner(checkpoint, monkeypatch, lora=None, **model) -> ModelRunner:
    """A CPU runner on the tiny Llama whose layers attend with TORCH_FLASH_ATTN, decode
    rows through the (emulated) Triton kernel, prompts through an emulated varlen_attn.
    ``lora``: its ``LoRAConfig``."""
    install(monkeypatch, ref_varlen_attn)
    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated_kernel([]))
    config = VllmConfig(
        model_config=ModelConfig(model=str(checkpoint), **model),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_model_len=MAX_LEN, max_num_batched_tokens=96, max_num_seqs=8
        ),
        lora_config=lora or LoRAConfig(),
    )
    runner = load_cpu_runner(config)
    a = runner.arch
    backend = TorchFlashAttentionBackend(
        a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, "cpu", BLOCK
    )
    backend.decode_kernel = "triton"  # as on a GPU with triton
    runner.attn_backend = backend
    runner.install_attention_backend()
    runner.initialize_kv_cache(NUM_BLOCKS)
    return runner


def random_decodes(n: int, seed: int) -> tuple[list[int], list[int], list]:
    """``n`` (at most 8) decodes over contexts of 0-27 cached tokens, in disjoint scattered
    blocks (never the null block 0)."""
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    ids, positions, seqs = [], [], []
    for _ in range(n):
        computed = rng.randrange(0, 28)
        blocks = [free.pop() for _ in range(computed // BLOCK + 1)]
        ids.append(rng.randrange(TINY_LLAMA["vocab_size"]))
        positions.append(computed)
        seqs.append((computed, 1, blocks))
    return ids, positions, seqs


def test_replayed_decode_steps_equal_eager_ones(checkpoint, monkeypatch):
    runner = make_runner(checkpoint, monkeypatch)
    torch.manual_seed(1)
    for cache in runner.kv_caches:
        cache.normal_()
    eager_caches = [c.clone() for c in runner.kv_caches]
    graphs = DecodeGraphs(
        runner.model,
        runner.attn_backend,
        runner.kv_caches,
        [1, 2, 4, 8],
        -(-MAX_LEN // BLOCK),
        runner.device,
        graph_factory=ReplayingGraph,
    )
    with torch.inference_mode():
        graphs.capture()
    assert sorted(graphs._graphs) == [1, 2, 4, 8]
    buffers = [graphs._ids, graphs._positions, graphs._meta.block_table, graphs._hidden]
    pointers = [t.data_ptr() for t in buffers]
    # The capture's warm-ups and recordings wrote the null block only.
    for cache, before in zip(runner.kv_caches, eager_caches, strict=True):
        assert torch.equal(cache[:, 1:], before[:, 1:])
        before[:, 0] = cache[:, 0]

    for step, n in enumerate([3, 1, 8, 5, 2, 7]):  # padded to 4, 1, 8, 8, 2, 8
        ids, positions, seqs = random_decodes(n, seed=step)
        with torch.inference_mode():
            replayed = graphs.run(ids, positions, seqs)
            meta = runner.attn_backend.build_metadata(seqs)
            eager = runner.model(torch.tensor(ids), torch.tensor(positions), meta, eager_caches)
        assert replayed.shape == eager.shape == (n, TINY_LLAMA["hidden_size"])
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        # The real rows' K/V landed where eager wrote them; padding touched block 0 only.
        for cache, ref in zip(runner.kv_caches, eager_caches, strict=True):
            torch.testing.assert_close(cache[:, 1:], ref[:, 1:], rtol=1e-5, atol=1e-5)
    assert graphs.num_replays == 6
    assert [t.data_ptr() for t in buffers] == pointers  # filled in place, never rebuilt
    assert sum(g.replays for g in graphs._graphs.values()) == 6
    assert graphs._graphs[8].replays == 3 and graphs._graphs[4].replays == 1


def test_steps_that_cannot_replay_run_eagerly(checkpoint, monkeypatch):
    runner = make_runner(checkpoint, monkeypatch)
    graphs = DecodeGraphs(
        runner.model, runner.attn_backend, runner.kv_caches, [1, 2, 4], 24, "cpu", ReplayingGraph
    )
    assert graphs.padded_size([(5, 1, [1, 2])]) is None  # not captured yet
    with torch.inference_mode():
        graphs.capture()
    assert graphs.padded_size([(5, 1, [1, 2])] * 3) == 4
    assert graphs.padded_size([(5, 1, [1, 2])] * 5) is None  # above the largest size
    assert graphs.padded_size([(5, 1, [1, 2]), (0, 3, [3])]) is None  # a prompt in the step
    assert graphs.padded_size([]) is None
    assert graphs.run([1, 2], [0, 1], [(0, 2, [3])]) is None and graphs.num_replays == 0


def test_a_backend_without_graphs_is_refused(checkpoint, monkeypatch):
    runner = make_runner(checkpoint, monkeypatch)
    runner.attn_backend.decode_kernel = "varlen"  # gathered K/V: shapes change per step
    assert not runner.attn_backend.supports_decode_graphs
    with pytest.raises(ValueError, match="cannot capture"):
        DecodeGraphs(runner.model, runner.attn_backend, runner.kv_caches, [1], 24, "cpu")
    sdpa = TorchSDPABackend(4, 2, 16, torch.float32, "cpu", BLOCK)
    assert not sdpa.supports_decode_graphs
    with pytest.raises(NotImplementedError):
        sdpa.graph_metadata(4, 8)
    # The runner logs it and stays eager.
    runner.capture_model(graph_factory=ReplayingGraph)
    assert runner.decode_graphs is None


def test_the_runner_warms_the_decode_kernel_up_on_its_cache(checkpoint, monkeypatch, caplog):
    # Start-up compiles what a step would (ModelRunner.warm_up_kernels, before the graphs):
    # on a CPU the kernel takes one number of splits, with and without query rows.
    runner = make_runner(checkpoint, monkeypatch)
    with caplog.at_level(logging.INFO, logger="vllm"):
        runner.warm_up_kernels()
    assert "Warmed up 2 attention kernel variants" in caplog.text
    runner.kv_caches = []
    with pytest.raises(RuntimeError, match="initialize_kv_cache first"):
        runner.warm_up_kernels()


# -- the runner ------------------------------------------------------------------------------
def run_steps(
    runner: ModelRunner, loras: dict | None = None, defer: bool = False
) -> list[dict[str, list[int]]]:
    """Three requests: prompts (eager), then greedy decodes (replayed where captured), one
    finishing midway so the batch shrinks from 3 to 2. ``loras``: request -> its
    ``LoRARequest``. ``defer`` (--async-scheduling): each step is launched before the
    last one's tokens are taken (its decodes read them on the device)."""
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13], "c": list(range(20, 33))}
    blocks = {"a": [3, 9, 4, 20], "b": [7, 30, 31], "c": [12, 2, 15, 16, 40, 41]}
    new = [new_req(r, p, blocks[r], 0) for r, p in prompts.items()]
    for req in new:
        req.lora_request = (loras or {}).get(req.req_id)
    tokens: list[dict[str, list[int]]] = []
    pending: list[DeferredOutput] = []

    def execute(so) -> None:
        out = runner.execute_model(so, defer=defer)
        if defer:
            assert isinstance(out, DeferredOutput)
            tokens.extend(d.result().sampled_token_ids for d in pending)
            pending[:] = [out]
        else:
            tokens.append(out.sampled_token_ids)

    execute(sched_out(new=new, num_scheduled={r: len(p) for r, p in prompts.items()}))
    computed = {r: len(p) for r, p in prompts.items()}
    live = list(prompts)
    for step in range(6):
        finished = ["b"] if step == 3 else []
        live = [r for r in live if r not in finished]
        execute(
            sched_out(
                cached=[(r, [], computed[r]) for r in live],
                num_scheduled={r: 1 for r in live},
                finished=finished,
            )
        )
        for r in live:
            computed[r] += 1
    tokens.extend(d.result().sampled_token_ids for d in pending)
    return tokens


def test_runner_replays_decode_steps_with_the_eager_tokens(checkpoint, monkeypatch):
    eager = make_runner(checkpoint, monkeypatch)
    eager.capture_model()  # CPU without a stand-in: nothing is captured
    assert eager.decode_graphs is None
    expected = run_steps(eager)

    runner = make_runner(checkpoint, monkeypatch, max_cudagraph_capture_size=2)
    runner.capture_model(graph_factory=ReplayingGraph)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2]
    assert run_steps(runner) == expected
    # Three decodes exceed the largest size (2): eager; two decodes replay (steps 4-6).
    assert graphs.num_replays == 3

    runner = make_runner(checkpoint, monkeypatch)
    runner.capture_model(graph_factory=ReplayingGraph)
    assert runner.decode_graphs.sizes == [1, 2, 4, 8]  # max_num_seqs 8
    assert run_steps(runner) == expected
    assert runner.decode_graphs.num_replays == 6

    runner = make_runner(checkpoint, monkeypatch, enforce_eager=True)
    runner.capture_model(graph_factory=ReplayingGraph)
    assert runner.decode_graphs is None
    assert run_steps(runner) == expected


def test_deferred_steps_replay_with_input_tokens_from_the_device(checkpoint, monkeypatch):
    # --async-scheduling: each decode step's input is the token the step before sampled,
    # still on the device: written over the graph's input rows (or the eager input).
    expected = run_steps(make_runner(checkpoint, monkeypatch))
    runner = make_runner(checkpoint, monkeypatch)
    runner.capture_model(graph_factory=ReplayingGraph)
    assert run_steps(runner, defer=True) == expected
    assert runner.decode_graphs.num_replays == 6
    eager = make_runner(checkpoint, monkeypatch)
    assert run_steps(eager, defer=True) == expected


def run_spec_steps(runner: ModelRunner) -> list[dict[str, list[int]]]:
    """Two requests: prompts, then a step in which "a" checks 3 drafts (4 decode rows)
    beside "b"'s plain decode, then one where both decode."""
    prompts = {"a": [5, 6, 7, 8, 9, 5, 6], "b": [11, 12, 13]}
    blocks = {"a": [3, 9, 4, 20], "b": [7, 30, 31]}
    out = runner.execute_model(
        sched_out(
            new=[new_req(r, p, blocks[r], 0) for r, p in prompts.items()],
            num_scheduled={r: len(p) for r, p in prompts.items()},
        )
    )
    tokens = [out.sampled_token_ids]
    so = sched_out(cached=[("a", [], 7), ("b", [], 3)], num_scheduled={"a": 4, "b": 1})
    so.scheduled_spec_decode_tokens = {"a": [7, 8, 9]}
    out = runner.execute_model(so)
    tokens.append(out.sampled_token_ids)
    kept = len(out.sampled_token_ids["a"])  # the scheduler's rollback: computed = 7 + kept
    so = sched_out(cached=[("a", [], 7 + kept), ("b", [], 4)], num_scheduled={"a": 1, "b": 1})
    tokens.append(runner.execute_model(so).sampled_token_ids)
    return tokens


def test_steps_with_drafts_replay_as_decode_rows(checkpoint, monkeypatch):
    # Each draft position is a decode row of its own: a step with drafts has the shape of
    # a decode step of that many rows, and replays its graph with the eager tokens.
    eager = make_runner(checkpoint, monkeypatch)
    expected = run_spec_steps(eager)
    assert 1 <= len(expected[1]["a"]) <= 4
    runner = make_runner(checkpoint, monkeypatch)
    runner.capture_model(graph_factory=ReplayingGraph)
    assert run_spec_steps(runner) == expected
    assert runner.decode_graphs.num_replays == 2  # the step with drafts (5 rows), the last
