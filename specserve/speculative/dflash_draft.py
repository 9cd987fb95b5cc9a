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
from specserve.models import cpu_kernels
from specserve.models.loader import LoadedModel
from specserve.speculative import eagle_kernels
from specserve.speculative.base import DraftKind, MethodEntry, MethodOptions, Proposal, Proposer, SpecMethod
from specserve.speculative.dflash import ContextCache, DFlashDrafter, is_dflash_dir, load_dflash
from specserve.models.step_costs import measured_step_costs
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.tree_budget import Nodes, TreeBudget
from specserve.speculative.weights import read_draft_vocab


class DFlashMethod(SpecMethod):
    name = "dflash"
    needs_hidden_states = True

    def __init__(self, drafter: DFlashDrafter, target_model, draft_vocab: torch.Tensor | None = None,
                 quantization: str = eagle_kernels.DEFAULT_HEAD_QUANTIZATION,
                 verify_seconds: Callable[[int], float] | None = None):
        """`draft_vocab` (sorted or not; the drafter's draft_vocab.json): the target ids drafts are scored over,
        through those rows of the target's lm_head, instead of the whole vocabulary. `quantization`: the
        drafter's linears and those rows on the CPU kernels (bf16 drafters).
        `verify_seconds(n)`: the target's cost of verifying n tokens, so that each step verifies the prefix of
        the block that pays most."""
        self.drafter = drafter
        if drafter.norm.weight.dtype == torch.bfloat16 and cpu_kernels.available():
            pack_linears(drafter, quantization)
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

    def new_proposer(self, params: SamplingParams, generator: torch.Generator, capacity: int) -> Proposer:
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


class DFlashProposer(Proposer):
    def __init__(self, method: DFlashMethod, params: SamplingParams, generator: torch.Generator, capacity: int):
        self.m = method
        self.params = params
        self.generator = generator
        self.cache = ContextCache(method.drafter, capacity)
        self.features: list[torch.Tensor] = []  # target features of committed tokens not yet injected
        self.budget = TreeBudget(method.verify_seconds, 1, method.block_size - 1, static=False)

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.features.append(hidden)
        self.budget.observe(hidden.shape[0] - 1)  # rows: the root and each accepted token

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        length = min(max_len, self.m.block_size - 1)
        if length <= 0 or (not self.features and not self.cache.length):
            return Proposal.chain(tokens[-1], [])
        start = time.perf_counter()
        self._inject(len(tokens) - 1)
        logits = self._block(tokens[-1], length)
        if self.params.greedy and self.grammar is None:
            index = logits.argmax(-1)
            drafted = self.m.to_target_ids(index).tolist()
            dists = []
        else:
            drafted, dists = self._choose(logits)
            index = None
        self.budget.time_level(time.perf_counter() - start)
        keep = self._worth_verifying(tokens[-1], drafted, logits, index, dists)
        return Proposal.chain(tokens[-1], drafted[:keep], torch.stack(dists[:keep]) if dists[:keep] else None)

    def _worth_verifying(self, root: int, drafted: list[int], logits, index, dists) -> int:
        """How many of the drafted tokens to verify: all without measured costs, else the budget's best prefix,
        each position scored by the drafter's log-probability of its token (the chain's path score)."""
        if self.m.verify_seconds is None or not drafted:
            return len(drafted)
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
        keep = self.budget.select(nodes)
        self.budget.expect(nodes, keep)
        return len(keep)

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
        outputs = m.drafter.block(m.embed(ids)[None], positions, self.cache.view())
        return m.draft_logits(outputs[0, 1:])

    def _choose(self, logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        """Each position's token (drawn from its q when sampling), under a guided request's grammar: a position
        drafts from its logits masked by what the grammar allows after the tokens drafted before it, so no draft
        token is forbidden and q is the distribution it was drawn from."""
        m = self.m
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        pushed = 0
        try:
            for row in logits:
                if self.grammar is not None:
                    allowed = self.grammar.allowed()
                    row = row.masked_fill(~(allowed if m.vocab_ids is None else allowed[m.vocab_ids]), float("-inf"))
                    if not bool(torch.isfinite(row).any()):  # nothing allowed the drafter can say
                        break
                if self.params.greedy:
                    index = row.argmax()
                else:
                    q = probabilities(row[None], self.params)[0]
                    index = sample(q[None], self.generator)[0]
                    dists.append(m.full_vocabulary(q))
                token = int(m.to_target_ids(index))
                drafted.append(token)
                if self.grammar is not None:
                    if token in self.grammar.eos_ids:  # the output would end here: nothing to draft after it
                        break
                    self.grammar.push(token)
                    pushed += 1
        finally:
            if self.grammar is not None:  # the request's grammar stays where its emitted tokens left it
                self.grammar.pop(pushed)
        return drafted, dists


@dataclass
class DFlashOptions(MethodOptions):
    # a bf16 drafter's linears and its draft vocabulary's lm_head rows on the CPU kernels: int4, int8 or none
    quantization: str = eagle_kernels.DEFAULT_HEAD_QUANTIZATION
    KEYS: ClassVar[frozenset[str]] = frozenset({"quantization"})

    @classmethod
    def read(cls, settings: dict) -> dict:
        return eagle_kernels.read_quantization(settings, "a DFlash drafter")


def build(options: DFlashOptions, target: LoadedModel) -> DFlashMethod:
    spec = target.model.spec
    try:
        drafter = load_dflash(options.model, spec, dtype=target.model.dtype)
        vocab = read_draft_vocab(Path(options.model), spec.vocab_size)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot use DFlash drafter {options.model}: {exc}") from None
    verify_seconds = measured_step_costs(target) if options.adaptive_draft_len else None
    return DFlashMethod(drafter, target.model, vocab, options.quantization, verify_seconds)


DFLASH = MethodEntry(DFlashMethod.name, DFlashOptions, build, trtllm="DFlash", vllm=("dflash",),
                     model_needed="the directory of the DFlash drafter", holds_head=is_dflash_dir, trains="dflash",
                     head_kind="dflash", fixed_draft_len=7)
