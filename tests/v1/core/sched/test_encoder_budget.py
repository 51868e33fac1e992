"""The step's vision-encoder budget (vLLM's ``max_num_encoder_input_tokens``, here
``max_num_batched_tokens`` image embeddings): a chunk that reaches an image the budget has
no room for stops before it; the first image of a step always runs; an image the runner
already holds (reached by an earlier chunk) costs nothing, unless the request was
preempted or is new and its prefix hit ends inside it; one image in two requests is
encoded once; ``disable_chunked_mm_input`` keeps a chunk from ending inside an image."""

from __future__ import annotations

import torch

from vllm.multimodal.inputs import MultiModalFeature

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done, step


def image(offset: int, length: int, name: str, is_embed=None) -> MultiModalFeature:
    return MultiModalFeature("image", torch.zeros(1), offset, length, name, is_embed)


def imaged(prompt_len: int, *images: MultiModalFeature, base: int = 0, **kw):
    return make_request(list(range(base, base + prompt_len)), mm_features=list(images), **kw)


def test_a_chunk_stops_before_an_image_the_budget_has_no_room_for():
    s = make_scheduler(budget=23)
    a = imaged(20, image(2, 12, "a"), max_tokens=1)
    b = imaged(20, image(2, 12, "b"), base=100, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s)
    # a's 20 tokens encode its 12; b's 3 would reach its image (24 > 23): 2 tokens.
    assert so.num_scheduled_tokens == {a.request_id: 20, b.request_id: 2}
    so, _ = step(s)
    assert so.num_scheduled_tokens[b.request_id] == 18  # its image whole, with a's decode
    run_until_done(s)


def test_the_embeddings_counted_are_the_images_not_their_markers():
    s = make_scheduler(budget=23)
    a = imaged(20, image(2, 12, "a"), max_tokens=1)
    # 12 positions, 6 of them embeddings (markers between tiles): 12 + 6 <= 23.
    b = imaged(20, image(2, 12, "b", [True, False] * 6), base=100, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 20, b.request_id: 3}


def test_the_first_image_of_a_step_runs_even_when_larger_than_the_budget():
    s = make_scheduler(budget=8)
    a = imaged(20, image(2, 12, "a"), max_tokens=1)
    b = imaged(6, image(0, 4, "b"), base=100, max_tokens=1)
    s.add_request(a)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 8}  # 12 embeddings > 8: still runs
    s.add_request(b)
    so, _ = step(s)
    # a's chunk (8..16) is inside its image, which the runner holds: no cost; b's runs.
    assert so.num_scheduled_tokens == {a.request_id: 8}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 4, b.request_id: 4}
    run_until_done(s)


def test_an_image_held_since_an_earlier_chunk_costs_nothing():
    s = make_scheduler(budget=10)
    a = imaged(14, image(4, 10, "a"), max_tokens=1)
    s.add_request(a)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 10}  # encodes a's image (10 <= 10)
    b = imaged(12, image(2, 8, "b"), base=100, max_tokens=1)
    s.add_request(b)
    so, _ = step(s)
    # a's rest (4 tokens) holds no new image: b gets the other 6 and its image's 8.
    assert so.num_scheduled_tokens == {a.request_id: 4, b.request_id: 6}
    run_until_done(s)


def test_one_image_in_two_requests_is_encoded_once():
    s = make_scheduler(budget=23)
    a = imaged(20, image(2, 12, "same"), max_tokens=1)
    b = imaged(20, image(2, 12, "same"), base=100, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 20, b.request_id: 3}


def test_a_resumed_request_pays_for_the_image_its_chunk_starts_inside():
    s = make_scheduler(budget=16)
    a = imaged(20, image(2, 12, "a"), max_tokens=1)
    s.add_request(a)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 16}
    b = imaged(8, image(2, 6, "b"), base=100, max_tokens=1)
    s.add_request(b)
    # Resumed: a's chunk starts at 4 (a prefix hit, say), inside its image: it pays 12,
    # and b's image (6) no longer fits beside it.
    num_new, images = s._encoder_inputs(a, 4, 16, step=_fresh_step(), resumed=True)
    assert (num_new, [f.identifier for f in images]) == (16, ["a"])
    step_ = _fresh_step()
    step_.encoder["a"] = images
    assert s._encoder_inputs(b, 0, 8, step_, resumed=True) == (2, [])
    # Still running, a holds its image: nothing to pay.
    assert s._encoder_inputs(a, 4, 16, _fresh_step(), resumed=False) == (16, [])
    run_until_done(s)


def _fresh_step():
    from vllm.v1.core.sched.scheduler import _Step

    return _Step()


def test_without_chunked_mm_input_a_chunk_never_ends_inside_an_image():
    s = make_scheduler(budget=8, disable_chunked_mm_input=True)
    a = imaged(20, image(6, 4, "a"), max_tokens=1)
    s.add_request(a)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 6}  # not 8: it would end in 6..10
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 8}
    # An image longer than the budget starts a step and runs across steps.
    b = imaged(20, image(3, 12, "b"), base=100, max_tokens=1)
    s2 = make_scheduler(budget=8, disable_chunked_mm_input=True)
    s2.add_request(b)
    assert step(s2)[0].num_scheduled_tokens == {b.request_id: 3}
    assert step(s2)[0].num_scheduled_tokens == {b.request_id: 8}
    run_until_done(s)
    run_until_done(s2)


def test_an_image_the_encoder_cache_holds_costs_nothing():
    s = make_scheduler(budget=23)
    s.encoder_cached = {"b"}.__contains__  # the runner's cache holds b's image
    a = imaged(20, image(2, 12, "a"), max_tokens=1)
    b = imaged(20, image(2, 12, "b"), base=100, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 20, b.request_id: 3}  # not cut to 2
    run_until_done(s)


def test_without_chunked_mm_input_a_chunk_started_inside_an_image_waits_for_room():
    """A prefix hit ending inside an image (resumed at 4 of an image at 2..12): a chunk
    that cannot reach the image's end runs nothing (the rest whole, in a later step); one
    that can runs; a rest longer than any chunk (the budget, or the long-prefill cap) is
    cut as before."""
    s = make_scheduler(budget=16, disable_chunked_mm_input=True)
    a = imaged(20, image(2, 10, "a"), max_tokens=1)
    s.add_request(a)
    assert s._encoder_inputs(a, 4, 5, _fresh_step(), resumed=True) == (0, [])
    num_new, images = s._encoder_inputs(a, 4, 8, _fresh_step(), resumed=True)
    assert (num_new, [f.identifier for f in images]) == (8, ["a"])
    capped = make_scheduler(budget=16, threshold=6, disable_chunked_mm_input=True)
    num_new, images = capped._encoder_inputs(a, 4, 6, _fresh_step(), resumed=True)
    assert (num_new, [f.identifier for f in images]) == (6, ["a"])  # 8 > the cap of 6
    # Without the flag the chunk ends inside the image.
    plain = make_scheduler(budget=16)
    assert plain._encoder_inputs(a, 4, 5, _fresh_step(), resumed=True)[0] == 5
    run_until_done(s)
