"""Medusa speculation: a static tree (`medusa_choices`) filled with the heads' top-k at the target's last hidden
state, cut each step to the paths whose measured acceptance pays for their verification (`static_tree.py`; with
`adaptive_draft_len: false` the whole tree is verified every step). Verification is lossless, unless the user opts
into Medusa's typical acceptance (`typical_acceptance`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specserve.checks import ConfigError
from specserve.engine.step_costs import target_verify_seconds
from specserve.models.loader import LoadedModel
from specserve.speculative.base import MethodEntry, MethodOptions, Proposal, Proposer, SpecMethod
from specserve.speculative.choices import DEFAULT_CHOICES
from specserve.speculative.medusa import MedusaHeads, load_medusa, medusa_tree
from specserve.speculative.static_tree import POOL_DECAY, PathRates, StaticTreePruner
from specserve.speculative.verify import TypicalAcceptance


class MedusaProposer(Proposer):
    def __init__(self, heads: MedusaHeads, pruner: StaticTreePruner, typical: TypicalAcceptance | None):
        self.heads, self.pruner, self.typical = heads, pruner, typical
        self.hidden: torch.Tensor | None = None

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden[-1]

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        self.pruner.learn(tokens)
        paths = self.pruner.choose(min(max_len, self.heads.num_heads))
        if self.hidden is None or not paths:
            return Proposal.chain(tokens[-1], [])
        tree = medusa_tree(self.heads, self.hidden.to(self.heads_dtype), tokens[-1], paths)
        # node i + 1 is paths[i]: both in (depth, ranks) order
        self.pruner.drafted(paths, dict(zip(paths, tree.tokens[1:].tolist())), len(tokens))
        return Proposal(tree, typical=self.typical)

    @property
    def heads_dtype(self) -> torch.dtype:
        return next(self.heads.parameters()).dtype


class MedusaMethod(SpecMethod):
    name = "medusa"
    needs_hidden_states = True
    drafts_trees = True

    def __init__(self, heads: MedusaHeads, choices=DEFAULT_CHOICES, typical: TypicalAcceptance | None = None,
                 verify_seconds=None):
        """`verify_seconds(n)`: the target's measured cost of verifying n tokens; given, each step verifies only
        the paths that pay (None: the whole tree)."""
        self.heads = heads
        self.choices = [list(c) for c in choices]
        self.typical = typical
        self.lossless = typical is None
        self.verify_seconds = verify_seconds
        self.path_rates = PathRates(POOL_DECAY)

    def draft_slots(self, max_draft_len: int) -> int:
        return 1 + sum(len(c) <= max_draft_len for c in self.choices)

    def new_proposer(self, params, generator, capacity) -> Proposer:
        pruner = StaticTreePruner(self.choices, self.verify_seconds, self.path_rates)
        return MedusaProposer(self.heads, pruner, self.typical)


@dataclass
class MedusaOptions(MethodOptions):
    choices: list[list[int]] | None = None  # medusa_choices; None: mc_sim_7b_63
    typical: TypicalAcceptance | None = None  # typical_acceptance (posterior_threshold, posterior_alpha): lossy
    KEYS: ClassVar[frozenset[str]] = frozenset({"medusa_choices", "typical_acceptance", "posterior_threshold",
                                                "posterior_alpha"})
    EXCLUSIVE: ClassVar[dict[str, str]] = {"typical_acceptance": "Medusa (decoding_type: Medusa)"}

    @classmethod
    def read(cls, settings: dict) -> dict:
        out = {"choices": settings.get("medusa_choices")}
        if settings.get("typical_acceptance"):
            default = TypicalAcceptance()
            out["typical"] = TypicalAcceptance(float(settings.get("posterior_threshold", default.threshold)),
                                               float(settings.get("posterior_alpha", default.alpha)))
        return out


def build(options: MedusaOptions, target: LoadedModel) -> MedusaMethod:
    spec = target.model.spec
    try:
        heads = load_medusa(options.model, spec.hidden_size, spec.vocab_size, dtype=target.model.dtype)
        verify_seconds = target_verify_seconds(target) if options.adaptive_draft_len else None
        return MedusaMethod(heads, options.choices or DEFAULT_CHOICES, options.typical, verify_seconds)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot use Medusa heads {options.model}: {exc}") from None


MEDUSA = MethodEntry(MedusaMethod.name, MedusaOptions, build, trtllm="Medusa", vllm=("medusa",),
                     model_needed="the directory of the Medusa heads", trains="medusa",
                     head_kind="medusa")
