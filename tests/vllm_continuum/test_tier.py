"""The automatic KV tier's size: one rule for both engines."""

import pytest

from vllm_continuum.tier import auto_tier_bytes, available_host_memory

GIB = 2**30


def test_sixteen_pools_at_most_half_the_free_host_memory():
    assert auto_tier_bytes(GIB, 64 * GIB) == 16 * GIB  # the pool bounds it
    assert auto_tier_bytes(4 * GIB, 64 * GIB) == 32 * GIB  # half the host bounds it
    assert auto_tier_bytes(0, 64 * GIB) == 0


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError, match="negative"):
        auto_tier_bytes(-1, GIB)


def test_available_host_memory_is_read():
    assert 0 < available_host_memory() < 2**50
