"""Lookup chains as a branch of a drafted tree: prompt lookup (EAGLE's `prompt_lookup_branch`, `eagle3+ngram`: the
n-gram continuation of the sequence, as `ngram` drafts it) or suffix decoding (`suffix_branch`, `eagle3+suffix`: the
best chain of the request's suffix trie and the model's response cache, as `suffix` drafts it), per request, and
how often such chains turned out right, by position."""

from __future__ import annotations

from specserve.speculative.ngram import NGramIndex, common_prefix_length
from specserve.speculative.policy.acceptance import AcceptanceByEvidence
from specserve.speculative.suffix import SuffixProposer


class LookupBranch:
    """Prompt lookup for one request inside EAGLE trees, with the acceptance of its chains by position (the first
    token's rate and each later one's given its predecessor, as `ngram`'s draft-length choice keeps them: a chain
    right at its first token is usually right for many more), per n-gram length, judged against the tokens
    committed next whether or not the budget verified them. A request's estimates start from the method's pool."""

    def __init__(self, min_n: int, max_n: int, pool: AcceptanceByEvidence | None = None):
        self.min_n, self.max_n = min_n, max_n
        self.acceptance = AcceptanceByEvidence(pool)
        self.last: tuple[int, int, list[int]] | None = None  # (sequence length, n, chain) of the last lookup
        self.index = NGramIndex(min_n, max_n)
        self._found: tuple[tuple, tuple[int, list[int]]] | None = None  # the last lookup, by what it was asked

    def propose(self, tokens: list[int], max_len: int) -> tuple[list[int], list[float]]:
        """The continuation (empty: no n-gram recurs) and, per depth d, the chance its first d tokens are right."""
        if self.last is not None:
            start, n, chain = self.last
            committed = tokens[start:]
            self.acceptance.update(min(len(chain), len(committed)), common_prefix_length(chain, committed), n)
        n, chain = self.find(tokens, max_len)
        self.last = (len(tokens), n, chain) if chain else None
        return chain, self.acceptance[n].path_probabilities(len(chain)) if chain else []

    def has_chain(self, tokens: list[int], max_len: int) -> bool:
        """Whether a lookup finds a chain of up to `max_len` tokens to follow `tokens` now."""
        return bool(self.find(tokens, max_len)[1])

    def find(self, tokens: list[int], max_len: int) -> tuple[int, list[int]]:
        """`lookup`, done once for a step that asks twice (the draft gate's `has_chain`, then `propose`)."""
        key = (len(tokens), tokens[-1] if tokens else None, max_len)
        if self._found is None or self._found[0] != key:
            self._found = (key, self.lookup(tokens, max_len))
        return self._found[1]

    def lookup(self, tokens: list[int], max_len: int) -> tuple[int, list[int]]:
        """The chain and the bucket its accuracy is counted in (prompt lookup: the n-gram's length)."""
        return self.index.lookup(tokens, max_len)

    def request_finished(self, output: list[int]) -> None:
        """The request ended (a branch that learns across requests keeps its response)."""


class SuffixBranch(LookupBranch):
    """Suffix decoding's best chain as the branch, its accuracy counted in one bucket."""

    def __init__(self, proposer: SuffixProposer, pool: AcceptanceByEvidence | None = None):
        super().__init__(1, 1, pool)
        self.proposer = proposer

    def lookup(self, tokens: list[int], max_len: int) -> tuple[int, list[int]]:
        return 1, self.proposer.draft(tokens, max_len, chain=True).tokens

    def request_finished(self, output: list[int]) -> None:
        self.proposer.request_finished(output)
