"""Prompt lookup: the n-gram matcher and its bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.speculative.ngram import NGramIndex, NGramMethod


def longest_ngram_continuation(tokens: list[int], max_len: int, min_n: int, max_n: int) -> list[int]:
    """One lookup on a fresh index."""
    return NGramIndex(min_n, max_n).lookup(tokens, max_len)[1]


def ngram_lookup(tokens: list[int], max_len: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """The reference: a tensor scan of the whole context for each n, longest first (what prompt lookup ran on
    before the index)."""
    length = len(tokens)
    if max_len <= 0 or length < min_n + 1:
        return 0, []
    seq = torch.tensor(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = seq[:-1].unfold(0, n, 1)  # n-grams that end before the last token, so a continuation exists
        hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            draft = []  # copied from `start` on; past the end, from the draft itself when the match is a loop's
            for at in range(start, start + max_len):
                if at < length:
                    draft.append(tokens[at])
                elif length - start <= n:
                    draft.append(draft[at - length])
            return n, draft
    return 0, []


def test_ngram_prefers_the_longest_match():
    tokens = [5, 6, 7, 1, 2, 6, 7, 8, 9, 4, 6, 7]
    # the 2-gram [6, 7] occurs twice; the most recent earlier occurrence is followed by 8, 9, 4
    assert longest_ngram_continuation(tokens, 3, 1, 3) == [8, 9, 4]
    # now the 3-gram [6, 7, 8] recurs and wins over the 1- and 2-grams
    assert longest_ngram_continuation(tokens + [8], 2, 1, 3) == [9, 4]


def test_ngram_respects_bounds_and_misses():
    assert longest_ngram_continuation([1, 2, 3, 4], 5, 1, 3) == []  # nothing recurs
    assert longest_ngram_continuation([1, 2, 1], 5, 2, 3) == []  # only a 1-gram recurs, min_n is 2
    assert longest_ngram_continuation([1, 2, 1], 5, 1, 3) == [2, 1]
    assert longest_ngram_continuation([1, 2, 3, 1, 2], 1, 1, 3) == [3]
    assert longest_ngram_continuation([1, 2, 3, 1, 2], 0, 1, 3) == []
    assert longest_ngram_continuation([7], 3, 1, 3) == []


def test_ngram_continues_a_loop_it_has_seen_repeat():
    # "4 4 4" last occurred one token back: it is followed by one 4, and the loop goes on
    assert longest_ngram_continuation([9, 4, 4, 4, 4], 5, 1, 3) == [4, 4, 4, 4, 4]
    # period 2: the last 3-gram [7, 8, 7] occurred two tokens back
    assert longest_ngram_continuation([1, 7, 8, 7, 8, 7], 5, 1, 3) == [8, 7, 8, 7, 8]
    assert longest_ngram_continuation([1, 7, 8, 7, 8, 7], 3, 1, 3) == [8, 7, 8]
    # a match further back than its own length is no loop yet: what followed it, up to the end
    assert longest_ngram_continuation([5, 6, 7, 5], 5, 1, 3) == [6, 7, 5]
    assert longest_ngram_continuation([1, 2, 1], 5, 1, 1) == [2, 1]


def test_ngram_method_validates_its_bounds():
    with pytest.raises(ValueError):
        NGramMethod(3, 2)
    with pytest.raises(ValueError):
        NGramMethod(0, 2)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=60), chunks=st.lists(st.integers(1, 6), max_size=30),
       bounds=st.tuples(st.integers(1, 3), st.integers(0, 2)), max_len=st.integers(0, 5))
def test_the_index_equals_the_scan_as_the_context_grows(tokens, chunks, bounds, max_len):
    """The incremental index (a request's proposer) gives the tensor scan's answer after every step, whatever the
    steps' sizes; a context that is not the last one grown is indexed anew."""
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    index, end = NGramIndex(min_n, max_n), 0
    for size in chunks + [len(tokens)]:
        end = min(end + size, len(tokens))
        assert index.lookup(tokens[:end], max_len) == ngram_lookup(tokens[:end], max_len, min_n, max_n)
    other = [t + 1 for t in tokens]
    assert index.lookup(other, max_len) == ngram_lookup(other, max_len, min_n, max_n)
    assert index.lookup(tokens[:len(tokens) // 2], max_len) == ngram_lookup(tokens[:len(tokens) // 2], max_len,
                                                                           min_n, max_n)
