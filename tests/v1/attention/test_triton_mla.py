"""``TRITON_MLA`` (``backends/triton_mla.py``): MLA's decode rows through the Triton latent
decode kernel, prefill chunks through the Triton latent prefill kernel (or, where Triton
cannot run, TORCH_SDPA's path), over the latent cache.

On CPU: the step metadata's layout in both forms (leading one-token rows are decodes, a
one-token prompt and a graph's padding row included), the CUDA-graph contract
(``graph_metadata``, ``narrow``, ``copy_``), and the backend over decodes, prompts and
chunks against float64, with the kernels emulated in float64 (checking the arguments the
real ones take) and with the real kernels in Triton's interpreter (a child process, where
the backend takes the prefill kernel), where a tiny DeepSeek-V2 also gives TORCH_SDPA's
logits through them. The selector offers it to MLA models only. On a GPU
(``cuda``): tests/cuda/test_deepseek_mla_cuda.py.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.model_executor.test_deepseek import TINY, save
from tests.tiny_models import load_cpu_runner, runner_logits
from tests.triton_interpreter import interpreted_cases, print_case_results
from tests.v1.attention.test_latent_kv import BLOCK, DIM, HEADS, LATENT, STEPS, run_steps
from tests.v1.attention.test_triton_mla_decode import mla_reference
from tests.v1.attention.test_triton_mla_prefill import mla_prefill_reference
from vllm.v1.attention.backends import triton_mla_decode, triton_mla_prefill
from vllm.v1.attention.backends.triton_mla import MLAMetadata, TritonMLABackend
from vllm.v1.attention.selector import select_attention_backend
from vllm.v1.worker.model_runner import ModelRunner


def backend(device="cpu", block_size=BLOCK, prefill_kernel=None) -> TritonMLABackend:
    b = TritonMLABackend(HEADS, 1, DIM, torch.float32, device, block_size, value_size=LATENT)
    if prefill_kernel is not None:
        b.prefill_kernel = prefill_kernel
    return b


def test_metadata_layout():
    seqs = [
        (5, 1, [3, 7]),  # a decode at position 5: block 7, offset 1
        (0, 1, [4]),  # a one-token prompt ahead of the chunks: a decode of itself
        (8, 4, [2, 9, 6]),  # a chunk over an 8-token prefix
        (0, 3, [11]),  # a prompt
        (2, 1, [12]),  # one token after a chunk: a prefill chunk
    ]
    meta = backend(block_size=4, prefill_kernel=False).build_metadata(seqs)
    assert meta.num_decodes == 2 and meta.prefill is None
    assert meta.block_table.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.block_table.tolist() == [[3, 7], [4, 0]] and meta.seq_lens.tolist() == [6, 1]
    assert meta.slot_mapping.tolist() == [29, 16, 24, 25, 26, 27, 44, 45, 46, 50]
    starts = [(c.start, c.num_tokens) for c in meta.prefills]
    assert starts == [(2, 4), (6, 3), (9, 1)]
    contexts = [
        None if c.context_slots is None else c.context_slots.tolist() for c in meta.prefills
    ]
    assert contexts == [[8, 9, 10, 11, 36, 37, 38, 39, 24, 25, 26, 27], None, [48, 49, 50]]
    with pytest.raises(ValueError, match="cannot hold"):
        backend(block_size=4).build_metadata([(4, 1, [3])])
    # The same step for the Triton prefill kernel: the chunks' tables, lengths and rows.
    meta = backend(block_size=4, prefill_kernel=True).build_metadata(seqs)
    assert meta.num_decodes == 2 and not meta.prefills and meta.has_prefills
    assert meta.block_table.tolist() == [[3, 7], [4, 0]] and meta.seq_lens.tolist() == [6, 1]
    assert meta.slot_mapping.tolist() == [29, 16, 24, 25, 26, 27, 44, 45, 46, 50]
    p = meta.prefill
    assert p.block_table.dtype == p.seq_lens.dtype == p.cu_seq_q.dtype == torch.int32
    assert p.block_table.tolist() == [[2, 9, 6], [11, 0, 0], [12, 0, 0]]
    assert p.seq_lens.tolist() == [12, 3, 3] and p.cu_seq_q.tolist() == [2, 6, 9, 10]
    assert p.max_q == 4
    decodes_only = backend(block_size=4, prefill_kernel=True).build_metadata(seqs[:2])
    assert decodes_only.prefill is None and not decodes_only.has_prefills


def test_graph_metadata_takes_a_decode_step_in_place():
    b = backend(block_size=4)
    graph = b.graph_metadata(8, 6)
    assert graph.num_decodes == 8 and (graph.seq_lens == 1).all() and not graph.prefills
    view = graph.narrow(3)
    pointers = [t.data_ptr() for t in (view.slot_mapping, view.block_table, view.seq_lens)]
    step = b.build_metadata([(5, 1, [3, 7]), (0, 1, [0]), (9, 1, [1, 2, 5])])
    view.copy_(step)
    assert [t.data_ptr() for t in (view.slot_mapping, view.block_table, view.seq_lens)] == pointers
    assert graph.block_table[:3].tolist() == [[3, 7, 0, 0, 0, 0], [0] * 6, [1, 2, 5, 0, 0, 0]]
    assert graph.seq_lens[:3].tolist() == [6, 1, 10]
    assert graph.slot_mapping[:3].tolist() == [29, 0, 21]
    with pytest.raises(ValueError, match="does not fit"):
        view.copy_(b.build_metadata([(40, 1, list(range(1, 12)))] * 3))  # 11 blocks > 6
    with pytest.raises(ValueError, match="decode-only"):
        view.copy_(b.build_metadata([(0, 1, [0]), (0, 1, [0]), (0, 2, [0])]))
    with pytest.raises(ValueError, match="decode-only"):
        b.build_metadata([(0, 2, [1])]).narrow(1)
    b.prefill_kernel = True
    with pytest.raises(ValueError, match="decode-only"):
        b.build_metadata([(0, 2, [1])]).narrow(1)
    with pytest.raises(ValueError, match="decode-only"):
        view.copy_(b.build_metadata([(0, 1, [0]), (0, 1, [0]), (0, 2, [0])]))
    assert isinstance(b.graph_metadata(1, 1), MLAMetadata) and b.supports_decode_graphs


def emulated_kernel(calls: list):
    """``mla_decode_attention`` in float64, checking the arguments the real one takes."""

    def kernel(q, kv_cache, block_table, seq_lens, scale, value_size, out=None, num_splits=None):
        assert block_table.dtype == seq_lens.dtype == torch.int32 and out is not None
        assert kv_cache.shape[0] == 1 and out.shape[2] == value_size
        calls.append(len(seq_lens))
        # A captured graph's padding rows hold whatever memory held: subnormal float64
        # products in them took ~8 ms a softmax (80 s a test) where the memory had some.
        flush = torch.set_flush_denormal(True)
        try:
            ref = mla_reference(q, kv_cache, block_table, seq_lens, scale, value_size)
        finally:
            if flush:
                torch.set_flush_denormal(False)
        for i, o in ref.items():
            out[i] = o.to(out.dtype)
        return out

    return kernel


def emulated_prefill_kernel(calls: list):
    """``mla_prefill_attention`` in float64, checking the arguments the real one takes
    (the chunks' own rows must be in the cache already)."""

    def kernel(q, kv_cache, block_table, seq_lens, cu_seq_q, max_q, scale, value_size, out):
        assert block_table.dtype == seq_lens.dtype == cu_seq_q.dtype == torch.int32
        assert kv_cache.shape[0] == 1 and out.shape[2] == value_size
        cu = cu_seq_q.tolist()
        seqs = [
            (n - (b - a), b - a) for n, a, b in zip(seq_lens.tolist(), cu[:-1], cu[1:], strict=True)
        ]
        assert max_q == max(n for _, n in seqs)
        calls.append(seqs)
        ref = mla_prefill_reference(q, kv_cache, block_table, seqs, cu, scale, value_size)
        for i, r in ref.items():
            out[cu[i] : cu[i + 1]] = r.to(out.dtype)
        return out

    return kernel


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("prefill_kernel", [False, True])
def test_backend_with_emulated_kernels_equals_float64(monkeypatch, cache_dtype, prefill_kernel):
    calls, prefill_calls = [], []
    monkeypatch.setattr(triton_mla_decode, "mla_decode_attention", emulated_kernel(calls))
    monkeypatch.setattr(
        triton_mla_prefill, "mla_prefill_attention", emulated_prefill_kernel(prefill_calls)
    )
    assert run_steps(backend(prefill_kernel=prefill_kernel), cache_dtype, STEPS) < 1e-5
    assert calls == [2, 1, 3]  # the decodes of each step that has some
    # (prefix, chunk) of each step's chunks: sequence 0's second prompt chunk is a decode.
    assert prefill_calls == ([[(0, 5), (0, 3)], [(0, 6)], [(6, 4)]] if prefill_kernel else [])


def test_the_selector_offers_it_to_mla_models_only():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="serves only models whose attention uses latent kv"):
        select_attention_backend(cpu, torch.float32, 16, 64, forced="TRITON_MLA")
    with pytest.raises(ValueError, match="device is cpu"):
        select_attention_backend(
            cpu, torch.float32, 16, 576, forced="TRITON_MLA", features={"latent_kv"}
        )
    with pytest.raises(ValueError, match="value_size"):
        TritonMLABackend(HEADS, 1, DIM, torch.float32, "cpu", BLOCK)


