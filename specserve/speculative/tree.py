"""Draft trees (Medusa, EAGLE, SpecInfer; a chain is a one-branch tree): structure and static trees.

A `DraftTree` holds N nodes in topological order: node 0 is the root, the last emitted token that is not yet in
the target's KV cache (the engine's `pending` token); every other node is a drafted token whose parent has a
smaller index. One target forward over all N nodes, with `tree.mask` as the tree attention mask and
`tree.positions(base)` as rope positions, gives at row i the target's logits for the token after the root path
of node i, exactly as if that path alone had been decoded as a chain. `verify.verify` walks it.

A `Chain` is the tree whose node i + 1 is the only child of node i. It keeps the draft as a list and makes its
tensors only when asked, so chain speculation (n-gram, a draft model) builds no per-node objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch


class DraftTree:
    is_chain = False

    def __init__(self, tokens, parents):
        """tokens [N]: node tokens, node 0 the root; parents [N]: parent index, -1 for the root, parents[i] < i."""
        self.tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
        self.parents = torch.as_tensor(parents, dtype=torch.long).flatten()
        n = self.tokens.numel()
        if n == 0 or self.parents.numel() != n:
            raise ValueError(f"a draft tree needs >= 1 node and one parent per token "
                             f"(got {n} tokens, {self.parents.numel()} parents)")
        parent_list = self.parents.tolist()
        if parent_list[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        for i, parent in enumerate(parent_list[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must precede their children")
        depth = [0] * n
        mask = torch.eye(n, dtype=torch.bool)
        self._children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            depth[i] = depth[parent_list[i]] + 1
            mask[i] |= mask[parent_list[i]]
            self._children[parent_list[i]].append(i)
        self.depth = torch.tensor(depth, dtype=torch.long)  # [N] long: root 0
        self.mask = mask  # [N, N] bool: node i attends to its ancestors and itself

    def __len__(self) -> int:
        return self.tokens.numel()

    @cached_property
    def draft(self) -> list[int]:
        """The drafted tokens: the nodes below the root, in node order."""
        return self.tokens[1:].tolist()

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def children(self, node: int) -> list[int]:
        """The children of `node` in index order (for static trees: rank order)."""
        return self._children[node]

    def positions(self, base: int) -> torch.Tensor:
        """Rope positions [N] when the root sits at position `base`."""
        return base + self.depth


class Chain(DraftTree):
    """The root, then one child per depth: node i + 1 holds draft[i]."""

    is_chain = True

    def __init__(self, root: int, draft: list[int]):  # no super().__init__(): it builds per-node lists
        self.root = root
        self.draft = draft

    def __len__(self) -> int:
        return len(self.draft) + 1

    @cached_property
    def tokens(self) -> torch.Tensor:  # [N] long
        return torch.tensor([self.root] + self.draft)

    @cached_property
    def parents(self) -> torch.Tensor:  # [N] long
        return torch.arange(-1, len(self) - 1)

    @cached_property
    def depth(self) -> torch.Tensor:  # [N] long
        return torch.arange(len(self))

    @cached_property
    def mask(self) -> torch.Tensor:  # [N, N] bool: causal
        return torch.ones(len(self), len(self), dtype=torch.bool).tril()

    @property
    def max_depth(self) -> int:
        return len(self.draft)

    def children(self, node: int) -> list[int]:
        return [node + 1] if node < len(self.draft) else []


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


def after_chain(root: int, chain: list[int], tree: DraftTree) -> DraftTree:
    """`tree` (rooted at chain[-1]) hung below the chain root -> chain: one tree whose first nodes are the chain."""
    if tree.is_chain:
        return Chain(root, chain + tree.draft)
    offset = len(chain)  # tree node i becomes node offset + i; its root is the chain's last node
    parents = list(range(-1, offset)) + [p + offset for p in tree.parents.tolist()[1:]]
    return DraftTree([root, *chain, *tree.tokens.tolist()[1:]], parents)
