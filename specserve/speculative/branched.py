"""A lookup chain as a branch of a model's draft tree: `eagle3+ngram`, `eagle3+suffix`, `dflash+ngram`.

The method holds the branch's source (`Branches`: prompt lookup's n-gram bounds, or a suffix method) and its
acceptance pooled over requests; each request's proposer (`BranchedProposer`) merges the branch's chain into the
drafted tree, where the draft's own nodes with the same tokens are shared and the rest hangs below them, scored by
the chain's measured acceptance by position (`lookup_branch.py`) so that the budget (`tree_budget.py`) weighs it
against the model's nodes. Both are deterministic candidates: verification stays lossless. EAGLE's trees and
DFlash's blocks take it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specserve.checks import ConfigError, flag
from specserve.speculative.base import MethodOptions, Proposal, Proposer, SpecMethod
from specserve.speculative.lookup_branch import LookupBranch, SuffixBranch
from specserve.speculative.ngram import LOOKUP_KEYS, NGRAM, NGramOptions, check_lookup_bounds, read_lookup_bounds
from specserve.speculative.policy.acceptance import AcceptanceByEvidence
from specserve.speculative.policy.tree_budget import Nodes, TreeBudget
from specserve.speculative.suffix import SUFFIX, SuffixMethod, SuffixOptions

BRANCHES = ((NGRAM, "prompt_lookup_branch"), (SUFFIX, "suffix_branch"))  # NAME+ngram, NAME+suffix
# a draft with a lookup branch, unless max_draft_len is given: as deep as `ngram`'s cap (a shallower branch lost
# to `ngram` alone: docs/design-notes.md); the budget and the draft gate keep the model's own part from going
# deeper than it pays
COMBINED_DRAFT_CAP = NGRAM.adaptive_draft_cap
OWNER = "EAGLE trees and DFlash blocks (decoding_type: Eagle, Eagle3 or DFlash)"


@dataclass
class BranchOptions(MethodOptions):
    """The branch's settings, in EAGLE's spelling (`prompt_lookup_branch`, `prompt_lookup_min` / `_max`) or
    suffix decoding's (`suffix_branch` and the `suffix_decoding_*` keys)."""

    lookup_branch: bool = False  # prompt_lookup_branch: merge prompt lookup's continuation into every draft
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = NGramOptions.prompt_lookup_max  # the branch drafts what prompt lookup alone would
    suffix_branch: bool = False  # merge suffix decoding's best chain into every draft instead
    suffix: dict = field(default_factory=dict)  # that suffix method's settings (SuffixOptions fields)
    KEYS: ClassVar[frozenset[str]] = LOOKUP_KEYS | SuffixOptions.KEYS | {"prompt_lookup_branch", "suffix_branch"}
    EXCLUSIVE: ClassVar[dict[str, str]] = {"prompt_lookup_branch": OWNER, "suffix_branch": OWNER}

    @classmethod
    def read(cls, settings: dict) -> dict:
        out = {**read_lookup_bounds(settings), "suffix": SuffixOptions.read(settings)}
        for key, name in (("prompt_lookup_branch", "lookup_branch"), ("suffix_branch", "suffix_branch")):
            if key in settings:
                out[name] = flag(settings[key], key)
        return out

    def check(self) -> None:
        if self.lookup_branch:
            check_lookup_bounds(self.prompt_lookup_min, self.prompt_lookup_max)
        if self.lookup_branch and self.suffix_branch:
            raise ConfigError("prompt_lookup_branch and suffix_branch: a draft takes one lookup branch")

    @property
    def label(self) -> str:
        if self.suffix_branch:
            return f"{self.name}+{SUFFIX.name}"
        return f"{self.name}+{NGRAM.name}" if self.lookup_branch else self.name


class Branches:
    """A method's branch source: prompt lookup (`lookup` = (min n, max n)) or a suffix method (`suffix`), or none;
    and the branch's acceptance over requests."""

    def __init__(self, lookup: tuple[int, int] | None = None, suffix: SuffixMethod | None = None):
        if lookup is not None:
            check_lookup_bounds(*lookup, ValueError)
        if lookup is not None and suffix is not None:
            raise ValueError("prompt lookup and suffix decoding cannot both be the branch")
        self.lookup, self.suffix = lookup, suffix
        self.pool = AcceptanceByEvidence.pooled()

    @classmethod
    def of(cls, options: BranchOptions, target) -> "Branches":
        lookup = (options.prompt_lookup_min, options.prompt_lookup_max) if options.lookup_branch else None
        suffix = SUFFIX.build(SuffixOptions(**options.suffix), target) if options.suffix_branch else None
        return cls(lookup, suffix)

    def __bool__(self) -> bool:
        return self.lookup is not None or self.suffix is not None

    def for_request(self, params, capacity: int) -> LookupBranch | None:
        """A request's branch, if there is one. A seeded request's learns from its own tokens only, so that its
        drafts, and so the random numbers its verification draws, do not depend on earlier requests."""
        pool = self.pool if params.seed is None else None
        if self.suffix is not None:
            return SuffixBranch(self.suffix.new_proposer(params, None, capacity), pool)
        return LookupBranch(*self.lookup, pool) if self.lookup else None

    def reset(self) -> None:
        self.pool = AcceptanceByEvidence.pooled()
        if self.suffix is not None:
            self.suffix.reset()

    def stats(self) -> dict:
        return self.suffix.stats() if self.suffix is not None else {}


class BranchedMethod(SpecMethod):
    """A model drafter's method with its `branches` (none: Branches())."""

    branches: Branches

    def reset(self) -> None:
        self.branches.reset()

    def stats(self) -> dict:
        return self.branches.stats()


class BranchedProposer(Proposer):
    """A model drafter's proposer with a request's branch (`lookup`, None without one), its `budget`, and the
    target features of the tokens committed since its model last ran (`features`)."""

    budget: TreeBudget
    lookup: LookupBranch | None
    features: list[torch.Tensor]

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.features.append(hidden)
        self.budget.observe(hidden.shape[0] - 1)  # rows: the root and each accepted node

    def request_finished(self, output: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.request_finished(output)

    def situation(self, tokens: list[int], max_len: int) -> bool | None:
        """With a branch: whether it has a chain to offer at this step (Proposer.situation)."""
        return None if self.lookup is None else self.lookup.has_chain(tokens, max(1, max_len))

    def branch_chain(self, tokens: list[int], max_len: int) -> tuple[list[int], list[float]]:
        """The branch's chain and, per depth d, the chance its first d tokens are accepted (none: empty)."""
        return self.lookup.propose(tokens, max_len) if self.lookup is not None else ([], [])

    def propose_cheap(self, tokens: list[int], max_len: int) -> Proposal:
        """The branch alone (nothing without one); the model's inputs wait for a later step."""
        if max_len <= 0 or self.lookup is None:
            return Proposal.chain(tokens[-1], [])
        return self.lookup_only(tokens[-1], *self.lookup.propose(tokens, max_len))

    def lookup_only(self, root: int, chain: list[int], reach: list[float]) -> Proposal:
        nodes = Nodes(root, None)
        self.merge(nodes, chain, reach)
        keep = self.budget.select(nodes)
        if not keep:
            return Proposal.chain(root, [], cheap=True)
        self.budget.expect(nodes, keep)
        return Proposal(nodes.tree(keep), cheap=True)

    def merge(self, nodes: Nodes, chain: list[int], reach: list[float]) -> None:
        # stored scores are the model's uncalibrated ones: dividing by c keeps c * exp(score) = reach[depth - 1]
        nodes.merge_chain(chain, reach, math.log(self.budget.calibration))
