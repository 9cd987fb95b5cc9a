"""The verifier: one entry point, `verify`, for every draft tree (a chain is a one-branch tree).

Terms:

* target probabilities p: the target's sampling distribution at a node (its logits after the shared temperature /
  top-k / top-p transform, `sampling.probabilities`), i.e. the distribution of the token after that node's path.
* draft probabilities q: the distribution a node's children were drawn from. Deterministic drafts (n-gram, top-k
  candidates of Medusa / EAGLE, static trees) have no q: each child counts as the one-hot q on its own token.
* accepted prefix: the accepted nodes, a root path; every emitted token but the last is one of them.
* bonus token: the token sampled from p at the last accepted node when it is a leaf (all of its path accepted).
* residual distribution: norm(max(0, p - q)), what p becomes after a child drawn from q is rejected.

Acceptance rules, chosen by the arguments:

* greedy (temperature 0): follow the child whose token is the target's argmax at its parent (the deepest such path
  if siblings repeat a token), then emit the argmax at the last accepted node. A chain takes a fast path: the
  longest prefix of the draft equal to the argmax row by row.
* rejection sampling (Leviathan et al. 2023; for trees SpecInfer's multi-step speculative sampling, EAGLE's
  `evaluate_posterior`): at a node with target distribution p try its children in order; accept child x with
  probability min(1, p(x) / q(x)); on rejection replace p by the residual distribution. Deterministic children use
  their one-hot q, so a rejection removes that token from p; children drawn i.i.d. from q keep the same q for
  every sibling. When every child is rejected the token comes from the residual p; at a leaf it is the bonus
  token. The output is distributed exactly as the target's.
* typical acceptance (Medusa, opt in, NOT lossless): a child is accepted when p(x) > min(threshold,
  alpha * exp(-entropy(p))) at its parent; the deepest such path wins and the next token is sampled from p at its
  last node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.models import cpu_kernels
from specserve.models.transformer import GreedyChoices
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.tree import DraftTree


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance (its `posterior_threshold` and `posterior_alpha`)."""

    threshold: float = 0.09
    alpha: float = 0.3


class Verdict(NamedTuple):
    nodes: list[int]  # the accepted prefix: node indices below the root, root to deepest
    tokens: list[int]  # tokens to emit: the accepted nodes' tokens, then the correction or bonus token

    @property
    def accepted(self) -> int:
        return len(self.nodes)


def verify(tree: DraftTree, logits: torch.Tensor | GreedyChoices, params: SamplingParams, generator: torch.Generator,
           draft_probs=None, typical: TypicalAcceptance | None = None, allowed: torch.Tensor | None = None
           ) -> Verdict:
    """logits [N, V]: the target's logits at each node of `tree` (row 0: the root). `draft_probs`: None when every
    child is deterministic; else a [N', V] tensor or a sequence whose entry i is the q node i's children were drawn
    from (None entries: deterministic children there). `typical`: Medusa's rule when sampling. `allowed` [N, V]
    bool: a grammar's tokens allowed after each node's path (structured outputs); the others get -inf first.
    Greedy verification takes GreedyChoices (each row's argmax) in place of logits as well."""
    if not isinstance(logits, GreedyChoices):
        logits = mask_logits(logits, allowed)
    elif not params.greedy or allowed is not None:
        raise ValueError("greedy choices stand in for logits only in greedy verification without a grammar")
    if params.greedy:
        return greedy_chain(tree.draft, logits) if tree.is_chain else greedy_tree(tree, logits)
    if typical is not None:
        return typical_acceptance(tree, logits, params, generator, typical)
    return rejection_sampling(tree, draft_probs, logits, params, generator)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits with the tokens `allowed` [N, V] forbids set to -inf (unchanged when there is no grammar)."""
    return logits if allowed is None else torch.where(allowed, logits, float("-inf"))


def argmaxes(logits: torch.Tensor | GreedyChoices) -> list[int]:
    return logits.ids.tolist() if isinstance(logits, GreedyChoices) else cpu_kernels.argmax(logits).tolist()


def greedy_chain(draft: list[int], logits: torch.Tensor | GreedyChoices) -> Verdict:
    """The chain's fast path: logits row i predicts the token after draft[:i]."""
    choices = argmaxes(logits)
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choices[accepted]:
        accepted += 1
    return Verdict(list(range(1, accepted + 1)), draft[:accepted] + [choices[accepted]])


def greedy_tree(tree: DraftTree, logits: torch.Tensor | GreedyChoices) -> Verdict:
    choice = argmaxes(logits)
    tokens = tree.tokens.tolist()
    nodes = deepest_path(tree, lambda node, child: tokens[child] == choice[node])
    return Verdict(nodes, [tokens[n] for n in nodes] + [choice[nodes[-1] if nodes else 0]])


def deepest_path(tree: DraftTree, accepts) -> list[int]:
    """The longest root path (node indices below the root) whose every child passes `accepts(parent, child)`;
    the first in node order among equally long ones."""
    def walk(node: int) -> list[int]:
        best: list[int] = []
        for child in tree.children(node):
            if accepts(node, child):
                path = [child] + walk(child)
                if len(path) > len(best):
                    best = path
        return best

    return walk(0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p where p <= q everywhere (then rejection had probability 0)."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def without_token(p: torch.Tensor, token: int) -> torch.Tensor:
    """residual_distribution(p, q) for q one-hot at `token`, without building q: p less that token's mass,
    renormalized (the same numbers: p - 0 is p, and p[token] - 1 clamps to 0)."""
    residual = p.clone()
    residual[token] = 0.0
    total = residual.sum()
    return residual / total if total > 0 else p


def rejection_sampling(tree: DraftTree, draft_probs, logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator) -> Verdict:
    """Lossless recursive rejection sampling over siblings; temperature / top-k / top-p come from `params` (the
    same transform must have produced q)."""
    p_all = probabilities(logits, params)
    tokens = tree.draft
    nodes: list[int] = []
    node = 0
    while True:
        p = p_all[node]
        children = tree.children(node)
        q_node = None if draft_probs is None or not children else draft_probs[node]  # a leaf has no q
        accepted_child = None
        for child in children:
            token = tokens[child - 1]
            if q_node is None:  # a deterministic draft: q is one-hot at its token
                ratio = p[token]
            else:
                ratio = p[token] / q_node[token] if q_node[token] > 0 else torch.tensor(0.0)
            if torch.rand((), generator=generator) < ratio:
                accepted_child = child
                break
            p = without_token(p, token) if q_node is None else residual_distribution(p, q_node)
        if accepted_child is None:  # every child rejected (residual) or a leaf (bonus): p is what is left
            final = int(sample(p[None], generator))
            return Verdict(nodes, [tokens[n - 1] for n in nodes] + [final])
        nodes.append(accepted_child)
        node = accepted_child


def typical_acceptance(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                       typical: TypicalAcceptance) -> Verdict:
    p_all = probabilities(logits, params)
    entropy = -(p_all * torch.log(p_all.clamp_min(1e-12))).sum(-1)
    limits = torch.minimum(torch.full_like(entropy, typical.threshold), typical.alpha * torch.exp(-entropy)).tolist()
    tokens = tree.tokens.tolist()
    nodes = deepest_path(tree, lambda node, child: float(p_all[node, tokens[child]]) > limits[node])
    last = nodes[-1] if nodes else 0
    return Verdict(nodes, [tokens[n] for n in nodes] + [int(sample(p_all[last][None], generator))])