@torch.inference_mode()
def replayed_logits(runner: ModelRunner, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """fp32 logits of ``ids[prefix:]``, each from a decode step replayed from the runner's
    captured graphs after an eager prefill of ``ids[:prefix]`` (blocks 1-8, as
    ``runner_logits``)."""
    blocks = list(range(1, 9))
    meta = runner.attn_backend.build_metadata([(0, prefix, blocks)])
    runner.model(ids[:prefix], torch.arange(prefix, device=ids.device), meta, runner.kv_caches)
    graphs, rows = runner.decode_graphs, []
    replays = graphs.num_replays
    for p in range(prefix, len(ids)):
        hidden = graphs.run([int(ids[p])], [p], [(p, 1, blocks)])
        assert hidden is not None, "a decode step of one sequence must replay"
        rows.append(runner.model.compute_logits(hidden))
    assert graphs.num_replays - replays == len(ids) - prefix
    return torch.cat(rows).float().cpu()


@torch.inference_mode()
def chunked_logits(runner: ModelRunner, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """fp32 logits of ``ids`` prefilled in ``chunks`` (each over the cached rows of the
    ones before it; blocks 1-8, as ``runner_logits``)."""
    blocks, rows, start = list(range(1, 9)), [], 0
    for n in chunks:
        meta = runner.attn_backend.build_metadata([(start, n, blocks)])
        pos = torch.arange(start, start + n, device=ids.device)
        hidden = runner.model(ids[start : start + n], pos, meta, runner.kv_caches)
        rows.append(runner.model.compute_logits(hidden))
        start += n
    assert start == len(ids)
    return torch.cat(rows).float().cpu()


def test_a_runner_replays_deepseek_decode_steps(monkeypatch, tmp_path):
    # The CUDA test's flow (tests/cuda/test_deepseek_mla_cuda.py) on the CPU: stand-in
    # graphs and the emulated kernels; TRITON_MLA installed by hand (the selector keeps it
    # to CUDA). Its prompt, chunked prompt and replayed decode logits equal TORCH_SDPA's.
    from tests.v1.worker.test_cuda_graph import ReplayingGraph
    from vllm.config import ModelConfig

    monkeypatch.setattr(triton_mla_decode, "mla_decode_attention", emulated_kernel([]))
    prefill_calls = []
    monkeypatch.setattr(
        triton_mla_prefill, "mla_prefill_attention", emulated_prefill_kernel(prefill_calls)
    )
    save("v2_lite", tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    ids = torch.randint(0, TINY["vocab_size"], (80,), generator=torch.Generator().manual_seed(1))
    ref = runner_logits(runner, ids)
    a = runner.arch
    runner.attn_backend = TritonMLABackend(
        a.num_heads, 1, a.head_dim, runner.dtype, "cpu", 16, value_size=a.latent_value_size
    )
    runner.attn_backend.prefill_kernel = True  # as on CUDA
    runner.install_attention_backend()
    ours = runner_logits(runner, ids)
    chunked = chunked_logits(runner, ids, [30, 33, 17])
    runner.capture_model(graph_factory=ReplayingGraph)
    decoded = replayed_logits(runner, ids, 60)
    assert (ours - ref).abs().max() < 1e-4
    assert (chunked - ref).abs().max() < 1e-4
    assert (decoded - ref[60:]).abs().max() < 1e-4
    layers = TINY["num_hidden_layers"]
    assert [c[0] for c in prefill_calls[: 4 * layers : layers]] == [(0, 80), (0, 30), (30, 33),
                                                                     (63, 17)]  # fmt: skip


def decode_step_without_host_reads(monkeypatch, model_cls, arch, positions, also=None):
    """What a CUDA graph needs of the forward around the kernel (the kernel itself reads
    lengths on the device): ``model_cls(arch)``'s decode step of four sequences at
    ``positions`` over TRITON_MLA, on the pure-torch ops CUDA runs, under
    tests/v1/worker/test_no_host_sync.py's guard (``also()`` runs under it too). The kernel
    is stood in for by a device-side copy. Returns the step's hidden states."""
    from tests.v1.worker.test_no_host_sync import HostSyncGuard
    from vllm import _custom_ops as ops

    def stand_in(q, kv_cache, block_table, seq_lens, scale, value_size, out=None, **_):
        return out.narrow(0, 0, block_table.shape[0]).copy_(q.narrow(2, 0, value_size))

    monkeypatch.setattr(triton_mla_decode, "mla_decode_attention", stand_in)
    monkeypatch.setattr(ops, "_op", lambda name: None)
    torch.manual_seed(0)
    model = model_cls(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.init_buffers()
    b = TritonMLABackend(arch.num_heads, 1, arch.head_dim, torch.float32, "cpu", 4,
                         value_size=arch.latent_value_size)  # fmt: skip
    model.set_attention_backend(b)
    caches = [torch.zeros(b.kv_cache_shape(8)) for _ in model.layers]
    meta = b.graph_metadata(4, 3)
    meta.copy_(b.build_metadata([(5, 1, [1, 2]), (0, 1, [3]), (9, 1, [4, 5, 6]), (0, 1, [0])]))
    ids = torch.tensor([7, 8, 9, 0])
    with torch.inference_mode(), HostSyncGuard():
        hidden = model(ids, torch.tensor(positions), meta, caches)
        if also is not None:
            also()
    assert hidden.shape == (4, arch.hidden_size) and torch.isfinite(hidden).all()
    return hidden


def test_a_deepseek_decode_step_reads_nothing_back_to_the_host(monkeypatch):
    """A dense DeepSeek-V2 (no experts): ``decode_step_without_host_reads``."""
    import transformers

    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Arch, DeepseekV2ForCausalLM

    config = transformers.DeepseekV2Config(**{**TINY, "first_k_dense_replace": 3})
    arch = DeepseekV2Arch.from_hf(config)
    assert not arch.sparse_layers
    decode_step_without_host_reads(monkeypatch, DeepseekV2ForCausalLM, arch, [5, 0, 9, 0])


# -- the real kernel in Triton's interpreter (CPU, a child process) ----------------------------
def _deepseek_logits_diff() -> float:
    """A tiny DeepSeek-V2 (V2-Lite's layout) teacher-forced through a 20-token prompt and 6
    decode steps on TRITON_MLA and on TORCH_SDPA: the largest logit difference."""
    import transformers

    from tests.model_executor.test_deepseek import TINY, VARIANTS
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Arch, DeepseekV2ForCausalLM
    from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

    torch.manual_seed(0)
    hf = transformers.DeepseekV2ForCausalLM(
        transformers.DeepseekV2Config(**{**TINY, **VARIANTS["v2_lite"][1]})
    )
    arch = DeepseekV2Arch.from_hf(hf.config)
    model = DeepseekV2ForCausalLM(arch)
    model.load_weights(hf.state_dict())
    ids = torch.randint(0, TINY["vocab_size"], (26,), generator=torch.Generator().manual_seed(1))
    logits = []
    for cls in (TritonMLABackend, TorchSDPABackend):
        b = cls(arch.num_heads, 1, arch.head_dim, torch.float32, "cpu", 16,
                value_size=arch.latent_value_size)  # fmt: skip
        model.set_attention_backend(b)
        caches = [torch.zeros(b.kv_cache_shape(4)) for _ in model.layers]
        rows = []
        with torch.inference_mode():
            for start, n in [(0, 20)] + [(p, 1) for p in range(20, 26)]:
                meta = b.build_metadata([(start, n, [2, 1, 3])])
                pos = torch.arange(start, start + n)
                rows.append(model.compute_logits(model(ids[start : start + n], pos, meta, caches)))
        logits.append(torch.cat(rows))
    return float((logits[0] - logits[1]).abs().max())


def _interpreted_steps(cache_dtype: torch.dtype) -> float:
    b = backend()
    assert b.prefill_kernel, "in the interpreter the backend takes the Triton prefill kernel"
    return run_steps(b, cache_dtype, STEPS)


INTERPRETED = {
    "steps-fp32": lambda: _interpreted_steps(torch.float32),
    "steps-fp8e5m2": lambda: _interpreted_steps(torch.float8_e5m2),
    "deepseek-v2-lite-logits": _deepseek_logits_diff,
}


def interpreter_main() -> None:
    print_case_results(
        type(triton_mla_decode._mla_decode_kernel).__name__,
        json.load(sys.stdin),
        lambda case_id: {"max_err": INTERPRETED[case_id]()},
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreted_cases(__name__, INTERPRETED)


@pytest.mark.parametrize("case_id", list(INTERPRETED))
def test_backend_with_the_interpreted_kernel(interpreted, case_id):
    result = interpreted[case_id]
    assert "error" not in result, result.get("error")
    assert result["max_err"] < 1e-4, result
