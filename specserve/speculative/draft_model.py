"""Draft-model speculation (TRT-LLM's Draft_Target, vLLM's draft_model): a small model of the same tokenizer drafts a
chain token by token; with sampling its distributions q go to the verifier's rejection sampling."""

from __future__ import annotations

from pathlib import Path

import time

import torch

from specserve.checks import ConfigError
from specserve.models import cpu_kernels
from specserve.models.kv_cache import KVCache
from specserve.models.loader import LoadedModel, load_model
from specserve.models.transformer import GreedyChoices
from specserve.speculative.base import MethodEntry, MethodOptions, Proposal, Proposer, SpecMethod
from specserve.speculative.grammar import DraftWalk
from specserve.speculative.ngram import common_prefix_length
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.weights import read_draft_vocab


class DraftModelProposer(Proposer):
    """Its KV cache follows the committed tokens by keeping the longest prefix it already holds, so a rejection
    costs only a length change. A greedy draft asks the draft model for its argmaxes only (its lm_head's greedy
    screen, where it has one). A proposal reports the draft's time per token from its drafting forwards alone: the
    cache catches up over a prompt or a run of undrafted steps in a forward of its own, paid once rather than priced
    into every drafted token (which would stop a cheap draft from drafting again)."""

    CATCH_UP = 3  # more tokens than this to feed: all but the last go in a cache-only forward first

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

    def _feed(self, new_tokens: list[int], greedy: bool) -> torch.Tensor | int:
        """The draft's logits after `new_tokens` (aligned to the target's vocabulary), or with `greedy` its argmax
        where the forward gives argmaxes only."""
        out = self._forward(new_tokens, torch.tensor([[len(new_tokens) - 1]]), greedy)
        if isinstance(out.logits, GreedyChoices):
            return int(out.logits.ids[0, -1])
        return self._align_vocab(out.logits[0, -1])

    def _catch_up(self, new_tokens: list[int]) -> None:
        """Feed tokens into the draft's cache, no logits."""
        self._forward(new_tokens, torch.empty(1, 0, dtype=torch.long), False)

    def _forward(self, new_tokens: list[int], logits_rows: torch.Tensor, greedy: bool):
        start = len(self.fed)
        positions = torch.arange(start, start + len(new_tokens))[None]
        out = self.model(torch.tensor([new_tokens]), positions, self.cache, positions, logits_rows=logits_rows,
                         greedy=greedy)
        self.fed.extend(new_tokens)
        self.cache.lengths[0] = len(self.fed)
        return out

    def _greedy_choices(self) -> bool:
        """Whether drafts may ask for argmaxes alone: greedy, no grammar to mask the logits with, and a draft
        vocabulary no larger than the target's (every argmax is then one of the target's ids, as it is of the
        aligned logits)."""
        return self.params.greedy and self.grammar is None and self.model.spec.vocab_size <= self.target_vocab

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        if max_len <= 0:
            return Proposal.chain(tokens[-1], [])
        keep = common_prefix_length(self.fed, tokens[:-1])
        del self.fed[keep:]
        self.cache.lengths[0] = keep
        feed = tokens[keep:]
        if len(feed) > self.CATCH_UP:
            self._catch_up(feed[:-1])
            feed = feed[-1:]
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        greedy = self._greedy_choices()
        step_seconds: list[float] = []  # the drafting forwards'
        with DraftWalk(self.grammar) as walk:
            for _ in range(max_len):
                start = time.perf_counter()
                out = self._feed(feed, greedy)
                step_seconds.append(time.perf_counter() - start)
                logits = out if isinstance(out, int) else walk.masked(out)
                if logits is None:  # the grammar allows nothing the draft can say: the target goes on alone
                    break
                if isinstance(logits, int):
                    token = logits
                elif self.params.greedy:
                    token = int(cpu_kernels.argmax(logits))
                else:
                    q = probabilities(logits[None], self.params)[0]
                    token = int(sample(q[None], self.generator))
                    dists.append(q)
                drafted.append(token)
                feed = [token]
                if not walk.take(token):
                    break
        proposal = Proposal.chain(tokens[-1], drafted, torch.stack(dists) if dists else None)
        if step_seconds:
            proposal.seconds_per_token = sum(step_seconds) / len(step_seconds)
        return proposal

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
    warm(draft.model)
    return DraftModelMethod(draft.model, target.model.spec.vocab_size)


def warm(draft_model) -> None:
    """Make now what the draft's first forward would make (its greedy screen, its layer stack): the draft-length
    choice prices drafting by the first drafts' times, and a one-time cost there would stop it from drafting."""
    cache = KVCache.for_model(draft_model, 1, 1)
    token = torch.zeros(1, 1, dtype=torch.long)
    draft_model(token, token, cache, token, logits_rows=token, greedy=True)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ConfigError(
            f"draft model {draft.name} does not share the target's tokenizer "
            f"({len(draft.tokenizer)} vs {len(target.tokenizer)} tokens): speculation needs the same vocabulary")


DRAFT_MODEL = MethodEntry(DraftModelMethod.name, MethodOptions, build,
                          aliases=("draft_model", "draft", "standalone"), trtllm="Draft_Target", vllm=("draft_model",),
                          model_needed="the draft model's path", any_model=True, trains="draft",
                          head_kind="draft")
