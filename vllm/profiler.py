"""torch.profiler on demand (vLLM's --profiler-config, /start_profile, /stop_profile).

One ``TorchProfiler`` per process that is profiled: the engine core (its steps: the CPU,
and the CUDA kernels on a GPU) and each API server (its CPU). ``start`` begins
recording, ``stop`` ends it and writes a Chrome trace (``chrome://tracing``, Perfetto)
into the configured folder, named after the process and the time; a second ``start`` or
a ``stop`` with nothing recording does nothing but say so.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class TorchProfiler:
    def __init__(self, options: dict[str, Any], name: str) -> None:
        """``options``: ``ProfilerConfig.options``; ``name``: the trace files' prefix (the
        process: ``engine_core``, ``api_server``)."""
        self.options = options
        self.name = name
        self._profile: Any = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> bool:
        """Begin recording; False (and a warning) if it already is."""
        if self._profile is not None:
            logger.warning("%s: the profiler is already recording", self.name)
            return False
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        o = self.options
        self._profile = profile(
            activities=activities,
            record_shapes=o["torch_profiler_record_shapes"],
            profile_memory=o["torch_profiler_with_memory"],
            with_stack=o["torch_profiler_with_stack"],
            with_flops=o["torch_profiler_with_flops"],
        )
        self._profile.start()
        logger.info("%s: profiling started", self.name)
        return True

    def stop(self) -> Path | None:
        """End recording and write the trace: its path, or None (and a warning) if nothing
        was recording."""
        if self._profile is None:
            logger.warning("%s: the profiler is not recording", self.name)
            return None
        profile, self._profile = self._profile, None
        profile.stop()
        folder = Path(self.options["torch_profiler_dir"])
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = folder / f"{self.name}-{os.getpid()}-{stamp}-{time.monotonic_ns()}.pt.trace.json"
        if self.options["torch_profiler_use_gzip"]:
            path = path.with_name(path.name + ".gz")
        # Written under a temporary name and renamed: a reader never sees half a trace.
        part = path.with_name(path.name + ".part")
        raw = part.with_name(part.name + ".json")
        profile.export_chrome_trace(str(raw))
        if self.options["torch_profiler_use_gzip"]:
            with open(raw, "rb") as src, gzip.open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
        else:
            raw.rename(part)
        part.rename(path)
        logger.info("%s: profile written to %s", self.name, path)
        return path
