"""Lookup chains as a branch of a drafted tree: prompt lookup (EAGLE's `prompt_lookup_branch`, `eagle3+ngram`: the
n-gram continuation of the sequence, as `ngram` drafts it) or suffix decoding (`suffix_branch`, `eagle3+suffix`: the
best chain of the request's suffix trie and the model's response cache, as `suffix` drafts it), per request, and
how often such chains turned out right."""

from __future__ import annotations

from specserve.speculative.ngram import NGramIndex, common_prefix_length
from specserve.speculative.suffix import SuffixProposer


class LookupBranch:
    """Prompt lookup for one request inside EAGLE trees, with its running accuracy per n-gram length: of the
    lookup tokens whose predecessors were right, how many the target then produced (judged against the tokens
    committed next, whether or not the budget verified them)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.right = {n: 1.0 for n in range(min_n, max_n + 1)}  # a prior of 1 right in 2
        self.judged = {n: 2.0 for n in range(min_n, max_n + 1)}
        self.last: tuple[int, int, list[int]] | None = None  # (sequence length, n, chain) of the last lookup
        self.index = NGramIndex(min_n, max_n)

    def propose(self, tokens: list[int], max_len: int) -> tuple[list[int], float]:
        """The continuation (empty: no n-gram recurs) and its per-token accuracy estimate."""
        if self.last is not None:
            start, n, chain = self.last
            committed = tokens[start:]
            right = common_prefix_length(chain, committed)
            self.right[n] += right
            self.judged[n] += min(len(chain), right + 1, len(committed))
        n, chain = self.lookup(tokens, max_len)
        self.last = (len(tokens), n, chain) if chain else None
        return chain, (self.right[n] / self.judged[n] if chain else 0.0)

    def lookup(self, tokens: list[int], max_len: int) -> tuple[int, list[int]]:
        """The chain and the bucket its accuracy is counted in (prompt lookup: the n-gram's length)."""
        return self.index.lookup(tokens, max_len)

    def request_finished(self, output: list[int]) -> None:
        """The request ended (a branch that learns across requests keeps its response)."""


class SuffixBranch(LookupBranch):
    """Suffix decoding's best chain as the branch, its accuracy counted in one bucket."""

    def __init__(self, proposer: SuffixProposer):
        super().__init__(1, 1)
        self.proposer = proposer

    def lookup(self, tokens: list[int], max_len: int) -> tuple[int, list[int]]:
        return 1, self.proposer.draft(tokens, max_len, chain=True).tokens

    def request_finished(self, output: list[int]) -> None:
        self.proposer.request_finished(output)
