"""The suffix trees of Suffix Decoding: drafts worked out by hand, the native
path-compressed tree equal to the Python trie on random workloads (both equal Arctic
Inference's drafts: scripts/suffix_reference_vs_arctic.py), its invariants and memory, and
the cache's request bookkeeping."""

from __future__ import annotations

import random

import pytest

from vllm.v1.spec_decode.suffix_tree import (
    PySuffixTree,
    SuffixDecodingCache,
    make_suffix_tree,
    native_tree_class,
)

needs_native = pytest.mark.skipif(
    native_tree_class() is None, reason="native kernels not built (make kernels)"
)
TREES = [pytest.param(False, id="python"), pytest.param(True, id="native", marks=needs_native)]


@pytest.mark.parametrize("native", TREES)
def test_draft_worked_out_by_hand(native):
    tree = make_suffix_tree(24, native)
    tree.extend(0, [1, 2, 3, 1, 2, 3, 1, 2, 3])
    draft = tree.speculate([1, 2, 3, 1, 2, 3], 8, 1.0, 0.0, 0.1)
    # [1, 2, 3] occurs 3 times, twice followed by 1 2 3: each token 2/3, three allowed by
    # the match's length; longer matches occur twice, once followed (1/2 each).
    assert draft.token_ids == [1, 2, 3]
    assert draft.probs == pytest.approx([2 / 3] * 3)
    assert draft.score == pytest.approx(2.0)
    assert draft.match_len == 3
    # A factor of 2 lets the 1-token match [3] draft 2 tokens (2/3 each): 4/3 < 2.
    assert tree.speculate([3], 8, 2.0, 0.0, 0.1).token_ids == []  # no match_len < 1
    assert tree.speculate([7, 3], 8, 2.0, 0.0, 0.1).token_ids == [1, 2]
    # min_token_prob cuts where the running product drops below it.
    assert tree.speculate([7, 2, 3], 8, 5.0, 0.0, 0.5).token_ids == [1, 2, 3]
    assert tree.speculate([7, 2, 3], 8, 5.0, 0.0, 0.7).token_ids == []
    # max_spec_tokens bounds, and a match plus its draft stays within max_depth.
    assert tree.speculate([1, 2, 3, 1, 2, 3], 2, 1.0, 0.0, 0.1).token_ids == [1, 2]
    shallow = make_suffix_tree(3, native)
    shallow.extend(0, [1, 2, 3, 1, 2, 3, 1, 2, 3])
    draft = shallow.speculate([1, 2, 3], 8, 5.0, 0.0, 0.1)
    assert (draft.token_ids, draft.match_len) == ([1, 2], 1)  # [3] 1 2: the whole depth


@pytest.mark.parametrize("native", TREES)
def test_ties_follow_arctic_order(native):
    # Under [1]: [1, 2] is made first, then [1, 1], then [1, 0]; [1, 1] reaches count 2
    # first, then [1, 0]. Arctic keeps [1, 1] ahead (a child that grows goes before the
    # first sibling of its old count, here behind [1, 1]): the draft is 1, not 0.
    tree = make_suffix_tree(2, native)
    for chunk in ([1, 2], [1, 1], [0, 1], [1, 0]):
        tree.extend(0, chunk)
    assert tree.speculate([9, 1], 4, 4.0, 0.0, 0.0).token_ids == [1]
    # A shrinking count goes first among its new count: take out a sequence with a 1 0.
    tree.extend(5, [1, 0, 1, 0])  # [1, 0] now 4, [1, 1] 2
    tree.extend(6, [1, 1, 1, 1])  # [1, 1] 5
    assert tree.speculate([9, 1], 4, 4.0, 0.0, 0.0).token_ids == [1]
    tree.remove(6)  # [1, 1] back to 2, behind [1, 0] (4)
    assert tree.speculate([9, 1], 4, 4.0, 0.0, 0.0).token_ids == [0]


