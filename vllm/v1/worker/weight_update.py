"""The engine's end of RL weight sync (``vllm.distributed.weight_transfer``): it joins the
trainer's process group, receives each round's checkpoint tensors and swaps them into the
served model between two steps.

A round may carry any of the checkpoint's tensors (vLLM's partial updates): the engine keeps
the checkpoint's tensors on the host while a transfer group is open (read from its folder
at ``init``; after each round, the round's tensors in place of theirs), so the new weights
are the last ones with the round's on top. They are made into a whole model on the host by
the start-up path (``model_from_state``: the model's own ``load_weights``, which fuses
q/k/v and gate/up), then copied in place into the served model's tensors, so their
addresses, and the CUDA graphs recorded over them, stay valid. With --load-format dummy
there is no checkpoint: the first round must carry every tensor. A round whose tensors do
not fit fails before anything is copied: the served weights stay as they were. Only models
served in a dense dtype take updates (not GGUF, FP8 or 4-bit formats: their weights would
need the checkpoint's own quantization).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, parse_update_info
from vllm.distributed.weight_transfer.torch_group import open_group, receive_tensors

if TYPE_CHECKING:
    from vllm.v1.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def served_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The served model's parameters and persistent buffers under their unwrapped names: a
    LoRA-wrapped linear layer keeps its own weight under ``<layer>.base``."""
    from vllm.lora.layers import LoRALinear

    wrapped = {name for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    tensors = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        head, sep, tail = name.partition(".base.")
        if sep and head in wrapped:
            name = f"{head}.{tail}"
        tensors[name] = tensor
    return tensors


def copy_weights(served: nn.Module, new: nn.Module) -> int:
    """Copy every tensor of ``new``'s state into ``served``'s same-named one, in place;
    ``ValueError`` (nothing copied) if one is missing or differs in shape or dtype."""
    targets = served_tensors(served)
    pairs = []
    for name, tensor in new.state_dict().items():
        target = targets.get(name)
        if target is None or target.shape != tensor.shape or target.dtype != tensor.dtype:
            found = "nothing" if target is None else f"{target.dtype} {tuple(target.shape)}"
            raise ValueError(
                f"the updated model's {name} ({tensor.dtype} {tuple(tensor.shape)}) has no "
                f"place in the served model (which holds {found} there)"
            )
        pairs.append((target, tensor))
    with torch.no_grad():
        for target, tensor in pairs:
            target.copy_(tensor, non_blocking=target.device.type == "cuda")
    if pairs and pairs[0][0].device.type == "cuda":
        torch.cuda.synchronize()  # the host copies must outlive the transfers
    return len(pairs)


def weight_digests(model: nn.Module) -> dict[str, str]:
    """sha256 of each parameter's bytes (vLLM's weight checksums), by unwrapped name."""
    params = {id(p) for p in model.parameters()}
    digests = {}
    for name, tensor in served_tensors(model).items():
        if id(tensor) in params:
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            digests[name] = hashlib.sha256(data.numpy()).hexdigest()
    return digests


class WeightUpdater:
    """One engine's weight-sync state: the group (``init``), the round in progress
    (``start`` .. ``finish``), and the tensors received so far (on the host)."""

    def __init__(
        self, runner: ModelRunner, backend: str, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        """``dp_rank`` of ``dp_size`` data-parallel engines: this engine's place in the
        trainer's group, after the trainer's ranks (vLLM's rule, one device an engine)."""
        self.runner, self.backend = runner, backend
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.group: Any = None
        self.info: WeightTransferInitInfo | None = None
        self.staged: dict[str, torch.Tensor] | None = None  # None: no round in progress
        # The weights served, as checkpoint tensors (None: not known, --load-format dummy)
        self.checkpoint: dict[str, torch.Tensor] | None = None

    def check_updatable(self) -> None:
        """``ValueError`` unless the served model's weights are dense (see module doc)."""
        model = self.runner.model
        if model is None:
            raise ValueError("the engine has no weights loaded (asleep at level 2?)")
        fmt = getattr(model, "weight_format", "fp32")
        if fmt != "fp32":
            raise ValueError(
                f"weight updates need a model served in a dense dtype; this one's weights "
                f"are {fmt} (restart with --quantization fp32, or from a dense checkpoint)"
            )
        if getattr(self.runner, "_weights_on_host", False):
            raise ValueError("the engine is asleep: wake it up before a weight update")

    def init(self, init_info: Any) -> None:
        info = WeightTransferInitInfo.parse(init_info)
        self.check_updatable()
        if self.group is not None:
            raise ValueError(
                "a weight-transfer group is open already: shutdown_weight_transfer_engine first"
            )
        if info.world_size != info.rank_offset + self.dp_size:
            engines = "one engine" if self.dp_size == 1 else f"{self.dp_size} engines (-dp)"
            raise ValueError(
                f"init_info.world_size {info.world_size} must be rank_offset "
                f"{info.rank_offset} + {engines} = {info.rank_offset + self.dp_size}: the "
                "group is the trainer's ranks and every engine (GET /get_world_size)"
            )
        rank = info.rank_offset + self.dp_rank
        start = time.monotonic()
        self.group = open_group(
            self.backend, info.master_address, info.master_port, rank,
            info.world_size, info.timeout_s, self.runner.device,
        )  # fmt: skip
        self.info = info
        self.checkpoint = self.runner.checkpoint_state()
        logger.info(
            "Weight transfer: joined %s:%d as rank %d of %d (%s, %s) in %.2f s",
            info.master_address, info.master_port, rank, info.world_size,
            self.backend, "packed" if info.packed else "unpacked", time.monotonic() - start,
        )  # fmt: skip

    def _check_group(self) -> None:
        if self.group is None:
            raise ValueError("no weight-transfer group: init_weight_transfer_engine first")

    def start(self) -> None:
        self._check_group()
        if self.staged is not None:
            raise ValueError("a weight update is in progress: finish_weight_update first")
        self.check_updatable()
        self.staged = {}

    def update(self, update_info: Any) -> None:
        """Receive one chunk of the round (its tensors arrive by broadcast meanwhile)."""
        self._check_group()
        if self.staged is None:
            raise ValueError("no weight update in progress: start_weight_update first")
        metas = parse_update_info(update_info)
        again = sorted({m.name for m in metas} & self.staged.keys())
        if again:
            raise ValueError(f"this round has received {again[:3]} already")
        info, staged = self.info, self.staged
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")

        def keep(name: str, tensor: torch.Tensor) -> None:
            staged[name] = tensor.cpu()

        start = time.monotonic()
        try:
            receive_tensors(
                self.group, metas, device, info.packed, info.packed_buffer_size_bytes,
                info.packed_num_buffers, keep,
            )  # fmt: skip
        except BaseException:
            self.staged = None  # the stream is out of step: the round is lost
            raise
        nbytes = sum(m.nbytes for m in metas)
        logger.info(
            "Weight transfer: received %d tensors (%.1f MiB) in %.2f s",
            len(metas), nbytes / 2**20, time.monotonic() - start,
        )  # fmt: skip

    def finish(self) -> None:
        """Swap the round's tensors in (see module doc); the round ends either way."""
        if self.staged is None:
            raise ValueError("no weight update in progress: start_weight_update first")
        staged, self.staged = self.staged, None
        start = time.monotonic()
        state = staged if self.checkpoint is None else {**self.checkpoint, **staged}
        new = self.runner.model_from_state(state)
        copied = copy_weights(self.runner.model, new)
        self.checkpoint = state  # the next round's base
        logger.info(
            "Weight update: %d of %d checkpoint tensors received, %d model tensors swapped "
            "in in %.2f s", len(staged), len(state), copied, time.monotonic() - start,
        )  # fmt: skip

    def shutdown(self) -> None:
        if self.staged is not None:
            raise ValueError("a weight update is in progress: finish_weight_update first")
        group, self.group, self.info = self.group, None, None
        self.checkpoint = None  # its host memory back
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()
