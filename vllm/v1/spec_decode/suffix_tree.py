"""Suffix trees for Suffix Decoding (vLLM's ``suffix`` method; arXiv 2411.04975).

A tree holds every suffix, cut at ``max_depth`` tokens, of the sequences given to it; a
node's ``count`` is how many times its path occurs in them. Speculation matches the last
``m`` tokens of the context (m = 1, 2, ... while they occur), walks down from that node
always to the most frequent child, each token's probability the running product of
``count(child) / count(node)``, and stops below ``min_token_prob`` or after
``min(max_spec_tokens, m * max_spec_factor + max_spec_offset)`` tokens; the draft whose
probabilities sum highest wins (a longer match on a tie). So a match plus its draft never
passes ``max_depth`` tokens. Children of equal count are ranked as Arctic Inference ranks
them (the implementation vLLM calls), so its drafts and ours are the same token for token
(``scripts/suffix_reference_vs_arctic.py``).

``SuffixDecodingCache`` keeps one tree per active request over its prompt and outputs,
and one global tree over the outputs of up to ``max_cached_requests`` requests (FIFO).

Two implementations of the tree: the native one (``csrc/cpu/suffix_tree.cpp``, a
path-compressed tree, built with the other native kernels) and ``PySuffixTree``, a plain
trie that is the reference in tests and the fallback where the kernels are not built
(about ``max_depth`` Python steps and nodes per token: slow for long prompts).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable, KeysView, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)
_f32 = np.float32


@dataclass
class SuffixDraft:
    """A speculation: ``token_ids`` with their estimated probabilities, ``score`` their
    sum, ``match_len`` the context tokens matched."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


def spec_limit(match_len: int, max_spec_tokens: int, factor: float, offset: float) -> int:
    """Tokens a match of ``match_len`` may draft (float32 product, as the native tree)."""
    scaled = float(_f32(match_len) * _f32(factor) + _f32(offset)) + 1e-6
    return max(min(max_spec_tokens, int(scaled)), 0)


class PySuffixTree:
    """A trie of every sequence's suffixes cut at ``max_depth`` tokens (one node per
    token of a path). Node 0 is the root; ``children[n]`` maps token -> node and
    ``order[n]`` lists them by rank (the root's are not ranked: no draft starts there)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.token = [-1]
        self.parent = [-1]
        self.count = [0]
        self.children: list[dict[int, int] | None] = [{}]
        self.order: list[list[int] | None] = [None]
        self._free: list[int] = []
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, deque[int]] = {}  # seq -> nodes its live suffixes end at

    def num_nodes(self) -> int:
        return len(self.token) - len(self._free)

    def _new_node(self, parent: int, token: int) -> int:
        if self._free:
            n = self._free.pop()
            self.token[n], self.parent[n], self.count[n] = token, parent, 1
            self.children[n], self.order[n] = {}, []
        else:
            n = len(self.token)
            self.token.append(token)
            self.parent.append(parent)
            self.count.append(1)
            self.children.append({})
            self.order.append([])
        self.children[parent][token] = n
        if parent != 0:
            self.order[parent].append(n)  # a new child ranks last
        return n

    def _increment(self, n: int) -> None:
        """count + 1. A child moves before the first sibling of its previous sibling's
        count when that count is its own or one more (Arctic Inference's rule: the last
        of its new count, or the first when it led its old count)."""
        count, parent = self.count, self.parent[n]
        if parent != 0:
            order = self.order[parent]
            i = order.index(n)
            if i > 0 and count[order[i - 1]] <= count[n] + 1:
                prev = count[order[i - 1]]
                head = next(j for j in range(i) if count[order[j]] == prev)
                order.insert(head, order.pop(i))
        count[n] += 1

    def _decrement(self, n: int) -> None:
        """count - 1; a child moves after the last sibling of its old count (so it is
        the first of its new count)."""
        count, parent = self.count, self.parent[n]
        if parent != 0:
            order = self.order[parent]
            i = order.index(n)
            end = i + 1
            while end < len(order) and count[order[end]] == count[n]:
                end += 1
            order.insert(end - 1, order.pop(i))
        count[n] -= 1

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new one when unknown)."""
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, deque())
        for token in tokens:
            token = int(token)
            seq.append(token)
            active.append(0)
            self.count[0] += 1
            if len(active) > self.max_depth:
                active.popleft()
            for i, node in enumerate(active):
                child = self.children[node].get(token)
                if child is None:
                    child = self._new_node(node, token)
                else:
                    self._increment(child)
                active[i] = child

    def remove(self, seq_id: int) -> None:
        """Take sequence ``seq_id``'s suffixes out of the tree (none: it has no tokens)."""
        seq = self._seqs.pop(seq_id, [])
        self._active.pop(seq_id, None)
        for start in range(len(seq)):
            self.count[0] -= 1
            node = 0
            for token in seq[start : start + self.max_depth]:
                child = self.children[node][token]
                if self.count[child] == 1:
                    del self.children[node][token]
                    if node != 0:
                        self.order[node].remove(child)
                    self._drop(child)
                    break
                self._decrement(child)
                node = child

    def _drop(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self.children[n].values())
            self.children[n] = self.order[n] = None
            self._free.append(n)

    def _match(self, context: Sequence[int]) -> int | None:
        node = 0
        for token in context:
            node = self.children[node].get(int(token))
            if node is None:
                return None
        return node

    def speculate(
        self,
        context: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float,
        max_spec_offset: float,
        min_token_prob: float,
    ) -> SuffixDraft:
        best = SuffixDraft()
        min_prob = _f32(min_token_prob)
        for match_len in range(1, len(context)):
            node = self._match(context[len(context) - match_len :])
            if node is None:
                break
            limit = spec_limit(match_len, max_spec_tokens, max_spec_factor, max_spec_offset)
            draft = SuffixDraft(match_len=match_len)
            prob, score = _f32(1.0), _f32(0.0)
            while len(draft.token_ids) < limit and prob >= min_prob and self.order[node]:
                child = self.order[node][0]
                prob = _f32(prob * (_f32(self.count[child]) / _f32(self.count[node])))
                if prob < min_prob:
                    break
                draft.token_ids.append(self.token[child])
                draft.probs.append(float(prob))
                score = _f32(score + prob)
                node = child
            draft.score = float(score)
            if draft.score >= best.score:
                best = draft
        return best