def _random_workload(seed: int, trees) -> int:
    """Random extends (half copies of earlier text), removals and speculations; every
    draft equal across ``trees``. Returns the non-empty drafts."""
    rng = random.Random(seed)
    vocab, depth = rng.choice([2, 3, 20]), trees[0].max_depth
    seqs: dict[int, list[int]] = {}
    nonempty = 0
    for step in range(200):
        if rng.random() < 0.07 and seqs:
            victim = rng.choice(sorted(seqs))
            for tree in trees:
                tree.remove(victim)
            del seqs[victim]
            continue
        sid = rng.randrange(6)
        if rng.random() < 0.4 and seqs:
            src = rng.choice(list(seqs.values()))
            start = rng.randrange(len(src))
            tokens = src[start : start + rng.choice([1, 3, 10])]
        else:
            tokens = [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 5]))]
        seqs.setdefault(sid, []).extend(tokens)
        for tree in trees:
            tree.extend(sid, tokens)
        native = trees[-1]
        if hasattr(native, "_tree"):
            assert native._tree.check_invariants() == "", (seed, step)
        base = rng.choice(list(seqs.values()))
        context = base[-rng.randrange(1, depth + 1) :]
        args = (context, rng.randrange(depth + 2), rng.choice([0.5, 1.0, 2.0]),
                rng.choice([0.0, 1.0]), rng.choice([0.0, 0.1, 0.4]))  # fmt: skip
        drafts = [tree.speculate(*args) for tree in trees]
        assert all(d == drafts[0] for d in drafts), (seed, step, args, drafts)
        nonempty += bool(drafts[0].token_ids)
    return nonempty


@needs_native
@pytest.mark.parametrize("depth", [2, 4, 24])
def test_native_equals_python_trie(depth):
    nonempty = sum(
        _random_workload(seed, [PySuffixTree(depth), make_suffix_tree(depth, True)])
        for seed in range(40)
    )
    assert nonempty > 200  # the drafts compared are not all empty


@needs_native
def test_native_tree_stays_compressed_and_frees_everything():
    rng = random.Random(0)
    text = [rng.randrange(5000) for _ in range(2000)]
    native, plain = make_suffix_tree(24, True), PySuffixTree(24)
    for seq_id, tokens in enumerate([text, text[500:1500] + text, text[::2]]):
        for tree in (native, plain):
            tree.extend(seq_id, tokens)  # novel text, then repeats of it
    total = 2000 + 3000 + 1000
    assert plain.num_nodes() > 10 * total  # one node per token of each suffix's path
    assert native.num_nodes() < 3 * total
    assert native._tree.check_invariants() == ""
    for seq_id in range(3):
        native.remove(seq_id)
        plain.remove(seq_id)
        assert native._tree.check_invariants() == ""  # incl. no sequence kept unread
    assert native.num_nodes() == plain.num_nodes() == 1  # the root


@pytest.mark.parametrize("native", TREES)
def test_cache_requests_and_global_tree(native):
    cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=2, native=native)
    cache.start_request("a", [5, 6, 7, 8])
    with pytest.raises(ValueError, match="already active"):
        cache.start_request("a", [1])
    # The prompt is the request's own: a drafts from it, b cannot.
    cache.start_request("b", [1, 2])
    assert cache.speculate("a", [9, 5, 6], 4).token_ids == [7, 8]
    assert cache.speculate("b", [9, 5, 6], 4).token_ids == []
    # Outputs go into the global tree, for every request, and stay after a stops.
    cache.add_active_response("a", [40, 41, 42, 43])
    cache.stop_request("a")
    assert set(cache.active_requests) == {"b"} and set(cache.cached_requests) == {"a", "b"}
    assert cache.speculate("b", [9, 40, 41], 4).token_ids == [42, 43]
    with pytest.raises(ValueError, match="not active"):
        cache.speculate("a", [40], 4)
    with pytest.raises(ValueError, match="not active"):
        cache.add_active_response("a", [1])
    # A third request evicts the oldest response (FIFO): a's outputs are gone.
    cache.start_request("c", [3])
    assert set(cache.cached_requests) == {"b", "c"}
    assert cache.speculate("b", [9, 40, 41], 4).token_ids == []
    with pytest.raises(ValueError, match="not cached"):
        cache.evict_cached_response("a")
    # The higher score wins, the request's own tree on a tie: after 60 61, b's own tree
    # drafts 62 (1); the global tree 70 60 (2/3 + 1/3), then (3/4 + 3/4) once c repeats.
    cache.add_active_response("b", [60, 61, 62])
    cache.add_active_response("c", [60, 61, 70, 60, 61, 70])
    assert cache.speculate("b", [9, 60, 61], 2).token_ids == [62]
    cache.add_active_response("c", [60, 61, 70, 60])
    assert cache.speculate("b", [9, 60, 61], 2).token_ids == [70, 60]


@pytest.mark.parametrize("native", TREES)
def test_cache_without_global_tree(native):
    cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=0, native=native)
    cache.start_request("a", [1])
    cache.add_active_response("a", [40, 41, 42])
    cache.stop_request("a")
    cache.start_request("b", [1])
    assert list(cache.cached_requests) == []
    assert cache.speculate("b", [9, 40, 41], 4).token_ids == []
