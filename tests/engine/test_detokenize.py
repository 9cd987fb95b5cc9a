"""The incremental detokenizer gives, after every step, exactly the full decode of the ids so far: for a byte-level
BPE (the tiny test models'), a SentencePiece model with byte fallback (llama2.c's) and Gemma's tokenizer (the
embedded default), with multi-byte characters split across steps. And the stop handling built on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from specserve.engine.output import IncrementalDetokenizer, StopChecker, skipped_special_ids
from specserve.models.gguf_convert import gguf_to_hf_dir
from specserve.models.loader import embedded_default_gguf, llama2c_to_hf_dir
from specserve.speculative.sampling import SamplingParams
from tests.conftest import STORIES

TEXTS = ["héllo wörld, 5 € and 日本語 🙂!", "def f(x):\n    return x  # ünïcode", "  leading spaces\tand tabs"]


def byte_tokens(tokenizer) -> list[int]:
    """Ids of single-byte tokens (SentencePiece's <0xNN> byte fallback), if the vocabulary has them."""
    ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    return [i for i in ids if i is not None and i != tokenizer.unk_token_id]


def id_pool(tokenizer) -> list[int]:
    """Ids that stress the window: the tokens of multi-byte text, byte tokens, ids the decode skips, and any ids."""
    pool = [i for text in TEXTS for i in tokenizer(text, add_special_tokens=False).input_ids]
    pool += byte_tokens(tokenizer) + sorted(skipped_special_ids(tokenizer))[:50]
    return pool + list(range(0, len(tokenizer), max(1, len(tokenizer) // 500)))


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece", "gemma"])
def real_tokenizer(request, tokenizer):
    if request.param == "byte-level":
        return tokenizer
    if request.param == "sentencepiece":
        if not Path(STORIES).exists():
            pytest.skip("the llama2.c models in ../shared/models are not here")
        return AutoTokenizer.from_pretrained(str(llama2c_to_hf_dir(Path(STORIES))))
    return AutoTokenizer.from_pretrained(str(gguf_to_hf_dir(embedded_default_gguf())))


def full(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_incremental_text_equals_the_full_decode_at_every_step(real_tokenizer, data):
    pool = id_pool(real_tokenizer)
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=40))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=12)))
    detokenizer, start = IncrementalDetokenizer(real_tokenizer), 0
    for end in cuts + [len(ids)]:
        assert detokenizer.extend(ids[start:end]) == full(real_tokenizer, ids[:end])
        start = end


def test_real_text_token_by_token(real_tokenizer):
    for text in TEXTS:
        ids = real_tokenizer(text, add_special_tokens=False).input_ids
        detokenizer = IncrementalDetokenizer(real_tokenizer)
        assert [detokenizer.extend([i]) for i in ids] == [full(real_tokenizer, ids[:n + 1]) for n in range(len(ids))]


def test_a_byte_run_continues_across_a_skipped_special_id(real_tokenizer):
    """<0x00> <s> <0x80>: the decode skips <s> (or Gemma's <unusedN>, an added token marked special), so the
    invalid run turns the settled-looking \\x00 into U+FFFD."""
    byte_ids = byte_tokens(real_tokenizer)
    if not byte_ids:
        pytest.skip("no byte-fallback tokens in this vocabulary")
    ids = real_tokenizer("h h", add_special_tokens=False).input_ids
    ids += [byte_ids[0x00], max(skipped_special_ids(real_tokenizer)), byte_ids[0x80], byte_ids[0x03]]
    detokenizer = IncrementalDetokenizer(real_tokenizer)
    assert [detokenizer.extend([i]) for i in ids] == [full(real_tokenizer, ids[:n + 1]) for n in range(len(ids))]


def test_a_long_output_decodes_a_window_not_everything(tokenizer):
    """The point of it: each step decodes a few ids, however long the output."""
    decoded = []
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer._decode = lambda ids: decoded.append(len(ids)) or full(tokenizer, ids)
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 20, add_special_tokens=False).input_ids
    for i in ids:
        detokenizer.extend([i])
    assert detokenizer.settled == full(tokenizer, ids) and len(ids) > 100
    assert max(decoded) <= 4


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_whole(tokenizer):
    class CleaningUp:
        clean_up_tokenization_spaces = True
        decode = staticmethod(tokenizer.decode)

    detokenizer = IncrementalDetokenizer(CleaningUp())
    ids = tokenizer("a b c", add_special_tokens=False).input_ids
    assert not detokenizer.windowed
    assert [detokenizer.extend([i]) for i in ids][-1] == full(tokenizer, ids)


@pytest.mark.parametrize("chunks", [[[5, 6, 7, 8]], [[5], [6], [7], [8]], [[5, 6], [7, 8]]])
def test_stops_on_the_incremental_text(tokenizer, chunks):
    """A stop string that spans steps ends the text before it; a stop id ends it before the id; max_tokens cuts."""
    ids = tokenizer("one two three four five six", add_special_tokens=False).input_ids
    text = full(tokenizer, ids)
    stop = text[text.index("three"):text.index("three") + 7]  # "three f": crosses tokens
    checker = StopChecker(tokenizer, SamplingParams(max_tokens=100, stop=[stop]), {2})
    pieces = [ids[:len(ids) * k // 4] for k in range(5)]
    for previous, piece in zip(pieces, pieces[1:]):
        if checker.finish_reason is None:
            checker.add(piece[len(previous):])
    assert (checker.finish_reason, checker.text) == ("stop", text[:text.index("three")])

    by_id = StopChecker(tokenizer, SamplingParams(max_tokens=100), {ids[3]})
    for chunk in chunks:
        if by_id.finish_reason is None:
            by_id.add([ids[i - 5] for i in chunk])
    assert (by_id.finish_reason, by_id.text, by_id.output) == ("stop", full(tokenizer, ids[:3]), ids[:4])

    capped = StopChecker(tokenizer, SamplingParams(max_tokens=3), set())
    for chunk in chunks:
        if capped.finish_reason is None:
            capped.add([ids[i - 5] for i in chunk])
    assert (capped.finish_reason, capped.text, capped.output) == ("length", full(tokenizer, ids[:3]), ids[:3])
