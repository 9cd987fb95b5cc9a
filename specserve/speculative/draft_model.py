"""Draft-model speculation (TRT-LLM's Draft_Target, vLLM's draft_model): a small model of the same tokenizer drafts a
chain token by token; with sampling its distributions q go to the verifier's rejection sampling."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.checks import ConfigError
from specserve.models import cpu_kernels
from specserve.models.kv_cache import KVCache
from specserve.models.loader import LoadedModel, load_model
from specserve.speculative.base import MethodEntry, MethodOptions, Proposal, Proposer, SpecMethod
from specserve.speculative.ngram import common_prefix_length
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.weights import read_draft_vocab


class DraftModelProposer(Proposer):
    """Its KV cache follows the committed tokens by keeping the longest prefix it already holds, so a rejection
    costs only a length change."""

    def __init__(self, draft_model, target_vocab: int, params: SamplingParams, generator: torch.Generator,
                 capacity: int):
        self.model = draft_model
        self.target_vocab = target_vocab
        self.params = params
        self.generator = generator
        self.cache = KVCache.for_model(draft_model, 1, capacity)
        self.fed: list[int] = []

    def _align_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft and target may pad their embedding tables differently; the shared tokenizer's ids agree."""
        vocab = logits.shape[-1]
        if vocab > self.target_vocab:
            return logits[..., : self.target_vocab]
        if vocab < self.target_vocab:
            pad = logits.new_full((*logits.shape[:-1], self.target_vocab - vocab), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def _feed(self, new_tokens: list[int]) -> torch.Tensor:
        start = len(self.fed)
        positions = torch.arange(start, start + len(new_tokens))[None]
        out = self.model(torch.tensor([new_tokens]), positions, self.cache, positions,
                         logits_rows=torch.tensor([[len(new_tokens) - 1]]))
        self.fed.extend(new_tokens)
        self.cache.lengths[0] = len(self.fed)
        return self._align_vocab(out.logits[0, -1])

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        if max_len <= 0:
            return Proposal.chain(tokens[-1], [])
        keep = common_prefix_length(self.fed, tokens[:-1])
        del self.fed[keep:]
        self.cache.lengths[0] = keep
        feed = tokens[keep:]
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        pushed = 0  # tokens the grammar took for this draft
        try:
            for _ in range(max_len):
                logits = self._constrained(self._feed(feed))
                if logits is None:  # the grammar allows nothing the draft can say: the target goes on alone
                    break
                if self.params.greedy:
                    token = int(cpu_kernels.argmax(logits))
                else:
                    q = probabilities(logits[None], self.params)[0]
                    token = int(sample(q[None], self.generator))
                    dists.append(q)
                drafted.append(token)
                feed = [token]
                if self.grammar is not None:
                    if token in self.grammar.eos_ids:  # the output would end here: nothing to draft after it
                        break
                    self.grammar.push(token)
                    pushed += 1
        finally:
            if self.grammar is not None:  # the request's grammar stays where its emitted tokens left it
                self.grammar.pop(pushed)
        return Proposal.chain(tokens[-1], drafted, torch.stack(dists) if dists else None)

    def _constrained(self, logits: torch.Tensor) -> torch.Tensor | None:
        """A guided request drafts from the draft's logits masked by its grammar, so a sampled draft's q is the
        masked distribution it was drawn from (rejection sampling stays exact) and no draft token is forbidden;
        None when no allowed token is in the draft's vocabulary."""
        if self.grammar is None:
            return logits
        masked = logits.masked_fill(~self.grammar.allowed(), float("-inf"))
        return masked if bool(torch.isfinite(masked).any()) else None


class DraftModelMethod(SpecMethod):
    name = "draft_target"

    def __init__(self, draft_model, target_vocab: int):
        self.draft_model = draft_model
        self.target_vocab = target_vocab

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return DraftModelProposer(self.draft_model, self.target_vocab, params, generator, capacity)


def build(options: MethodOptions, target: LoadedModel) -> DraftModelMethod:
    draft = load_model(options.model, dtype=target.model.dtype)
    check_same_tokenizer(target, draft)
    try:
        draft.model.restrict_vocab(read_draft_vocab(Path(options.model), target.model.spec.vocab_size))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return DraftModelMethod(draft.model, target.model.spec.vocab_size)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ConfigError(
            f"draft model {draft.name} does not share the target's tokenizer "
            f"({len(draft.tokenizer)} vs {len(target.tokenizer)} tokens): speculation needs the same vocabulary")


DRAFT_MODEL = MethodEntry(DraftModelMethod.name, MethodOptions, build,
                          aliases=("draft_model", "draft", "standalone"), trtllm="Draft_Target", vllm=("draft_model",),
                          model_needed="the draft model's path", any_model=True, trains="draft",
                          head_kind="draft")
