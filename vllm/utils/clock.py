"""Injected clocks (defined in the engine-agnostic ``vllm_continuum.clock``)."""

from vllm_continuum.clock import Clock, FakeClock, monotonic_clock

__all__ = ["Clock", "FakeClock", "monotonic_clock"]
