"""Output processing: a request's tokens to text as they come (`IncrementalDetokenizer`), its stop conditions
(`StopChecker`: EOS and stop ids, max_tokens, stop strings on the decoded text) and the events a stream yields."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from specserve.engine.request import GenerationResult
from specserve.speculative.sampling import SamplingParams, TokenLogprobs


@dataclass
class StreamEvent:
    text: str  # new text since the previous event
    token_ids: list[int]  # new token ids since the previous event
    result: GenerationResult | None = None  # set on the last event
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asks for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first event, when the request asks


@functools.lru_cache(maxsize=8)
def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """The ids of a SentencePiece vocabulary's byte tokens (<0x00> .. <0xFF>); none in other vocabularies."""
    ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    return frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)


@functools.lru_cache(maxsize=8)
def skipped_special_ids(tokenizer) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` drops: the special tokens and the added tokens marked
    special (Gemma's thousands of <unusedN>)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in added.items() if t.special}


class IncrementalDetokenizer:
    """The text of a growing list of token ids, as `tokenizer.decode(ids, skip_special_tokens=True)` gives it,
    for a few tokens' decoding per step instead of all of them (a full decode per step made a long output
    quadratic).

    Windowed as vLLM's detokenize_incrementally: the text up to `read` is settled; each step decodes the ids
    from `prefix` (the settled window's start, at a character boundary) on, and the new text is what that
    decode adds to the decode of ids[prefix:read]. Both decodes start at the same token, so whatever a decoder
    does to a string's start (a stripped leading space) cancels out. The window settles once its text does not
    end in U+FFFD (an incomplete UTF-8 character) and its last id that the decode keeps (special ids are skipped)
    is not a byte token (SentencePiece's <0xNN> byte fallback decodes a run of byte tokens together, across a
    skipped special id, and an invalid run turns every byte of it into U+FFFD, the ones before too). A tokenizer
    that cleans up spaces between tokens (`clean_up_tokenization_spaces`) rewrites earlier text, so it is decoded
    whole."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.windowed = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.byte_ids = byte_fallback_ids(tokenizer) if self.windowed else frozenset()
        self.special_ids = skipped_special_ids(tokenizer) if self.windowed else frozenset()
        self.ids: list[int] = []
        self.settled = ""  # the text of ids[:read]
        self.prefix = self.read = 0

    def extend(self, ids: list[int]) -> str:
        """Append ids; returns the text of all ids so far."""
        self.ids += ids
        if not self.windowed:
            return self._decode(self.ids)
        before = self._decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        tail = self._decode(self.ids[self.prefix:])[len(before):]
        if tail and not tail.endswith("\ufffd") and not self._ends_in_a_byte_run():
            self.settled += tail
            self.prefix, self.read, tail = self.read, len(self.ids), ""
        return self.settled + tail

    def _ends_in_a_byte_run(self) -> bool:
        kept = next((i for i in reversed(self.ids[self.read:]) if i not in self.special_ids), None)
        return kept in self.byte_ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class StopChecker:
    """Applies EOS / stop ids / max_tokens per token and stop strings on the decoded text."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: set[int]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self.output: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    def add(self, tokens: list[int]) -> None:
        """Append emitted tokens until one of them ends the request. The text never includes a stop token or a
        stop string (as vLLM and OpenAI do); the token ids include the token that stopped it."""
        text_tokens = []  # decoded together after the loop (without stop strings)
        for token in tokens:
            self.output.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            if not self.params.stop:
                text_tokens.append(token)
            elif self._hit_stop_string(token):
                self.finish_reason = "stop"
                return
            if len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        if text_tokens:
            self.text = self.detokenizer.extend(text_tokens)

    def _hit_stop_string(self, token: int) -> bool:
        """Decode `token`; a stop string in the text ends it there."""
        text = self.detokenizer.extend([token])
        for stop in self.params.stop:
            index = text.find(stop, max(0, len(self.text) - len(stop)))
            if index >= 0:
                self.text = text[:index]
                return True
        self.text = text
        return False

    def stable_text_length(self) -> int:
        """How much of the text can be streamed: hold back a partial UTF-8 character or a partial stop string."""
        text = self.text
        end = len(text.rstrip("\ufffd")) if self.finish_reason is None else len(text)
        if self.finish_reason is None:
            for stop in self.params.stop:
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if text[:end].endswith(stop[:k]):
                        end -= k
                        break
        return end
