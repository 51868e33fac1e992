"""A pretend ``cuda:0`` with real values, for CPU-only tests of device placement.

torch's FakeTensorMode fakes CUDA tensors on a CPU-only build but has no values, so code
that copies results to the host (``.tolist()``, ``int(t)``) cannot run under it. Here the
data stays on the CPU and is computed for real, while ``FakeDevice`` (a TorchFunctionMode)
reports the tensors made with ``FakeDevice.tensor`` and everything computed from them as
living on ``cuda:0``, and raises ``DeviceMismatch`` where eager CUDA raises:

- an op mixing a device tensor with a host tensor of one or more dimensions (a host 0-dim
  tensor is a scalar and mixes; index tensors of ``[]`` may stay on the host, as in eager);
  ``cat``/``stack``/``searchsorted`` take no host tensor at all, 0-dim or not;
- a random draw whose generator is on the other device (``FakeDevice.generator`` makes a
  CPU generator that stands for one on the device);
- ``.numpy()`` of a device tensor.

It also records every tensor made from nothing on the host (``host_tensors``: a factory
call without ``device=``), which on a GPU would be a host tensor plus a copy, or a
mismatch. ``torch.from_numpy`` is exempt: host data by definition. And it records every
copy of host data to the device that CUDA makes the host wait for (``blocking_uploads``):
``torch.tensor(data, device="cuda")``, ``host.to("cuda")`` or ``.cuda()`` without
``non_blocking=True``, ``device_tensor.copy_(host)`` likewise, and indexing a device tensor
with a Python list or a host index tensor (eager copies the index up the same way). From
pageable memory such a copy synchronizes the stream, which --async-scheduling cannot
afford (``vllm/utils/device.py``). Every read that makes the host wait for a device value
goes to ``device_reads``: ``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()`` of a
device tensor, a copy of one to the host without ``non_blocking=True``, and the ops whose
output shape depends on device values (``nonzero``, one-argument ``where``, boolean-mask
indexing, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without
``output_size``). These are the operations torch's CUDA sync debug mode
(``torch.cuda.set_sync_debug_mode``) reports.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

DEVICE = torch.device("cuda", 0)
HOST = torch.device("cpu")
_STRICT = {torch.cat, torch.concat, torch.stack, torch.searchsorted}  # no 0-dim exemption
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_TRANSFERS = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_}
_NO_HOST_RECORD = {torch.from_numpy}
_READS = {  # a device value read on the host
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__complex__,
}  # fmt: skip
_SHAPE_FROM_VALUES = {  # the output's size is read from the device first
    torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
    torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
    torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.bincount,
    torch.Tensor.bincount,
}  # fmt: skip


class OnDevice(torch.Tensor):
    """A CPU tensor that ``FakeDevice`` treats as living on ``cuda:0``."""

    __torch_function__ = torch._C._disabled_torch_function_impl


class DeviceMismatch(RuntimeError):
    """What eager CUDA would have raised."""


def _on(t: object) -> bool:
    return isinstance(t, OnDevice)


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    return (x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor))


def _is_cuda(value: object) -> bool:
    device = _as_device(value)
    return device is not None and device.type == "cuda"


def _as_device(value: object) -> torch.device | None:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:  # a string that is no device (e.g. a memory format)
            return None
    return None


class FakeDevice(TorchFunctionMode):
    """``with FakeDevice() as dev:`` run code on ``dev.tensor(...)`` inputs (see module)."""

    def __init__(self) -> None:
        super().__init__()
        self._device_generators: set[int] = set()
        self.host_tensors: list[str] = []  # "func at file:line" of host-made tensors
        self.blocking_uploads: list[str] = []  # "func at file:line" of waiting copies
        self.device_reads: list[str] = []  # "func at file:line" of reads that wait

    # -- inputs ---------------------------------------------------------------------------
    @staticmethod
    def tensor(t: torch.Tensor) -> OnDevice:
        """A copy of host tensor ``t`` on the pretend device."""
        return t.detach().clone().as_subclass(OnDevice)

    def generator(self, seed: int) -> torch.Generator:
        """A generator that stands for ``torch.Generator(device="cuda")``: a random draw
        with it must be on the device (it really draws on the CPU, so values match a CPU
        generator of the same seed)."""
        g = torch.Generator().manual_seed(seed)
        self._device_generators.add(id(g))
        return g

    # -- the mode -------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.device:  # naming a device is not placing anything on it
            return func(*args, **kwargs)
        if func == torch.Tensor.device.__get__:
            return DEVICE if _on(args[0]) else args[0].device
        if func == torch.Tensor.is_cuda.__get__:
            return _on(args[0])
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and _on(args[0]):
            raise DeviceMismatch("can't convert cuda:0 device type tensor to numpy")
        if self._reads_device(func, args, kwargs):
            self._record(func, self.device_reads)
        target = self._target(func, args, kwargs)
        if target == DEVICE and self._uploads_blocking(func, args, kwargs):
            self._record(func, self.blocking_uploads)
        self._check_generator(kwargs.get("generator"), target)
        kwargs = {k: (HOST if k == "device" else v) for k, v in kwargs.items()}
        args = tuple(HOST if _is_cuda(a) else a for a in args)
        out = func(*args, **kwargs)
        if func in _TRANSFERS and func is not torch.Tensor.copy_:
            out = out.clone() if out is args[0] else out  # a transfer copies
        if isinstance(out, torch.Tensor) and target == HOST and func not in _NO_HOST_RECORD:
            if next(_tensors((args, kwargs)), None) is None:
                self._record(func)
        return pytree.tree_map(lambda x: self._wrap(x, target), out)

    def _target(self, func, args: tuple, kwargs: dict) -> torch.device:
        """The device of ``func``'s result; raises where eager CUDA would."""
        if func in _TRANSFERS:
            if func is torch.Tensor.cuda:
                return DEVICE
            if func is torch.Tensor.cpu:
                return HOST
            if func is torch.Tensor.copy_:  # copies across devices; keeps its own
                return DEVICE if _on(args[0]) else HOST
            for a in (*args[1:], kwargs.get("device")):
                if isinstance(a, torch.Tensor):
                    return DEVICE if _on(a) else HOST
                if _as_device(a) is not None:
                    return DEVICE if _as_device(a).type == "cuda" else HOST
            return DEVICE if _on(args[0]) else HOST
        if kwargs.get("device") is not None:
            return DEVICE if _is_cuda(kwargs["device"]) else HOST
        if func in _INDEXING:
            return self._check_indexing(func, args)
        tensors = list(_tensors((args, kwargs)))
        if not any(map(_on, tensors)):
            return HOST
        host = [t for t in tensors if not _on(t) and (t.dim() > 0 or func in _STRICT)]
        if host:
            raise DeviceMismatch(
                f"{_name(func)}: expected all tensors on the same device, found cuda:0 and "
                f"cpu (a host tensor of shape {tuple(host[0].shape)})"
            )
        return DEVICE

    @staticmethod
    def _reads_device(func, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` makes the host wait for a value on the device."""
        first = args[0] if args else None
        if func in _READS or func in _SHAPE_FROM_VALUES:
            return _on(first)
        if func is torch.where and len(args) + len(kwargs) == 1:
            return _on(first)
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return _on(repeats) and kwargs.get("output_size") is None
        if func in _INDEXING and _on(first):  # a boolean mask: its nonzero first
            return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1]))
        if func in _TRANSFERS and not kwargs.get("non_blocking", False):
            if func is torch.Tensor.copy_:
                return not _on(first) and _on(args[1])
            if func is torch.Tensor.cpu:
                return _on(first)
            if func is torch.Tensor.to and _on(first):
                devices = [_as_device(a) for a in (*args[1:], kwargs.get("device"))]
                return any(d is not None and d.type == "cpu" for d in devices)
        return False

    @staticmethod
    def _uploads_blocking(func, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` (its result on the device) copies host data there and waits."""
        if func in _INDEXING:  # a list or a host tensor as an index goes up first
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(
                isinstance(i, list) or (isinstance(i, torch.Tensor) and not _on(i) and i.dim())
                for i in index
            )
        if func in (torch.tensor, torch.as_tensor):
            return not _on(args[0]) if isinstance(args[0], torch.Tensor) else True
        if func in _TRANSFERS and func is not torch.Tensor.cpu:
            source = args[1] if func is torch.Tensor.copy_ else args[0]
            return not _on(source) and not kwargs.get("non_blocking", False)
        return False

    @staticmethod
    def _check_indexing(func, args: tuple) -> torch.device:
        """``t[idx]`` / ``t[idx] = v``: host index tensors are fine on a device tensor (as in
        eager); device indices on a host tensor are not; an assigned value must be on
        ``t``'s device or be 0-dim."""
        target = DEVICE if _on(args[0]) else HOST
        if target == HOST and any(map(_on, _tensors(args[1]))):
            raise DeviceMismatch("indices on cuda:0 for a cpu tensor")
        if func is torch.Tensor.__setitem__ and isinstance(args[2], torch.Tensor):
            value = args[2]
            if _on(value) != (target == DEVICE) and value.dim() > 0:
                raise DeviceMismatch(f"assigning a {value.device} value into a {target} tensor")
        return target

    def _check_generator(self, generator: object, target: torch.device) -> None:
        if not isinstance(generator, torch.Generator):
            return
        on_device = id(generator) in self._device_generators
        if on_device != (target == DEVICE):
            gen = "cuda" if on_device else "cpu"
            raise DeviceMismatch(
                f"Expected a '{target.type}' device type for generator but found '{gen}'"
            )

    def _record(self, func, into: list[str] | None = None) -> None:
        frame = next(
            (f for f in reversed(traceback.extract_stack()[:-2]) if "/vllm/" in f.filename),
            None,
        )
        where = f" at {frame.filename.split('/vllm/')[-1]}:{frame.lineno}" if frame else ""
        (self.host_tensors if into is None else into).append(f"{_name(func)}{where}")

    @staticmethod
    def _wrap(x: object, target: torch.device) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        if target == DEVICE:
            return x if _on(x) else x.as_subclass(OnDevice)
        return x.as_subclass(torch.Tensor) if _on(x) else x


def _name(func) -> str:
    return getattr(func, "__name__", None) or repr(func)
