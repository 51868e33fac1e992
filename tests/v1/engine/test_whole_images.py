"""``whole_images``: a model whose image tokens attend to each other both ways (Gemma 3)
gets every image in one prefill chunk (the scheduler's ``whole_images``): a chunk shorter
than its longest image is refused at start, naming the flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.config import SchedulerConfig
from vllm.v1.engine.core import whole_images

MODEL = SimpleNamespace(max_image_tokens=256)


@pytest.mark.parametrize(
    "fields, flag",
    [
        ({"max_num_batched_tokens": 200}, "--max-num-batched-tokens 200"),
        ({"long_prefill_token_threshold": 100}, "--long-prefill-token-threshold 100"),
    ],
)
def test_a_chunk_shorter_than_an_image_is_refused(fields, flag):
    config = SchedulerConfig(**{"max_num_batched_tokens": 2048, **fields})
    with pytest.raises(ValueError, match=f"{flag} is shorter than one image of this model"):
        whole_images(config, MODEL)
    whole_images(SchedulerConfig(max_num_batched_tokens=256), MODEL)  # exactly one image
