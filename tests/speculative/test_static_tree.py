"""Medusa's static tree cut to the paths that pay: which path a step accepted is read back exactly, a tree whose
paths are never accepted shrinks to nothing, one whose top paths are always accepted keeps them."""

from __future__ import annotations

from specserve.speculative.choices import DEFAULT_CHOICES
from specserve.speculative.static_tree import PathRates, StaticTreePruner


def verify(n: float) -> float:
    return 1.0 + 0.15 * n  # a CPU-like curve: each verified token costs 15% of a plain step


def tokens_of(paths):
    """A made-up token per path: 100 + rank at depth 1, 10 * parent's token + rank deeper."""
    out = {}
    for path in paths:
        token = 100
        for rank in path:
            token = token * 10 + rank
        out[path] = token
    return out


def step(pruner: StaticTreePruner, context: list[int], accept: tuple[int, ...]) -> list[tuple[int, ...]]:
    """One step: choose, 'verify' accepting the path `accept` (as far as it was drafted), commit a bonus token."""
    pruner.learn(context)
    paths = pruner.choose(5)
    table = tokens_of(paths)
    pruner.drafted(paths, table, len(context))
    accepted = [table[accept[:d]] for d in range(1, len(accept) + 1) if accept[:d] in table]
    context.extend(accepted + [7])  # 7: the bonus, never a drafted token
    return paths


def test_learn_reads_back_the_accepted_path():
    pruner = StaticTreePruner(DEFAULT_CHOICES, verify, PathRates())
    context = [1, 2, 3]
    paths = step(pruner, context, (0, 0, 1))  # (0, 0, 1) itself is not drafted: the step accepts (0,), (0, 0)
    pruner.learn(context)
    assert (0, 0) in paths and (0, 0, 1) not in paths
    assert pruner.own.accepted == {(0,): 1.0, (0, 0): 1.0}
    assert set(pruner.own.verified) == set(paths)


def test_a_tree_never_accepted_shrinks_to_nothing_and_one_always_accepted_keeps_its_path():
    context = [1]
    never = StaticTreePruner(DEFAULT_CHOICES, verify, PathRates())
    sizes = [len(step(never, context, ())) for _ in range(30)]
    assert sizes[0] > 0 and sizes[-1] == 0

    always = StaticTreePruner(DEFAULT_CHOICES, verify, PathRates())
    for _ in range(30):
        paths = step(always, context, (0, 0, 0))
    assert {(0,), (0, 0), (0, 0, 0)} <= set(paths)
    assert len(paths) < len(DEFAULT_CHOICES) // 2  # the paths that are never accepted are cut


def test_without_costs_the_whole_tree_is_verified():
    pruner = StaticTreePruner(DEFAULT_CHOICES, None, PathRates())
    assert len(pruner.choose(5)) == len({tuple(c) for c in DEFAULT_CHOICES})


def test_the_chosen_paths_are_closed_under_parents():
    pruner = StaticTreePruner(DEFAULT_CHOICES, verify, PathRates())
    context = [1]
    for accept in [(1, 0), (0,), (2, 1, 0), (0, 0)] * 5:
        paths = step(pruner, context, accept)
        assert all(p[:-1] in paths for p in paths if len(p) > 1)
