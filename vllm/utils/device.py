"""Host values onto the device, and device values back, without waiting for it.

On CUDA a plain copy from pageable host memory (``torch.tensor(values, device="cuda")``,
``host.to("cuda")``) synchronizes the stream: the host waits until every kernel queued
before it has run. In a step that follows one still on the device (--async-scheduling),
each such copy throws the overlap away. These go through page-locked memory with
``non_blocking=True`` instead, as vLLM's runner does with its pinned buffers; torch's
caching host allocator keeps a pinned block until the copy out of it has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def pinned(host: torch.Tensor) -> torch.Tensor:
    """``host`` in page-locked memory where CUDA is present (a source that a
    ``copy_(..., non_blocking=True)`` to the device does not wait on); else ``host``."""
    return host.pin_memory() if torch.cuda.is_available() else host


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` in one copy: from pinned memory without blocking on CUDA;
    ``host`` itself on the CPU."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = pinned(host)
    return host.to(device, non_blocking=True)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without waiting for the
    device (``upload``). Built through numpy: the same values (Python floats rounded to
    ``dtype`` once), and a host array, not a host tensor made from nothing."""
    return upload(torch.from_numpy(np.asarray(values)).to(dtype), torch.device(device))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor ``t`` on the host without waiting for the device: into
    page-locked memory where CUDA is present, queued behind the work before it, so read
    it only after an event recorded later (--async-scheduling's deferred steps);
    ``t`` itself when it is on the CPU."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    return host
