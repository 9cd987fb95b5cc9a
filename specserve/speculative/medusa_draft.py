"""Medusa speculation: a static tree (`medusa_choices`) filled with the heads' top-k at the target's last hidden
state, cut each step by the heads' own confidence. Head d predicts one position, so a path's score, the sum of its
nodes' head log-probabilities, estimates the chance that the target accepts the whole path (the shipped heads' top-1
probability tracks their acceptance: 0.92 of tokens accepted where head 0 gives >= 0.8, 0.14 where it gives < 0.2,
on distilled answers they were not trained on). As for EAGLE's trees, `tree_budget.TreeBudget` keeps the closed
subtree with the most expected tokens per second under the target's measured verify costs, calibrated by the
acceptance the request gets; a deeper head runs only while its level is worth drafting (the budget's rule for
EAGLE's levels). With `adaptive_draft_len: false` the whole tree is drafted and verified every step. The heads
draft on the CPU kernels where they run (`medusa_kernels.py`). Verification is lossless, unless the user opts into
Medusa's typical acceptance (`typical_acceptance`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from specserve.checks import ConfigError
from specserve.models.loader import LoadedModel
from specserve.models.step_costs import measured_step_costs
from specserve.speculative import medusa_kernels
from specserve.speculative.base import DraftKind, MethodEntry, MethodOptions, Proposal, Proposer, SpecMethod
from specserve.speculative.choices import DEFAULT_CHOICES
from specserve.speculative.eagle_kernels import DEFAULT_HEAD_QUANTIZATION, read_quantization
from specserve.speculative.medusa import MedusaHeads, load_medusa
from specserve.speculative.policy.tree_budget import Nodes, TreeBudget
from specserve.speculative.verify import TypicalAcceptance


class MedusaProposer(Proposer):
    def __init__(self, method: MedusaMethod):
        self.m = method
        self.hidden: torch.Tensor | None = None
        self.budget = TreeBudget(method.verify_seconds, 1, len(method.paths), static=True)

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden[-1]
        self.budget.observe(hidden.shape[0] - 1)  # rows: the root and each accepted node

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        depth = min(max_len, self.m.heads.num_heads)
        if self.hidden is None or depth <= 0:
            return Proposal.chain(tokens[-1], [])
        nodes = self.m.scored_tree(tokens[-1], self.hidden, depth, self.budget)
        keep = self.budget.select(nodes)
        if not keep:
            return Proposal.chain(tokens[-1], [])
        self.budget.expect(nodes, keep)
        return Proposal(nodes.tree(keep), typical=self.m.typical)


class MedusaMethod(SpecMethod):
    name = "medusa"
    needs_hidden_states = True
    draft_kind = DraftKind.HEAD_TREE

    def __init__(self, heads: MedusaHeads, choices=DEFAULT_CHOICES, typical: TypicalAcceptance | None = None,
                 verify_seconds=None, head_quantization: str = DEFAULT_HEAD_QUANTIZATION):
        """`verify_seconds(n)`: the target's measured cost of verifying n tokens; given, each step verifies only
        the nodes that pay (None: the whole tree). `head_quantization`: the heads' weights on the kernels ("int8",
        "int4" or "none": bf16), medusa_kernels.py."""
        self.heads = heads
        self.paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        lacking = [list(c) for c in self.paths if not c or min(c) < 0 or (len(c) > 1 and c[:-1] not in self.paths)]
        if lacking:
            raise ValueError(f"medusa_choices {lacking[:3]}: each choice must be a path of ranks >= 0 whose "
                             f"every prefix is a choice too")
        self.typical = typical
        self.lossless = typical is None
        self.verify_seconds = verify_seconds
        usable = medusa_kernels.usable(heads)
        self.runner = medusa_kernels.KernelMedusa(heads, head_quantization) if usable else None

    def draft_slots(self, max_draft_len: int) -> int:
        return 1 + sum(len(c) <= max_draft_len for c in self.paths)

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return MedusaProposer(self)

    @torch.inference_mode()
    def scored_tree(self, root: int, hidden: torch.Tensor, depth: int, budget: TreeBudget | None = None) -> Nodes:
        """The tree's paths up to `depth` below `root`, node c carrying head len(c) - 1's candidate of rank c[-1],
        scored by its path's summed head log-probabilities (ranks beyond a small draft vocabulary are left out).
        With a `budget` (under measured costs), head d runs only where its level is worth drafting."""
        below: dict[tuple[int, ...], list[int]] = {}
        for path in self.paths:
            if len(path) <= depth:
                below.setdefault(path[:-1], []).append(path[-1])
        nodes, node_of = Nodes(root, None), {(): 0}
        hidden = hidden.to(self.heads_dtype)
        for level in range(depth):
            parents = [path for path in node_of if len(path) == level and path in below]
            if level and budget is not None:
                parents = [nodes.paths[n] for n in budget.worth_expanding(nodes, [node_of[p] for p in parents])]
            if not parents:
                break
            start = time.perf_counter()
            logits = (self.runner or self.heads).head_logits(hidden, level)
            ranks = min(1 + max(rank for parent in parents for rank in below[parent]), logits.shape[-1])
            top = torch.topk(torch.log_softmax(logits, dim=-1), ranks)
            ids = top.indices if self.heads.vocab_subset is None else self.heads.vocab_subset[top.indices]
            ids, logps = ids.tolist(), top.values.tolist()
            if budget is not None:
                budget.time_level(time.perf_counter() - start)
                budget.observe_level([logps[0]])  # a head's best token, whatever its parent
            for parent in parents:
                for rank in below[parent]:
                    if rank < len(ids):
                        node_of[parent + (rank,)] = nodes.add(node_of[parent], ids[rank], logps[rank], rank)
        return nodes

    @property
    def heads_dtype(self) -> torch.dtype:
        return next(self.heads.parameters()).dtype


@dataclass
class MedusaOptions(MethodOptions):
    choices: list[list[int]] | None = None  # medusa_choices; None: mc_sim_7b_63
    typical: TypicalAcceptance | None = None  # typical_acceptance (posterior_threshold, posterior_alpha): lossy
    # the heads' weights when they draft on the CPU kernels: int4, int8 or none (bf16)
    quantization: str = DEFAULT_HEAD_QUANTIZATION
    KEYS: ClassVar[frozenset[str]] = frozenset({"medusa_choices", "typical_acceptance", "posterior_threshold",
                                                "posterior_alpha", "quantization"})
    EXCLUSIVE: ClassVar[dict[str, str]] = {"typical_acceptance": "Medusa (decoding_type: Medusa)"}

    @classmethod
    def read(cls, settings: dict) -> dict:
        out = {"choices": settings.get("medusa_choices"), **read_quantization(settings, "Medusa heads")}
        if settings.get("typical_acceptance"):
            default = TypicalAcceptance()
            out["typical"] = TypicalAcceptance(float(settings.get("posterior_threshold", default.threshold)),
                                               float(settings.get("posterior_alpha", default.alpha)))
        return out


def build(options: MedusaOptions, target: LoadedModel) -> MedusaMethod:
    spec = target.model.spec
    try:
        heads = load_medusa(options.model, spec.hidden_size, spec.vocab_size, dtype=target.model.dtype)
        verify_seconds = measured_step_costs(target) if options.adaptive_draft_len else None
        return MedusaMethod(heads, options.choices or DEFAULT_CHOICES, options.typical, verify_seconds,
                            options.quantization)
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"cannot use Medusa heads {options.model}: {exc}") from None


MEDUSA = MethodEntry(MedusaMethod.name, MedusaOptions, build, trtllm="Medusa", vllm=("medusa",),
                     model_needed="the directory of the Medusa heads", trains="medusa",
                     head_kind="medusa")
