"""Log-probabilities in OpenAI's two layouts.

Completions (legacy): `{"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
"text_offset": [int]}`, prompt tokens first when the request echoes it (the first prompt token has no log-probability).
Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

The numbers are the engine's (`speculative.sampling.token_logprobs`): the distribution the token was drawn from.
A token that distribution excludes (top-k / top-p) has -inf, written as -9999.0 as vLLM does (JSON has no -inf).
"""

from __future__ import annotations

from specserve.speculative.sampling import TokenLogprobs, json_logprob


class TokenText:
    """Token id -> its text, as the tokenizer decodes it alone (cached: a request repeats its tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = self.tokenizer.decode([token])
        return self.cache[token]


def completion_logprobs(text_of: TokenText, ids: list[int], entries: list[TokenLogprobs | None],
                        offset: int = 0) -> dict:
    """`ids[i]` scored by `entries[i]` (None: no log-probability, the first prompt token); text offsets from
    `offset` on."""
    tokens = [text_of(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else json_logprob(e.logprob) for e in entries],
            "top_logprobs": [None if e is None else _top_by_text(text_of, e.top) for e in entries],
            "text_offset": offsets}


def _top_by_text(text_of: TokenText, top: list[tuple[int, float]]) -> dict[str, float]:
    """The legacy layout keys top tokens by text: of tokens with the same text, the likeliest keeps its entry."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(text_of(token), json_logprob(logprob))
    return out


def join_completion_logprobs(parts: list[dict]) -> dict:
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}


def chat_logprobs(text_of: TokenText, entries: list[TokenLogprobs]) -> dict:
    def item(token: int, logprob: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
