"""Suffix decoding draft tokens for speculative decoding (vLLM's ``suffix`` method, after
Suffix Decoding, arXiv 2411.04975).

Where n-gram lookup copies what followed the sequence's last n tokens once, suffix
decoding keeps suffix trees with counts: one over the request's own prompt and output
(local), and one over the responses of up to ``suffix_decoding_max_cached_requests``
past requests (global). The sequence's last tokens (at most the tree depth) are matched
in both, and the continuation taken is the likeliest by those counts, token by token
while its estimated probability stays at least ``suffix_decoding_min_token_prob``, and
at most ``suffix_decoding_max_spec_factor`` tokens per matched token. So an agent's
repeated commands, file contents and answers across turns and across requests are
drafted, with as many tokens a step as the match supports.

As n-gram lookup, drafts are proposed in the scheduler, on the host; the runner checks
them the same way. The trees themselves are ``vllm.v1.spec_decode.suffix_tree``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.config import SpeculativeConfig


class SuffixDecodingProposer:
    """A ``SuffixDecodingCache`` fed each request's tokens, and the drafts it proposes.

    Invariant: a request id is in ``cache.active_requests`` iff it is in ``_num_appended``,
    whose value is how many of the request's tokens (prompt and outputs) the cache holds.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> None:
        self.k = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # Imported here: the trees load only for the method that uses them.
        from vllm.v1.spec_decode.suffix_tree import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth, max_cached_requests)
        self._num_appended: dict[str, int] = {}

    @classmethod
    def from_config(cls, spec: SpeculativeConfig) -> SuffixDecodingProposer:
        return cls(
            spec.num_speculative_tokens,
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
        )

    def propose(
        self, req_id: str, token_ids: Sequence[int], limit: int, num_prompt_tokens: int
    ) -> list[int]:
        """At most ``min(k, limit)`` drafts for the request whose known tokens are
        ``token_ids`` (its first ``num_prompt_tokens`` the prompt). Every call first
        adds the tokens the cache lacks: the first builds the request's tree over its
        prompt, later ones append the outputs since (also when no drafts are asked for);
        a sequence shorter than the cache holds starts the request anew."""
        total = len(token_ids)
        appended = self._num_appended.get(req_id)
        if appended is not None and total < appended:  # not the sequence the cache holds
            self.forget(req_id)
            appended = None
        if appended is None:
            if req_id in self.cache.cached_requests:  # its old response (reused id) goes
                self.cache.evict_cached_response(req_id)
            self.cache.start_request(req_id, token_ids[:num_prompt_tokens])
            appended = num_prompt_tokens
        if total > appended:
            self.cache.add_active_response(req_id, token_ids[appended:total])
        self._num_appended[req_id] = total
        k = min(self.k, limit)
        if k < 1:
            return []
        draft = self.cache.speculate(
            req_id,
            token_ids[max(0, total - self.max_tree_depth) : total],
            max_spec_tokens=k,
            max_spec_factor=self.max_spec_factor,
            min_token_prob=self.min_token_prob,
        )
        return list(draft.token_ids[:k])

    def forget(self, req_id: str) -> None:
        """The request finished: its tree goes; its response stays in the global tree
        (until evicted, or until the id is reused)."""
        if self._num_appended.pop(req_id, None) is not None:
            self.cache.stop_request(req_id)
