"""Block drafting with a DFlash drafter (`dflash.py`): one drafter forward proposes a chain of up to block_size - 1
tokens, which the target verifies in one forward.

Per request the drafter keeps its context cache: each step it first injects the features of the tokens committed
since the last step (their keys and values, no attention), then runs the block [pending token, mask, ...] once.
Greedy drafts take each position's argmax; sampled drafts draw each position from its own distribution q_j, which
goes to the verifier's rejection sampling: a token drawn from q_j independently of the other positions and of the
target keeps the rule exact, so sampled outputs follow the target's distribution and greedy outputs equal plain
decoding whatever the drafter says.

How much of the block is verified: with the target's measured costs (`verify_seconds`), each step verifies the
prefix with the most expected tokens per second, a position's chance of acceptance being the drafter's own
probability of its token along the prefix, calibrated against what the target accepts (`tree_budget.TreeBudget`,
EAGLE's: a chain is a tree of one branch); without them, the batch's draft-length choice (acceptance per
position). The draft gate turns drafting off for a request where it does not pay.

With a lookup branch (`dflash+ngram`, `dflash+suffix`: `branched.py`), the branch's chain is merged into the
block's chain as a second branch of a tree, scored by its measured acceptance, and the budget verifies the nodes of
both that pay; a step where the chain alone promises more than the last drafted tree skips the drafter. A tree
with a branch takes the block's argmax tokens: both chains are deterministic candidates, verified losslessly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from specserve.checks import ConfigError
from specserve.models.loader import LoadedModel
from specserve.models.step_costs import measured_step_costs
from specserve.speculative import dflash_kernels, eagle_kernels
from specserve.speculative.base import DraftKind, MethodEntry, Proposal
from specserve.speculative.branched import (BRANCHES, COMBINED_DRAFT_CAP, BranchedMethod, BranchedProposer,
                                            BranchOptions, Branches)
from specserve.speculative.dflash import ContextCache, DFlashDrafter, is_dflash_dir, load_dflash
from specserve.speculative.grammar import DraftWalk
from specserve.speculative.policy.tree_budget import Nodes, TreeBudget
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.weights import read_draft_vocab


class DFlashMethod(BranchedMethod):
    needs_hidden_states = True

    def __init__(self, drafter: DFlashDrafter, target_model, draft_vocab: torch.Tensor | None = None,
                 quantization: str = eagle_kernels.DEFAULT_HEAD_QUANTIZATION,
                 verify_seconds: Callable[[int], float] | None = None, branches: Branches | None = None,
                 name: str = "dflash"):
        """`draft_vocab` (sorted or not; the drafter's draft_vocab.json): the target ids drafts are scored over,
        through those rows of the target's lm_head, instead of the whole vocabulary. `quantization`: the
        drafter's linears and those rows on the CPU kernels (bf16 drafters).
        `verify_seconds(n)`: the target's cost of verifying n tokens, so that each step verifies the prefix of
        the block that pays most. `branches`: the lookup chain merged into every draft (none by default)."""
        self.name = name
        self.branches = branches or Branches()
        self.drafter = drafter
        self.kernel_block = None  # the block's forward on the kernels, where they run
        if dflash_kernels.usable(drafter):
            pack_linears(drafter, quantization)
            self.kernel_block = dflash_kernels.KernelBlock(drafter)
        self.verify_seconds = verify_seconds
        self.target = target_model
        config = drafter.config
        self.hidden_layers = tuple(config.target_layer_ids)  # the outputs of these target layers
        self.block_size = config.block_size
        self.mask_token = torch.tensor(config.mask_token_id)
        self.embedding_scale = config.input_embedding_scale
        whole_head = getattr(target_model, "lm_head_shard", None) is None  # a shard holds other rows
        self.vocab_ids = draft_vocab.sort().values if draft_vocab is not None and whole_head else None
        self.vocab_rows = None if self.vocab_ids is None else \
            eagle_kernels.target_rows(target_model, self.vocab_ids, quantization)

    @property
    def draft_kind(self) -> DraftKind:
        """Sized by the proposer from measured costs, else by the batch's draft-length choice; gated either way."""
        return DraftKind.SIZED_TREE if self.verify_seconds is not None else DraftKind.HEAD_TREE

    def draft_slots(self, max_draft_len: int) -> int:
        return 1 + max_draft_len + (max_draft_len if self.branches else 0)

    def new_proposer(self, params: SamplingParams, generator: torch.Generator, capacity: int) -> "DFlashProposer":
        return DFlashProposer(self, params, generator, capacity)


    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding rows (its table may be packed: only these rows are dequantized), scaled as the
        drafter was trained."""
        x = self.target.model.embed_tokens(tokens)
        return x * torch.tensor(self.embedding_scale, dtype=x.dtype) if self.embedding_scale != 1.0 else x

    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, V'] of the drafter's normed outputs [n, h]: over the draft vocabulary's rows, or the
        target's whole lm_head."""
        if self.vocab_rows is not None:
            return self.vocab_rows(outputs)
        return self.target.logits(outputs, self.target.kernels_usable and outputs.shape[0] <= 64).float()

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.vocab_ids is None else self.vocab_ids[index]

    def full_vocabulary(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary as one over the target's (zero elsewhere)."""
        if self.vocab_ids is None:
            return q
        full = q.new_zeros(self.target.spec.vocab_size)
        full[self.vocab_ids] = q
        return full


def pack_linears(drafter: DFlashDrafter, quantization: str) -> None:
    """The drafter's linears in `quantization` on the CPU kernels, in place: its weights' bytes are most of its
    drafting time."""
    for module in list(drafter.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, eagle_kernels.packed(child, quantization))


class DFlashProposer(BranchedProposer):
    def __init__(self, method: DFlashMethod, params: SamplingParams, generator: torch.Generator, capacity: int):
        self.m = method
        self.params = params
        self.generator = generator
        self.cache = ContextCache(method.drafter, capacity)
        self.features: list[torch.Tensor] = []  # target features of committed tokens not yet injected
        self.budget = TreeBudget(method.verify_seconds, 1, method.block_size - 1, static=False)
        self.lookup = method.branches.for_request(params, capacity)

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        length = min(max_len, self.m.block_size - 1)
        if length <= 0 or (not self.features and not self.cache.length):
            return Proposal.chain(tokens[-1], [])
        chain, reach = self.branch_chain(tokens, max_len)
        if self.budget.lookup_alone_pays(reach):
            return self.lookup_only(tokens[-1], chain, reach)
        start = time.perf_counter()
        self._inject(len(tokens) - 1)
        logits = self._block(tokens[-1], length)
        if chain or (self.params.greedy and self.grammar is None):
            index = logits.argmax(-1)
            drafted = self.m.to_target_ids(index).tolist()
            dists = []
        else:
            drafted, dists = self._choose(logits)
            index = None
        elapsed = time.perf_counter() - start
        self.budget.time_level(elapsed)
        if chain:
            return self._with_branch(self._nodes(tokens[-1], drafted, logits, index, dists), chain, reach, elapsed)
        keep = self._worth_verifying(tokens[-1], drafted, logits, index, dists, elapsed)
        return Proposal.chain(tokens[-1], drafted[:keep], torch.stack(dists[:keep]) if dists[:keep] else None)

    def _worth_verifying(self, root: int, drafted: list[int], logits, index, dists, elapsed: float) -> int:
        """How many of the drafted tokens to verify: all without measured costs, else the budget's best prefix."""
        if self.m.verify_seconds is None or not drafted:
            return len(drafted)
        nodes = self._nodes(root, drafted, logits, index, dists)
        keep = self.budget.select(nodes)
        if self.lookup is not None:  # what a branch's chain alone must beat at a later step
            self.budget.note_head_rate(nodes, keep, elapsed)
        self.budget.expect(nodes, keep)
        return len(keep)

    def _with_branch(self, nodes: Nodes, chain: list[int], reach: list[float], elapsed: float) -> Proposal:
        """The block's chain and the lookup branch's as one tree, cut to the nodes that pay."""
        self.merge(nodes, chain, reach)
        keep = self.budget.select(nodes)
        self.budget.note_head_rate(nodes, keep, elapsed)
        if not keep:
            return Proposal.chain(nodes.tokens[0], [])
        self.budget.expect(nodes, keep)
        return Proposal(nodes.tree(keep))

    @staticmethod
    def _nodes(root: int, drafted: list[int], logits, index, dists) -> Nodes:
        """The drafted chain as tree nodes, each position scored by the drafter's log-probability of its token
        (summed along the chain: the path score)."""
        if dists:  # sampled: the chance of the drawn token under the q it was drawn from
            logps = [math.log(max(float(q[token]), 1e-12)) for q, token in zip(dists, drafted)]
        else:
            rows = logits[: len(drafted)]
            picked = index if index is not None else rows.argmax(-1)
            logps = (rows.gather(-1, picked[:, None])[:, 0] - torch.logsumexp(rows, -1)).tolist()
        nodes = Nodes(root, None)
        node = 0
        for token, logp in zip(drafted, logps):
            node = nodes.add(node, token, logp, 0)
        return nodes

    def _inject(self, committed: int) -> None:
        """The context's keys and values of the tokens committed since the last step."""
        if not self.features:
            return
        features = torch.cat(self.features)
        self.features = []
        start = committed - features.shape[0]
        if start != self.cache.length:
            raise RuntimeError(f"DFlash context out of step: {self.cache.length} tokens cached, {start} expected")
        positions = torch.arange(start, committed)[None]
        self.cache.append(self.m.drafter.context(features[None], positions))

    def _block(self, root: int, length: int) -> torch.Tensor:
        """The draft logits [length, V'] of the block [root, mask * length] after the cached context."""
        m = self.m
        ids = torch.cat([torch.tensor([root]), m.mask_token.expand(length)])
        positions = torch.arange(self.cache.length, self.cache.length + length + 1)[None]
        if m.kernel_block is not None:
            cos, sin = m.drafter.rotary(positions[0])
            return m.draft_logits(m.kernel_block(m.embed(ids), cos, sin, self.cache)[1:])
        outputs = m.drafter.block(m.embed(ids)[None], positions, self.cache.slots())
        return m.draft_logits(outputs[0, 1:])

    def _choose(self, logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        """Each position's token (drawn from its q when sampling), under a guided request's grammar."""
        m = self.m
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        with DraftWalk(self.grammar) as walk:
            for row in logits:
                row = walk.masked(row, m.vocab_ids)
                if row is None:  # nothing allowed the drafter can say
                    break
                if self.params.greedy:
                    index = row.argmax()
                else:
                    q = probabilities(row[None], self.params)[0]
                    index = sample(q[None], self.generator)[0]
                    dists.append(m.full_vocabulary(q))
                drafted.append(int(m.to_target_ids(index)))
                if not walk.take(drafted[-1]):
                    break
        return drafted, dists


@dataclass
class DFlashOptions(BranchOptions):
    # a bf16 drafter's linears and its draft vocabulary's lm_head rows on the CPU kernels: int4, int8 or none
    quantization: str = eagle_kernels.DEFAULT_HEAD_QUANTIZATION
    KEYS: ClassVar[frozenset[str]] = BranchOptions.KEYS | {"quantization"}

    @classmethod
    def read(cls, settings: dict) -> dict:
        return {**BranchOptions.read(settings), **eagle_kernels.read_quantization(settings, "a DFlash drafter")}


def build(options: DFlashOptions, target: LoadedModel) -> DFlashMethod:
    spec = target.model.spec
    try:
        drafter = load_dflash(options.model, spec, dtype=target.model.dtype)
        vocab = read_draft_vocab(Path(options.model), spec.vocab_size)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot use DFlash drafter {options.model}: {exc}") from None
    verify_seconds = measured_step_costs(target) if options.adaptive_draft_len else None
    return DFlashMethod(drafter, target.model, vocab, options.quantization, verify_seconds,
                        Branches.of(options, target), options.label)


DFLASH = MethodEntry("dflash", DFlashOptions, build, trtllm="DFlash", vllm=("dflash",),
                     model_needed="the directory of the DFlash drafter", holds_head=is_dflash_dir, trains="dflash",
                     head_kind="dflash", fixed_draft_len=7, combines=BRANCHES,
                     combined_draft_cap=COMBINED_DRAFT_CAP)