class NativeSuffixTree:
    """The native path-compressed tree behind the same methods as ``PySuffixTree``."""

    def __init__(self, cls, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._tree = cls(max_depth)

    def num_nodes(self) -> int:
        return self._tree.num_nodes()

    def extend(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> None:
        self._tree.extend(seq_id, _as_tensor(tokens))

    def remove(self, seq_id: int) -> None:
        self._tree.remove(seq_id)

    def speculate(
        self,
        context: Sequence[int] | np.ndarray,
        max_spec_tokens: int,
        max_spec_factor: float,
        max_spec_offset: float,
        min_token_prob: float,
    ) -> SuffixDraft:
        tokens, probs, score, match_len = self._tree.speculate(
            _as_tensor(context), max_spec_tokens, max_spec_factor, max_spec_offset,
            min_token_prob,
        )  # fmt: skip
        return SuffixDraft(list(tokens), list(probs), score, match_len)


def _as_tensor(tokens: Sequence[int] | np.ndarray) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        return tokens.to(torch.int32).contiguous()
    return torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32))


def native_tree_class():
    """The native ``SuffixTree`` class, or None where the kernels are not built."""
    from vllm import _custom_ops

    if _custom_ops.has_native_kernels():
        try:
            return torch.classes.vllm_continuum_C.SuffixTree
        except (AttributeError, RuntimeError):  # a build from before the class
            return None
    return None


def make_suffix_tree(max_depth: int, native: bool | None = None):
    """A tree: the native one when built (or when ``native`` asks for it), else Python."""
    cls = native_tree_class() if native is not False else None
    if native and cls is None:
        raise RuntimeError("the native suffix tree is not built")
    return NativeSuffixTree(cls, max_depth) if cls is not None else PySuffixTree(max_depth)


class SuffixDecodingCache:
    """The request trees and the global tree of past outputs.

    Contract: a request is *active* from ``start_request`` to ``stop_request``; its prompt
    and outputs are in its own tree meanwhile. Its outputs also go into the global tree
    (when ``max_cached_requests`` is not 0), where they stay after it stops until evicted:
    past ``max_cached_requests`` the oldest other request's go first (-1: no limit)."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int, native: bool | None = None):
        if max_cached_requests < -1:
            raise ValueError(f"max_cached_requests must be >= -1, got {max_cached_requests}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self._native = native
        self._global = make_suffix_tree(max_tree_depth, native)
        # Tokens go to two trees: the native ones take them converted once.
        self._tokens = _as_tensor if isinstance(self._global, NativeSuffixTree) else list
        self._local: dict[Hashable, PySuffixTree | NativeSuffixTree] = {}
        self._seq_of: dict[Hashable, int] = {}  # insertion order = FIFO eviction order
        self._next_seq = 0
        if isinstance(self._global, PySuffixTree):
            logger.warning(
                "Suffix decoding runs its Python suffix tree (the native kernels are not "
                "built): slow for long prompts; `python -m vllm._custom_ops --build` builds it"
            )

    @property
    def active_requests(self) -> KeysView:
        return self._local.keys()

    @property
    def cached_requests(self) -> KeysView:
        return self._seq_of.keys()

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int] | np.ndarray) -> None:
        if req_id in self._local:
            raise ValueError(f"request {req_id!r} is already active")
        tree = make_suffix_tree(self.max_tree_depth, self._native)
        tree.extend(0, prompt_token_ids)
        self._local[req_id] = tree
        if self.max_cached_requests != 0:
            if req_id in self._seq_of:
                self.evict_cached_response(req_id)
            self._seq_of[req_id] = self._next_seq
            self._next_seq += 1
            while 0 < self.max_cached_requests < len(self._seq_of):
                self.evict_cached_response(next(iter(self._seq_of)))

    def stop_request(self, req_id: Hashable) -> None:
        if self._local.pop(req_id, None) is None:
            raise ValueError(f"request {req_id!r} is not active")

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> None:
        tree = self._local.get(req_id)
        if tree is None:
            raise ValueError(f"request {req_id!r} is not active")
        token_ids = self._tokens(token_ids)
        tree.extend(0, token_ids)
        if req_id in self._seq_of:
            self._global.extend(self._seq_of[req_id], token_ids)

    def evict_cached_response(self, req_id: Hashable) -> None:
        seq = self._seq_of.pop(req_id, None)
        if seq is None:
            raise ValueError(f"request {req_id!r} is not cached")
        self._global.remove(seq)

    def speculate(
        self,
        req_id: Hashable,
        context: Sequence[int] | np.ndarray,
        max_spec_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> SuffixDraft:
        """The better of the request's own tree's draft and the global tree's (the own
        tree's on a tie) for the context's last ``max_tree_depth`` tokens."""
        tree = self._local.get(req_id)
        if tree is None:
            raise ValueError(f"request {req_id!r} is not active")
        context = self._tokens(context[max(len(context) - self.max_tree_depth, 0) :])
        args = (context, max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob)
        own = tree.speculate(*args)
        other = self._global.speculate(*args)
        return own if own.score >= other.score else other
