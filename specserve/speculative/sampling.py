"""Sampling parameters and the one logits -> probabilities transform shared by target and draft.

Rejection sampling is lossless only if p (target) and q (draft) go through the very same temperature / top-k /
top-p transform, so both use `probabilities` below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specserve.speculative.grammar import Guide

SEEDS = range(-2**63, 2**64)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's top_logprobs cap)


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or negative: no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # per output token: its log-probability and this many top ones (None: none)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (None: none)
    guide: Guide | None = None  # structured outputs: the output must match this JSON schema / regex / grammar
    # speculation, per request (not sampling, but the engine reads them from here as it reads the rest):
    num_speculative_tokens: int | None = None  # at most this many draft tokens per step (0: none; None: no cap)
    suffix_cache: bool = True  # the suffix method's shared cache: draft from it and add the response to it

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reproducible(self) -> bool:
        """A request that asked for a seed: its speculation must not depend on other requests or on timing, so that
        the same seed gives the same output."""
        return self.seed is not None

    def validate(self) -> None:
        """Raise ValueError naming the first bad field: every number finite and in range, every list of its type."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be positive unless the request scores its prompt (prompt_logprobs)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.num_speculative_tokens is not None and (not _is_int(self.num_speculative_tokens)
                                                        or self.num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {self.num_speculative_tokens!r}")
        if not isinstance(self.suffix_cache, bool):
            raise ValueError(f"suffix_cache must be true or false, got {self.suffix_cache!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed not in SEEDS):
            raise ValueError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.guide is not None:
            if not isinstance(self.guide, Guide):
                raise ValueError(f"guide must be a Guide, got {type(self.guide).__name__}")
            self.guide.validate()

    def make_generator(self) -> torch.Generator:
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,))))
        return gen


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite int or float (JSON's NaN and Infinity literals parse to floats; bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of logits [N, V] -> sampling distributions [N, V] (float32) under temperature, top-k, top-p."""
    logits = logits.float() / max(params.temperature, 1e-5)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # keep the smallest prefix reaching top_p
        drop_sorted[..., 0] = False  # and always the top token: a top_p below float32's range rounds to 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of probs [N, V]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class TokenLogprobs:
    """A token's log-probability under the distribution it was drawn from, and the `top` most likely tokens'."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first
    rank: int = 1  # 1 + the number of tokens more likely than `token` (vLLM's Logprob.rank)


EXCLUDED_LOGPROB = -9999.0  # a token the sampling distribution excludes (-inf), as vLLM writes it in JSON


def json_logprob(logprob: float) -> float:
    """A log-probability as JSON can carry it: JSON has no -inf."""
    return logprob if math.isfinite(logprob) else EXCLUDED_LOGPROB


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top: int) -> list[TokenLogprobs]:
    """Row i of logits [N, V] scores tokens[i]. The distribution is the one sampling draws from (temperature,
    top-k, top-p; a token they exclude gets -inf); greedy requests get the model's own (log-softmax of the raw
    logits), as vLLM and OpenAI report them. Each row is computed alone, so a token's numbers are the same
    whether its logits came from a forward of one token or from a verified draft."""
    out = []
    for row, token in zip(logits, tokens):
        row = row[None].float()
        logs = torch.log_softmax(row, -1) if params.greedy else torch.log(probabilities(row, params))
        logs = logs[0]
        best = torch.topk(logs, top) if top else None
        pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
        logprob = logs[token]
        out.append(TokenLogprobs(token, float(logprob), pairs, int((logs > logprob).sum()) + 1))
    return out
