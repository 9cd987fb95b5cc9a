"""Draft trees for tree speculation (Medusa, EAGLE, SpecInfer): structure, static trees, verification.

A `DraftTree` holds N nodes in topological order: node 0 is the root, the last emitted token that is not yet in
the target's KV cache (the engine's `pending` token); every other node is a drafted token whose parent has a
smaller index. One target forward over all N nodes, with `tree.mask` as the tree attention mask and
`tree.positions(base)` as rope positions, gives at row i the target's logits for the token after the root path
of node i, exactly as if that path alone had been decoded as a chain.

Verification walks down from the root:

* greedy (`verify_tree_greedy`): follow the child whose token is the target's argmax at its parent (the deepest
  such path if siblings repeat a token); emit the accepted tokens and the argmax at the last accepted node.
* sampling (`verify_tree_sampling`): recursive rejection sampling over siblings (SpecInfer's multi-step
  speculative sampling; EAGLE's `evaluate_posterior` sampling branch). At a node with target distribution p, try
  its children in order; accept child x with probability min(1, p(x) / q(x)); on rejection replace p by
  norm(max(0, p - q)). Deterministic (top-k) children use the one-hot q without replacement: q is one-hot on the
  child tried, so a rejection removes that token from p. Stochastic children, i.i.d. samples from a draft
  distribution q at their parent, keep the same q for every sibling. When every child is rejected the token
  comes from the residual p; at a leaf the bonus token comes from the leaf's p. Both keep the output distributed
  exactly as the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.verify import residual_distribution


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long: node tokens; node 0 is the root (the pending token)
    parents: torch.Tensor  # [N] long: parent index, -1 for the root; parents[i] < i
    depth: torch.Tensor = field(init=False)  # [N] long: root 0
    mask: torch.Tensor = field(init=False)  # [N, N] bool: node i attends to its ancestors and itself

    def __post_init__(self):
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).flatten()
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).flatten()
        n = self.tokens.numel()
        if n == 0 or self.parents.numel() != n:
            raise ValueError(f"a draft tree needs >= 1 node and one parent per token "
                             f"(got {n} tokens, {self.parents.numel()} parents)")
        parents = self.parents.tolist()
        if parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        for i, parent in enumerate(parents[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must precede their children")
        depth = [0] * n
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            mask[i] |= mask[parents[i]]
        self.depth = torch.tensor(depth, dtype=torch.long)
        self.mask = mask
        self._children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            self._children[parents[i]].append(i)

    def __len__(self) -> int:
        return self.tokens.numel()

    def children(self, node: int) -> list[int]:
        """The children of `node` in index order (for static trees: rank order)."""
        return self._children[node]

    def positions(self, base: int) -> torch.Tensor:
        """Rope positions [N] when the root sits at position `base`."""
        return base + self.depth

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        path = [node]
        while path[-1] != 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]

    @property
    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if not self._children[i]]

    @property
    def paths(self) -> list[list[int]]:
        """Root-to-leaf node index lists, leaves in index order."""
        return [self.path_to(leaf) for leaf in self.leaves]


def tree_from_choices(choices: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]],
                      root_token: int = 0) -> DraftTree:
    """A static Medusa / EAGLE tree. `choices`: paths of top-k ranks per depth (e.g. `choices.mc_sim_7b_63`);
    `candidates[d]`: the ranked candidate tokens at depth d + 1 (Medusa: head d's top-k). Nodes are ordered as
    Medusa's `generate_medusa_buffers` orders them: the root, then the choices sorted by (depth, ranks); the
    node of choice c carries candidates[len(c) - 1][c[-1]]."""
    ordered = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    if any(len(c) == 0 for c in ordered):
        raise ValueError("a choice must be a non-empty path of ranks")
    index = {c: i + 1 for i, c in enumerate(ordered)}
    tokens, parents = [int(root_token)], [-1]
    for choice in ordered:
        depth, rank = len(choice), choice[-1]
        if depth > len(candidates):
            raise ValueError(f"choice {list(choice)} has depth {depth}, but candidates cover {len(candidates)}")
        if not 0 <= rank < len(candidates[depth - 1]):
            raise ValueError(f"choice {list(choice)} asks for rank {rank} at depth {depth}, but only "
                             f"{len(candidates[depth - 1])} candidates are given there")
        parent = choice[:-1]
        if parent and parent not in index:
            raise ValueError(f"choice {list(choice)} lacks its parent {list(parent)} in the choices")
        tokens.append(int(candidates[depth - 1][rank]))
        parents.append(index[parent] if parent else 0)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def chain_tree(tokens: Sequence[int]) -> DraftTree:
    """A chain (root, then one child per depth) as a tree: chain speculation is its special case."""
    return DraftTree(torch.tensor(list(tokens)), torch.arange(-1, len(tokens) - 1))


class TreeVerdict(NamedTuple):
    nodes: list[int]  # accepted node indices below the root, root to deepest
    tokens: list[int]  # tokens to emit: the accepted nodes' tokens, then the correction / bonus token

    @property
    def accepted(self) -> int:
        return len(self.nodes)


def verify_tree_greedy(tree: DraftTree, logits: torch.Tensor) -> TreeVerdict:
    """logits [N, V]: the target's logits at each node. The longest root path whose every child token is the
    target's argmax at its parent, plus the argmax at its last node."""
    choice = logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    nodes = deepest_path(tree, lambda node, child: tokens[child] == choice[node])
    last = nodes[-1] if nodes else 0
    return TreeVerdict(nodes, [tokens[n] for n in nodes] + [choice[last]])


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


def verify_tree_sampling(tree: DraftTree, draft_probs_per_node, logits: torch.Tensor, params: SamplingParams,
                         generator: torch.Generator) -> TreeVerdict:
    """Lossless recursive rejection sampling over siblings.

    `draft_probs_per_node`: None when every node's children are deterministic candidates (top-k, n-gram,
    static trees); else a [N, V] tensor or a length-N sequence whose entry i is the draft distribution q that
    node i's children were sampled from i.i.d. (None entries: deterministic children at that node).
    `logits` [N, V] are the target's logits at each node; temperature / top-k / top-p come from `params`
    (the same transform must have produced q)."""
    p_all = probabilities(logits, params)
    tokens = tree.tokens.tolist()
    nodes: list[int] = []
    node = 0
    while True:
        p = p_all[node]
        q_node = None if draft_probs_per_node is None else draft_probs_per_node[node]
        accepted_child = None
        for child in tree.children(node):
            token = tokens[child]
            if q_node is None:
                q = torch.zeros_like(p)
                q[token] = 1.0
            else:
                q = q_node
            ratio = p[token] / q[token] if q[token] > 0 else torch.tensor(0.0)
            if torch.rand((), generator=generator) < ratio:
                accepted_child = child
                break
            p = residual_distribution(p, q)
        if accepted_child is None:  # every child rejected (residual) or a leaf (bonus): p is what is left
            final = int(sample(p[None], generator))
            return TreeVerdict(nodes, [tokens[n] for n in nodes] + [final])
        nodes.append(accepted_child)
        node = accepted_child


def verify_tree_typical(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                        threshold: float, alpha: float) -> TreeVerdict:
    """Medusa's typical acceptance (NOT lossless: the output distribution is no longer the target's). A child is
    accepted when the target gives its token p > min(threshold, alpha * exp(-entropy(p))) at the parent; the
    deepest such path wins and the next token is sampled from p at its last node."""
    p_all = probabilities(logits, params)
    entropy = -(p_all * torch.log(p_all.clamp_min(1e-12))).sum(-1)
    limits = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy)).tolist()
    tokens = tree.tokens.tolist()
    nodes = deepest_path(tree, lambda node, child: float(p_all[node, tokens[child]]) > limits[node])
    last = nodes[-1] if nodes else 0
    return TreeVerdict(nodes, [tokens[n] for n in nodes] + [int(sample(p_all[last][None], generator))])


def verify_tree(tree: DraftTree, draft_probs_per_node, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator, typical: tuple[float, float] | None = None) -> TreeVerdict:
    """`typical` (posterior_threshold, posterior_alpha): Medusa's typical acceptance for temperature > 0."""
    if params.greedy:
        return verify_tree_greedy(tree, logits)
    if typical is not None:
        return verify_tree_typical(tree, logits, params, generator, *typical)
    return verify_tree_sampling(tree, draft_probs_per_node, logits, params, generator)
