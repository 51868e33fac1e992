"""The model runner: per-request state, input packing, one forward per step, sampling.

It never decides which blocks a request gets: block ids come from the scheduler (block 0
is the null block and is never written).
"""

from __future__ import annotations

import gc
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import VllmConfig
from vllm.lora.manager import LoRAAdapterError, LoRAManager
from vllm.model_executor.layers.pooler import (
    classify_activation,
    pool_rows,
    pooling_use_activation,
)
from vllm.model_executor.layers.recurrent import (
    RecurrentBatch,
    StateSpec,
    allocate_states,
    copy_slots,
    refuse_unsupported,
    ssm_state_dtype,
    state_bytes,
)
from vllm.model_executor.model_loader import apply_quantization, load_model_weights, resolve_model
from vllm.model_executor.models.registry import ModelRegistry, model_class_for_task
from vllm.multimodal.inputs import (
    EncoderCache,
    MultiModalFeature,
    features_in,
    mrope_positions,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.device import to_device, to_host, upload
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    BlockIds,
    attend_both_ways,
    kv_cache_bytes,
    kv_cache_shape,
    latent_value_size,
)
from vllm.v1.attention.kv_cache_dtype import is_fp8, kv_cache_torch_dtype
from vllm.v1.attention.selector import select_attention_backend
from vllm.v1.core.kv_cache_utils import blocks_for_sequence, kv_capacity_tokens
from vllm.v1.core.sched.output import KVOffloadTransfers, NewRequestData, SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput, PromptLogprobs, RequestFailure
from vllm.v1.sample.logits_processor import build_logits_processors
from vllm.v1.sample.logits_processor.state import PersistentBatch
from vllm.v1.sample.penalty_table import PenaltyTable, has_penalty
from vllm.v1.sample.rejection_sampler import SampledDrafts, verify_sampled_batch
from vllm.v1.sample.sampler import (
    NON_FINITE_LOGITS,
    PrefixView,
    SamplingRow,
    finite_and_argmax,
    is_bare,
    is_bare_greedy,
    logprobs_from_host,
    logprobs_source,
    row_failure,
    sample,
    sample_on_device,
    sampled_logprobs_on_device,
    token_logprobs,
    token_logprobs_on_device,
    unprocessed,
)
from vllm.v1.spec_decode.draft_model import DraftDistribution, DraftModelProposer
from vllm.v1.spec_decode.eagle import EagleProposer, check_eagle_head, eagle_head_class
from vllm.v1.spec_decode.ngram_proposer import drafts_allowed, verify_greedy
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.cuda_graph import CUDAGraph, DecodeGraphs, Graph, cudagraph_capture_sizes
from vllm.v1.worker.gpu_memory import (
    MemorySnapshot,
    measure_before_load,
    profile_kv_cache_budget,
)
from vllm.v1.worker.kv_cache_groups import GroupedBuilder, KVCacheGroups, plan_kv_cache_groups
from vllm.v1.worker.sleep_mode import move_module_tensors

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
# Prompt logprobs take the logits of every prompt position: at most this many rows of
# (rows, vocab) logits at a time (256 x 49,152 fp32 = 48 MiB).
PROMPT_LOGPROBS_ROWS = 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVTensorPlan:
    """The KV cache tensors' shapes: ``layer_tensor[i]`` is cache layer ``i``'s tensor,
    ``shapes[t]`` tensor ``t``'s ``(num_kv_heads, head_dim)``; every tensor has the pool's
    number of blocks (a block id indexes each one)."""

    layer_tensor: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]

    @property
    def num_tensors(self) -> int:
        return len(self.shapes)


def arch_layer_kv_shapes(arch: object) -> tuple[tuple[int, int], ...]:
    """Each cache layer's ``(num_kv_heads, head_dim)``: the arch's ``layer_kv_shapes``
    where it declares them (a model whose layers differ: Gemma 4), else the arch's one
    ``(num_kv_heads, head_dim)`` for every layer."""
    n = arch.num_layers
    shapes = getattr(arch, "layer_kv_shapes", None)
    if shapes is None:
        return ((arch.num_kv_heads, arch.head_dim),) * n
    shapes = tuple((int(h), int(d)) for h, d in shapes)
    if len(shapes) != n:
        raise ValueError(f"layer_kv_shapes names {len(shapes)} layers, the arch caches {n}")
    return shapes


def plan_kv_tensors(
    layer_tensor: tuple[int, ...], layer_shapes: tuple[tuple[int, int], ...]
) -> KVTensorPlan:
    """The cache tensors of layers that share tensors as ``layer_tensor`` says (one a
    layer, or the hybrid KV cache's: layer ``j`` of every group on tensor ``j``), each of
    its layers' shape. Layers of different shapes never share a tensor: a shared tensor
    whose layers differ becomes one tensor per shape, or, when that costs more bytes, one
    of the largest heads and head size (each layer's KV head count dividing its), which
    the smaller layers pad into (the model reads its tensor's shape: gemma4.py). Tensors
    are numbered in order of their first layer."""
    by_tensor: dict[int, list[int]] = {}
    for layer, t in enumerate(layer_tensor):
        by_tensor.setdefault(t, []).append(layer)
    shapes: list[tuple[int, int]] = []
    index: dict[tuple[int, tuple[int, int]], int] = {}  # (old tensor, shape) -> new tensor
    new_tensor = [0] * len(layer_tensor)
    for layer, t in enumerate(layer_tensor):
        distinct = {layer_shapes[i] for i in by_tensor[t]}
        shape = layer_shapes[layer]
        if len(distinct) > 1:
            heads, dim = max(h for h, _ in distinct), max(d for _, d in distinct)
            fits = all(heads % h == 0 for h, _ in distinct)
            if fits and heads * dim < sum(h * d for h, d in distinct):
                shape = (heads, dim)
        if (t, shape) not in index:
            index[(t, shape)] = len(shapes)
            shapes.append(shape)
        new_tensor[layer] = index[(t, shape)]
    return KVTensorPlan(tuple(new_tensor), tuple(shapes))


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # One list per KV cache group (kv_cache_groups.py), each made a BlockIds (it keeps a
    # numpy copy for the metadata builders).
    block_ids: tuple[BlockIds, ...]
    generator: torch.Generator | None
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    lora_int_id: int = 0  # its adapter's id (0: the base model)
    lora_slot: int = 0  # the adapter's slot (LoRAManager), fixed while the request runs
    bare_greedy: bool = False  # sampler.is_bare_greedy(sampling_params): the argmax alone
    # Sampled on the device without its output on the host: sampler.is_bare, or
    # penalised only, with the penalties from the runner's PenaltyTable.
    bare: bool = False
    penalty_slot: int | None = None  # its row in ModelRunner.penalty_table, if any
    # A draft model's bookkeeping (draft_model.py): positions whose draft KV holds this
    # request's tokens (None: its first pass starts at its computed prefix), the drafts
    # fed past them in the last pass, and whether it may get drafts at all; a sampled
    # request's last proposals with the q each was drawn from (on the device, until
    # the next step verifies them; gone with the state when it finishes or is preempted).
    draft_valid: int | None = None
    draft_ahead: list[int] = field(default_factory=list)
    draft_allowed: bool = False
    draft_probs: DraftDistribution | None = None
    # Its images (vllm.multimodal), and the embeddings of those whose placeholders are
    # still to be computed, by index (made by the first step that needs them; dropped
    # after the step that computes an image's last position, or with the state).
    mm_features: list[MultiModalFeature] | None = None
    mm_embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    # --enable-prompt-embeds: the prompt's embeddings on the device, in the model's dtype,
    # read in place of the embedding lookup until the prompt's last position is computed
    # (dropped then; a preempted request gets them again with its NewRequestData).
    prompt_embeds: torch.Tensor | None = None
    # An M-RoPE model's request with images: its positions are mrope_positions' (past an
    # image they run behind or ahead of its indices), not its indices.
    mrope: bool = False
    # A model with recurrent layers: the slot of this request's recurrent states
    # (ModelRunner.recurrent_states), held from its first step to its end or preemption.
    state_slot: int | None = None
    # The prompt inside token_ids, one view for the request's life (it caches the
    # prompt's distinct ids for the repetition penalty).
    prompt_view: PrefixView = field(init=False)
    # What a step's sequence layout carries: the one group's BlockIds, or the tuple of
    # every group's (the hybrid KV cache's GroupedBuilder takes it apart); and the first
    # group's, which holds every position when any group does (full attention comes
    # first): a draft model's table.
    table: BlockIds | tuple[BlockIds, ...] = field(init=False)
    full_table: BlockIds = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_view = PrefixView(self.token_ids, self.num_prompt_tokens)
        self.block_ids = tuple(BlockIds(ids) for ids in self.block_ids)
        self.table = self.block_ids[0] if len(self.block_ids) == 1 else self.block_ids
        self.full_table = self.block_ids[0]


@dataclass
class PendingPromptLogprobs:
    """One request's prompt logprobs of a step, as ``token_logprobs_on_device`` left them
    (one (ints, floats) pair per chunk of rows), on the device or copied to the host."""

    req_id: str
    start: int
    targets: list[int]
    parts: list[tuple[torch.Tensor, torch.Tensor]]


def prompt_logprobs_from(pending: list[PendingPromptLogprobs]) -> dict[str, PromptLogprobs]:
    """The host's ``PromptLogprobs`` of each request (its tensors read, a sync if on a
    device)."""
    result = {}
    for p in pending:
        ints = [row for a, _ in p.parts for row in a.tolist()]
        floats = [row for _, f in p.parts for row in f.tolist()]
        result[p.req_id] = PromptLogprobs(p.start, logprobs_from_host(p.targets, ints, floats))
    return result


