"""Prompt lookup (n-gram) speculation: the draft is what followed the latest earlier occurrence of the sequence's
longest recurring suffix n-gram, continued as a loop where the text has just repeated. No model, no training; it
pays where outputs copy their prompt (code, edits) or themselves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specserve.checks import ConfigError, int_at_least
from specserve.speculative.base import DraftKind, MethodEntry, MethodOptions, Proposal, Proposer, SpecMethod


class NGramIndex:
    """Prompt lookup over one request's growing context, in time proportional to the tokens added since the last
    call rather than to the whole context (a step looks up twice per request, its draft and its shadow draft). For each n it keeps, per n-gram, the
    position after its latest occurrence that ends before the last token. The context may only grow between
    calls; one that does not (shorter, or another last indexed token) is indexed anew."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._start_over()

    def _start_over(self) -> None:
        self.follows: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.ends = 0  # n-grams ending at tokens[0 .. ends - 1] are indexed
        self.last: int | None = None  # tokens[ends - 1] when they were indexed

    def lookup(self, tokens: list[int], max_len: int) -> tuple[int, list[int]]:
        """(n, continuation): the tokens that followed the most recent earlier occurrence of the longest suffix
        n-gram (max_n down to min_n) of `tokens`, at most max_len of them, and that n; (0, []) if none recurs.
        A match at most n tokens back (the text has just repeated) is continued as a loop: `loop_continuation`."""
        self._index(tokens)
        length = len(tokens)
        if max_len <= 0 or length < self.min_n + 1:
            return 0, []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.follows[n].get(tuple(tokens[length - n:]))
            if start is not None:
                return n, loop_continuation(tokens, start, n, max_len)
        return 0, []

    def _index(self, tokens: list[int]) -> None:
        if self.ends and (len(tokens) < self.ends or tokens[self.ends - 1] != self.last):
            self._start_over()
        for end in range(self.ends, len(tokens) - 1):  # an n-gram ending at the last token has no continuation
            for n, follows in self.follows.items():
                if end + 1 >= n:
                    follows[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.ends = max(self.ends, len(tokens) - 1)
        self.last = tokens[self.ends - 1] if self.ends else None


def loop_continuation(tokens: list[int], start: int, n: int, max_len: int) -> list[int]:
    """Up to max_len tokens from tokens[start], where an n-gram ending at start - 1 equals the last n tokens. The
    latest match of text in a loop of period p lies p tokens back, so it is followed by p tokens only (one in
    "x x x x"). When p <= n the last n + p tokens already repeat with period p, and the draft goes on repeating
    them (draft[j] = draft[j - p], the copy overlapping itself) up to max_len; a match further back keeps what
    followed it."""
    period = len(tokens) - start
    if period > n:
        return tokens[start:start + max_len]
    return [tokens[start + j % period] for j in range(max_len)]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class NGramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int):
        self.index = NGramIndex(min_n, max_n)

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        # a longer matched n-gram is a surer continuation (docs/design-notes.md): drafts are priced per n
        n, draft = self.index.lookup(tokens, max_len)
        return Proposal.chain(tokens[-1], draft, evidence=n)


class NGramMethod(SpecMethod):
    name = "ngram"
    draft_kind = DraftKind.LOOKUP

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3):
        check_lookup_bounds(prompt_lookup_min, prompt_lookup_max, ValueError)
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return NGramProposer(self.min_n, self.max_n)


def check_lookup_bounds(min_n: int, max_n: int, error=ConfigError) -> None:
    if not 1 <= min_n <= max_n:
        raise error(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")


LOOKUP_KEYS = frozenset({"prompt_lookup_min", "prompt_lookup_max", "max_matching_ngram_size"})


def read_lookup_bounds(settings: dict) -> dict:
    """prompt_lookup_min / prompt_lookup_max (TRT-LLM's NGram spells the latter max_matching_ngram_size)."""
    out = {}
    for key, spellings in (("prompt_lookup_min", ("prompt_lookup_min",)),
                           ("prompt_lookup_max", ("prompt_lookup_max", "max_matching_ngram_size"))):
        given = next((k for k in spellings if k in settings), None)
        if given is not None:
            out[key] = int_at_least(settings[given], given)
    return out


@dataclass
class NGramOptions(MethodOptions):
    prompt_lookup_min: int = 1  # the shortest n-gram to match
    prompt_lookup_max: int = 5  # the longest n-gram to match (the longest match drafts: a surer continuation)
    KEYS: ClassVar[frozenset[str]] = LOOKUP_KEYS

    @classmethod
    def read(cls, settings: dict) -> dict:
        return read_lookup_bounds(settings)

    def check(self) -> None:
        check_lookup_bounds(self.prompt_lookup_min, self.prompt_lookup_max)


NGRAM = MethodEntry(NGramMethod.name, NGramOptions, lambda o, target: NGramMethod(o.prompt_lookup_min, o.prompt_lookup_max),
                    aliases=("prompt_lookup",), trtllm="NGram", vllm=("ngram", "[ngram]"), adaptive_draft_cap=6)
