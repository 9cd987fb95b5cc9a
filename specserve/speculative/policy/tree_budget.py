"""The hardware-aware size of a drafted tree (EAGLE's and Medusa's): how many of its nodes to verify, and whether
to draft another level.

A node's score is its path's cumulative draft log-probability, so exp(score) estimates the chance the target
accepts the whole path. With the target's measured verify cost `verify_seconds(n)` the budget keeps the N best
nodes that maximize (1 + c * sum of their path probabilities) / (verify cost of N + 1 tokens + drafting time), and
drafts another level only while its expected gain (the expanded nodes' best children) pays for the level's drafting
and their verification at that rate; c calibrates the head's confidence against the acceptance it actually gets
(accepted tokens / predicted, smoothed by a prior of 1 / 1).
Without measured costs a dynamic tree keeps its `total_tokens` best nodes and a static tree all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specserve.smoothing import smoothed
from specserve.speculative.tree import DraftTree


class Nodes:
    """A growing draft tree: node 0 is the root; per node its token, parent, depth, score (cumulative log-prob),
    the head's output once expanded and its head-cache slot."""

    def __init__(self, root_token: int, root_output: torch.Tensor | None):
        self.tokens, self.parents, self.depths, self.scores = [root_token], [-1], [0], [0.0]
        self.paths: list[tuple[int, ...]] = [()]
        self.outputs: dict[int, torch.Tensor] = {0: root_output}
        self.slots: dict[int, int] = {}
        self.looked_up = 0  # nodes the lookup branch added

    def child(self, parent: int, token: int) -> int | None:
        return next((c for c in range(1, len(self.tokens)) if self.parents[c] == parent and self.tokens[c] == token),
                    None)

    def add(self, parent: int, token: int, logp: float, rank: int) -> int:
        """A head-drafted child; a lookup node with the same token there becomes it (with the better score)."""
        shared = self.child(parent, token) if self.looked_up else None
        if shared is not None:
            self.scores[shared] = max(self.scores[shared], self.scores[parent] + logp)
            self.paths[shared] = self.paths[parent] + (rank,)
            self.looked_up -= 1
            return shared
        return self._append(parent, token, self.scores[parent] + logp, rank)

    def _append(self, parent: int, token: int, score: float, rank: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        self.paths.append(self.paths[parent] + (rank,))
        return len(self.tokens) - 1

    def merge_chain(self, chain: list[int], reach: list[float], offset: float) -> None:
        """Hang a lookup chain below the root, sharing nodes that carry the same tokens; its node at depth d
        scores log(reach[d - 1]) - offset (unless the node already scores higher): reach[d - 1] is the chance that
        the chain's first d tokens are accepted."""
        node = 0
        for token, chance in zip(chain, reach):
            score = math.log(chance) - offset
            same = self.child(node, token)
            if same is not None:
                node = same
                self.scores[node] = max(self.scores[node], score)
            else:
                node = self._append(node, token, score, -1)
                self.looked_up += 1

    def ancestors(self, node: int) -> list[int]:
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out

    def tree(self, keep: list[int]) -> DraftTree:
        """The tree of the root and `keep` (closed under parents), ordered by depth then score."""
        order = [0] + sorted(keep, key=lambda n: (self.depths[n], -self.scores[n]))
        index = {node: i for i, node in enumerate(order)}
        return DraftTree(torch.tensor([self.tokens[n] for n in order]),
                         torch.tensor([-1] + [index[self.parents[n]] for n in order[1:]]))


class TreeBudget:
    """One request's budget; `nodes` is the growing tree (`Nodes`)."""

    KEEP = 0.8  # the share of the level time and the child share that a new reading keeps

    def __init__(self, verify_seconds: Callable[[int], float] | None, top_k: int, total_tokens: int, static: bool):
        self.verify_seconds = verify_seconds
        self.top_k, self.total_tokens, self.static = top_k, total_tokens, static
        self.predicted, self.accepted = 1.0, 1.0
        self.pending_prediction: float | None = None  # the path probabilities of the tree under verification
        self.level_seconds: float | None = None  # drafting one level, smoothed
        self.child_share = 0.5  # a node's best child's share of its path probability, smoothed (see observe_level)
        self.head_rate: float | None = None  # expected tokens/s of the last step the head drafted (with lookup)
        self._verify_table: list[float] | None = None  # verify_seconds(n) for n = 1, 2, ... (read every level)
        self._ranking: tuple | None = None  # (nodes, their state, best's answer): the last level check's, reused

    @property
    def calibration(self) -> float:
        return self.accepted / self.predicted

    def expect(self, nodes, keep: list[int]) -> None:
        """The tree of `keep` goes to verification: remember what it predicts."""
        self.pending_prediction = sum(math.exp(nodes.scores[n]) for n in keep)

    def observe(self, accepted: int) -> None:
        """The target accepted `accepted` nodes of the last tree."""
        if self.pending_prediction is not None:
            self.predicted += self.pending_prediction
            self.accepted += accepted
            self.pending_prediction = None

    def time_level(self, elapsed: float) -> None:
        self.level_seconds = smoothed(self.level_seconds, elapsed, self.KEEP)

    def best(self, nodes) -> tuple[list[int], float]:
        """The best nodes to verify and the expected tokens per second of verifying them."""
        # the level check that ends a step ranks the tree select then ranks again: the same state, one ranking
        state = (tuple(nodes.scores), len(nodes.slots), nodes.looked_up, self.level_seconds, self.calibration)
        if self._ranking is None or self._ranking[0] is not nodes or self._ranking[1] != state:
            self._ranking = (nodes, state, self._rank(nodes))
        return self._ranking[2]

    def _rank(self, nodes) -> tuple[list[int], float]:
        ranked = sorted(range(1, len(nodes.tokens)), key=lambda n: (-nodes.scores[n], nodes.depths[n]))
        limit = len(ranked) if self.static else min(len(ranked), self.total_tokens + nodes.looked_up)
        if self.verify_seconds is None:
            return ranked[:limit], 0.0
        # plain Python: a tree has tens of nodes, where each tensor op would cost more than the whole loop
        drafting = (self.level_seconds or 0.0) * max(len(nodes.slots), 1) / max(self.top_k, 1)
        seconds = self.verify_table(limit + 1)
        expected, best, best_rate = 1.0, 0, 1.0 / (seconds[0] + drafting)
        for count, node in enumerate(ranked[:limit], start=1):
            expected += self.calibration * math.exp(nodes.scores[node])
            rate = expected / (seconds[count] + drafting)
            if rate > best_rate:
                best, best_rate = count, rate
        return ranked[:best], best_rate

    def verify_table(self, count: int) -> list[float]:
        """[verify_seconds(1), ..., verify_seconds(count)], computed once per budget and extended as needed."""
        if self._verify_table is None or len(self._verify_table) < count:
            size = max(count, 2 * len(self._verify_table) if self._verify_table is not None else 65)
            self._verify_table = [self.verify_seconds(n) for n in range(1, size + 1)]
        return self._verify_table[:count]

    def observe_level(self, top_logps: list[float]) -> None:
        """The top child's draft log-probability under each node a level expanded."""
        if top_logps:
            share = sum(math.exp(logp) for logp in top_logps) / len(top_logps)
            self.child_share = smoothed(self.child_share, share, self.KEEP)

    def worth_another_level(self, nodes, expand: list[int]) -> bool:
        """Whether drafting a level below `expand` raises the step's expected tokens/s: its expected gain (each
        expanded node's best child, at the head's measured top-child share of its path probability) against what
        the level costs, its drafting and the verification of one more node per expanded one, at the tree's rate."""
        if self.verify_seconds is None or self.level_seconds is None:
            return True
        keep, rate = self.best(nodes)
        gain = self.calibration * self.child_share * sum(math.exp(nodes.scores[n]) for n in expand)
        table = self.verify_table(len(keep) + len(expand) + 1)
        more_verify = table[-1] - table[len(keep)]
        return gain > rate * (self.level_seconds + more_verify)

    def worth_expanding(self, nodes, candidates: list[int]) -> list[int]:
        """The best-scoring of `candidates` whose children are worth drafting a level for: the longest prefix by
        score that `worth_another_level` passes (none: the level does not pay). A static tree's level lists every
        node with children, most of them too unlikely to pay for a verified child."""
        ranked = sorted(candidates, key=lambda n: -nodes.scores[n])
        return next((ranked[:count] for count in range(len(ranked), 0, -1)
                     if self.worth_another_level(nodes, ranked[:count])), [])

    def select(self, nodes) -> list[int]:
        """The nodes to verify: all of a static tree, or (with measured costs) the budget's best closed subtree."""
        if self.static and self.verify_seconds is None:
            return list(range(1, len(nodes.tokens)))
        keep = set(self.best(nodes)[0])
        # a child never outscores its parent, but ties could break the other way: keep the tree closed
        return [n for n in keep if all(a in keep for a in nodes.ancestors(n))]

    def note_head_rate(self, nodes, keep: list[int], head_seconds: float) -> None:
        if self.verify_seconds is not None:
            expected = 1.0 + self.calibration * sum(math.exp(nodes.scores[n]) for n in keep)
            self.head_rate = expected / (self.verify_seconds(len(keep) + 1) + head_seconds)

    def lookup_alone_pays(self, reach: list[float]) -> bool:
        """Whether verifying the lookup chain alone (reach[d - 1]: the chance its first d tokens are accepted)
        promises at least the tokens/s of the last head-drafted tree (measured costs only): then a step skips the
        head, which would cost a step's drafting."""
        if not reach or self.verify_seconds is None or self.head_rate is None:
            return False
        expected = 1.0
        best = 0.0
        for depth, chance in enumerate(reach, start=1):
            expected += chance
            best = max(best, expected / self.verify_seconds(depth + 1))
        return best >= self.head_rate
