"""CUDA graphs of decode steps: the model's forward for a batch of sequences with one new
token each, captured once per batch size of a ladder and replayed, as vLLM does.

A decode step of an 8B model launches about a thousand kernels; launched one by one from
Python, a batch-1 step costs several times the 4.8 ms its weights take to read on an
H100. A graph launches them all at once. What makes a step replayable:

- **Fixed buffers.** Token ids, positions and the attention metadata of every captured
  size are views of one set of tensors for the largest size (``narrow``); a step's
  values are copied into them before the replay, and the hidden states come out in one
  buffer (the graph's last kernel copies them there).
- **Fixed shapes.** A batch of ``n`` sequences replays the graph of the next captured
  size ``B >= n``; rows ``n..B-1`` are padding: token 0 at position 0, written to slot 0
  of the null block 0, which no sequence reads, attending over that one slot. Their
  outputs are dropped.
- **No host reads.** The forward reads no device value on the host (the attention
  backend's ``supports_decode_graphs``; ``tests/v1/worker/test_no_host_sync.py``), so the
  kernels' launch shapes depend on ``B`` only.

A draft model's single-token steps (``vllm/v1/spec_decode/draft_model.py``) are captured
the same way, by a second ``DecodeGraphs`` over the draft's model, backend and KV tensors;
their input ids may come straight from the device (the previous step's argmax).

The sizes are vLLM's ladder: 1, 2, 4, multiples of 8 below 256, multiples of 16 from 256,
up to ``--max-cudagraph-capture-size`` (default ``min(max_num_seqs, 512)``), which is
captured too when it is off the ladder; or the sizes ``--cudagraph-capture-sizes`` lists
(``--compilation-config``'s key too). Larger decode batches, and every step with a prompt
or a chunk, run eagerly. ``--enforce-eager`` captures nothing.

The graphs share one memory pool, captured largest first so the smaller ones reuse its
blocks; that pool is taken after the KV cache is sized (``ModelRunner.capture_model``
logs it) and is not part of the ``--gpu-memory-utilization`` budget's profile.

``graph_factory`` makes the graph objects: CUDA's by default; tests pass one that re-runs
the captured function at each replay, to check the buffer plumbing on a CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from vllm.utils.device import pinned
from vllm.v1.attention.backends.abstract import AttentionBackend, SeqLayout

logger = logging.getLogger(__name__)

DEFAULT_MAX_CAPTURE_SIZE = 512


def cudagraph_capture_sizes(
    max_num_seqs: int,
    max_capture_size: int | None = None,
    sizes: Sequence[int] | None = None,
) -> list[int]:
    """The decode batch sizes to capture, ascending: 1, 2, 4, multiples of 8 below 256,
    multiples of 16 from 256, up to the largest (``max_capture_size``, default
    ``min(max_num_seqs, 512)``, never above ``max_num_seqs``), which is always included.
    ``sizes`` (``--cudagraph-capture-sizes``): those instead, less any above
    ``max_num_seqs`` (no decode batch is that large); ValueError if none is left."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_capture_size is not None and max_capture_size < 1:
        raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {max_capture_size}")
    if sizes is not None:
        usable = sorted({s for s in sizes if s <= max_num_seqs})
        if not usable or usable[0] < 1:
            raise ValueError(
                f"cudagraph_capture_sizes {list(sizes)}: no size in [1, max_num_seqs="
                f"{max_num_seqs}]"
            )
        return usable
    top = DEFAULT_MAX_CAPTURE_SIZE if max_capture_size is None else max_capture_size
    top = min(top, max_num_seqs)
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return sorted({s for s in ladder if s <= top} | {top})


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` once, recording it; returns its output (replays rewrite it)."""

    def replay(self) -> None: ...


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` in a shared memory pool."""

    def __init__(self, pool: Any) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self._graph, pool=self._pool):
            return fn()

    def replay(self) -> None:
        self._graph.replay()


class DecodeGraphs:
    """The captured decode steps of one model over one KV cache.

    ``run(ids, positions, seqs)`` replays the step when every sequence of ``seqs`` has one
    new token and there are at most ``max_size`` of them; it returns the hidden states of
    the ``len(seqs)`` real rows (a view of the output buffer, valid until the next run), or
    None when the step must run eagerly.
    """

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        max_blocks: int,
        device: torch.device,
        graph_factory: Callable[[], Graph] | None = None,
        lora: Any = None,
        name: str = "decode",
        hidden_input: tuple[int, torch.dtype] | None = None,
    ) -> None:
        """``lora``: the model's ``LoRABatch`` (--enable-lora): the graphs then compute
        every adapter slot, masked per row by the slots ``run`` is given. ``name``: what
        the start-up log calls these graphs (the target's, a draft model's).
        ``hidden_input``: (width, dtype) of a per-row input the model takes as
        ``hidden_states`` besides the tokens (an EAGLE head's), given to ``run``.
        A model whose forward leaves ``aux_hidden`` (``aux_hidden_layers``, EAGLE-3's
        target) gets it back after each replay, a view of a buffer of the graphs."""
        if not backend.supports_decode_graphs:
            raise ValueError(f"{backend.name} cannot capture decode steps in CUDA graphs")
        if not sizes or sorted(set(sizes)) != list(sizes) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be ascending and >= 1, got {sizes}")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = list(sizes)
        self.max_size = self.sizes[-1]
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = lambda: CUDAGraph(pool)  # noqa: E731
        self._graph_factory = graph_factory
        # The largest step's inputs; every size replays views of their first rows.
        self._ids = torch.zeros(self.max_size, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(self.max_size, dtype=torch.long, device=self.device)
        self._meta = backend.graph_metadata(self.max_size, max_blocks)
        self._hidden: torch.Tensor | None = None  # (max_size, hidden): every graph's output
        self._hidden_in: torch.Tensor | None = None
        if hidden_input is not None:
            width, dtype = hidden_input
            self._hidden_in = torch.zeros(self.max_size, width, dtype=dtype, device=self.device)
        self._aux: torch.Tensor | None = None  # the model's aux_hidden, when it leaves one
        self._graphs: dict[int, Graph] = {}
        self.num_replays = 0
        self.lora = lora
        self.name = name

    def _forward(self, size: int) -> torch.Tensor:
        """The step the graph of ``size`` records: the model over the first ``size`` rows
        of the buffers, its hidden states copied into the shared output."""
        hidden = self._call(size)
        if self._hidden is None:
            raise RuntimeError("capture() allocates the output before recording")
        out = self._hidden.narrow(0, 0, size)
        out.copy_(hidden)
        if self._aux is not None:
            self._aux.narrow(0, 0, size).copy_(self.model.aux_hidden)
        return out

    def _call(self, size: int) -> torch.Tensor:
        """The model over the first ``size`` rows of the input buffers."""
        kwargs = {}
        if self._hidden_in is not None:
            kwargs["hidden_states"] = self._hidden_in.narrow(0, 0, size)
        return self.model(
            self._ids.narrow(0, 0, size),
            self._positions.narrow(0, 0, size),
            self._meta.narrow(size),
            self.kv_caches,
            **kwargs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every size, largest first (the smaller graphs reuse the pool's blocks).
        Each is run once eagerly before its capture (kernels compile and tune outside it),
        on the padding the buffers hold, which writes only the null block."""
        start = time.monotonic()
        warm_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        aux_layers = getattr(self.model, "aux_hidden_layers", None)
        for size in reversed(self.sizes):
            if self.lora is not None:
                self.lora.use_graph_rows(size, self.max_size, self.device)
            if warm_stream is not None:  # as torch's docs ask: warm up on a side stream
                warm_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warm_stream):
                    warm = self._call(size)
                torch.cuda.current_stream().wait_stream(warm_stream)
            else:
                warm = self._call(size)
            if self._hidden is None:
                self._hidden = torch.zeros(
                    self.max_size, *warm.shape[1:], dtype=warm.dtype, device=self.device
                )
                if aux_layers:
                    aux = self.model.aux_hidden
                    self._aux = torch.zeros(
                        self.max_size, *aux.shape[1:], dtype=aux.dtype, device=self.device
                    )
            graph = self._graph_factory()
            graph.capture(lambda size=size: self._forward(size))
            self._graphs[size] = graph
        if self.lora is not None:
            self.lora.set([], self.device)  # eager steps set their own
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(
            "Captured %d %s CUDA graphs (batch sizes %d-%d) in %.1f s",
            len(self.sizes),
            self.name,
            self.sizes[0],
            self.max_size,
            time.monotonic() - start,
        )

    def padded_size(self, seqs: list[SeqLayout]) -> int | None:
        """The captured size that replays ``seqs``, or None (not decode-only, too many)."""
        n = len(seqs)
        if not self._graphs or n == 0 or n > self.max_size or any(k != 1 for _, k, _ in seqs):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(
        self,
        ids: list[int] | torch.Tensor,
        positions: list[int],
        seqs: list[SeqLayout],
        lora_slots: list[int] | None = None,
        tokens_ahead: tuple[torch.Tensor, torch.Tensor] | None = None,
        hidden_in: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``ids``: the rows' input tokens, on the host or (a tensor of ``len(seqs)``) on
        the device, copied there without a host round trip (a draft model feeding its
        last step's argmax). ``lora_slots``: each row's adapter slot, when the graphs
        were captured with LoRA (None or all 0: the base model). ``tokens_ahead``: (rows,
        tokens) on the device, input tokens that a step still on the device sampled
        (--async-scheduling), written over those rows of ``ids``. ``hidden_in``: the rows'
        ``hidden_states`` input (graphs captured with ``hidden_input``)."""
        size = self.padded_size(seqs)
        if size is None:
            return None
        n = len(seqs)
        pad = size - n
        on_device = isinstance(ids, torch.Tensor)
        if on_device and ids.shape != (n,):
            raise ValueError(f"{n} rows, {tuple(ids.shape)} input ids")
        if self.lora is not None:
            # The state the graph recorded (what a stand-in graph re-runs in Python).
            self.lora.use_graph_rows(size, self.max_size, self.device)
            self.lora.fill_graph_rows((lora_slots or [0] * n) + [0] * pad)
        step = self.backend.build_metadata(seqs + [(0, 1, [0])] * pad)
        host_ids = [0] * size if on_device else ids + [0] * pad
        host = pinned(torch.tensor([host_ids, positions + [0] * pad], dtype=torch.long))
        self._meta.narrow(size).copy_(step)
        self._ids.narrow(0, 0, size).copy_(host[0], non_blocking=True)
        self._positions.narrow(0, 0, size).copy_(host[1], non_blocking=True)
        if on_device:  # after the padding's zeros, on the same stream
            self._ids.narrow(0, 0, n).copy_(ids)
        if tokens_ahead is not None:
            self._ids.index_copy_(0, *tokens_ahead)
        if self._hidden_in is not None:
            if hidden_in is None or hidden_in.shape[0] != n:
                raise ValueError(f"{n} rows need their hidden_states input")
            self._hidden_in.narrow(0, 0, n).copy_(hidden_in)
        self._graphs[size].replay()
        self.num_replays += 1
        if self._aux is not None:
            self.model.aux_hidden = self._aux.narrow(0, 0, n)
        return self._hidden.narrow(0, 0, n)
