"""The vLLM-v1 scheduler: one token budget per step, running first, recompute preemption.

Every decision that differs between policies is asked of ``self.policy`` (a
``vllm_continuum.policy.Policy``, the same objects upstream's scheduler runs through the
plugin: waiting order, preemption order, the fate of a finished request's blocks); this
file holds only the mechanism: admission and preemption here, the pins a policy asks for
in ``pinned.py``.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm import envs
from vllm.config import SpeculativeConfig, VllmConfig
from vllm.distributed.kv_events import KVEventLog, ZmqEventPublisher, rank_options
from vllm.multimodal.inputs import MultiModalFeature
from vllm.utils.clock import Clock, monotonic_clock
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.pinned import KVCachePinManager
from vllm.v1.core.sched.policy import make_request_queue
from vllm.v1.core.sched.state_checkpoints import (
    StateCheckpoints,
    StateRestore,
    prompt_boundary,
)
from vllm.v1.core.sched.utils import TokenBudget, check_stop
from vllm.v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestError,
    FinishReason,
)
from vllm.v1.metrics.stats import KVTransferStats, SchedulerStats, SpecDecodingStats
from vllm.v1.outputs import ModelRunnerOutput, RequestFailure
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.ngram_proposer import NgramProposer, drafts_allowed
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
from vllm_continuum.cache_hints import ttl_with_floor
from vllm_continuum.policy import FinishedAction, Offload, Pin, Policy

logger = logging.getLogger(__name__)


class KVTransferHook(Protocol):
    """What the scheduler asks of a KV connector (``vllm.distributed.kv_transfer``)."""

    def request_finished(self, request: Request) -> dict[str, Any] | None: ...

    def take_stats(self) -> KVTransferStats: ...


class PauseState(enum.IntEnum):
    """What ``schedule()`` may run (vLLM's pause of generation, ``EngineCore.pause``).

    UNPAUSED: everything. PAUSED_NEW: the running requests only; no waiting request is
    admitted (new ones, and those preempted meanwhile, wait for the resume). PAUSED_ALL:
    nothing; the running requests keep their blocks and go on after the resume.
    """

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


@dataclass
class _Step:
    """What one ``schedule()`` call decided so far."""

    new: list[Request] = field(default_factory=list)
    cached: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)  # per group
    num_tokens: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    num_loaded: int = 0  # tokens loaded from the CPU KV tier
    drafts: dict[str, list[int]] = field(default_factory=dict)  # speculative decoding
    # Per request: the images its chunk makes the vision encoder compute.
    encoder: dict[str, list[MultiModalFeature]] = field(default_factory=dict)
    # A model with recurrent layers: the checkpoint each new request's state starts from
    # (its prefix hit's, on the device or in the CPU tier; state_checkpoints.py).
    restores: dict[str, StateRestore] = field(default_factory=dict)

    @property
    def encoded(self) -> dict[str, int]:
        """The step's images so far: identifier -> embeddings."""
        return {f.identifier: f.num_embeds for fs in self.encoder.values() for f in fs}


class Scheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        num_gpu_blocks: int,
        policy: Policy,
        clock: Clock = monotonic_clock,
        num_cpu_blocks: int = 0,
        cpu_block_bytes: int = 0,
        kv_cache_windows: tuple[int | None, ...] = (None,),
        encoder_cached: Callable[[str], bool] | None = None,
        whole_images: bool = False,
        state_checkpoint_slots: int = 0,
        state_checkpoint_host_slots: int = 0,
    ) -> None:
        """``policy``: built by ``create_policy`` (the one place policies are built).
        ``num_cpu_blocks``: size of the CPU KV tier (0: none), blocks of
        ``cpu_block_bytes`` bytes each (for the bytes-moved metric).
        ``kv_cache_windows``: the runner's KV cache groups (``KVCacheManager``).
        ``encoder_cached``: whether the runner's encoder cache holds an image (by
        identifier): such an image costs the encoder budget nothing. ``whole_images``:
        a chunk never ends inside an image, as ``disable_chunked_mm_input`` asks (the
        model's image tokens attend to each other both ways: ``whole_images`` of
        vllm/v1/engine/core.py). ``state_checkpoint_slots``: a model with recurrent
        layers, with prefix caching: the runner's checkpoint slots of recurrent states
        (``StateCheckpoints``); a prefix hit reaches only as far as a checkpoint.
        ``state_checkpoint_host_slots``: with the CPU KV tier, its slots for checkpoints
        evicted from the device."""
        self.config = vllm_config.scheduler_config
        self.encoder_cached = encoder_cached
        self.whole_images = whole_images or self.config.disable_chunked_mm_input
        self.max_model_len = self.config.max_model_len
        self._chunk_cap = self.config.max_chunk_tokens  # the longest prefill chunk of a step
        self.clock = clock
        self.policy = policy
        self.max_ttl_s = vllm_config.policy_config.max_ttl_s  # caps a client's pin floor
        cache = vllm_config.cache_config
        self.block_size = cache.block_size
        lora = vllm_config.lora_config
        self.max_loras = lora.max_loras if lora.enable_lora else 0  # distinct adapters running
        # --kv-events-config: the pools record, each step's end publishes.
        events = vllm_config.kv_events_config
        self.kv_events = KVEventLog() if events.enabled else None
        # --kv-cache-metrics: the pool samples blocks' residency, make_stats drains it.
        observability = vllm_config.observability_config
        self.kv_metrics_collector: KVCacheMetricsCollector | None = None
        if observability.kv_cache_metrics:
            self.kv_metrics_collector = KVCacheMetricsCollector(
                observability.kv_cache_metrics_sample, clock, vllm_config.model_config.seed
            )
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks,
            cache.block_size,
            self.max_model_len,
            cache.enable_prefix_caching,
            num_cpu_blocks,
            cpu_block_bytes,
            self.kv_events,
            kv_cache_windows,
            self.config.max_num_batched_tokens,
            self.kv_metrics_collector,
        )
        if policy.has_tier != (self.kv_cache_manager.offload is not None):
            raise ValueError(
                f"the policy was built with has_kv_tier={policy.has_tier}, but the KV cache "
                f"has {'no' if self.kv_cache_manager.offload is None else 'a'} CPU tier"
            )
        self.requests: dict[str, Request] = {}
        self.pins = KVCachePinManager(self.kv_cache_manager, policy, self._job_pin_changed)
        self.state_checkpoints: StateCheckpoints | None = None
        if state_checkpoint_slots and cache.enable_prefix_caching:
            self.state_checkpoints = StateCheckpoints(
                state_checkpoint_slots,
                cache.block_size,
                self.pins.__contains__,
                state_checkpoint_host_slots if num_cpu_blocks else 0,
            )
        self.waiting = make_request_queue(policy, clock, self.pins)
        policy.bind(self.pins)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self._num_preemptions = 0
        self.pause_state = PauseState.UNPAUSED
        spec = vllm_config.speculative_config
        # n-gram and suffix drafts are proposed here, on the host; a draft model's come
        # back in the runner's output (Request.spec_token_ids) and write their KV ahead of
        # the step's tokens, in the lookahead slots every allocation adds.
        self.spec_method = spec.method
        self.proposer = _make_proposer(spec)
        self.num_lookahead_tokens = spec.num_lookahead_tokens
        self._spec_stats = SpecDecodingStats()
        self._spec_max_batch = spec.disable_by_batch_size
        # Finish events decided inside schedule(), delivered by the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        # --async-scheduling: the engine may schedule a step before the previous one's
        # update. Each schedule() leaves here the requests it scheduled (the objects: an
        # id may be reused once its request finished) and those that took a placeholder
        # for the token they sample; update_from_output takes them back in order.
        self.async_scheduling = self.config.async_scheduling
        self._scheduled: deque[tuple[dict[str, Request], list[Request]]] = deque()
        # --kv-transfer-config: the engine's connector (disaggregated prefill), told of
        # each finished request before its blocks are freed.
        self.kv_transfer: KVTransferHook | None = None
        # Last: its socket and thread are not left behind by a constructor that failed.
        self.kv_event_publisher = None
        if events.enabled:  # a data-parallel rank publishes on its own endpoints
            rank = envs.VLLM_DP_RANK
            self.kv_event_publisher = ZmqEventPublisher(rank_options(events.options, rank), rank)

    # -- requests in and out --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it can never run (more than the KV pool holds).

        The prompt's length against ``max_model_len`` is the processor's check (the front
        end knows the config); the pool's size is known only here."""
        self.check_request(request)
        self.requests[request.request_id] = request
        self.policy.on_arrival(request, self.clock())
        self.waiting.add_request(request)

    def check_request(self, request: Request) -> None:
        """``add_request``'s checks, without queueing (ValueError naming the problem)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        kv = self.kv_cache_manager
        if not kv.can_fit(request.num_prompt_tokens + 1):
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than the KV cache "
                f"holds ({kv.token_capacity()} tokens in {kv.block_pool.num_gpu_blocks - 1} "
                f"blocks of {self.block_size}); raise --kv-cache-memory or "
                "--num-gpu-blocks-override"
            )

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside: aborted ones (and failed ones,
        ``FINISHED_ERROR``) are freed; a running request that the front end saw stop
        (``FINISHED_STOPPED``: a stop string) finishes like an EOS, so the policy decides
        its blocks. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING and status == RequestStatus.FINISHED_STOPPED:
                request.status = status
                self._finish(request, self.clock())
                continue
            del self.requests[req_id]
            was_running = request.status == RequestStatus.RUNNING
            if was_running:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = status
            self.kv_cache_manager.free(request)
            # An aborted request's last checkpoint is good (its step runs before any
            # restore); a failed one's step may not have copied it.
            self._release_states(request, keep=status != RequestStatus.FINISHED_ERROR)
            self.finished_req_ids.add(req_id)
            self.policy.on_aborted(request, was_running, self.clock())

    # -- schedule -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        paused = self.pause_state is not PauseState.UNPAUSED
        # The head of the waiting queue keeps its job's expired pin for its hit, unless
        # paused: it is not admitted then, and a pin kept past its deadline would make
        # every loop of the engine a step.
        head = self.waiting.peek_request().job_key if self.waiting and not paused else None
        self.pins.expire(now, head)
        budget = TokenBudget(
            self.config.max_num_batched_tokens, self.config.long_prefill_token_threshold
        )
        step = _Step()
        if self.pause_state is not PauseState.PAUSED_ALL:
            self._schedule_running(budget, step, now)
        if not step.preempted and not paused:
            self._schedule_waiting(budget, step, now)
        return self._make_output(step)

    def set_pause_state(self, pause_state: PauseState) -> None:
        """What the next ``schedule()`` calls may run (``PauseState``); nothing is freed."""
        if pause_state is not self.pause_state:
            logger.info("Scheduler pause state: %s", pause_state.name)
        self.pause_state = pause_state

    def _schedule_running(self, budget: TokenBudget, step: _Step, now: float) -> None:
        i = 0
        while i < len(self.running) and budget.remaining > 0:
            request = self.running[i]
            num_new = request.num_tokens_with_placeholders - request.num_computed_tokens
            if request.num_output_placeholders and self._surely_done(request):
                i += 1  # its step on the device ends it: the next would be wasted
                continue
            drafts = self._drafts(request, budget) if num_new == 1 else []
            num_new = budget.clip(num_new + len(drafts))
            start = request.num_computed_tokens
            num_new = self._cut_for_checkpoint(request, start, num_new)
            num_new, images = self._encoder_inputs(request, start, num_new, step, resumed=False)
            if num_new == 0:
                i += 1
                continue
            del drafts[max(num_new - 1, 0) :]  # a budget cut keeps the first drafts
            num_running = len(self.running)
            new_block_ids = self._allocate_or_preempt(request, num_new, budget, step, now)
            if new_block_ids is None:
                break  # the request itself was preempted: nothing later fits either
            if images:
                step.encoder[request.request_id] = images
            step.cached.append(request)
            step.new_block_ids[request.request_id] = new_block_ids
            step.num_tokens[request.request_id] = num_new
            if drafts:
                step.drafts[request.request_id] = drafts
            budget.consume(num_new)
            # A victim scheduled earlier in this step shifts the list (rare: look it up).
            i = i + 1 if len(self.running) == num_running else self.running.index(request) + 1

    def _cut_for_checkpoint(self, request: Request, start: int, num_new: int) -> int:
        """With recurrent-state checkpoints: a chunk that runs past the prompt's checkpoint
        position (``prompt_boundary``) stops on it, so that the state there is saved (the
        rest of the prompt, at most a block, runs in the next step)."""
        if self.state_checkpoints is None:
            return num_new
        boundary = prompt_boundary(request.num_prompt_tokens, self.block_size)
        return boundary - start if start < boundary < start + num_new else num_new

    def _encoder_inputs(
        self, request: Request, start: int, num_new: int, step: _Step, resumed: bool
    ) -> tuple[int, list[MultiModalFeature]]:
        """The chunk of ``num_new`` tokens from ``start``, cut so that the step's vision
        encoder computes at most ``max_num_batched_tokens`` image embeddings (vLLM's
        encoder budget, its ``max_num_encoder_input_tokens``), and the images the chunk
        makes it encode.

        A chunk that reaches an image encodes the whole image (the runner keeps its rows
        until the image's last position is computed). An image the budget has no room
        for ends the chunk before it (nothing of the request runs when the chunk starts
        inside it); the first image of a step is never cut, so an image larger than the
        budget still runs, in a step of its own. ``resumed``: the request comes from the
        waiting queue (new, or preempted), so the runner holds none of its images, those
        its prefix-cache hit ends inside included. With ``disable_chunked_mm_input`` a
        chunk never ends inside an image: it stops before it, or, when it starts inside
        it (a prefix hit ending there), waits for a step with room for the rest; only an
        image longer than a chunk can be (``_chunk_cap``) is cut. An image sent twice in one
        step (one agent's screenshot in two requests) is encoded once, and one the
        runner's encoder cache holds not at all (``encoder_cached``)."""
        features = request.mm_features
        if not features or num_new == 0:
            return num_new, []
        end = start + num_new
        encoded = step.encoded
        used = sum(encoded.values())
        images: list[MultiModalFeature] = []
        for f in sorted(features, key=lambda f: f.offset):
            if f.offset >= end:
                break
            if f.end <= start or (f.offset < start and not resumed):
                continue  # computed, or held by the runner since an earlier step
            if self.whole_images and end < f.end:
                if start < f.offset:
                    return f.offset - start, images  # the image whole, from the next step
                if f.end - start <= self._chunk_cap:
                    return 0, []  # started by a prefix hit: the rest whole, in a later step
            cached = self.encoder_cached is not None and self.encoder_cached(f.identifier)
            if cached or f.identifier in encoded:
                continue  # in the runner's encoder cache, or encoded in this step already
            if used and used + f.num_embeds > self.config.max_num_batched_tokens:
                return max(f.offset - start, 0), images
            used += f.num_embeds
            encoded[f.identifier] = f.num_embeds
            images.append(f)
        return num_new, images

    def _surely_done(self, request: Request) -> bool:
        """Whether ``request`` stops at the latest with the tokens its steps on the device
        sample (max_tokens or max_model_len reached; an EOS is not known before)."""
        ahead = request.num_output_placeholders
        max_tokens = request.max_tokens
        return request.num_tokens + ahead >= self.max_model_len or (
            max_tokens is not None and request.num_output_tokens + ahead >= max_tokens
        )

    def _drafts(self, request: Request, budget: TokenBudget) -> list[int]:
        """Draft tokens for a decoding request (speculative decoding; [] without it, for
        a request whose sampling needs more than the argmax, or when nothing matches or
        was proposed), at most what the step's budget, max_tokens and max_model_len leave
        room for: n-gram lookup's or suffix decoding's, or those the draft model proposed
        in the last step."""
        if self.spec_method is None or not drafts_allowed(request.sampling_params):
            return []
        if self._spec_max_batch is not None and len(self.running) > self._spec_max_batch:
            return []  # a batch this large is better served by plain decode steps
        limit = min(
            budget.remaining - 1,
            self.max_model_len - request.num_tokens,
            (request.max_tokens or self.max_model_len) - request.num_output_tokens - 1,
        )
        if self.state_checkpoints is not None:
            # A step with drafts never reaches a block boundary (where recurrent states
            # are checkpointed; how many drafts it keeps is known only after it): at most
            # up to the token before the next one, none when the step would end on it.
            p = request.num_computed_tokens
            limit = min(limit, (p // self.block_size + 1) * self.block_size - p - 2)
        if self.proposer is None:
            return request.spec_token_ids[: max(limit, 0)]
        return self.proposer.propose(
            request.request_id,
            request.all_token_ids,
            limit,
            num_prompt_tokens=request.num_prompt_tokens,
        )

    def _lookahead(self, num_tokens: int) -> int:
        """KV slots to allocate past a request's first ``num_tokens`` for the positions a
        draft model writes ahead (vLLM's lookahead slots; 0 without one). Fewer where the
        whole pool could not hold them: a request that fits alone must still be served
        (the runner drafts only into slots its request holds)."""
        if not self.num_lookahead_tokens:
            return 0
        capacity = self.kv_cache_manager.token_capacity()
        return max(0, min(self.num_lookahead_tokens, capacity - num_tokens))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, budget: TokenBudget, step: _Step, now: float
    ) -> tuple[list[int], ...] | None:
        """Allocate for a running request: release pins first, then preempt victims."""
        while True:
            lookahead = self._lookahead(request.num_computed_tokens + num_new)
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=lookahead
            )
            if new_block_ids is not None:
                return new_block_ids
            if self.pins.release_for_pressure(request, now):
                continue
            if len(self.running) == 1:
                if len(self.pins):
                    # Pins the policy keeps for older jobs hold the memory: this request
                    # waits for them (they end by their TTL at the latest).
                    self._preempt(request, budget, step)
                    return None
                # Alone, without pins, and still out of memory: the sequence outgrew the
                # whole cache. Recomputing it would hit the same wall forever.
                self._cap_length(request, now)
                return None
            victim = self._select_victim()
            self._preempt(victim, budget, step)
            if victim is request:
                return None

    def _select_victim(self) -> Request:
        """The running request the policy preempts first: the largest ``victim_key``, or
        the last admitted when the policy has no order of its own."""
        if self.policy.victim_key(self.running[-1]) is None:
            return self.running[-1]
        return max(self.running, key=self.policy.victim_key)

    def _job_pin_changed(self, job: str) -> None:
        self.waiting.job_pin_changed(job)

    def _preempt(self, victim: Request, budget: TokenBudget, step: _Step) -> None:
        self.running.remove(victim)
        if victim.request_id in step.num_tokens:  # already scheduled this step: undo it
            budget.refund(step.num_tokens.pop(victim.request_id))
            step.cached.remove(victim)
            step.new_block_ids.pop(victim.request_id, None)
            step.drafts.pop(victim.request_id, None)
            step.encoder.pop(victim.request_id, None)
        self.kv_cache_manager.free(victim)
        self._release_states(victim, keep=True)  # its resume may start from it
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        # A token its step on the device samples is dropped (the request is no longer
        # running when that step's update comes); recomputed, it is sampled again.
        victim.num_output_placeholders = 0
        victim.spec_token_ids = []  # proposed for the KV it no longer has
        victim.num_preemptions += 1
        self._num_preemptions += 1
        step.preempted.add(victim.request_id)
        self.waiting.prepend_request(victim)
        self.policy.on_preempted(victim, self.clock())
        logger.debug("preempted %s", victim.request_id)

    def _cap_length(self, request: Request, now: float) -> None:
        logger.warning(
            "%s outgrew the KV cache at %d tokens", request.request_id, request.num_tokens
        )
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.running.remove(request)
        del self.requests[request.request_id]
        self.kv_cache_manager.free(request)
        self._release_states(request, keep=True)
        self.finished_req_ids.add(request.request_id)
        self._pending_outputs.append(
            EngineCoreOutput(
                request.request_id,
                [],
                finish_reason=FinishReason.LENGTH,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
        )

    def _schedule_waiting(self, budget: TokenBudget, step: _Step, now: float) -> None:
        kv = self.kv_cache_manager
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        skipped: list[Request] = []  # waiting for a LoRA slot: back in their places after
        while (
            self.waiting and budget.remaining > 0 and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek_request()
            lora = request.lora_request
            if lora and lora.lora_int_id not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.pop_request())  # as vLLM: later ones may run
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_loaded = self._offloaded_hit(request, num_hit, step)
            restore = None
            if self.state_checkpoints is not None and num_hit + num_loaded:
                # Only as far as a recurrent state was saved (on the device or in the CPU
                # tier): the blocks past it, pooled or offloaded, recompute.
                reach, restore = self.state_checkpoints.hit(
                    request.block_hashes, num_hit + num_loaded
                )
                num_loaded = max(reach - num_hit, 0)
                num_hit = min(num_hit, reach)
                hit_blocks = tuple(b[: num_hit // self.block_size] for b in hit_blocks)
            num_new = request.num_tokens - num_hit - num_loaded
            if not self.config.enable_chunked_prefill and num_new > budget.remaining:
                break
            free_tokens = kv.free_tokens
            if not self.policy.may_admit(request, num_new, free_tokens, now):
                break
            num_new = budget.clip(num_new)
            start = num_hit + num_loaded
            num_new = self._cut_for_checkpoint(request, start, num_new)
            num_new, images = self._encoder_inputs(request, start, num_new, step, resumed=True)
            if num_new == 0:
                break  # its image waits for a step with room for it
            new_block_ids = kv.allocate_slots(
                request,
                num_new,
                hit_blocks,
                num_hit,
                num_lookahead_tokens=self._lookahead(num_hit + num_loaded + num_new),
                num_external_computed_tokens=num_loaded,
            )
            if new_block_ids is None:
                if self._may_release_pins_for(request, now) and (
                    self.pins.release_for_pressure(request, now, exclude=request.job_key)
                ):
                    continue
                break
            self.waiting.pop_request()
            if lora:
                adapters.add(lora.lora_int_id)
            kv.record_prefix_cache_query(request.num_tokens, num_hit, num_loaded)
            self._admit(request, num_hit + num_loaded, now)
            if images:
                step.encoder[request.request_id] = images
            if restore is not None:
                step.restores[request.request_id] = restore
                self.state_checkpoints.use(restore)
            step.num_loaded += num_loaded
            step.new.append(request)
            step.num_tokens[request.request_id] = num_new
            budget.consume(num_new)
        for request in reversed(skipped):
            self.waiting.prepend_request(request)

    def _offloaded_hit(self, request: Request, num_hit: int, step: _Step) -> int:
        """Tokens of ``request`` to load from the CPU KV tier after its pool hit (0 without
        a tier). Loads take no compute budget, but a step loads at most
        ``max_num_batched_tokens`` tokens, except its first load, which is never cut (a
        context longer than the budget could otherwise never be loaded whole)."""
        limit = None
        if step.num_loaded:
            limit = max(self.config.max_num_batched_tokens - step.num_loaded, 0)
        return self.kv_cache_manager.get_num_offloaded_tokens(request, num_hit, limit)

    def _admit(self, request: Request, num_hit: int, now: float) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
            request.scheduled_time = now
        self.running.append(request)
        self.policy.on_scheduled(request, num_hit, now)
        self.pins.on_admitted(request, num_hit, now)

    def _make_output(self, step: _Step) -> SchedulerOutput:
        kv = self.kv_cache_manager
        if self.proposer is not None:
            for req_id in self.finished_req_ids:
                self.proposer.forget(req_id)
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                lora_request=r.lora_request,
                mm_features=r.mm_features,
                prompt_embeds=r.prompt_embeds,
                state_restore=step.restores.get(r.request_id),
            )
            for r in step.new
        ]
        cached = CachedRequestData(
            req_ids=[r.request_id for r in step.cached],
            new_block_ids=[step.new_block_ids[r.request_id] for r in step.cached],
            num_computed_tokens=[r.num_computed_tokens for r in step.cached],
        )
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_tokens,
            total_num_scheduled_tokens=sum(step.num_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=step.preempted,
            kv_transfers=kv.take_kv_transfers(),
            scheduled_spec_decode_tokens=step.drafts,
        )
        self.finished_req_ids = set()
        # As in vLLM: the scheduled tokens count as computed from now on.
        checkpoints = self.state_checkpoints
        for req_id, n in step.num_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if checkpoints is not None:  # a step that ends on a block boundary saves
                slot = checkpoints.plan(
                    req_id, request.num_computed_tokens, request.num_prompt_tokens
                )
                if slot is not None:
                    output.state_checkpoints[req_id] = slot
        if checkpoints is not None:  # after every plan: its evictions offload
            output.state_offloads = checkpoints.take_offloads()
        if self.async_scheduling:
            self._take_placeholders(step)
        return output

    def _take_placeholders(self, step: _Step) -> None:
        """--async-scheduling: each request of the step that samples a token takes a
        placeholder for it (the next step may be scheduled before it is known); the
        step's requests and those are kept for its update."""
        scheduled = {req_id: self.requests[req_id] for req_id in step.num_tokens}
        sampling = []
        for request in scheduled.values():
            if request.num_computed_tokens == request.num_tokens_with_placeholders:
                request.num_output_placeholders += 1
                sampling.append(request)
        self._scheduled.append((scheduled, sampling))

    # -- results --------------------------------------------------------------------------
    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        with_stats: bool = True,
    ) -> EngineCoreOutputs:
        """Apply a step's results to its requests (in the order the steps were scheduled);
        ``with_stats`` False: no ``scheduler_stats`` (the counters carry over to the next
        update that makes them: --async-scheduling may update two steps at once)."""
        now = self.clock()
        scheduled, sampling = self._scheduled.popleft() if self._scheduled else ({}, [])
        for request in sampling:  # its token is known now (or never will be)
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
        outputs, self._pending_outputs = self._pending_outputs, []
        errors = self._fail_requests(runner_output.errors, scheduled)
        if self.state_checkpoints is not None:  # the step's copies ran: prompts' are shared
            for req_id in scheduler_output.state_checkpoints:
                request = self.requests.get(req_id)
                if request is not None:
                    self.state_checkpoints.written(req_id, request.job_key, request.block_hashes)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            new_tokens = runner_output.sampled_token_ids.get(req_id) or []
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request is not scheduled.get(req_id, request)
            ):
                continue  # aborted, preempted or finished meanwhile (its id maybe reused)
            if req_id in runner_output.prompt_logprobs:  # kept until the first token
                request.add_prompt_logprobs(runner_output.prompt_logprobs[req_id])
            pooled = runner_output.pooled.get(req_id)
            if pooled is not None:  # an embedding: done once its prompt is
                outputs.append(self._finish_pooled(request, pooled, now))
                continue
            # The draft model's proposals from this step (none for an n-gram engine's).
            request.spec_token_ids = runner_output.draft_token_ids.get(req_id, [])
            if not new_tokens:
                continue  # a partial prefill chunk
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # The KV of the drafts after the first one rejected holds nothing: the
                # next step computes from the last token kept.
                accepted = len(new_tokens) - 1
                request.num_computed_tokens -= len(drafts) - accepted
                self._spec_stats.observe(len(drafts), accepted)
            first = request.first_token_time is None
            stopped = False
            for i, token in enumerate(new_tokens):
                request.append_output_token_ids(token)
                if check_stop(request, self.max_model_len):
                    new_tokens = new_tokens[: i + 1]
                    stopped = True
                    break
            if stopped and drafts:
                # Stopped inside the kept drafts: those after the stop are not its tokens.
                request.num_computed_tokens = min(
                    request.num_computed_tokens, request.num_tokens - 1
                )
            if first:
                request.first_token_time = now
            output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_tokens,
                new_logprobs=runner_output.logprobs.get(req_id),
                new_prompt_logprobs=request.take_prompt_logprobs(),
                finish_reason=request.get_finished_reason(),
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                queue_time_s=(request.scheduled_time or now) - request.arrival_time
                if first
                else None,
                num_prompt_tokens=request.num_prompt_tokens if first else None,
            )
            if stopped:
                output.kv_transfer_params = self._finish(request, now, answers=True)
            outputs.append(output)
        if not with_stats:
            self.publish_kv_events()
            return EngineCoreOutputs(outputs, None, errors=errors)
        stats = self.make_stats()
        stats.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        return EngineCoreOutputs(outputs, stats, errors=errors)

    def _finish_pooled(self, request: Request, pooled: list[float], now: float) -> EngineCoreOutput:
        """A pooling request whose prompt is computed: finished (the policy decides its
        blocks, as for any request), its embedding the output."""
        request.status = RequestStatus.FINISHED_STOPPED
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finished_reason(),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            queue_time_s=(request.scheduled_time or now) - request.arrival_time,
            num_prompt_tokens=request.num_prompt_tokens,
            pooled=pooled,
        )
        self._finish(request, now)
        return output

    def _fail_requests(
        self, failures: dict[str, RequestFailure], scheduled: dict[str, Request]
    ) -> list[EngineCoreRequestError]:
        """Finish the requests that failed in this step, through the abort path (their
        blocks freed, the policy told), with status ``FINISHED_ERROR``.

        Every block they hashed loses its hash (``free`` of a request with nothing
        computed): the step may have left a chunk's KV or a load from the CPU tier
        unwritten, and which blocks it did write is unknown. A valid block shared with
        another request only stops being a prefix hit."""
        errors = []
        for req_id, failure in failures.items():
            request = self.requests.get(req_id)
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request is not scheduled.get(req_id, request)
            ):
                continue
            logger.warning("request %s failed in its step: %s", req_id, failure.message)
            request.num_computed_tokens = 0
            self.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
            errors.append(EngineCoreRequestError(req_id, failure.message, failure.internal))
        return errors

    def _finish(self, request: Request, now: float, answers: bool = False) -> dict | None:
        """A request stopped: the policy decides between freeing and pinning its blocks.
        ``answers``: its finishing output is being made, so a disaggregated prefill's
        blocks are held in the CPU tier for a consumer (``kv_transfer``) and the
        ``kv_transfer_params`` returned for that output; else None."""
        self.running.remove(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        self._release_states(request, keep=True)  # the job's next turn may start from it
        params = None
        if self.kv_transfer is not None and answers:  # before the blocks are freed
            params = self.kv_transfer.request_finished(request)
        action = self._with_cache_hints(request, self.policy.on_finished(request, now))
        # Without prefix caching (--no-enable-prefix-caching) no later request can hit a
        # pinned block: the pin would only hold memory. Freed.
        if isinstance(action, Pin) and self.kv_cache_manager.enable_caching:
            self.pins.pin(request, action.ttl_s, now, strict=action.strict)
        else:
            # Offload: copied to the CPU tier first (a plain free when there is none).
            offload = isinstance(action, Offload) and request.sampling_params.may_offload
            self.kv_cache_manager.free(request, offload=offload)
        return params

    def _release_states(self, request: Request, keep: bool) -> None:
        """A request stops running: its recurrent-state checkpoint into the cache
        (``keep``) or its slot freed (``StateCheckpoints.release``)."""
        if self.state_checkpoints is not None:
            self.state_checkpoints.release(
                request.request_id, request.job_key, request.block_hashes, keep
            )

    def _with_cache_hints(self, request: Request, action: FinishedAction) -> FinishedAction:
        """The policy's action with the client's pin floor applied (``cache_hints``)."""
        floor = request.sampling_params.cache_ttl_s
        if floor is None or request.is_last_step:
            return action
        ttl = action.ttl_s if isinstance(action, Pin) else 0.0
        new_ttl = ttl_with_floor(ttl, floor, self.max_ttl_s)
        if new_ttl <= ttl:
            return action
        return Pin(new_ttl, strict=isinstance(action, Pin) and action.strict)

    # -- pins -----------------------------------------------------------------------------
    def _may_release_pins_for(self, request: Request, now: float) -> bool:
        return self.policy.may_release_pins_for(
            request, request.job_key in self.pins, len(self.running), now
        )

    # -- state ----------------------------------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Whether a step would compute anything (pins alone are no work)."""
        return self.get_num_unfinished_requests() > 0

    def has_work(self) -> bool:
        """Whether a step would compute anything under the pause state: paused, the
        waiting requests do not count (PAUSED_NEW), nor the running ones (PAUSED_ALL)."""
        if self.pause_state is PauseState.UNPAUSED:
            return self.has_unfinished_requests()
        return self.pause_state is PauseState.PAUSED_NEW and bool(self.running)

    def next_wakeup(self) -> float | None:
        """Clock time of the earliest pin deadline: an idle engine may sleep until then."""
        return self.pins.next_deadline()

    def make_stats(self) -> SchedulerStats:
        pin_stats = self.pins.take_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            pin_stats=pin_stats,
            policy_stats=self.policy.make_stats(),
            policy_name=self.policy.name,
        )
        offload = self.kv_cache_manager.offload
        if offload is not None:
            stats.connector_prefix_cache_stats, stats.offload_stats = offload.make_stats()
        if self.kv_transfer is not None:
            stats.kv_transfer_stats = self.kv_transfer.take_stats()
            # Waiting for their blocks (vLLM's WAITING_FOR_REMOTE_KVS counts as waiting).
            stats.num_waiting_reqs += stats.kv_transfer_stats.fetching_requests
        if self.state_checkpoints is not None:
            stats.state_checkpoint_stats = self.state_checkpoints.take_stats()
        if self.spec_method is not None:
            stats.spec_decoding_stats, self._spec_stats = self._spec_stats, SpecDecodingStats()
        if self.kv_metrics_collector is not None:
            stats.kv_cache_eviction_events = self.kv_metrics_collector.drain_events()
        if self.max_loras:
            stats.running_lora_adapters = _count_adapters(self.running)
            stats.waiting_lora_adapters = _count_adapters(self.waiting)
        self._num_preemptions = 0
        self.publish_kv_events()  # with the step's figures (or an idle engine's)
        return stats

    def publish_kv_events(self) -> None:
        """--kv-events-config: the KV cache's changes since the last call, as one batch."""
        if self.kv_events is not None and self.kv_events.events:
            self.kv_event_publisher.publish(self.kv_events.take())

    def reset_prefix_cache(self) -> bool:
        ok = self.kv_cache_manager.reset_prefix_cache()
        if ok and self.state_checkpoints is not None:
            self.state_checkpoints.clear()
        self.publish_kv_events()
        return ok

    def shutdown(self) -> None:
        self.pins.release_all(self.clock())
        self.policy.shutdown()
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
            self.kv_event_publisher.shutdown()

    def check_invariants(self) -> None:
        """Block conservation and ownership; raises AssertionError on a violation."""
        kv = self.kv_cache_manager
        kv.check_invariants()
        if self.state_checkpoints is not None:
            self.state_checkpoints.check_invariants()
        holders = {r.request_id for r in self.running}
        holders |= {r.request_id for r in self.pins.pinned.requests()}
        assert set(kv.req_to_blocks) <= holders, (
            f"blocks held by unknown requests: {set(kv.req_to_blocks) - holders}"
        )
        for request in self.running:
            assert kv.get_num_slots(request.request_id) >= request.num_computed_tokens, (
                f"{request} has fewer slots than computed tokens"
            )
        for request in self.waiting:
            assert kv.get_num_blocks(request.request_id) == 0, f"waiting {request} holds blocks"


def _make_proposer(spec: SpeculativeConfig) -> NgramProposer | SuffixDecodingProposer | None:
    """The host-side drafter of ``spec``'s method; None without one (no speculative
    decoding, or a model's drafts, which the runner proposes)."""
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    if spec.method == "suffix":
        return SuffixDecodingProposer.from_config(spec)
    return None


def _count_adapters(requests) -> dict[str, int]:
    """Adapter name -> how many of ``requests`` run with it."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts
