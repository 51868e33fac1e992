"""The engine core: scheduler + model runner, one ``step()`` at a time (in process).

The ZMQ process wrapper around it lives in ``core_proc.py``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.config import SchedulerConfig, VllmConfig
from vllm.model_executor.layers.recurrent import split_tier
from vllm.profiler import TorchProfiler
from vllm.utils.clock import Clock, monotonic_clock
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, kv_capacity_tokens
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.policy import create_policy
from vllm.v1.core.sched.scheduler import PauseState, Scheduler
from vllm.v1.engine import (
    PAUSE_MODES,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestError,
    FinishReason,
)
from vllm.v1.engine.kv_transfer import KVTransferMixin
from vllm.v1.engine.weight_sync import WeightSyncMixin
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, RequestFailure
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output.ahead import PendingGrammars
from vllm.v1.worker.sleep_mode import SLEEP_TAGS, check_sleep_level, check_wake_up_tags
from vllm_continuum.policy import get_policy_class

if TYPE_CHECKING:
    from vllm.v1.worker.model_runner import DeferredOutput

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.05  # an idle step waits this long for a compiling grammar


def check_kv_capacity(
    vllm_config: VllmConfig,
    num_gpu_blocks: int,
    kv_cache_windows: tuple[int | None, ...] = (None,),
) -> None:
    """``ValueError`` naming --max-model-len when one request of max_model_len tokens
    cannot fit the KV pool sized from memory (as vLLM refuses to start): the request
    would otherwise be cut at the pool's size and reported as ``length``. The KV cache
    groups' windows (the hybrid KV cache) count what a sliding group holds.

    An exact --num-gpu-blocks-override is taken as asked (tests and experiments shrink
    the pool on purpose), with a warning; vLLM too checks only the memory-derived size."""
    block_size = vllm_config.cache_config.block_size
    capacity = kv_capacity_tokens(  # the null block holds no tokens
        num_gpu_blocks - 1,
        block_size,
        kv_cache_windows,
        vllm_config.scheduler_config.max_num_batched_tokens,
    )
    max_model_len = vllm_config.scheduler_config.max_model_len
    if max_model_len <= capacity:
        return
    if vllm_config.cache_config.num_gpu_blocks_override is not None:
        logger.warning(
            "--max-model-len %d is more than the KV cache holds (%d tokens with "
            "--num-gpu-blocks-override %d): longer requests are refused",
            max_model_len,
            capacity,
            num_gpu_blocks,
        )
        return
    raise ValueError(
        f"--max-model-len {max_model_len} is more than the KV cache can hold: {capacity} "
        f"tokens ({num_gpu_blocks - 1} blocks of {block_size}). Lower --max-model-len to at "
        f"most {capacity}, or give the cache more memory (--kv-cache-memory, "
        "--gpu-memory-utilization)."
    )


def whole_images(config: SchedulerConfig, model: Any) -> None:
    """For a model whose image tokens attend to each other both ways (Gemma 3), every
    image's tokens run in one prefill chunk (the scheduler's ``whole_images``, as
    ``disable_chunked_mm_input`` asks): a chunk (``max_num_batched_tokens``,
    ``long_prefill_token_threshold``) must be long enough for the model's longest image
    (``max_image_tokens``), else ``ValueError`` naming the flag."""
    if not config.disable_chunked_mm_input:
        logger.info(
            "The model's image tokens attend to each other both ways: each image runs in "
            "one prefill chunk (as --disable-chunked-mm-input)"
        )
    longest = getattr(model, "max_image_tokens", 0)
    cap = config.max_chunk_tokens  # the scheduler's longest chunk
    if cap < longest:
        flag = "max_num_batched_tokens"
        if cap < config.max_num_batched_tokens:  # the threshold binds
            flag = "long_prefill_token_threshold"
        raise ValueError(
            f"--{flag.replace('_', '-')} {cap} is shorter than one image of this model "
            f"({longest} tokens), whose image tokens attend to each other both ways and so "
            f"run in one prefill chunk: set it to at least {longest}"
        )


class EngineCore(WeightSyncMixin, KVTransferMixin):
    """Owns the model runner and the scheduler. ``step`` = schedule, execute, update.

    ``clock`` (monotonic seconds) is the scheduler's and the policy's time source; a
    request's ``arrival_time`` inside the core is on this clock.
    """

    # Steps failing in a row before ``step`` re-raises (see ``_failed_step``).
    MAX_FAILED_STEPS = 3

    def __init__(self, vllm_config: VllmConfig, clock: Clock = monotonic_clock) -> None:
        from vllm.model_executor.model_loader import eos_token_ids
        from vllm.transformers_utils.tokenizer import init_tokenizer_from_config
        from vllm.v1.worker.model_runner import ModelRunner

        start = time.monotonic()
        self.vllm_config = vllm_config
        self.clock = clock
        mc = vllm_config.model_config
        self.tokenizer = init_tokenizer_from_config(mc)  # None: --skip-tokenizer-init
        # The EOS id, and the generation config's other EOS ids (stops too, as vLLM);
        # without a tokenizer, the generation config's (else config.json's) first is it.
        self.eos_token_id, self.extra_eos_token_ids = eos_token_ids(mc, self.tokenizer)
        if self.eos_token_id is None:
            logger.warning(
                "No EOS token id (%s): requests end at max_tokens, a stop_token_id or the "
                "context limit",
                "no tokenizer, and none in the model's configs"
                if self.tokenizer is None
                else "none in the tokenizer or the model's configs",
            )
        self.model_runner = ModelRunner(vllm_config)
        self.model_runner.load_model()
        self.num_gpu_blocks = self.model_runner.determine_num_blocks()
        check_kv_capacity(vllm_config, self.num_gpu_blocks, self.model_runner.kv_cache_windows)
        self.model_runner.initialize_kv_cache(self.num_gpu_blocks)
        self.num_host_state_slots = 0  # the CPU tier's checkpoint slots (_init_kv_offload)
        self._check_kv_transfer_model()
        self.num_cpu_blocks, block_bytes = self._init_kv_offload()
        policy = create_policy(
            vllm_config, decode=self._decode, clock=clock, has_kv_tier=self.num_cpu_blocks > 0
        )
        policy.prepare(self.model_runner.profile_prefill)
        self.model_runner.warm_up_kernels()  # compiled now, not in a request's step
        self.model_runner.capture_model()  # CUDA graphs of decode steps (not on CPU)
        # Constrained requests wait here while their grammar compiles (not in a step).
        self.grammars = PendingGrammars(self.model_runner.structured_output)
        # --limit-mm-per-prompt '{"image": 0}': a multimodal checkpoint served as text.
        images = (mc.limit_mm_per_prompt or {}).get("image") != 0
        bidirectional = images and self.model_runner.bidirectional_images
        if bidirectional:
            whole_images(vllm_config.scheduler_config, self.model_runner.model)
        self.scheduler = Scheduler(
            vllm_config,
            self.num_gpu_blocks,
            policy,
            clock,
            self.num_cpu_blocks,
            block_bytes,
            self.model_runner.kv_cache_windows,
            self.model_runner.encoder_cache.__contains__,
            whole_images=bidirectional,
            state_checkpoint_slots=self.model_runner.num_state_checkpoint_slots,
            state_checkpoint_host_slots=self.num_host_state_slots,
        )
        self.block_hasher = get_request_block_hasher(vllm_config.cache_config.block_size)
        self._init_kv_transfer()  # --kv-transfer-config: the connector (None without)
        # Finished/preempted ids of steps the runner did not see (empty or failed steps),
        # delivered with the next step that runs it.
        self._undelivered_finished: set[str] = set()
        self._undelivered_preempted: set[str] = set()
        self._num_failed_steps = 0  # in a row
        # --async-scheduling: the step whose tokens are still on the device.
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, DeferredOutput] | None = None
        self._profiler: TorchProfiler | None = None  # --profiler-config, made on first use
        # Sleep mode: scheduling stopped (any level), what is off the device (levels 1-2).
        self._asleep = False
        self.sleeping_tags: set[str] = set()
        self.sleep_level = 0  # of the last sleep, while asleep
        if self.async_scheduling and self.model_runner.device.type == "cpu":
            logger.warning(
                "--async-scheduling on the CPU: the forward runs on the engine's own thread, "
                "so nothing overlaps it, and each token reaches the client a step later"
            )
        logger.info(
            "Engine core ready in %.1f s: %d KV blocks%s, policy %s",
            time.monotonic() - start,
            self.num_gpu_blocks,
            f" + {self.num_cpu_blocks} in the CPU tier" if self.num_cpu_blocks else "",
            policy.name,
        )

    def _init_kv_offload(self) -> tuple[int, int]:
        """(tier blocks, bytes per block) of the CPU KV tier; (0, 0) when it is off.

        ``--kv-offloading-size`` unset: a policy that keeps jobs' contexts
        (``Policy.wants_kv_tier``) gets a tier sized from free host memory when prefix
        caching is on (the tier finds blocks by their prefix hash); others get none."""
        offload = self.vllm_config.offload_config
        policy_cls = get_policy_class(self.vllm_config.scheduler_config.policy)
        auto = offload.auto and (
            (policy_cls.wants_kv_tier or self.vllm_config.kv_transfer_config.enabled)
            and self.vllm_config.cache_config.enable_prefix_caching
        )
        if not (auto or offload.enabled):  # (VllmConfig refuses a tier without prefix caching)
            return 0, 0
        runner = self.model_runner
        block_bytes = runner.get_kv_cache_bytes_per_block()
        if block_bytes == 0:  # an attention-free model (Mamba): no KV cache to offload
            if auto:  # sized for a policy: none
                return 0, 0
            raise ValueError("--kv-offloading-size: the model has no attention layer, "
                             "so no KV cache to offload")  # fmt: skip
        slot_bytes = runner.state_checkpoint_bytes
        device_slots = runner.num_state_checkpoint_slots
        auto_bytes = None
        if auto:
            pool_bytes = self.num_gpu_blocks * block_bytes + device_slots * slot_bytes
            # Data-parallel engines share the host: each sizes its tier from its share.
            dp = self.vllm_config.parallel_config.data_parallel_size
            auto_bytes = offload.auto_size_bytes(pool_bytes) // dp
            if auto_bytes < block_bytes:
                return 0, 0
            logger.info(
                "CPU KV tier sized for policy %s: %.2f GiB (--kv-offloading-size 0 turns it off)",
                policy_cls.name,
                auto_bytes / 2**30,
            )
        num_slots = 0
        if runner.recurrent_specs is None:
            num_blocks = offload.num_blocks(block_bytes, auto_bytes)
        else:
            # A hit needs its recurrent states as well as its blocks: the tier holds
            # checkpoints of them too, in the device's proportion (recurrent.split_tier).
            size = offload.size_bytes if auto_bytes is None else auto_bytes
            num_blocks, num_slots = split_tier(
                size, block_bytes, slot_bytes, self.num_gpu_blocks, device_slots
            )
            if num_blocks < 1:
                if auto_bytes is not None:
                    return 0, 0
                raise ValueError(
                    f"--kv-offloading-size: {offload.kv_offloading_size} GiB holds no checkpoint "
                    f"of the model's recurrent states ({slot_bytes} bytes) next to its share "
                    "of KV blocks; give it more"
                )
        runner.initialize_kv_offload(num_blocks, num_slots)
        self.num_host_state_slots = num_slots
        return num_blocks, block_bytes

    @property
    def config(self) -> VllmConfig:
        return self.vllm_config

    def _decode(self, token_ids: list[int]) -> str | None:
        """The policies' view of an output as text; None without a tokenizer (a policy
        then reads no tool call from it, as the upstream plugin does)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (naming the field) if it can never run."""
        params = request.sampling_params
        eos = request.eos_token_id if request.eos_token_id is not None else self.eos_token_id
        params.update_from_generation_config(eos, self.extra_eos_token_ids)
        core_request = Request(
            request.request_id,
            request.prompt_token_ids,
            params,
            eos_token_id=eos,
            arrival_time=self.clock(),
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=request.lora_request,
            block_hasher=self.block_hasher,
            mm_features=request.mm_features,
            prompt_embeds=request.prompt_embeds,
        )
        if self._take_for_transfer(core_request):  # its KV comes from a producer first
            return
        self._admit(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests now and free their blocks (unknown ids are ignored)."""
        self.grammars.discard(request_ids)
        self._cancel_fetches(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """These requests ended on a stop string (seen by the front end's detokenizer):
        finish them as stopped, like an EOS, so the policy decides their blocks."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, update. A request that fails inside the step is finished
        with an error (``EngineCoreOutputs.errors``); the engine goes on. The outputs
        carry the weights' version (``weight_version``) their tokens were sampled with."""
        errors: list[EngineCoreRequestError] = []
        self._kv_transfer_before_step(errors)  # fetched blocks in, their requests queued
        outputs = self._step()
        self._kv_transfer_after_step()  # a producer's held blocks filled before they leave
        outputs.errors[:0] = errors
        outputs.weight_version = self._weight_version
        return outputs

    def _step(self) -> EngineCoreOutputs:
        if self._asleep:  # requests added while asleep wait for wake_up
            return EngineCoreOutputs(scheduler_stats=self.make_stats())
        if self.async_scheduling:
            return self._step_async()
        errors = self._schedule_compiled()
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self._execute(scheduler_output)
        except Exception as e:
            runner_output = self._failed_step(scheduler_output, e)
        else:
            if not scheduler_output.is_empty:  # the model ran: the engine works
                self._num_failed_steps = 0
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.errors.extend(errors)
        return outputs

    def _step_async(self) -> EngineCoreOutputs:
        """--async-scheduling: schedule and launch a step, then finish the one before it,
        whose tokens stayed on the device meanwhile (the scheduler counted them as
        placeholders). The host's work of this step overlaps the device's of the last."""
        errors = self._schedule_compiled()
        scheduler_output = self.scheduler.schedule()
        try:
            result = self._execute(scheduler_output, defer=True)
        except Exception as e:
            result = self._failed_step(scheduler_output, e)
        else:
            if not scheduler_output.is_empty:
                self._num_failed_steps = 0
        ready = isinstance(result, ModelRunnerOutput)  # else a DeferredOutput
        outputs = None
        if self._in_flight is not None:  # first: steps are updated in their order
            outputs = self._finish_in_flight(with_stats=not ready)
        if not ready:
            self._in_flight = (scheduler_output, result)
            if outputs is None:  # nothing finished in this step
                outputs = EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        else:
            now = self.scheduler.update_from_output(scheduler_output, result)
            if outputs is not None:
                now.outputs[:0] = outputs.outputs
                now.errors[:0] = outputs.errors
            outputs = now
        outputs.errors.extend(errors)
        return outputs

    def _finish_in_flight(self, with_stats: bool = True) -> EngineCoreOutputs:
        """Wait for the step on the device and apply its tokens."""
        scheduler_output, deferred = self._in_flight
        self._in_flight = None
        try:
            runner_output = deferred.result()
        except Exception as e:  # a device error surfaces when its copy is waited for
            runner_output = self._failed_step(scheduler_output, e)
        return self.scheduler.update_from_output(scheduler_output, runner_output, with_stats)

    def _schedule_compiled(self) -> list[EngineCoreRequestError]:
        """Hand the requests whose grammar is ready to the scheduler. With nothing else to
        run, wait a little for one (no busy loop while grammars compile)."""
        idle = not self.scheduler.has_work()
        ready, errors = self.grammars.take_ready(GRAMMAR_POLL_S if idle else 0.0)
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except ValueError as e:
                errors.append(EngineCoreRequestError(request.request_id, str(e)))
        return errors

    def _execute(
        self, scheduler_output: SchedulerOutput, defer: bool = False
    ) -> ModelRunnerOutput | DeferredOutput:
        """Run the model, unless nothing is scheduled (pins expiring, all waiting blocked).
        ``defer``: the runner may leave the sampled tokens on the device."""
        if scheduler_output.is_empty:
            if scheduler_output.kv_transfers:  # saves of freed blocks: run them now
                self.model_runner.transfer_kv(scheduler_output.kv_transfers)
            self._undeliver(scheduler_output)
            return EMPTY_MODEL_RUNNER_OUTPUT
        # The runner drops these before adding this step's new requests, so an id reused
        # by a new request is safe; a preempted one keeps its random stream.
        scheduler_output.finished_req_ids |= self._undelivered_finished
        scheduler_output.preempted_req_ids |= self._undelivered_preempted
        self._undelivered_finished, self._undelivered_preempted = set(), set()
        if defer:
            return self.model_runner.execute_model(scheduler_output, defer=True)
        return self.model_runner.execute_model(scheduler_output)

    def _undeliver(self, scheduler_output: SchedulerOutput) -> None:
        """The runner did not see (all of) this step: tell it again with the next one."""
        self._undelivered_finished |= scheduler_output.finished_req_ids
        self._undelivered_preempted |= scheduler_output.preempted_req_ids

    def _failed_step(
        self, scheduler_output: SchedulerOutput, error: Exception
    ) -> ModelRunnerOutput:
        """The runner raised: every request of the step fails (which one caused it is
        unknown), the rest of the engine goes on. ``MAX_FAILED_STEPS`` failures in a row,
        with no step succeeding in between, mean a broken model or engine: re-raised, the
        engine process reports FATAL and the server exits (a supervisor restarts it)."""
        self._num_failed_steps += 1
        if self._num_failed_steps >= self.MAX_FAILED_STEPS:
            logger.error("%d steps in a row failed: the engine stops", self._num_failed_steps)
            raise error
        req_ids = list(scheduler_output.num_scheduled_tokens)
        logger.exception("A step failed; its %d request(s) end with an error", len(req_ids))
        # The runner may have dropped the finished and preempted requests' state or not:
        # dropping is idempotent, so deliver them again. The failed requests' state is
        # dropped when they come back as finished.
        self._undeliver(scheduler_output)
        if scheduler_output.kv_transfers:  # the CPU tier's saves may not have run
            self.scheduler.kv_cache_manager.discard_kv_saves(scheduler_output.kv_transfers)
        if scheduler_output.state_offloads:  # nor its copies of recurrent states
            self.scheduler.state_checkpoints.discard_offloads(scheduler_output.state_offloads)
        failure = RequestFailure(f"the engine failed in this request's step: {_brief(error)}")
        return ModelRunnerOutput([], {}, errors=dict.fromkeys(req_ids, failure))

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has anything to do: requests scheduled or waiting, or held
        while their grammar compiles (pinned blocks alone are no work)."""
        return (
            self.scheduler.has_unfinished_requests()
            or len(self.grammars) > 0
            or self._in_flight is not None
            or (self.kv_connector is not None and self.kv_connector.num_fetching > 0)
        )

    def has_work(self) -> bool:
        """Whether ``step`` would compute anything now: nothing while asleep; paused, only
        the running requests (``PauseState``; requests held for their grammar wait too).
        An engine loop blocks for input instead of stepping when this is false."""
        if self._asleep:
            return False
        if self._in_flight is not None or self.scheduler.has_work():
            return True
        return len(self.grammars) > 0 and not self.is_paused()

    def next_wakeup(self) -> float | None:
        """Clock time of the earliest pin deadline (an idle engine may sleep until then), or
        of the KV connector's (fetched blocks to take in, a producer's hold to end)."""
        wakes = [self.scheduler.next_wakeup()]
        if self.kv_connector is not None:
            wakes.append(self.kv_connector.next_wakeup())
        return min((w for w in wakes if w is not None), default=None)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's figures now (what a step's outputs carry), for an engine loop
        that publishes them without a step (an abort left the engine idle)."""
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        if self.kv_connector is not None:  # held blocks are forgotten with the rest
            self.kv_connector.drop_holds()
        return self.scheduler.reset_prefix_cache()

    # -- sleep mode (--enable-sleep-mode) -------------------------------------------------
    def sleep(self, level: int = 1) -> EngineCoreOutputs:
        """vLLM's sleep in its default "abort" mode: every unfinished request is aborted
        (returned: their outputs, finish_reason abort) and scheduling pauses (level 0);
        level 1 also releases Continuum's pins, empties the prefix cache, frees the KV
        cache and moves the weights off the device (on the CPU they stay); level 2 frees
        the weights too. Requests added while asleep wait, unscheduled, until ``wake_up``.
        ``ValueError`` without --enable-sleep-mode or for a level not in 0-2."""
        if not self.vllm_config.model_config.enable_sleep_mode:
            raise ValueError(
                "sleep mode is off: start the engine with --enable-sleep-mode "
                "(LLM(enable_sleep_mode=True))"
            )
        check_sleep_level(level)
        if self.is_sleeping():
            logger.warning("sleep: the engine is already sleeping (level %d)", self.sleep_level)
            return EngineCoreOutputs(scheduler_stats=self.make_stats())
        outputs = self._finish_in_flight() if self._in_flight is not None else EngineCoreOutputs()
        aborted = self._abort_all(outputs)
        self._asleep, self.sleep_level = True, level
        if level >= 1:
            self.scheduler.pins.release_all(self.clock())
            if not self.reset_prefix_cache():  # nothing holds a block now
                raise RuntimeError("sleep: the prefix cache could not be reset")
            self.model_runner.sleep(level)
            self.sleeping_tags = set(SLEEP_TAGS)
        outputs.scheduler_stats = self.make_stats()
        logger.info("Engine asleep (level %d); %d request(s) aborted", level, len(aborted))
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back ``tags`` ("weights", "kv_cache"; None: all): the KV cache with as many
        blocks as before, the weights from host memory or the checkpoint. Scheduling
        resumes ("scheduling", vLLM's level-0 tag) once both are back; returns whether the
        engine is fully awake. Waking what is awake is a no-op, as vLLM's. ``ValueError``
        for an unknown tag."""
        wake = [t for t in check_wake_up_tags(tags) if t in self.sleeping_tags]
        if not self.is_sleeping():
            if self.is_paused():  # vLLM's wake_up resumes a paused scheduler
                self.resume()
            else:
                logger.warning("wake_up: the engine is not sleeping")
            return True
        if wake:
            self.model_runner.wake_up(tuple(wake), self.num_gpu_blocks, self.num_cpu_blocks)
            self.sleeping_tags -= set(wake)
        if not self.sleeping_tags:
            self._asleep, self.sleep_level = False, 0
            self.resume()  # as vLLM's: a full wake-up also ends a pause
        logger.info("Engine woke %s: %s", wake, "asleep" if self.is_sleeping() else "awake")
        return not self.is_sleeping()

    def is_sleeping(self) -> bool:
        """Asleep at any level (scheduling stopped); requests wait until fully awake."""
        return self._asleep

    def _abort_all(self, outputs: EngineCoreOutputs) -> list[str]:
        """Abort every unfinished request, those waiting for their grammar included; their
        endings (finish_reason abort) are added to ``outputs``. Returns their ids."""
        fetching = self.kv_connector.fetching_ids if self.kv_connector is not None else []
        aborted = [*self.scheduler.requests, *self.grammars._held, *fetching]
        self.abort_requests(aborted)
        abort = FinishReason.ABORT
        outputs.outputs += [EngineCoreOutput(r, [], finish_reason=abort) for r in aborted]
        return aborted

    # -- pause of generation (vLLM's pause_generation / resume_generation) ----------------
    def pause(self, mode: str = "abort", clear_cache: bool = True) -> EngineCoreOutputs:
        """Stop scheduling until ``resume``; requests added meanwhile wait, unscheduled.
        ``mode`` says what happens to the requests in flight: "abort" aborts every
        unfinished request (their endings, finish_reason abort, are returned); "wait" lets
        the running ones go on to their end (the pause is complete once ``pause_drained``);
        "keep" freezes them, blocks kept, until ``resume``. The step on the device
        (--async-scheduling) is finished first, its tokens returned. ``clear_cache`` is
        for ``finish_pause``. ``ValueError`` for an unknown mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        outputs = self._finish_in_flight() if self._in_flight is not None else EngineCoreOutputs()
        aborted = self._abort_all(outputs) if mode == "abort" else []
        keep = mode == "keep"
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL if keep else PauseState.PAUSED_NEW)
        outputs.scheduler_stats = self.make_stats()
        logger.info("Generation paused (%s); %d request(s) aborted", mode, len(aborted))
        return outputs

    def pause_drained(self) -> bool:
        """Whether a pause is complete: no step runs any more (keep: at once; abort and
        wait: once no request is running). False when not paused."""
        state = self.scheduler.pause_state
        if state is PauseState.PAUSED_NEW:
            return not self.scheduler.running and self._in_flight is None
        return state is PauseState.PAUSED_ALL

    def finish_pause(self, clear_cache: bool = True) -> None:
        """A drained pause: with ``clear_cache`` (ignored under "keep", whose requests
        keep their blocks), Continuum's pins are released and the prefix cache emptied, so
        that no later request hits KV computed before (e.g. by the weights of before an
        update)."""
        if not clear_cache or self.scheduler.pause_state is not PauseState.PAUSED_NEW:
            return
        self.scheduler.pins.release_all(self.clock())
        if not self.reset_prefix_cache():
            raise RuntimeError("pause: the prefix cache could not be reset")

    def resume(self) -> None:
        """Schedule again: the kept requests go on, the queued ones are admitted."""
        if self.is_paused():
            logger.info("Generation resumed")
        self.scheduler.set_pause_state(PauseState.UNPAUSED)

    def is_paused(self) -> bool:
        """Paused in any mode (sleep is apart: ``is_sleeping``)."""
        return self.scheduler.pause_state is not PauseState.UNPAUSED

    def profile(self, start: bool) -> None:
        """--profiler-config: begin recording the steps, or end it and write the trace
        (``vllm.profiler``); ``ValueError`` when no profiler is configured."""
        if self._profiler is None:
            config = self.vllm_config.profiler_config
            if not config.enabled:
                raise ValueError("no profiler: start the engine with --profiler-config")
            self._profiler = TorchProfiler(config.options, "engine_core")
        if start:
            self._profiler.start()
        else:
            self._profiler.stop()

    def shutdown(self) -> None:
        profiler = getattr(self, "_profiler", None)
        if profiler is not None and profiler.active:
            profiler.stop()  # what was recorded is still written
        self._in_flight = None  # its tokens are no one's now
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.scheduler.shutdown()
        self.model_runner.release()


def _brief(error: Exception, limit: int = 200) -> str:
    """``Type: message`` of an exception, bounded (it goes to the client)."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[:limit] + "..."
