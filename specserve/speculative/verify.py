"""Verification of a draft chain against the target's logits.

Greedy: the longest prefix of the draft that equals the target's argmax, plus the target's next token.
Sampling (Leviathan et al. 2023): accept draft token x with probability min(1, p(x)/q(x)); at the first
rejection sample from norm(max(0, p - q)); if every draft token is accepted, sample a bonus token from p.
A deterministic proposal (n-gram) is the one-hot q, for which this reduces to accept with probability p(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.speculative.sampling import SamplingParams, probabilities, sample


@dataclass
class Verdict:
    accepted: int  # draft tokens accepted
    tokens: list[int]  # tokens to emit: the accepted drafts, then the target's correction or bonus token


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> Verdict:
    """target_logits [K+1, V]: row i predicts the token after draft[:i]."""
    choices = target_logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choices[accepted]:
        accepted += 1
    return Verdict(accepted, draft[:accepted] + [choices[accepted]])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p where p <= q everywhere (then rejection had probability 0)."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def verify_sampling(draft: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                    params: SamplingParams, generator: torch.Generator) -> Verdict:
    """draft_probs [K, V] is q (None: deterministic draft, i.e. one-hot q)."""
    p = probabilities(target_logits, params)
    for i, token in enumerate(draft):
        if draft_probs is None:
            q = torch.zeros_like(p[i])
            q[token] = 1.0
        else:
            q = draft_probs[i]
        ratio = p[i, token] / q[token] if q[token] > 0 else torch.tensor(0.0)
        if torch.rand((), generator=generator) < ratio:
            continue
        correction = sample(residual_distribution(p[i], q)[None], generator)
        return Verdict(i, draft[:i] + [int(correction)])
    bonus = sample(p[len(draft)][None], generator)
    return Verdict(len(draft), draft + [int(bonus)])


def verify(draft: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
           params: SamplingParams, generator: torch.Generator) -> Verdict:
    if params.greedy:
        return verify_greedy(draft, target_logits)
    return verify_sampling(draft, draft_probs, target_logits, params, generator)
