"""Sleep mode's helpers: the level-1 weight move (run on CUDA; checked here with the meta
device, which moves nothing real) and the level and tag checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm.v1.worker.sleep_mode import check_sleep_level, check_wake_up_tags, move_module_tensors


class Packed(nn.Module):
    """A quantized layer's shape: a packed weight kept as a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.qweight = torch.ones(4, 4, dtype=torch.int8)
        self.register_buffer("scale", torch.ones(4))


def test_every_tensor_moves_once_in_place():
    model = nn.Sequential(nn.Embedding(8, 4), Packed(), nn.Linear(4, 8, bias=False))
    model[2].weight = model[0].weight  # tied: one tensor
    param = model[0].weight
    moved = move_module_tensors(model, torch.device("meta"))
    assert moved == 8 * 4 * 4 + 16 + 4 * 4  # the tied weight counted once
    assert model[0].weight is param and param.device.type == "meta"  # the same Parameter
    assert model[2].weight is param
    assert model[1].qweight.device.type == "meta" and model[1].scale.device.type == "meta"
    assert move_module_tensors(model, torch.device("meta")) == 0  # nothing left to move


def test_levels_and_tags():
    for level in (0, 1, 2):
        check_sleep_level(level)
    for bad in (3, -1, True):
        with pytest.raises(ValueError, match="level"):
            check_sleep_level(bad)
    assert check_wake_up_tags(None) == ("weights", "kv_cache")
    assert check_wake_up_tags([]) == ("weights", "kv_cache")
    assert check_wake_up_tags(["kv_cache", "kv_cache"]) == ("kv_cache",)
    assert check_wake_up_tags(["scheduling"]) == ()
    with pytest.raises(ValueError, match="bogus"):
        check_wake_up_tags(["weights", "bogus"])
