"""Medusa's static tree (`medusa_choices`) cut each step to the paths that pay. (EAGLE-1's static trees are cut
by the head's own calibrated scores instead: `tree_budget.py`.)

A static tree is a set of paths of top-k ranks (`mc_sim_7b_63`: 63 nodes, tuned on a GPU, where verifying 64
tokens costs about what one does). On a CPU a forward of 64 tokens costs several plain steps, so the full tree
loses unless nearly all of it is accepted. Per request this keeps, for every path c of the tree, the rate at which
verification accepted it:

    p(c) = (accepted_c + W * p0(c)) / (verified_c + W)

with p0 the pool's rate (every request's so far, slowly forgotten; before any evidence a prior of 0.6 per depth,
halved per rank step). Accepting a node needs its parent accepted, so p is made monotone down the tree.
A tree of the n best paths emits 1 + (sum of their p) tokens per step on average, for the target's measured cost
of verifying n + 1 tokens, `verify_seconds(n + 1)`; each step verifies the n that maximize tokens per second
(none, when no path pays). Which path was accepted is read back from the tokens the step committed: exactly the
tree's root path that the committed tokens follow (a rejected node's token is never what the target emits there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Path = tuple[int, ...]
REQUEST_WEIGHT = 4.0  # the pool's rate counts as this many verifications of a path in a request's estimate
PRIOR_WEIGHT = 4.0  # the prior counts as this many verifications in the pool's
POOL_DECAY = 0.995


def prior(path: Path) -> float:
    """Before any evidence: 0.6 for the top-1 child, halved per rank step, compounded down the path."""
    out = 1.0
    for rank in path:
        out *= 0.6 * 0.5 ** rank
    return out


class PathRates:
    """Accepted / verified counts per path (a request's, or the pool's: then decayed)."""

    def __init__(self, decay: float = 1.0):
        self.decay = decay
        self.verified: dict[Path, float] = {}
        self.accepted: dict[Path, float] = {}

    def update(self, verified: list[Path], accepted: set[Path]) -> None:
        if self.decay < 1.0:
            for table in (self.verified, self.accepted):
                for key in table:
                    table[key] *= self.decay
        for path in verified:
            self.verified[path] = self.verified.get(path, 0.0) + 1.0
            if path in accepted:
                self.accepted[path] = self.accepted.get(path, 0.0) + 1.0

    def rate(self, path: Path, start: float, weight: float) -> float:
        return (self.accepted.get(path, 0.0) + weight * start) / (self.verified.get(path, 0.0) + weight)


class StaticTreePruner:
    """One request's choice of paths; `pool` is the method's PathRates (decaying)."""

    def __init__(self, choices: Sequence[Sequence[int]], verify_seconds: Callable[[int], float] | None,
                 pool: PathRates):
        self.paths: list[Path] = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        self.verify_seconds = verify_seconds
        self.pool, self.own = pool, PathRates()
        self.pending: tuple[list[Path], dict[Path, int], int] | None = None  # paths, their tokens, context length

    def rates(self, max_depth: int) -> dict[Path, float]:
        out: dict[Path, float] = {}
        for path in self.paths:  # parents first (sorted by depth)
            if len(path) > max_depth:
                continue
            pooled = self.pool.rate(path, prior(path), PRIOR_WEIGHT)
            rate = self.own.rate(path, pooled, REQUEST_WEIGHT)
            out[path] = min(rate, out[path[:-1]]) if len(path) > 1 else rate
        return out

    def choose(self, max_depth: int) -> list[Path]:
        """The paths to verify this step (all of them without measured costs), parents before children."""
        if self.verify_seconds is None:
            return [p for p in self.paths if len(p) <= max_depth]
        rates = self.rates(max_depth)
        ranked = sorted(rates, key=lambda p: (-rates[p], len(p)))  # a parent never ranks below its child
        best, best_rate, expected = 0, 1.0 / self.verify_seconds(1), 1.0
        for n, path in enumerate(ranked, start=1):
            expected += rates[path]
            rate = expected / self.verify_seconds(n + 1)
            if rate > best_rate:
                best, best_rate = n, rate
        return sorted(ranked[:best], key=lambda c: (len(c), c))

    def drafted(self, paths: list[Path], tokens_of: dict[Path, int], context_length: int) -> None:
        """The tree of `paths` (path -> its token) goes to verification after a context of this length."""
        self.pending = (paths, tokens_of, context_length) if paths else None

    def learn(self, tokens: list[int]) -> None:
        """Read which path the last tree's step accepted from the tokens it committed (`tokens`: the context now)."""
        if self.pending is None:
            return
        paths, tokens_of, start = self.pending
        self.pending = None
        by_prefix: dict[Path, dict[int, Path]] = {}
        for path in paths:
            by_prefix.setdefault(path[:-1], {})[tokens_of[path]] = path
        accepted, node = set(), ()
        for token in tokens[start:]:
            node = by_prefix.get(node, {}).get(token)
            if node is None:
                break
            accepted.add(node)
        self.own.update(paths, accepted)
        self.pool.update(paths, accepted)
