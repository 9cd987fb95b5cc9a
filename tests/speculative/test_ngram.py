"""Prompt lookup: the n-gram matcher and its bounds."""

from __future__ import annotations

import pytest

from specserve.speculative.ngram import NGramMethod, longest_ngram_continuation


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


def test_ngram_method_validates_its_bounds():
    with pytest.raises(ValueError):
        NGramMethod(3, 2)
    with pytest.raises(ValueError):
        NGramMethod(0, 2)
