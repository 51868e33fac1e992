"""``AsyncLLM``: the asyncio front end of the engine core process (used by the server)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from vllm.config import VllmConfig
from vllm.model_executor.model_loader import get_eos_token_id
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.core_client import AsyncMPClient, EngineDeadError
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.processor import Processor

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, vllm_config: VllmConfig, stat_loggers: list | None = None) -> None:
        mc = vllm_config.model_config
        self.config = vllm_config
        self.tokenizer = get_tokenizer(mc.model, mc.tokenizer, mc.chat_template)
        self.processor = Processor(vllm_config, self.tokenizer, get_eos_token_id(mc.model))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = stat_loggers or []
        self.client = AsyncMPClient(vllm_config)
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> dict:
        info = await self.client.wait_ready()
        self._loop_task = asyncio.create_task(self._output_loop())
        return info

    @property
    def is_alive(self) -> bool:
        return self.client.is_alive

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        add_special_tokens: bool = True,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes; cancelling the caller aborts it."""
        stream = await self.add_request(
            prompt, sampling_params, request_id, add_special_tokens, priority
        )
        async for out in stream:
            yield out

    async def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        add_special_tokens: bool = True,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Validate and queue now (ValueError / EngineDeadError raise here), stream later."""
        if not self.client.is_alive:
            raise EngineDeadError(self.client.dead_reason or "the engine core process died")
        _, core_reqs = self.processor.process(
            prompt, sampling_params, request_id, priority, add_special_tokens=add_special_tokens
        )
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, core_reqs
        )
        for r in core_reqs:
            await self.client.send("add", r)
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue):
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        child_ids = self.output_processor.child_ids(request_id)
        self.output_processor.abort_request(request_id)
        if child_ids and self.client.is_alive:
            await self.client.send("abort", child_ids)

    async def _output_loop(self) -> None:
        try:
            while True:
                msg = await self.client.recv()
                if msg is None:
                    continue
                kind, payload = msg
                if kind == "outputs":
                    await self._dispatch(payload)
                elif kind == "request_error":
                    self._fail_request(*payload)
        except asyncio.CancelledError:
            return
        except Exception as e:
            # A dead engine, or a bug here: fail every pending request instead of hanging.
            logger.exception("output loop stopped")
            self.client.dead_reason = self.client.dead_reason or f"output loop failed: {e}"
            err = e if isinstance(e, EngineDeadError) else EngineDeadError(str(e))
            for queue in self._queues.values():
                queue.put_nowait(err)

    def _fail_request(self, core_id: str, message: str) -> None:
        for request_id, queue in self._queues.items():
            if core_id in self.output_processor.child_ids(request_id):
                queue.put_nowait(ValueError(message))

    async def _dispatch(self, core_outputs) -> None:
        results, to_abort = self.output_processor.process_outputs(core_outputs.outputs)
        if to_abort:
            await self.client.send("abort", to_abort)
        for out in results:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for stat_logger in self.stat_loggers:
            stat_logger.record(core_outputs, results)

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.client.shutdown()