class DeferredOutput:
    """A step whose sampled tokens are still on the device (``--async-scheduling``): the
    engine schedules and launches the next step, then takes this one's ``result()``.

    The rows are sampled on the device (``sampler.sample_on_device``): each row's token
    and its two finiteness flags, the logprobs of the rows that ask for them and the
    step's prompt logprobs are copied to the host behind the forward (into pinned memory
    on CUDA, an event marks the copies' end); ``result()`` waits for them, appends the
    tokens to the requests' states and advances their grammars (``accept``)."""

    def __init__(
        self,
        output: ModelRunnerOutput,
        states: list[CachedRequestState],
        packed: torch.Tensor,
        logprobs: list[tuple[list[int], torch.Tensor, torch.Tensor]],
        prompt_logprobs: list[PendingPromptLogprobs],
        event: torch.cuda.Event | None,
        grammar_errors: dict[int, RequestFailure],
        accept: Callable[[list[CachedRequestState], list[int]], None],
    ) -> None:
        self._output = output
        self._states = states
        self._packed = packed  # host: the rows' tokens, then their two flags (row_failure)
        self._logprobs = logprobs  # host: sampler.sampled_logprobs_on_device's groups
        self._prompt_logprobs = prompt_logprobs  # host: the step's prompt logprobs
        self._event = event
        self._grammar_errors = grammar_errors  # rows whose grammar failed (all -inf)
        self._accept = accept  # StructuredOutputManager.accept
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def result(self) -> ModelRunnerOutput:
        """The step's output, once the device is done with it (idempotent)."""
        if self._done:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        values = self._packed.tolist()
        n = len(self._states)
        out = self._output
        sampled: list[CachedRequestState] = []
        for i, state in enumerate(self._states):
            token = values[i]
            failure = self._grammar_errors.get(i) or row_failure(
                bool(values[n + i]), bool(values[2 * n + i])
            )
            if failure is not None:
                out.errors[state.req_id] = failure
                continue
            state.token_ids.append(token)
            state.output_token_ids.append(token)
            out.sampled_token_ids[state.req_id] = [token]
            sampled.append(state)
        self._accept(sampled, [s.output_token_ids[-1] for s in sampled])
        out.prompt_logprobs = prompt_logprobs_from(self._prompt_logprobs)
        for rows, ints, floats in self._logprobs:
            entries = logprobs_from_host([values[i] for i in rows], ints.tolist(), floats.tolist())
            for i, entry in zip(rows, entries, strict=True):
                req_id = self._states[i].req_id
                if req_id in out.sampled_token_ids:  # not a failed row's
                    out.logprobs[req_id] = [entry]
        self._done = True
        return out


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """The maximal runs ``[a, b)`` of consecutive values in ascending ``rows``."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device | str | None = None):
        self.config = vllm_config
        self.model_config = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype = self.model_config.dtype
        if dtype == "auto":
            # fp32 on CPU: the exactness reference. On a CPU with bf16 hardware (this Zen 4
            # has AVX512-BF16) bf16 GEMMs are 2-3x faster from 128 rows on, torch's bf16
            # SDPA is not; --quantization gguf takes bf16 for its prefill GEMMs only
            # (VLLM_CPU_GGUF_PREFILL_DTYPE, docs/kernels.md). Without bf16 hardware oneDNN
            # emulates bf16 (expected slower than fp32; no such CPU measured here).
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = _DTYPES[dtype]
        # --kv-cache-dtype: the model's dtype or an FP8 type (attention/kv_cache_dtype.py)
        self.kv_cache_dtype = kv_cache_torch_dtype(vllm_config.cache_config.cache_dtype, self.dtype)
        self.model = None  # a class of the model registry, built in load_model
        self.classify_activation = "softmax"  # a classifier's, from its config in load_model
        self.arch = None  # the model's shapes (model.arch)
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0  # the cache's blocks once made (Mamba's: without tensors)
        # CUDA: the device's memory before the weights (load_model), the KV sizing's baseline.
        self.memory_before_load: MemorySnapshot | None = None
        self.kv_offload = None  # the CPU KV tier's handler (initialize_kv_offload)
        self.lora: LoRAManager | None = None  # --enable-lora: the adapters' slots
        self.requests: dict[str, CachedRequestState] = {}
        # Generators of seeded requests preempted (recompute) and not yet resumed.
        self._paused_generators: dict[str, torch.Generator] = {}
        self.attn_backend: AttentionBackend | None = None  # chosen in load_model
        # The KV cache groups (kv_cache_groups.py: the hybrid KV cache of sliding-window
        # models), planned in load_model (or on first use).
        self._kv_groups: KVCacheGroups | None = None
        # The cache tensors' shapes (each layer's own: ``arch.layer_kv_shapes``), planned
        # with the groups.
        self._kv_tensors: KVTensorPlan | None = None
        # A model with recurrent layers (layers/recurrent.py: linear attention, Mamba2): each
        # layer's states per sequence, their pools (a slot for each of max_num_seqs
        # requests; made with the KV cache) and the free slots.
        self.recurrent_specs: list[tuple[StateSpec, ...]] | None = None
        self.recurrent_states: list[tuple[torch.Tensor, ...]] = []
        self._free_state_slots: list[int] = []
        # With prefix caching: copies of states at block boundaries, in slots the scheduler
        # assigns (vllm/v1/core/sched/state_checkpoints.py); with the CPU KV tier, host
        # slots for the checkpoints evicted from the device (initialize_kv_offload).
        self.recurrent_checkpoints: list[tuple[torch.Tensor, ...]] = []
        self.host_checkpoints: list[tuple[torch.Tensor, ...]] = []
        self.num_host_state_slots = 0
        # --speculative-config's draft_model: the draft, its KV tensors, its passes.
        self.drafter: DraftModelProposer | None = None
        self.decode_graphs: DecodeGraphs | None = None  # capture_model (CUDA)
        self._weights_on_host = False  # sleep level 1 on a device: wake_up moves them back
        self.structured_output = StructuredOutputManager(vllm_config)  # guided decoding
        # Images' encoder outputs across requests: as many rows as a step's tokens, at least
        # 8192 (vLLM sizes its encoder cache by the step's budget too).
        self.encoder_cache = EncoderCache(
            max(vllm_config.scheduler_config.max_num_batched_tokens, 8192)
        )
        # --logits-processors: vLLM's custom processors, over a persistent batch of their
        # own (logits_processor/state.py); built here, so a bad one fails the start.
        self.logitsprocs = []
        if self.model_config.logits_processors:
            self.logitsprocs = build_logits_processors(
                self.model_config.logits_processors, vllm_config, self.device
            )
        self.logitsprocs_batch = PersistentBatch()
        self.logprobs_mode = getattr(self.model_config, "logprobs_mode", "raw_logprobs")
        # --async-scheduling: the deferred steps whose tokens may not be on the host yet,
        # and the last one's sampled tokens on the device with each sampling request's row
        # in them (the next step's input for a request whose last token is not known here).
        self._deferred: list[DeferredOutput] = []
        self._device_tokens: torch.Tensor | None = None
        self._device_token_rows: dict[str, tuple[CachedRequestState, int]] = {}
        # Penalties from per-request token tables on the device (penalty_table.py), not
        # from histories built on the host each step: no per-step host work, and a
        # deferred step (--async-scheduling) with penalised rows waits for nothing. Off:
        # the sampler's sparse way (the same values; tests compare the two).
        self.use_penalty_tables = True
        self._num_prompt_logprobs = 0  # requests held here that ask for prompt logprobs
        self._num_with_images = 0  # requests held here that have images
        self.penalty_table: PenaltyTable | None = None  # made for the first such request
        if self.device.type == "cpu":
            torch.set_num_threads(envs.VLLM_CPU_THREADS)

    def release(self) -> None:
        """Drop the graphs, the CPU tier, the KV cache and the weights, and give the device
        memory back (``EngineCore.shutdown``): an ``LLM`` shut down frees its GPU, so the
        next one in the process sizes its pool from what is really free."""
        self._drop_caches()
        self.penalty_table = None
        self.model = None
        self.drafter = None
        self.lora = None
        self.requests.clear()
        self._num_prompt_logprobs = self._num_with_images = 0
        self._paused_generators.clear()
        if self.device.type == "cuda":
            gc.collect()  # the graphs' and the model's reference cycles
            torch.cuda.empty_cache()

    # -- start-up -------------------------------------------------------------------------
    def install_attention_backend(self) -> None:
        """Every layer attends with ``self.attn_backend``, told the model's prefill compute
        dtype: when the gguf path's prefill GEMMs compute in bf16
        (``VLLM_CPU_GGUF_PREFILL_DTYPE``), the torch backend's native prefill kernel takes
        bf16 products too (docs/kernels.md); fp32 models keep fp32 attention. Called again
        after the model's weight format changes."""
        from vllm.model_executor.layers.quantization.gguf import model_prefill_dtype
        from vllm.model_executor.layers.quantization.kv_scales import apply_kv_scales

        self.decode_graphs = None  # captured over the previous forward, if any
        self.attn_backend.use_prefill_dtype(model_prefill_dtype(self.model))
        self.model.set_attention_backend(self.attn_backend)
        # An FP8-KV checkpoint's scales, around each layer's attention (kv_scales.py).
        apply_kv_scales(self.model, is_fp8(self.kv_cache_dtype), self.dtype)
        detail = self.attn_backend.detail
        logger.info(
            "Attention backend: %s%s", self.attn_backend.name, f" ({detail})" if detail else ""
        )

    def load_model(self) -> None:
        """The target model, its attention backend and, with a draft model
        (``--speculative-config``'s draft_model), the draft (``_load_drafter``)."""
        from vllm.model_executor.layers.quantization.kv_scales import resolve_cache_dtype

        start = time.monotonic()
        if self.device.type == "cuda":
            self.memory_before_load = measure_before_load(self.device)
        served = self.model_config.max_model_len or self.config.scheduler_config.max_model_len
        loaded = self._load_weights(self.model_config, served)
        self.model, architecture, model_cls, hf_config = loaded
        self.model_cls, self.hf_config = model_cls, hf_config  # model_from_state builds one
        if self.model_config.pooling_task == "classify":  # its logits' activation
            self.classify_activation = classify_activation(hf_config)
        # An FP8-KV checkpoint's kv_cache_scheme turns --kv-cache-dtype auto into fp8.
        cache_dtype = resolve_cache_dtype(self.config.cache_config.cache_dtype, hf_config)
        self.kv_cache_dtype = kv_cache_torch_dtype(cache_dtype, self.dtype)
        self.arch = self.model.arch
        if self.model_config.enable_prompt_embeds:
            forward = inspect.signature(self.model.forward).parameters
            if "inputs_embeds" not in forward or not hasattr(self.model, "embed_input_ids"):
                raise ValueError(
                    f"--enable-prompt-embeds: {architecture} ({model_cls.__name__}) reads "
                    "no input embeddings in this engine"
                )
        if self.config.lora_config.enable_lora:  # wraps the linear layers, as quantized
            self.lora = LoRAManager(self.model, self.config.lora_config, self.device, self.dtype)
        self.attn_backend = self._make_attention_backend(self.model, self.model_config)
        self.install_attention_backend()
        logger.info(
            "Loaded %s (%s: %s) in %.1f s",
            self.model_config.model,
            architecture,
            model_cls.__name__,
            time.monotonic() - start,
        )
        self._plan_recurrent_states(hf_config)
        if self.recurrent_specs is not None:  # (EngineArgs refuses these before loading)
            refuse_unsupported(self.config)
        draft_config = self.config.draft_model_config
        if draft_config is not None:
            self.drafter = self._load_drafter(draft_config)
        self.plan_kv_cache_groups()

    def _plan_recurrent_states(self, hf_config: object) -> None:
        """A model with recurrent layers (linear attention, Mamba2) declares each one's
        states per sequence (``recurrent_state_specs``); the pools are made with the KV
        cache. ``--mamba-ssm-cache-dtype auto`` takes the checkpoint's
        ``mamba_ssm_cache_dtype`` where its config names one (Nemotron-H's float32, as
        vLLM), else the model's dtype."""
        declare = getattr(self.model, "recurrent_state_specs", None)
        if declare is None:
            self.recurrent_specs = None
            return
        name = self.config.cache_config.mamba_ssm_cache_dtype
        if name == "auto":
            text = getattr(hf_config, "get_text_config", lambda: hf_config)()
            own = getattr(text, "mamba_ssm_cache_dtype", None)
            name = own if own in ("float32", "bfloat16", "float16") else "auto"
        ssm_dtype = ssm_state_dtype(name, self.dtype)
        self.recurrent_specs = declare(ssm_dtype)
        slots = self.config.scheduler_config.max_num_seqs
        logger.info(
            "Recurrent states: %d recurrent layers, %.2f MiB a sequence (states in "
            "%s), %d slots (--max-num-seqs) + %d checkpoint slots (prefix caching): %.2f GiB",
            len(self.recurrent_specs),
            state_bytes(self.recurrent_specs) / 2**20,
            str(ssm_dtype).removeprefix("torch."),
            slots,
            self.num_state_checkpoint_slots,
            self.recurrent_states_bytes / 2**30,
        )

    @property
    def num_state_checkpoint_slots(self) -> int:
        """Checkpoint slots of recurrent states (``state_checkpoints.py``): as many as
        --max-num-seqs with prefix caching, for a model with recurrent layers."""
        if self.recurrent_specs is None or not self.config.cache_config.enable_prefix_caching:
            return 0
        return self.config.scheduler_config.max_num_seqs

    @property
    def state_checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint slot: a sequence's states over every recurrent layer (0
        for a model without recurrent layers)."""
        return 0 if self.recurrent_specs is None else state_bytes(self.recurrent_specs)

    @property
    def recurrent_states_bytes(self) -> int:
        """Bytes of the recurrent states' pools and checkpoints (0 for a model without
        recurrent layers)."""
        slots = self.config.scheduler_config.max_num_seqs + self.num_state_checkpoint_slots
        return self.state_checkpoint_bytes * slots

    def plan_kv_cache_groups(self) -> KVCacheGroups:
        """The KV cache groups (``kv_cache_groups.py``), before the cache is sized: the
        hybrid KV cache for a model with sliding-window layers, unless
        --disable-hybrid-kv-cache-manager turns it off, or a draft model would find no
        full-attention group to cache its layers in the blocks of."""
        if self.arch.num_layers == 0:  # attention-free (Mamba): blocks without tensors
            self._kv_groups = KVCacheGroups((None,), (), (), 0)
            self._kv_tensors = KVTensorPlan((), ())
            return self._kv_groups
        windows = tuple(getattr(self.arch, "sliding_windows", ()) or ())
        windows = windows or (None,) * self.arch.num_layers
        off = None
        if self.config.scheduler_config.disable_hybrid_kv_cache_manager:
            off = "--disable-hybrid-kv-cache-manager"
        elif self.drafter is not None and None not in windows:
            # The draft caches every position in the blocks of a full-attention group.
            off = "a draft model over a target whose every layer slides"
        groups = plan_kv_cache_groups(windows, hybrid=off is None)
        if off is not None and any(w is not None for w in windows):
            logger.info("Hybrid KV cache off (%s): every layer keeps every block", off)
        elif groups.hybrid:
            logger.info("Hybrid KV cache: %s", groups.describe())
        self._kv_groups = groups
        shapes = arch_layer_kv_shapes(self.arch)
        self._kv_tensors = plan_kv_tensors(groups.layer_tensor, shapes)
        if len(set(shapes)) > 1:
            logger.info(
                "KV cache tensors of their layers' shapes: %s",
                ", ".join(f"{h}x{d}" for h, d in self._kv_tensors.shapes),
            )
        return groups

    @property
    def kv_groups(self) -> KVCacheGroups:
        """The KV cache groups, planned from the model's arch on first use when nothing
        planned them (a runner whose model came from elsewhere)."""
        if self._kv_groups is None:
            return self.plan_kv_cache_groups()
        return self._kv_groups

    @property
    def kv_tensors(self) -> KVTensorPlan:
        """The cache tensors' shapes (``plan_kv_tensors``), planned with the groups."""
        if self._kv_tensors is None:
            self.plan_kv_cache_groups()
        return self._kv_tensors

    @property
    def bidirectional_images(self) -> bool:
        """Each image's tokens attend to each other both ways (Gemma 3), not causally."""
        return getattr(self.model, "bidirectional_image_attention", False)

    @property
    def metadata_builder(self) -> AttentionBackend | GroupedBuilder:
        """What builds a step's attention metadata: the backend, or with several KV cache
        groups the backend once per group over its block tables."""
        groups = self._kv_groups
        if groups is None or groups.num_groups == 1:
            return self.attn_backend
        return GroupedBuilder(self.attn_backend, groups)

    @property
    def kv_cache_windows(self) -> tuple[int | None, ...]:
        """Each KV cache group's window (None: full attention), for the scheduler."""
        return self.kv_groups.windows

    def _load_weights(
        self, model_config, served_len: int, model_cls: type | None = None, hf_config=None
    ) -> tuple[torch.nn.Module, str, type, object]:
        """``model_config``'s model on this runner's device in its dtype, in the weight
        format its quantization asks for: (model, architecture, class, HF config). The
        target and a draft model load the same way; ``model_cls`` overrides the class the
        config's architecture names (an EAGLE head's, chosen by the method); ``hf_config``:
        the model's HF config when the caller has read it already."""
        from vllm.model_executor.layers.rotary_embedding import use_long_rope
        from vllm.model_executor.model_loader import hf_config_of

        path = resolve_model(
            model_config.model, model_config.revision, model_config.download_dir,
            model_config.hf_token,
        )  # fmt: skip
        hf_config = hf_config or hf_config_of(model_config)
        # longrope's factors follow the served length (vLLM's choice at start-up)
        use_long_rope(hf_config, served_len)
        if model_cls is None:
            model_cls, architecture = ModelRegistry.resolve_model_cls(hf_config)
            model_cls = model_class_for_task(model_cls, architecture, model_config.pooling_task)
        else:  # an EAGLE head: its rotary table covers every position the target serves
            architecture = model_cls.__name__
            own = getattr(hf_config, "max_position_embeddings", None) or served_len
            hf_config.max_position_embeddings = max(own, served_len)
        if hasattr(model_cls, "check_dtype"):  # a family that cannot run in some dtype
            model_cls.check_dtype(hf_config, self.dtype)
        torch.manual_seed(model_config.seed)
        model = load_model_weights(
            model_cls,
            hf_config,
            path,
            self.device,
            self.dtype,
            model_config.load_format,
            model_config.seed,
        )
        if self.device.type == "cpu":
            # Norm, rotary, SiLU and decode-attention kernels: JIT-built once when missing
            # (then cached); without a compiler the pure-torch fallbacks run.
            ops.ensure_native_kernels()
        # The format served: "fp32" is dense (in the model's dtype), the one that takes
        # weight updates (weight_update.py).
        model.weight_format = apply_quantization(model, model_config)
        return model, architecture, model_cls, hf_config

    def checkpoint_state(self) -> dict[str, torch.Tensor] | None:
        """The served checkpoint's tensors as stored (on the host), re-read from its
        folder; None for --load-format dummy (there is none)."""
        from vllm.model_executor.model_loader import read_checkpoint

        mc = self.model_config
        if mc.load_format == "dummy":
            return None
        path = resolve_model(mc.model, mc.revision, mc.download_dir, mc.hf_token)
        return read_checkpoint(self.model_cls, self.hf_config, path, mc.load_format)

    def model_from_state(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A twin of the served model, on the host in its dtype, whose weights are the
        checkpoint tensors ``state`` (a weight update's); ``ValueError`` naming a tensor
        the model reads that ``state`` lacks."""
        from vllm.model_executor.model_loader import model_from_state

        try:
            return model_from_state(self.model_cls, self.hf_config, state, self.dtype)
        except KeyError as e:
            raise ValueError(
                f"the weight update lacks the checkpoint tensor {e.args[0]!r} (of "
                f"{len(state)} received): a round sends every tensor the model reads, under "
                "its checkpoint name"
            ) from None
        except RuntimeError as e:  # copy_ of a tensor of another shape
            raise ValueError(f"the weight update's tensors do not fit the model: {e}") from None

    def _make_attention_backend(self, model: torch.nn.Module, model_config) -> AttentionBackend:
        """The attention backend for ``model``'s shapes and features on this device."""
        a = model.arch
        features = frozenset(getattr(model, "attention_features", frozenset()))
        if is_fp8(self.kv_cache_dtype):  # a backend that reads FP8 caches
            features |= {"fp8_kv_cache"}
        value_size = latent_value_size(a)
        if value_size is not None:  # MLA: one latent per token, values read from the keys
            features |= {"latent_kv"}
        backend_cls = select_attention_backend(
            self.device, self.dtype, self.block_size, a.head_dim,
            getattr(model_config, "attention_backend", None), features,
        )  # fmt: skip
        backend = backend_cls(
            a.num_heads, a.num_kv_heads, a.head_dim, self.dtype, self.device, self.block_size,
            value_size=value_size,
        )  # fmt: skip
        backend.model_features = frozenset(features)
        return backend

    def _load_drafter(self, draft_config) -> DraftModelProposer:
        """The draft model, loaded as the target (same device, dtype, load format and
        seed: ``--load-format dummy`` gives it random weights too), with its own
        attention backend (its shapes may differ) and KV tensors in the target's blocks."""
        from vllm.model_executor.layers.quantization.gguf import model_prefill_dtype
        from vllm.model_executor.layers.quantization.kv_scales import apply_kv_scales
        from vllm.model_executor.model_loader import hf_config_of

        start = time.monotonic()
        spec = self.config.speculative_config
        hf_config = hf_config_of(draft_config)  # read once: the head's class, then its load
        eagle_cls = eagle_head_class(spec.method, self.model, hf_config)
        model, architecture, _, hf_config = self._load_weights(
            draft_config, draft_config.max_model_len, eagle_cls, hf_config
        )
        if eagle_cls is not None:
            check_eagle_head(model, hf_config, self.model)
        backend = self._make_attention_backend(model, draft_config)
        backend.use_prefill_dtype(model_prefill_dtype(model))
        model.set_attention_backend(backend)
        apply_kv_scales(model, is_fp8(self.kv_cache_dtype), self.dtype)  # its checkpoint's
        logger.info(
            "Loaded %s %s (%s, %d layers; %d draft tokens) in %.1f s",
            "draft model" if eagle_cls is None else f"{spec.method} head",
            draft_config.model,
            architecture,
            model.arch.num_layers,
            spec.num_speculative_tokens,
            time.monotonic() - start,
        )
        proposer_cls = DraftModelProposer if eagle_cls is None else EagleProposer
        return proposer_cls(
            model,
            backend,
            spec.num_speculative_tokens,
            self.block_size,
            draft_config.max_model_len,
            self.config.scheduler_config.max_model_len,
            self.kv_cache_dtype,
            self.device,
        )

    def kv_tensor_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        """Each cache tensor's shape at ``num_blocks`` blocks (``kv_tensors``: the layers'
        own ``(num_kv_heads, head_dim)``): K and V halves, or the K half alone when the arch
        reads values from the keys (MLA's latent, ``latent_value_size``)."""
        latent = latent_value_size(self.arch) is not None
        return [
            kv_cache_shape(num_blocks, self.block_size, h, d, latent)
            for h, d in self.kv_tensors.shapes
        ]

    def get_kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV block over every cache tensor (one a layer, or with the hybrid
        KV cache one a layer of a group; each of its layers' shape): the target's and a
        draft model's (whose layers cache in the same blocks), so sizing and
        --num-gpu-blocks-override hold."""
        dtype = self.kv_cache_dtype
        target = sum(kv_cache_bytes(shape, dtype, 1) for shape in self.kv_tensor_shapes(1))
        draft = self.drafter.kv_cache_bytes_per_block() if self.drafter is not None else 0
        return target + draft

    def determine_num_blocks(self) -> int:
        """KV blocks from --num-gpu-blocks-override, else --kv-cache-memory, else on CUDA
        what --gpu-memory-utilization leaves after the weights and the largest step's
        activations (``kv_cache_budget_from_memory``), else 1 GiB on CPU."""
        cache = self.config.cache_config
        per_block = self.get_kv_cache_bytes_per_block()
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        else:
            budget = cache.kv_cache_memory_bytes
            if budget is None and self.device.type == "cuda":
                budget = self.kv_cache_budget_from_memory()
            budget = budget if budget is not None else DEFAULT_CPU_KV_BYTES
            num_blocks = max(budget, 0) // per_block if per_block else self._free_blocks()
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory too small: {num_blocks} blocks of {per_block} bytes")
        sc = self.config.scheduler_config
        max_len = sc.max_model_len
        windows = self.kv_groups.windows
        # A request's blocks over every group at its longest (the hybrid KV cache's
        # sliding groups hold their window and a step's tokens).
        per_request = blocks_for_sequence(
            max_len, self.block_size, windows, sc.max_num_batched_tokens
        )
        # The longest one sequence the pool holds (unbounded when every group slides).
        unbounded = 1 << 40
        tokens = kv_capacity_tokens(
            num_blocks - 1, self.block_size, windows, sc.max_num_batched_tokens, unbounded
        )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f KiB per block, %.2f GiB); %s; "
            "maximum concurrency for %d tokens per request: %.2fx",
            num_blocks,
            self.block_size,
            per_block / 1024,
            num_blocks * per_block / 2**30,
            "a sequence of any length" if tokens >= unbounded else f"{tokens} tokens",
            max_len,
            (num_blocks - 1) / per_request,
        )
        return num_blocks

    def _free_blocks(self) -> int:
        """Blocks of an attention-free model (no KV bytes: they only count tokens for
        the scheduler and prefix caching): --max-num-seqs sequences at --max-model-len
        each, at most 2**18 (the block pool's bookkeeping), and the null block."""
        sc = self.config.scheduler_config
        return 1 + min(sc.max_num_seqs * -(-sc.max_model_len // self.block_size), 1 << 18)

    def kv_cache_budget_from_memory(self) -> int:
        """Bytes for the KV cache on CUDA, as vLLM: ``total * gpu_memory_utilization``
        minus what this engine holds after loading and a profile run of the largest step
        (``gpu_memory.py``)."""
        if self.memory_before_load is None:
            raise RuntimeError("load_model first: the KV sizing needs the memory before it")
        utilization = self.config.cache_config.gpu_memory_utilization

        def profile_step() -> None:
            self.reserve_penalty_table()  # stays allocated: counted as consumed
            self.profile_run()

        budget = profile_kv_cache_budget(
            self.device, utilization, self.memory_before_load, profile_step
        )
        logger.info("GPU memory (utilization %.2f): %s", utilization, budget.describe())
        # The recurrent layers' states come out of the same memory, before the KV.
        kv_bytes = budget.kv_cache_bytes - self.recurrent_states_bytes
        if kv_bytes < 2 * self.get_kv_cache_bytes_per_block():
            states = self.recurrent_states_bytes
            raise ValueError(
                f"no room for a KV cache under gpu_memory_utilization {utilization}: "
                f"{budget.describe()}"
                + (f", less {states / 2**30:.2f} GiB of recurrent states" if states else "")
                + "; raise --gpu-memory-utilization, lower --max-num-batched-tokens or "
                "--max-model-len"
                + (" or --max-num-seqs" if states else "")
                + ", or set --kv-cache-memory"
            )
        return kv_bytes

    def reserve_penalty_table(self) -> None:
        """The penalty tables' rows for ``max_num_seqs`` requests, allocated before the KV
        cache is sized from memory (5 bytes a vocabulary token each: 164 MiB for 256
        requests of Llama-3's 128k), so that penalised requests cannot run the device out
        of memory later; their token lists start 4,096 long and grow on demand."""
        if self.use_penalty_tables and self.penalty_table is None:
            rows = self.config.scheduler_config.max_num_seqs
            width = min(self.config.scheduler_config.max_model_len, 4096)
            self.penalty_table = PenaltyTable(self.arch.vocab_size, self.device, rows, width)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One cache tensor per layer, or with the hybrid KV cache one per layer of a
        group, each layer's the tensor its place in its group names (a block id is one
        group's); each tensor of its layers' shape (``kv_tensors``), all of
        ``num_blocks`` blocks."""
        tensors = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            for shape in self.kv_tensor_shapes(num_blocks)
        ]
        self.kv_caches = [tensors[t] for t in self.kv_tensors.layer_tensor]
        self.num_kv_blocks = num_blocks
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)
        if self.recurrent_specs is not None:
            slots = self.config.scheduler_config.max_num_seqs
            self.recurrent_states = allocate_states(self.recurrent_specs, slots, self.device)
            self._free_state_slots = list(range(slots - 1, -1, -1))
            self.recurrent_checkpoints = allocate_states(
                self.recurrent_specs, self.num_state_checkpoint_slots, self.device
            )

    def initialize_kv_offload(self, num_cpu_blocks: int, num_state_slots: int = 0) -> None:
        """Allocate the CPU KV tier (``--kv-offloading-backend``) after the KV cache, and
        for a model with recurrent layers ``num_state_slots`` host checkpoint slots of its
        states (``StateCheckpoints``' host tier; plain host memory, copied with the step)."""
        from vllm.v1.kv_offload.registry import get_offloading_backend_class

        backend = self.config.offload_config.kv_offloading_backend
        start = time.monotonic()
        # A draft model's layers travel with the target's: a block loaded back from the
        # tier drafts as well as it did before it left. The hybrid KV cache's layers share
        # tensors: each is copied once (a block is one group's, whichever it is).
        layers = list({id(t): t for t in self.kv_caches}.values())
        layers += self.drafter.kv_caches if self.drafter is not None else []
        self.kv_offload = get_offloading_backend_class(backend)(layers, num_cpu_blocks)
        logger.info(
            "CPU KV tier (%s): %d blocks x %d tokens (%.2f GiB, allocated in %.1f s%s); %d tokens",
            backend,
            num_cpu_blocks,
            self.block_size,
            self.kv_offload.size_bytes / 2**30,
            time.monotonic() - start,
            ", page-locked in the background" if getattr(self.kv_offload, "pinner", None) else "",
            num_cpu_blocks * self.block_size,
        )
        self.num_host_state_slots = num_state_slots
        if num_state_slots and self.recurrent_specs is not None:
            self.host_checkpoints = allocate_states(self.recurrent_specs, num_state_slots, "cpu")
            logger.info(
                "CPU KV tier: %d checkpoint slots of recurrent states (%.2f GiB)",
                num_state_slots,
                num_state_slots * self.state_checkpoint_bytes / 2**30,
            )

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compile the attention backend's kernel variants before the first request
        (``AttentionBackend.warm_up``): a step that met one first would wait for it."""
        if not self.kv_cache_made:
            raise RuntimeError("initialize_kv_cache first: the kernels run on the cache")
        start = time.perf_counter()
        sc = self.config.scheduler_config
        # Once per cache shape (a model whose layers' shapes differ: Gemma 4), the tensors
        # of that shape in the layers' order: the kernels specialise on the head size.
        by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for cache in self.kv_caches:
            by_shape.setdefault(tuple(cache.shape[2:]), []).append(cache)
        launches = sum(
            self.attn_backend.warm_up(caches, sc.max_num_seqs) for caches in by_shape.values()
        )
        if self.drafter is not None:
            launches += self.drafter.attn_backend.warm_up(self.drafter.kv_caches, sc.max_num_seqs)
        if launches:
            logger.info(
                "Warmed up %d attention kernel variants in %.1f s",
                launches,
                time.perf_counter() - start,
            )

    def capture_model(self, graph_factory: Callable[[], Graph] | None = None) -> None:
        """Capture decode steps in CUDA graphs over the KV cache (``cuda_graph.py``): on
        CUDA, unless ``--enforce-eager`` or the attention backend cannot replay a decode
        step (``supports_decode_graphs``); then a draft model's single-token steps, over
        the same ladder (``DraftModelProposer.capture``). ``graph_factory``: stand-in
        graphs (tests), which also run on the CPU."""
        mc, sc = self.model_config, self.config.scheduler_config
        if mc.enforce_eager or (graph_factory is None and self.device.type != "cuda"):
            return
        if mc.is_pooling:  # every step is a prompt: no decode step to replay
            return
        if self.recurrent_specs is not None:
            # The recurrent layers' decode gathers each sequence's state by its slot: not yet
            # captured (and not yet run on a GPU), so such a model runs eagerly.
            logger.info("No CUDA graphs: the model's recurrent layers run eagerly")
            return
        if not self.kv_cache_made:
            raise RuntimeError("initialize_kv_cache first: the graphs record the cache's address")
        sizes = cudagraph_capture_sizes(
            sc.max_num_seqs, mc.max_cudagraph_capture_size, mc.cudagraph_capture_sizes
        )
        max_blocks = -(-sc.max_model_len // self.block_size)
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        if graph_factory is None:
            # One pool for the target's graphs and the draft's: they replay one after the
            # other on one stream, never at once, so the draft's reuse the target's blocks.
            pool = torch.cuda.graph_pool_handle()
            graph_factory = lambda: CUDAGraph(pool)  # noqa: E731
        if self.attn_backend.supports_decode_graphs:
            graphs = DecodeGraphs(
                self.model,
                self.metadata_builder,
                self.kv_caches,
                sizes,
                max_blocks,
                self.device,
                graph_factory,
                lora=None if self.lora is None else self.lora.batch,
            )
            graphs.capture()
            self.decode_graphs = graphs
        else:
            logger.info(
                "No CUDA graphs: the %s backend cannot replay decode steps (%s)",
                self.attn_backend.name,
                self.attn_backend.detail or "eager only",
            )
        if self.drafter is not None:  # its positions never pass the target's max_model_len
            self.drafter.capture(sizes, max_blocks, graph_factory)
        if self.device.type == "cuda":
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info("CUDA graphs' memory: %.0f MiB (--enforce-eager: none)", used / 2**20)

    def _drop_caches(self) -> None:
        """Forget the graphs, the deferred step's device state, the CPU tier and the KV
        cache (``release`` and ``sleep``); the memory goes back once nothing holds it."""
        self.decode_graphs = None
        self._deferred, self._device_tokens, self._device_token_rows = [], None, {}
        self.encoder_cache.clear()
        close = getattr(self.kv_offload, "close", None)
        if close is not None:
            close()  # unlock the tier's pages before they are freed
        self.kv_offload = None
        self.kv_caches, self.num_kv_blocks = [], 0
        self.recurrent_states, self._free_state_slots = [], []
        self.recurrent_checkpoints, self.host_checkpoints = [], []
        if self.drafter is not None:
            self.drafter.kv_caches, self.drafter.graphs = [], None

    # -- sleep mode (EngineCore.sleep / wake_up) -----------------------------------------
    def sleep(self, level: int) -> None:
        """Free the KV cache (and the CPU tier: the contents of both are forgotten) and, at
        level 1, move the weights to host memory (on the CPU they already are: kept as
        they are), at level 2 drop them. The engine has finished or aborted every request
        first. The CUDA graphs recorded the cache's and the weights' addresses: dropped
        here, recaptured by the ``wake_up`` that makes the runner whole again."""
        self._drop_caches()
        if level >= 2:
            self.model, self.lora, self.drafter = None, None, None  # load_model remakes them
        elif self.device.type != "cpu":
            moved = move_module_tensors(self.model, torch.device("cpu"))
            if self.drafter is not None:
                moved += move_module_tensors(self.drafter.model, torch.device("cpu"))
            self._weights_on_host = True
            logger.info("Sleep: %.2f GiB of weights moved to host memory", moved / 2**30)
        else:
            logger.info("Sleep level 1 on the CPU: the weights stay where they are")
        if self.device.type == "cuda":
            gc.collect()  # the graphs' reference cycles
            torch.cuda.empty_cache()

    def wake_up(self, tags: tuple[str, ...], num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Bring back the ``tags`` ("weights", "kv_cache"): the weights from host memory,
        or (level 2) from the checkpoint through ``load_model``, the start-up path (same
        load format, seed, quantization and attention backend); a zeroed KV cache of
        ``num_blocks`` (and a CPU tier of ``num_cpu_blocks``, if any). Once both are back,
        the kernels are warmed up and the CUDA graphs recaptured over the new addresses,
        as at start-up (the CPU has none)."""
        if "weights" in tags:
            if self.model is None:
                self.load_model()
            elif self._weights_on_host:
                move_module_tensors(self.model, self.device)
                if self.drafter is not None:
                    move_module_tensors(self.drafter.model, self.device)
                    self.drafter.model.set_attention_backend(self.drafter.attn_backend)
                self._weights_on_host = False
                self.install_attention_backend()
        if "kv_cache" in tags and not self.kv_cache_made:
            self.initialize_kv_cache(num_blocks)
            if num_cpu_blocks:
                self.initialize_kv_offload(num_cpu_blocks, self.num_host_state_slots)
        if self.is_awake:
            self.warm_up_kernels()
            self.capture_model()

    @property
    def kv_cache_made(self) -> bool:
        """``initialize_kv_cache`` ran (and no ``sleep`` since): its tensors, or for an
        attention-free model (Mamba: no tensor) its blocks."""
        return bool(self.kv_caches) or (self.num_kv_blocks > 0 and not self.kv_groups.num_tensors)

    @property
    def is_awake(self) -> bool:
        """Weights on the device and a KV cache: the runner can run a step."""
        return self.model is not None and not self._weights_on_host and self.kv_cache_made

    def transfer_kv(self, plan: KVOffloadTransfers) -> None:
        """Run the step's copies to and from the CPU tier (before its forward pass)."""
        if self.kv_offload is None:
            raise RuntimeError("the scheduler planned KV copies but no CPU tier exists")
        self.kv_offload.transfer(plan)

    def offload_states(self, offloads: list[tuple[int, int]]) -> None:
        """Copy evicted checkpoints (device slot, host slot) to the CPU tier's host slots."""
        if not self.host_checkpoints:
            raise RuntimeError("the scheduler offloaded recurrent states but no host slots exist")
        copy_slots(
            self.recurrent_checkpoints, [d for d, _ in offloads],
            self.host_checkpoints, [h for _, h in offloads],
        )  # fmt: skip

    # -- one step -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> dict[str, RequestFailure]:
        """Apply the step's request changes; the new requests whose state could not be
        built (left out of the batch, failed alone)."""
        self.structured_output.remove(so.preempted_req_ids | so.finished_req_ids)
        for req_id in so.preempted_req_ids:
            state = self._drop_state(req_id)
            if state is not None and state.generator is not None:
                # As vLLM: a seeded request resumes its random stream where it stopped, so
                # its tokens do not depend on whether memory pressure preempted it.
                self._paused_generators[req_id] = state.generator
        for req_id in so.finished_req_ids:
            self._drop_state(req_id)
            self._paused_generators.pop(req_id, None)
        failed: dict[str, RequestFailure] = {}
        for new in so.scheduled_new_reqs:
            try:
                state = self.requests[new.req_id] = self._new_state(new)
                if state.sampling_params.prompt_logprobs is not None:
                    self._num_prompt_logprobs += 1  # given back by _drop_state
                if state.mm_features:
                    self._num_with_images += 1  # likewise
            except LoRAAdapterError as e:  # the request's own: an adapter that cannot load
                failed[new.req_id] = RequestFailure(str(e), internal=False)
            except Exception as e:  # this request only (e.g. a seed its generator refuses)
                logger.warning("request %s: its runner state failed", new.req_id, exc_info=True)
                failed[new.req_id] = RequestFailure(f"{type(e).__name__}: {e}")
        cached = so.scheduled_cached_reqs
        for req_id, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests[req_id]
            for ids, new_ids in zip(state.block_ids, blocks, strict=True):
                ids.extend(new_ids)
            state.num_computed_tokens = computed
        return failed

    def _drop_state(self, req_id: str) -> CachedRequestState | None:
        """Forget a request (finished, aborted or preempted): its state, its penalty row."""
        state = self.requests.pop(req_id, None)
        if state is not None and state.state_slot is not None:
            self._free_state_slots.append(state.state_slot)
            state.state_slot = None
        if state is not None and state.sampling_params.prompt_logprobs is not None:
            self._num_prompt_logprobs -= 1
        if state is not None and state.mm_features:
            self._num_with_images -= 1
        if state is not None and state.penalty_slot is not None:  # a slot: the table exists
            self.penalty_table.remove(state.penalty_slot)
            state.penalty_slot = None
        return state

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        if self.recurrent_specs is not None:  # first: a failure here leaves nothing half-made
            if new.num_computed_tokens and new.state_restore is None:
                raise RuntimeError(
                    f"the request starts at token {new.num_computed_tokens}, but the model's "
                    "recurrent layers have no state for its prefix"
                )
            if not self._free_state_slots:
                raise RuntimeError(
                    "no free recurrent-state slot (more running requests than --max-num-seqs)"
                )
        lora_id = slot = 0
        if new.lora_request is not None:  # first: a failure here leaves nothing half-made
            if self.lora is None:
                raise LoRAAdapterError("a LoRA adapter was requested but LoRA is not enabled")
            in_use = {s.lora_int_id for s in self.requests.values() if s.lora_int_id}
            slot = self.lora.activate(new.lora_request, in_use)
            lora_id = new.lora_request.lora_int_id
        p = new.sampling_params
        gen = self._paused_generators.pop(new.req_id, None)
        if gen is None and p.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(p.seed)
        tabled = self.use_penalty_tables and has_penalty(p)
        state = CachedRequestState(
            new.req_id,
            list(new.token_ids),
            new.num_prompt_tokens,
            p,
            new.block_ids,
            gen,
            new.num_computed_tokens,
            list(new.token_ids[new.num_prompt_tokens :]),
            lora_int_id=lora_id,
            lora_slot=slot,
            bare_greedy=is_bare_greedy(p),
            bare=is_bare(p) or (tabled and unprocessed(p)),
            draft_allowed=drafts_allowed(p),
            mm_features=new.mm_features,
            mrope=bool(new.mm_features) and getattr(self.model, "uses_mrope", False),
        )
        if new.prompt_embeds is not None and new.num_computed_tokens < new.num_prompt_tokens:
            state.prompt_embeds = new.prompt_embeds.to(self.device, self.dtype)
        if tabled:
            if self.penalty_table is None:
                self.penalty_table = PenaltyTable(self.arch.vocab_size, self.device)
            state.penalty_slot = self.penalty_table.add(
                state.prompt_view.unique_ids(), state.output_token_ids
            )
        if self.recurrent_specs is not None:  # last: nothing after it can fail
            state.state_slot = self._free_state_slots.pop()
            restore = new.state_restore
            if restore is not None:  # its prefix hit's states, before the forward
                source = self.host_checkpoints if restore.host else self.recurrent_checkpoints
                copy_slots(source, [restore.slot], self.recurrent_states, [state.state_slot])
        return state

    def _image_rows(
        self, images: list[tuple[CachedRequestState, int, int, int]]
    ) -> tuple[list[int], torch.Tensor, list[tuple[int, int]]] | None:
        """The step's rows that take image embeddings, those embeddings, and the rows
        ``[a, b)`` of each run of one image's embedding positions (its ``is_embed`` runs;
        the whole image without them), which attend to each other both ways in a model
        with ``bidirectional_image_attention`` (Gemma 3: transformers' mask groups each run
        of image tokens). None: no image in the step; ``_encode_images`` made the
        embeddings. ``images``: (request, first position, positions, first row) of each
        scheduled request that has images. An image's embeddings are kept until the step
        that computes its last position."""
        if not images:
            return None
        rows: list[int] = []
        parts = []
        spans: list[tuple[int, int]] = []
        for state, start, n, row in images:
            for i, lo, hi in features_in(state.mm_features, start, start + n):
                feature = state.mm_features[i]
                first_row = row + feature.offset + lo - start  # the step's row of position lo
                taken, first, last = feature.embedding_rows(lo, hi)
                image_rows = [first_row + r for r in taken]
                rows += image_rows
                spans += _runs(image_rows)
                parts.append(state.mm_embeds[i][first:last])
                if hi == feature.length:  # its last position: not needed again
                    del state.mm_embeds[i]
        if not rows:  # only an image's text tokens (between its tiles) in this step
            return None
        return rows, torch.cat(parts), spans

    @staticmethod
    def _prompt_embeds_rows(
        embedded: list[tuple[CachedRequestState, int, int, int]],
    ) -> tuple[list[int], torch.Tensor] | None:
        """The step's rows that read prompt embeddings and those embeddings (None: no
        prompt position of such a request in the step). ``embedded``: (request, first
        position, positions, first row) of each scheduled request that has them. A
        request's embeddings are dropped once its prompt's last position is scheduled."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for state, start, n, row in embedded:
            end = min(start + n, state.num_prompt_tokens)
            if end > start:
                rows += range(row, row + end - start)
                parts.append(state.prompt_embeds[start:end])
            if end >= state.num_prompt_tokens:
                state.prompt_embeds = None
        return (rows, torch.cat(parts)) if rows else None

    def _positions(
        self, positions: list[int], positions3: list[tuple[int, np.ndarray]]
    ) -> torch.Tensor:
        """The step's positions on the device: (num_tokens,), or (3, num_tokens) when some
        rows are image tokens of an M-RoPE model (``positions3``: their first row and
        their three rows of positions; every other row's three are equal)."""
        if not positions3:
            return to_device(positions, torch.long, self.device)
        table = np.tile(np.asarray(positions, dtype=np.int64), (3, 1))
        for row, rows3 in positions3:
            table[:, row : row + rows3.shape[1]] = rows3
        return upload(torch.from_numpy(table), self.device)

    def _encode_images(self, order: list[str], so: SchedulerOutput) -> dict[str, RequestFailure]:
        """Each image the step's chunks reach and no request holds yet, from the encoder
        cache or the vision encoder: the tiles of them all in one pass, an image two
        requests hold once. When that pass fails (a device out of memory, an image the
        tower cannot take), each image is encoded alone and the requests whose image
        fails fail alone (returned), their steps left out; the others go on. A step
        when no request held has images reads nothing (the decode steps of text)."""
        if not self._num_with_images:
            return {}
        missing: dict[str, list[tuple[CachedRequestState, int]]] = {}  # by identifier
        for req_id in order:
            state = self.requests[req_id]
            if not state.mm_features:
                continue
            start = state.num_computed_tokens
            for i, *_ in features_in(
                state.mm_features, start, start + so.num_scheduled_tokens[req_id]
            ):
                if i in state.mm_embeds:
                    continue
                identifier = state.mm_features[i].identifier
                cached = self.encoder_cache.get(identifier)
                if cached is None:
                    missing.setdefault(identifier, []).append((state, i))
                else:
                    state.mm_embeds[i] = cached
        if not missing:
            return {}
        features = {
            key: holders[0][0].mm_features[holders[0][1]] for key, holders in missing.items()
        }
        try:
            encoded = dict(zip(features, self._encode(list(features.values())), strict=True))
        except Exception as e:
            if len(features) == 1:
                encoded = {next(iter(features)): e}
            else:
                logger.warning("the step's images failed together (%s); each alone", e)
                encoded = {}
                for key, feature in features.items():
                    try:
                        encoded[key] = self._encode([feature])[0]
                    except Exception as one:
                        encoded[key] = one
        failed: dict[str, RequestFailure] = {}
        for key, rows in encoded.items():
            for state, i in missing[key]:
                if isinstance(rows, Exception):
                    logger.warning("request %s: image %d failed in the vision encoder",
                                   state.req_id, i, exc_info=rows)  # fmt: skip
                    failed[state.req_id] = RequestFailure(
                        f"image {i} failed in the vision encoder: {type(rows).__name__}: {rows}"
                    )
                else:
                    state.mm_embeds[i] = rows
            if not isinstance(rows, Exception):
                self.encoder_cache.put(key, rows)
        return failed

    def _encode(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Each image's embedding rows (rows, hidden), from one pass of the vision encoder
        over them all: its tiles' rows in order (LLaVA, SmolVLM), or its patches' merged
        rows (Qwen2-VL, whose encoder takes the images' patch grids), or, for a model that
        takes each image at its own size (``images_at_own_size``: Mistral 3), its rows
        from the list of the images' own pixels."""
        if getattr(self.model, "images_at_own_size", False):  # sizes differ: no one tensor
            return self.model.embed_images([f.data.to(self.device) for f in features])
        data = torch.cat([f.data for f in features]).to(self.device)
        if features[0].grid_thw is not None:
            grids = torch.tensor([f.grid_thw for f in features])
            rows = self.model.embed_images(data, grids)
            return list(rows.split([f.length for f in features]))
        embedded = self.model.embed_images(data)  # (tiles, rows per tile, hidden)
        parts = embedded.split([f.data.shape[0] for f in features])
        return [part.flatten(0, 1) for part in parts]

    def _resolve_deferred(self) -> None:
        """The deferred steps' tokens onto the host, in order (before a step that samples
        on the host appends its own)."""
        for deferred in self._deferred:
            deferred.result()
        self._deferred = []

    def _tokens_ahead(self, ahead: list[tuple[int, CachedRequestState]]) -> tuple | None:
        """Rows of the step's input whose token the deferred step samples on the device:
        (row indices, tokens), both on the device; None when there are none."""
        if not ahead:
            return None
        src = []
        for _, state in ahead:
            known = self._device_token_rows.get(state.req_id)
            if known is None or known[0] is not state or self._device_tokens is None:
                raise RuntimeError(
                    f"request {state.req_id} needs a token that no step on the device samples"
                )
            src.append(known[1])
        rows = [row for row, _ in ahead]
        tokens = self._device_tokens
        if src != list(range(tokens.shape[0])):  # not the whole previous batch, in order
            tokens = tokens[to_device(src, torch.long, self.device)]
        return to_device(rows, torch.long, self.device), tokens

    def _sample_deferred(
        self,
        hidden: torch.Tensor,
        sample_reqs: list[CachedRequestState],
        out: ModelRunnerOutput,
        prompt_logprobs: list[PendingPromptLogprobs],
    ) -> DeferredOutput | ModelRunnerOutput:
        """Sample the rows without waiting for this step's forward: the tokens stay on the
        device for the next step's input, a copy goes to the host behind the forward. Rows
        whose penalties, logits processors or grammar read their output wait first for
        the tokens of the steps before (already ahead of this forward on the device): a
        grammar's mask is built on the host once its matcher has taken the last token.
        Should sampling on the device raise, the step samples on the host as without
        async scheduling (each row failing alone) and returns its output."""
        if self.logitsprocs or not all(s.bare for s in sample_reqs):
            self._resolve_deferred()  # custom processors read the output ids too
        raw = self.model.compute_logits(hidden)
        grammar_errors = self.structured_output.mask_logits(raw, sample_reqs)
        logits = self._process_logits(raw, sample_reqs)
        rows = self._sampling_rows(sample_reqs)
        try:
            tokens, logits_ok, ok = sample_on_device(logits, rows, self.penalty_table)
            groups = []
            if any(r.params.logprobs is not None for r in rows):  # before the tables count
                source, as_logits = logprobs_source(
                    self.logprobs_mode, raw, logits, rows, self.penalty_table
                )
                groups = sampled_logprobs_on_device(source, rows, tokens, as_logits)
        except Exception:  # as sample() does: the rows one by one, each failing alone
            logger.warning("sampling on the device failed; this step samples on the host",
                           exc_info=True)  # fmt: skip
            self._resolve_deferred()
            self._sample_on_host(logits, sample_reqs, grammar_errors, out, raw)
            out.prompt_logprobs = prompt_logprobs_from(prompt_logprobs)
            return out
        self._count_penalised(sample_reqs, tokens, logits_ok & ok)
        packed = to_host(torch.cat([tokens, logits_ok.long(), ok.long()]))
        logprobs = [(idx, to_host(ints), to_host(fl)) for idx, ints, fl in groups]
        for p in prompt_logprobs:
            p.parts = [(to_host(ints), to_host(fl)) for ints, fl in p.parts]
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._device_tokens = tokens
        self._device_token_rows = {s.req_id: (s, i) for i, s in enumerate(sample_reqs)}
        deferred = DeferredOutput(
            out, sample_reqs, packed, logprobs, prompt_logprobs, event, grammar_errors,
            self.structured_output.accept,
        )  # fmt: skip
        self._deferred = [d for d in self._deferred if not d.done] + [deferred]
        return deferred

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, defer: bool = False
    ) -> ModelRunnerOutput | DeferredOutput:
        """Run one step. ``defer`` (--async-scheduling): a step that samples (and has no
        drafts) returns a ``DeferredOutput`` at once, its tokens still on the device; a
        step that samples nothing returns its output, as without it. A request whose last
        token a deferred step samples reads it from the device."""
        failed = self._update_states(so)
        if so.kv_transfers:
            self.transfer_kv(so.kv_transfers)
        if so.state_offloads:  # before the forward, after which the slots are rewritten
            self.offload_states(so.state_offloads)
        order = [r for r in so.num_scheduled_tokens if r not in failed]
        image_failures = self._encode_images(order, so)
        if image_failures:
            failed |= image_failures
            order = [r for r in order if r not in failed]
        if self.logitsprocs:  # before the forward pass, as vLLM: the batch's changes
            update = self.logitsprocs_batch.update([self.requests[r] for r in order])
            for processor in self.logitsprocs:
                processor.update_state(update)
        if not order:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids={}, errors=failed)
        drafted = so.scheduled_spec_decode_tokens
        if self.attn_backend.decodes_first:  # the torch backend batches decodes together
            order.sort(
                key=lambda r: (
                    not (
                        (so.num_scheduled_tokens[r] == 1 or r in drafted)
                        and self.requests[r].num_computed_tokens > 0
                    )
                )
            )
        ids, positions, seqs, sample_idx, sample_reqs = [], [], [], [], []
        token_slots: list[int] = []  # each row's LoRA slot (0: the base model)
        row_starts: dict[str, int] = {}  # req_id -> its first row in the flat batch
        spec_rows: list[int] = []  # speculative decoding: every row of a request's step
        spec_reqs: list[tuple[CachedRequestState, list[int]]] = []
        ahead: list[tuple[int, CachedRequestState]] = []  # (row, request): token on device
        images: list[tuple[CachedRequestState, int, int, int]] = []  # (state, start, n, row)
        embedded: list[tuple[CachedRequestState, int, int, int]] = []  # prompt embeds, same
        positions3: list[tuple[int, np.ndarray]] = []  # (first row, (3, n)): image tokens
        # (tokens, fresh, state slot, verifies drafts) a sequence
        recurrent: list[tuple[int, bool, int, bool]] = []
        recurrent_ids: list[str] = []
        for req_id in order:
            state = self.requests[req_id]
            start, n = state.num_computed_tokens, so.num_scheduled_tokens[req_id]
            row_starts[req_id] = len(ids)
            drafts = drafted.get(req_id)
            if drafts:  # its last token, then the drafts: each row checks the next one
                spec_rows += range(len(ids), len(ids) + n)
                spec_reqs.append((state, drafts))
                ids += state.token_ids[start:] + drafts
                # One decode row per token: row i attends to the context up to position
                # start + i, whose K/V this step writes first (every backend writes the
                # step's K/V, then attends). The decode kernels (and CUDA graphs of
                # decode steps) serve them instead of a prefill chunk.
                seqs += [(start + i, 1, state.table) for i in range(n)]
            else:
                known = state.token_ids[start : start + n]
                ids += known
                if len(known) < n:  # the last one: sampled by a step still on the device
                    ahead.append((len(ids), state))
                    ids.append(0)
                seqs.append((start, n, state.table))
            if not state.mrope:
                positions += range(start, start + n)
            else:  # M-RoPE: (3, n) positions; equal rows (text) go in the flat list
                rows3 = mrope_positions(state.mm_features, start, start + n)
                positions += rows3[0].tolist()
                if not (rows3[0] == rows3[1]).all() or not (rows3[0] == rows3[2]).all():
                    positions3.append((len(positions) - n, rows3))
            if state.mm_features:
                images.append((state, start, n, row_starts[req_id]))
            if state.prompt_embeds is not None:
                embedded.append((state, start, n, row_starts[req_id]))
            token_slots += [state.lora_slot] * n
            if state.state_slot is not None:  # recurrent layers: its state's slot
                recurrent.append((n, start == 0, state.state_slot, bool(drafts)))
                recurrent_ids.append(req_id)
            if not drafts and start + n >= len(state.token_ids):  # the end: sample a token
                sample_idx.append(len(ids) - 1)
                sample_reqs.append(state)
        hidden = None
        recurrent_batch = None
        patch = self._tokens_ahead(ahead)
        if self.lora is not None:
            self.lora.set_token_slots(token_slots, self.device)
        image_rows = self._image_rows(images)
        embeds_rows = self._prompt_embeds_rows(embedded) if embedded else None
        if self.decode_graphs is not None and image_rows is None and embeds_rows is None:
            hidden = self.decode_graphs.run(ids, positions, seqs, token_slots, patch)
        if hidden is None:
            meta = self.metadata_builder.build_metadata(seqs)
            if image_rows is not None and self.bidirectional_images:
                attend_both_ways(meta, image_rows[2])
            input_ids = to_device(ids, torch.long, self.device)
            if patch is not None:
                input_ids.index_copy_(0, *patch)
            extra = {}
            if recurrent:
                lens, fresh, slots, drafts_in = (list(c) for c in zip(*recurrent, strict=True))
                recurrent_batch = RecurrentBatch(lens, fresh, slots, self.recurrent_states,
                                                 drafts_in)  # fmt: skip
                extra["recurrent"] = recurrent_batch
            if image_rows is not None or embeds_rows is not None:
                embeds = self.model.embed_input_ids(input_ids)
                if image_rows is not None:  # the images' embeddings in their placeholders'
                    rows, values, _ = image_rows
                    rows = to_device(rows, torch.long, self.device)
                    merge = getattr(self.model, "merge_image_rows", None)
                    if merge is None:
                        embeds.index_copy_(0, rows, values)
                    else:  # rows wider than the embeddings: the rest for later layers
                        merge(embeds, rows, values)  # (Qwen3-VL)
                if embeds_rows is not None:  # prompt embeddings over their placeholders'
                    rows, values = embeds_rows
                    embeds.index_copy_(0, to_device(rows, torch.long, self.device), values)
                extra["inputs_embeds"] = embeds
            hidden = self.model(
                input_ids, self._positions(positions, positions3), meta, self.kv_caches, **extra
            )
            if so.state_checkpoints:
                self._save_checkpoints(so.state_checkpoints)
        output = ModelRunnerOutput(order, {r: [] for r in order}, errors=failed)
        if self.model_config.is_pooling:  # embeddings: the prompt's last row, no token
            if sample_reqs:
                output.pooled = self._pool(self._rows(hidden, sample_idx), sample_reqs)
            return output
        prompt_logprobs = self._prompt_logprobs(so, hidden, row_starts)
        if sample_reqs:
            rows = self._rows(hidden, sample_idx)
            if defer and not drafted:  # drafts are verified on the host
                return self._sample_deferred(rows, sample_reqs, output, prompt_logprobs)
            self._resolve_deferred()  # earlier steps' tokens land before this one's
            self._sample(rows, sample_reqs, output)
        output.prompt_logprobs = prompt_logprobs_from(prompt_logprobs)
        if spec_reqs:
            self._verify_drafts(self._rows(hidden, spec_rows), spec_reqs, output)
            if recurrent_batch is not None:
                self._roll_back_states(recurrent_batch, recurrent_ids, spec_reqs, output)
        if isinstance(self.drafter, EagleProposer):
            output.draft_token_ids = self._propose_eagle(so, order, output, hidden, row_starts)
        elif self.drafter is not None:
            output.draft_token_ids = self._propose_drafts(so, order, output)
        return output

    def _roll_back_states(
        self,
        batch: RecurrentBatch,
        req_ids: list[str],
        spec_reqs: list[tuple[CachedRequestState, list[int]]],
        out: ModelRunnerOutput,
    ) -> None:
        """Each request that verified drafts keeps the recurrent states after the tokens
        it kept (its last one and the drafts accepted), not after every draft (the
        scheduler never ends such a step on a block boundary, so no checkpoint of it was
        saved). ``req_ids``: the batch's sequences'."""
        seq = {r: i for i, r in enumerate(req_ids)}
        for state, _ in spec_reqs:
            tokens = out.sampled_token_ids.get(state.req_id)
            if tokens and state.req_id not in out.errors:
                batch.roll_back(seq[state.req_id], len(tokens) - 1)

    def _save_checkpoints(self, checkpoints: dict[str, int]) -> None:
        """Copy the states of the requests whose step ended on a block boundary into
        their checkpoint slots (after the forward; the scheduler's plan)."""
        held = [(self.requests[r].state_slot, slot) for r, slot in checkpoints.items()
                if r in self.requests]  # fmt: skip
        copy_slots(
            self.recurrent_states, [a for a, _ in held],
            self.recurrent_checkpoints, [b for _, b in held],
        )  # fmt: skip

    def _propose_drafts(
        self, so: SchedulerOutput, order: list[str], out: ModelRunnerOutput
    ) -> dict[str, list[int]]:
        """The draft model's pass over the step's requests, after the target's tokens are
        known (``DraftModelProposer``): a prefill chunk's tokens catch up, a request that
        got tokens catches up and proposes. A request that failed this step has none.

        With ``disable_by_batch_size`` N, the scheduler drops every draft of a step it
        schedules with more than N running requests. It decides before admitting anyone,
        so that step's running requests are at most those held here now: with more than
        N here, nobody proposes (the k - 1 single-token forwards and the read-back are
        skipped). The catch-up still runs: a block that prefix caching shares must hold
        the draft's KV of its tokens. When requests finish in this step's update and the
        batch falls to N, the next step has no drafts yet (one step late, never wrong)."""
        max_batch = self.config.speculative_config.disable_by_batch_size
        may_propose = max_batch is None or len(self.requests) <= max_batch
        reqs = []
        for req_id in order:
            if req_id in out.errors:
                continue
            state = self.requests[req_id]
            sampled = bool(out.sampled_token_ids.get(req_id))
            if sampled:
                end = len(state.token_ids)
            else:
                end = state.num_computed_tokens + so.num_scheduled_tokens[req_id]
            planned = self.drafter.plan(state, end, sampled, may_propose)
            if planned is not None:
                reqs.append(planned)
        return self.drafter.propose(reqs) if reqs else {}

    def _propose_eagle(
        self,
        so: SchedulerOutput,
        order: list[str],
        out: ModelRunnerOutput,
        hidden: torch.Tensor,
        row_starts: dict[str, int],
    ) -> dict[str, list[int]]:
        """The EAGLE head's pass (``spec_decode/eagle.py``) over the step's rows: the
        target's last hidden states (EAGLE-1) or its auxiliary ones (EAGLE-3), each
        request's from its first row; ``disable_by_batch_size`` as ``_propose_drafts``."""
        max_batch = self.config.speculative_config.disable_by_batch_size
        may_propose = max_batch is None or len(self.requests) <= max_batch
        target = self.model.aux_hidden if self.drafter.model.eagle3 else hidden
        reqs = []
        for req_id in order:
            if req_id in out.errors:
                continue
            state = self.requests[req_id]
            planned = self.drafter.plan_step(
                state,
                state.num_computed_tokens,
                so.num_scheduled_tokens[req_id],
                row_starts[req_id],
                bool(out.sampled_token_ids.get(req_id)),
                may_propose,
            )
            if planned is not None:
                reqs.append(planned)
        return self.drafter.propose_step(reqs, target) if reqs else {}

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``hidden[rows]`` without waiting for the device: a list index is copied up from
        pageable memory, which synchronizes the stream on CUDA (the step before is still
        running under --async-scheduling); this index goes up from pinned memory.
        ``rows`` ascend without repeats, so as many as ``hidden`` has are all of them (a
        decode-only step samples every row): ``hidden`` itself, no index at all."""
        if len(rows) == hidden.shape[0]:
            return hidden
        return hidden.index_select(0, to_device(rows, torch.long, self.device))

    def _pool(self, rows: torch.Tensor, reqs: list[CachedRequestState]) -> dict[str, list[float]]:
        """--runner pooling (LAST): each request's last prompt row, the final norm's output
        as transformers' ``last_hidden_state``: in fp32 (embed), or the model's score head
        over it (classify: ``layers/pooler.py``); activated (L2-normalised, softmaxed) as
        the pooler config says unless the request turns it off (``use_activation``)."""
        mc = self.model_config
        default = mc.pooler_use_activation
        use = [pooling_use_activation(state.sampling_params, default) for state in reqs]
        if mc.pooling_task == "classify":
            values = pool_rows(self.model, rows, use, self.classify_activation,
                               mc.logit_calibration)  # fmt: skip
        else:
            values = pool_rows(self.model, rows, use, "normalize")
        return {state.req_id: v for state, v in zip(reqs, values, strict=True)}

    def _verify_drafts(
        self,
        hidden: torch.Tensor,
        spec_reqs: list[tuple[CachedRequestState, list[int]]],
        out: ModelRunnerOutput,
    ) -> None:
        """Requests with drafts (``hidden``: each one's rows, its last token's then one per
        draft). Greedy: the drafts the argmax agrees with, then the argmax after them
        (``verify_greedy``); sampled: rejection sampling (``verify_sampled_batch``: on a
        GPU all of them at once), with the q a draft model drew them from, or as point
        masses (n-gram drafts). Their next token depends on the logits alone
        (``drafts_allowed``), so either gives plain
        decoding's tokens (greedy) or distribution (sampled); logprobs, when asked for,
        are each kept token's row's. A request whose rows are not finite fails alone."""
        logits = self.model.compute_logits(hidden)
        finite, argmax = finite_and_argmax(logits, list(range(logits.shape[0])))
        row = 0
        results: dict[str, list[int] | None] = {}
        blocks: dict[str, range] = {}
        sampled: list[tuple[str, SampledDrafts]] = []
        for state, drafts in spec_reqs:
            rows = blocks[state.req_id] = range(row, row + len(drafts) + 1)
            row = rows.stop
            proposed, state.draft_probs = state.draft_probs, None  # verified: freed
            params = state.sampling_params
            if not all(finite[i] for i in rows):
                results[state.req_id] = None
            elif params.sampling_type_greedy:
                results[state.req_id] = verify_greedy([argmax[i] for i in rows], drafts)
            else:
                q = None if proposed is None else proposed.for_drafts(drafts)
                block = logits[rows.start : rows.stop]
                sampled.append(
                    (state.req_id, SampledDrafts(block, drafts, params, state.generator, q))
                )
        # The sampled requests together (on a GPU: one read from the device).
        verified = verify_sampled_batch([s for _, s in sampled])
        results.update(zip([req_id for req_id, _ in sampled], verified, strict=True))
        for state, _ in spec_reqs:
            tokens = results[state.req_id]
            if tokens is None:
                out.errors[state.req_id] = NON_FINITE_LOGITS
                continue
            state.token_ids += tokens
            state.output_token_ids += tokens
            out.sampled_token_ids[state.req_id] = tokens
            num_top = state.sampling_params.logprobs
            if num_top is not None:  # the model's raw logprobs, as the sampler reports
                rows = blocks[state.req_id]
                kept = logits[rows.start : rows.start + len(tokens)]
                as_logits = self.logprobs_mode == "raw_logits"  # processed: refused
                out.logprobs[state.req_id] = token_logprobs(kept, tokens, num_top, as_logits)

    def _sample(
        self, hidden: torch.Tensor, sample_reqs: list[CachedRequestState], out: ModelRunnerOutput
    ) -> None:
        """Sample one token per request of ``sample_reqs`` (``hidden``: their last rows)
        into ``out``; a row that cannot be sampled fails its request alone."""
        raw = self.model.compute_logits(hidden)
        if all(s.bare_greedy for s in sample_reqs):  # the argmax of each row, one copy
            logits = self._process_logits(raw, sample_reqs)
            finite, argmax = finite_and_argmax(logits, list(range(len(sample_reqs))))
            tokens = [t if f else None for f, t in zip(finite, argmax, strict=True)]
            lps: list = [None] * len(tokens)
            row_errors = {i: NON_FINITE_LOGITS for i, f in enumerate(finite) if not f}
            self._take_sampled(sample_reqs, tokens, lps, row_errors, out)
        else:
            # As vLLM: the grammar masks first (the raw logprobs are of masked logits),
            # then the custom processors, then the sampler's own steps.
            grammar_errors = self.structured_output.mask_logits(raw, sample_reqs)
            logits = self._process_logits(raw, sample_reqs)
            self._sample_on_host(logits, sample_reqs, grammar_errors, out, raw)

    def _process_logits(
        self, logits: torch.Tensor, sample_reqs: list[CachedRequestState]
    ) -> torch.Tensor:
        """The custom logits processors' output for the sampling rows (``logits`` itself
        without any). They see vLLM's layout: a row per scheduled request, in their
        persistent batch's order; a request that samples nothing this step (a prefill
        chunk) gets a row of zeros. ``logits`` is left as it was (the raw logprobs)."""
        if not self.logitsprocs:
            return logits
        batch = self.logitsprocs_batch
        rows = [batch.index[s.req_id] for s in sample_reqs]
        in_place = rows == list(range(batch.batch_size))  # every row samples, in order
        if in_place:
            full = logits.clone()
        else:
            index = to_device(rows, torch.long, self.device)
            full = logits.new_zeros((batch.batch_size, logits.shape[1]))
            full.index_copy_(0, index, logits)
        for processor in self.logitsprocs:
            full = processor.apply(full)
        return full if in_place else full.index_select(0, index)

    def _sample_on_host(
        self,
        logits: torch.Tensor,
        sample_reqs: list[CachedRequestState],
        grammar_errors: dict[int, RequestFailure],
        out: ModelRunnerOutput,
        raw: torch.Tensor | None = None,
    ) -> None:
        """``sampler.sample`` of ``logits`` (grammar masks applied), a row that cannot be
        sampled failing alone, into ``out``; logprobs from ``raw`` (the model's logits,
        before custom processors) when given."""
        rows = self._sampling_rows(sample_reqs)
        tokens, lps, row_errors = sample(logits, rows, self.penalty_table, raw, self.logprobs_mode)
        for i, failure in grammar_errors.items():  # all -inf rows: none was sampled
            tokens[i], row_errors[i] = None, failure
        self._take_sampled(sample_reqs, tokens, lps, row_errors, out)

    def _take_sampled(
        self,
        sample_reqs: list[CachedRequestState],
        tokens: list[int | None],
        lps: list,
        row_errors: dict[int, RequestFailure],
        out: ModelRunnerOutput,
    ) -> None:
        for i, failure in row_errors.items():
            out.errors[sample_reqs[i].req_id] = failure
        ok = [
            (s, t, lp) for s, t, lp in zip(sample_reqs, tokens, lps, strict=True) if t is not None
        ]
        self.structured_output.accept([s for s, _, _ in ok], [t for _, t, _ in ok])
        counted = [(s.penalty_slot, t) for s, t, _ in ok if s.penalty_slot is not None]
        if counted:
            self.penalty_table.record(*zip(*counted, strict=True))
        for state, token, lp in ok:
            state.token_ids.append(token)
            state.output_token_ids.append(token)
            out.sampled_token_ids[state.req_id] = [token]
            if lp is not None:
                out.logprobs[state.req_id] = [lp]

    def _count_penalised(
        self, sample_reqs: list[CachedRequestState], tokens: torch.Tensor, ok: torch.Tensor
    ) -> None:
        """Count a deferred step's tokens, still on the device, in the penalty rows of its
        requests that have one (a failed row's token is not counted)."""
        rows = [i for i, s in enumerate(sample_reqs) if s.penalty_slot is not None]
        if not rows:
            return
        slots = [sample_reqs[i].penalty_slot for i in rows]
        if len(rows) < len(sample_reqs):
            index = to_device(rows, torch.long, self.device)
            tokens, ok = tokens.index_select(0, index), ok.index_select(0, index)
        self.penalty_table.record_on_device(slots, tokens, ok)

    @staticmethod
    def _sampling_rows(sample_reqs: list[CachedRequestState]) -> list[SamplingRow]:
        return [
            SamplingRow(
                s.sampling_params, s.generator, s.prompt_view, s.output_token_ids, s.penalty_slot
            )
            for s in sample_reqs
        ]

    def _prompt_logprobs(
        self, so: SchedulerOutput, hidden: torch.Tensor, row_starts: dict[str, int]
    ) -> list[PendingPromptLogprobs]:
        """For requests with ``prompt_logprobs``: the logprobs of the prompt tokens this
        step's chunk predicts (the row of position p predicts prompt token p + 1), still
        on the device (``prompt_logprobs_from``)."""
        result = []
        if not self._num_prompt_logprobs:  # the common step: no request asks for them
            return result
        for req_id, row in row_starts.items():
            state = self.requests[req_id]
            num_top = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            end = min(start + so.num_scheduled_tokens[req_id], state.num_prompt_tokens - 1)
            if num_top is None or end <= start:
                continue
            targets = state.token_ids[start + 1 : end + 1]
            parts = []
            for i in range(0, end - start, PROMPT_LOGPROBS_ROWS):  # bounds the logits' size
                rows = hidden[row + i : row + min(i + PROMPT_LOGPROBS_ROWS, end - start)]
                logits = self.model.compute_logits(rows)
                chunk = to_device(targets[i : i + len(rows)], torch.long, self.device)
                # A prompt token passes no sampling step: raw and processed agree (vLLM).
                as_logits = self.logprobs_mode.endswith("_logits")
                parts.append(token_logprobs_on_device(logits, chunk, num_top, as_logits))
            result.append(PendingPromptLogprobs(req_id, start + 1, targets, parts))
        return result

    # -- profiling ------------------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self) -> torch.Tensor:
        """One forward of the largest step the scheduler can send, for the memory sizing:
        ``max_num_batched_tokens`` tokens as the last chunks of ``max_model_len``-token
        prompts (the widest attention a step can ask for), then the logits and their
        softmax for ``max_num_seqs`` rows (the sampler's). Runs before the KV cache
        exists, on a scratch cache of two blocks: every context position aliases block 1
        (the values do not matter, only the shapes). Returns the probabilities.

        Not profiled: a decode backend's transient for a batch of long contexts (bounded
        by what the pool holds, which is what is being sized)."""
        sc = self.config.scheduler_config
        a = self.arch
        scratch = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            for shape in self.kv_tensor_shapes(2)
        ]
        scratch = [scratch[t] for t in self.kv_tensors.layer_tensor]
        assert len(scratch) == a.num_layers
        blocks = [1] * -(-sc.max_model_len // self.block_size)
        seqs, positions, left = [], [], sc.max_num_batched_tokens
        while left > 0:
            n = min(left, sc.max_model_len)
            seqs.append((sc.max_model_len - n, n, blocks))
            positions.append(torch.arange(sc.max_model_len - n, sc.max_model_len))
            left -= n
        meta = self.attn_backend.build_metadata(seqs)
        pos = torch.cat(positions).to(self.device)
        ids = torch.zeros_like(pos)
        hidden = self.model(ids, pos, meta, scratch)
        if self.drafter is not None:  # its catch-up pass over the same tokens
            self.drafter.profile_run(seqs, sc.max_num_batched_tokens)
        rows = min(sc.max_num_seqs, hidden.shape[0])
        return torch.softmax(self.model.compute_logits(hidden[-rows:]), dim=-1)

    @torch.inference_mode()
    def profile_prefill(self, sizes: tuple[int, ...] = (16, 64, 256)) -> list[tuple[int, float]]:
        """Seconds to prefill a context of each size (used by Continuum's TTL rule).

        Runs on the KV cache's blocks from 1 on, before any request exists."""
        if not self.kv_cache_made:
            raise RuntimeError("initialize_kv_cache first")
        num_blocks = self.kv_caches[0].shape[1] if self.kv_caches else self.num_kv_blocks
        samples = []
        for size in sizes:
            need = -(-size // self.block_size)
            if need > num_blocks - 1:
                break
            meta = self.attn_backend.build_metadata([(0, size, list(range(1, need + 1)))])
            ids = torch.zeros(size, dtype=torch.long, device=self.device)
            pos = torch.arange(size, device=self.device)
            self.model(ids, pos, meta, self.kv_caches)  # warm-up
            start = time.perf_counter()
            self.model(ids, pos, meta, self.kv_caches)
            samples.append((size, time.perf_counter() - start))
        return samples
