"""The decoding loop for one request: prefill, then draft -> verify in one target forward -> commit, until a stop.

With no method (or max_draft_len 0) every step verifies an empty draft, which is plain autoregressive decoding
through the very same code path. A request runs through a one-row `BatchEngine`, the server's step: with
`adaptive_draft_len` its draft-length choice is the server's; without it, every step drafts max_draft_len.

A request's state and its verify-and-commit are `sequence.Sequence`'s; detokenizing and stops are output.py's. A
prompt longer than sequence.PREFILL_CHUNK tokens is prefilled chunk by chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specserve.checks import ConfigError
from specserve.engine.batch import BatchEngine
from specserve.engine.output import StopChecker, StreamEvent
from specserve.engine.request import GenerationResult
from specserve.engine.sequence import PREFILL_CHUNK, Sequence, kv_capacity
from specserve.engine.verify_batch import VerifyBatch
from specserve.models.kv_cache import KVCache
from specserve.models.loader import LoadedModel
from specserve.models.step_costs import measured_step_costs
from specserve.speculative.base import DraftKind, Proposal, SpecMethod
from specserve.speculative.grammar import AfterForced, GrammarVocabulary, GuideError, TokenGrammar
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.tree import Chain, after_chain

log = logging.getLogger("specserve.engine")


class RequestError(ValueError):
    """A request the engine refuses (bad parameters, prompt too long): the caller's mistake, not a crash."""


@dataclass
class CheckedRequest:
    """What Engine.check_request made of a request it passed: its grammar, compiled once (None: no guide)."""

    grammar: TokenGrammar | None


def forced_then(root: int, forced: list[int], proposal: Proposal | None) -> Proposal:
    """A draft of the grammar's forced tokens from `root`, with the method's draft from their end (None: the
    forced tokens took the room) below them. A method's sampled draft (with its q rows) is dropped: the methods
    that draft after forced tokens draft deterministically."""
    if proposal is None or proposal.probs is not None:
        return Proposal(Chain(root, forced))
    return Proposal(after_chain(root, forced, proposal.tree), typical=proposal.typical, evidence=proposal.evidence)


class Engine:
    def __init__(self, target: LoadedModel, method: SpecMethod | None = None, max_draft_len: int = 0,
                 max_model_len: int | None = None, adaptive_draft_len: bool = False):
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.method = method
        self.max_draft_len = max_draft_len if method is not None else 0
        # each step's draft length chosen as the server's batch engine chooses it (`stream`)
        self.adaptive_draft_len = adaptive_draft_len and bool(self.max_draft_len)
        self._solo_batch = None  # that one-row batch engine, kept across requests
        # KV slots a verify step may use beyond the committed tokens (a tree needs all its nodes)
        self.draft_slots = method.draft_slots(self.max_draft_len) if self.max_draft_len else 1
        self.needs_hidden = bool(self.max_draft_len) and method.needs_hidden_states
        self.hidden_layers = method.hidden_layers if self.needs_hidden else ()
        if max_model_len is not None and not 2 <= max_model_len <= target.max_model_len:
            raise ConfigError(f"max_model_len={max_model_len} is outside the model's 2..{target.max_model_len} "
                              "tokens")
        self.max_model_len = max_model_len or target.max_model_len
        self.eos_ids = target.eos_token_ids
        # structured outputs: the tokenizer as the grammar engine sees it, built on the first guided request
        self.grammar_vocab = GrammarVocabulary(self.tokenizer, self.model.spec.vocab_size, self.eos_ids)
        # logits for the verified rows alone, not for those padded to the batch's longest draft (a sharded
        # model's ranks compute the padded form together)
        self.ragged_logits = self.model.ragged_logits
        if self.max_draft_len and not self.model.kernels_usable:
            log.warning("speculation verifies on PyTorch's kernels here (dtype %s, or not a CPU): their sums can "
                        "round differently with the number of tokens in a forward, so an output may leave plain "
                        "decoding's where two tokens' logits nearly tie; bfloat16 on a CPU runs the row-invariant "
                        "kernels that keep them equal", str(self.model.dtype).removeprefix("torch."))

    @property
    def lossless(self) -> bool:
        """False only with Medusa's opt-in typical acceptance (sampling no longer follows the target exactly)."""
        return self.method is None or self.method.lossless

    @property
    def method_name(self) -> str:
        return self.method.name if self.method is not None and self.max_draft_len > 0 else "ar"

    def encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string")
        return self.tokenizer(prompt).input_ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """RequestError unless the request can run; its grammar compiled (once: new_sequence takes it from here)."""
        try:
            params.validate()
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if not prompt_ids:
            raise RequestError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len} tokens")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens")
        self.check_token_ids(prompt_ids)
        if params.guide is None:
            return CheckedRequest(None)
        try:
            return CheckedRequest(self.grammar_vocab.compile_checked(params.guide))
        except GuideError as exc:
            raise RequestError(str(exc)) from None

    def check_token_ids(self, token_ids: list[int]) -> None:
        """RequestError unless every id is a token of the target's vocabulary."""
        vocab = self.model.spec.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")

    def generate(self, prompt: str | list[int], params: SamplingParams) -> GenerationResult:
        for event in self.stream(prompt, params):
            if event.result is not None:
                return event.result
        raise RuntimeError("stream ended without a result")

    def new_sequence(self, prompt: str | list[int], params: SamplingParams, capacity: int | None = None,
                     checked: CheckedRequest | None = None) -> Sequence:
        """Set up a request's decoding state, validated here (RequestError for bad input) unless `checked` says
        check_request passed it already (a server checks requests off the compute thread). Its proposer's caches
        get `capacity` slots, by default the request's own size rather than the full context."""
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        grammar = (checked or self.check_request(prompt_ids, params)).grammar
        capacity = capacity or kv_capacity(len(prompt_ids), params, self.draft_slots)
        generator = params.make_generator()
        proposer = self.method.new_proposer(params, generator, capacity) if self.max_draft_len else None
        if proposer is not None:
            proposer.grammar = grammar
        return Sequence(prompt_ids, params, generator, proposer, StopChecker(self.tokenizer, params, self.eos_ids),
                        grammar)

    def open_batch(self, max_active: int, adaptive_draft: bool = True) -> BatchEngine:
        """A continuous batch of up to `max_active` requests over this engine (the server's runner steps it)."""
        return BatchEngine(self, max_active, adaptive_draft=adaptive_draft)

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """One request through a one-row batch engine, the server's step, kept across requests. With
        `adaptive_draft_len` each step drafts the length with the most expected tokens per second (the target's
        measured step costs, the request's acceptance per evidence, learnt from the requests before it too), as
        the server does; without it every step drafts max_draft_len (or the request's own cap). The same tokens
        either way: only the speed differs."""
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if self._solo_batch is None:
            costs = measured_step_costs(self.target) if self.adaptive_draft_len else None
            self._solo_batch = BatchEngine(self, 1, adaptive_draft=self.adaptive_draft_len, costs=costs)
        batch = self._solo_batch
        seq = batch.add(prompt_ids, params)
        try:
            while not seq.finished:
                for _, event in batch.step():
                    if isinstance(event, Exception):
                        raise event
                    yield event
        finally:
            batch.cancel(seq)  # a consumer that stopped early, or a failure: the row is free for the next request

    def forget_requests(self) -> None:
        """Forget what was learnt from earlier requests: the method's (suffix decoding's responses) and the draft-length
        choice's pooled acceptance (the bench's warm-up must not inform its timed requests)."""
        if self.method is not None:
            self.method.reset()
        if self._solo_batch is not None:
            self._solo_batch.forget_acceptance()

    def prefill_chunk(self, cache: KVCache, seq: Sequence) -> bool:
        """Run the next PREFILL_CHUNK prompt tokens of `seq` (row 0 of `cache`) into the cache when more than one
        chunk remains; False when the rest fits in the ordinary forward (or the prompt is done)."""
        if seq.uncached(int(cache.lengths[0])) <= PREFILL_CHUNK:
            return False
        start = int(cache.lengths[0])
        chunk = seq.tokens[start:start + PREFILL_CHUNK]
        positions = torch.arange(start, start + len(chunk))[None]
        scored = seq.prompt_to_score(start) and len(chunk)  # logits for every column when the prompt is scored
        out = self.model(torch.tensor([chunk]), positions, cache, positions,
                         logits_rows=torch.arange(scored)[None], output_layers=self.hidden_layers)
        if scored:
            seq.score_prompt(out.logits[0], start)
        if self.needs_hidden:
            seq.proposer.observe_hidden(torch.cat([out.hidden_states[i][0] for i in self.hidden_layers], -1))
        cache.lengths[0] = start + len(chunk)
        return True

    def draft(self, seqs: list[Sequence], max_len: int, cheap: frozenset[Sequence] = frozenset()
              ) -> list[tuple[Sequence, Exception]]:
        """Each sequence's next proposal, drafted by the method for the whole batch at once (those in `cheap`:
        their proposers' cheap drafts, `Proposer.propose_cheap`); returns the sequences whose proposer failed
        (their requests end, the others go on)."""
        drafting = [seq for seq in seqs if seq.draft_room(max_len) > 0]
        for seq in seqs:
            seq.proposal = Proposal.chain(seq.pending[0], [])
        failed = []
        for seq in [seq for seq in drafting if seq in cheap]:
            drafting.remove(seq)
            try:
                start = time.perf_counter()
                seq.proposal = seq.proposer.propose_cheap(seq.context, seq.draft_room(max_len))
                seq.proposal.seconds, seq.proposal.cheap = time.perf_counter() - start, True
                seq.metrics.draft_time_s += seq.proposal.seconds
                seq.constrain_draft()
            except Exception as exc:  # noqa: BLE001 - this request's failure alone
                failed.append((seq, exc))
        views = []  # each drafting sequence as the method sees it: after the tokens its grammar forces, if any
        for seq in drafting:
            try:
                views.append(self.after_forced(seq, max_len))
            except Exception as exc:  # noqa: BLE001 - a grammar failure ends this request alone
                failed.append((seq, exc))
        asking = [view for view in views if view.draft_room(max_len) > 0]
        proposals = dict(zip(map(id, asking), self.method.propose_batch(asking, max_len) if asking else []))
        for view in views:
            seq, proposal = getattr(view, "seq", view), proposals.get(id(view))
            if isinstance(proposal, Exception):
                failed.append((seq, proposal))
                continue
            try:
                seq.metrics.draft_time_s += proposal.seconds if proposal is not None else 0.0
                seq.proposal = forced_then(seq.pending[0], view.forced, proposal) \
                    if isinstance(view, AfterForced) else proposal
                seq.constrain_draft()  # before the forward: forbidden branches cost no target compute
            except Exception as exc:  # noqa: BLE001 - a grammar failure ends this request alone
                failed.append((seq, exc))
        return failed

    def after_forced(self, seq: Sequence, max_len: int):
        """`seq` as its method drafts for it: a guided request whose grammar forces the next tokens (a JSON
        schema's keys and punctuation) drafts those first, and the method drafts on after them. Only for methods
        that draft from tokens alone (n-gram, suffix); a model-drafting method needs the target's features."""
        if seq.grammar is None or self.method.draft_kind is not DraftKind.LOOKUP:
            return seq
        forced = seq.grammar.forced(seq.draft_room(max_len))
        return AfterForced(seq, forced) if forced else seq

    def forward(self, cache: KVCache, seqs: list[Sequence | None]) -> list[StreamEvent | Exception | None]:
        """One target forward for rows 0..len(seqs)-1 of `cache` (None: an idle row, fed a dummy token): each
        sequence's uncached tokens + its draft; then verification and commit. Returns each row's event, or the
        exception that ended that row's request alone (its batch mates commit as usual). An exception raised
        here comes from the shared forward, before any row committed."""
        batch = VerifyBatch.build(cache, [seq.feed(int(cache.lengths[row])) if seq else [0]
                                          for row, seq in enumerate(seqs)],
                                  [seq.proposal.tree if seq else None for seq in seqs],
                                  [seq.prompt_to_score(int(cache.lengths[row])) if seq else 0
                                   for row, seq in enumerate(seqs)])
        greedy = all(seq is None or seq.greedy_only(int(cache.lengths[row])) for row, seq in enumerate(seqs))
        out = self.model(batch.tokens, batch.positions, cache, batch.slots, tree_mask=batch.tree_mask,
                         logits_rows=batch.logits_rows, output_layers=self.hidden_layers,
                         logits_counts=batch.wanted, greedy=greedy)
        events = []
        for row, seq in enumerate(seqs):
            try:
                events.append(None if seq is None else self._commit_row(cache, batch, out, row, seq))
            except Exception as exc:  # noqa: BLE001 - e.g. a sampler failure: it ends this request only
                events.append(exc)
        return events

    def _commit_row(self, cache: KVCache, batch: VerifyBatch, out, row: int, seq: Sequence) -> StreamEvent | None:
        hidden = None
        if self.needs_hidden:  # the features of every fed row (uncached tokens, root, tree nodes)
            hidden = torch.cat([out.hidden_states[i][row, : batch.fed[row]] for i in self.hidden_layers], -1)
        scored, verified = batch.scored[row], batch.verified[row]
        if scored:
            seq.score_prompt(out.row_logits(row, 0, scored), batch.starts[row])
        nodes, event = seq.commit(out.row_logits(row, scored, scored + verified), hidden)
        base = batch.starts[row] + batch.root(row)  # the root's slot: the accepted nodes move right after it
        cache.compact(row, base + torch.tensor([0] + nodes), base)
        cache.lengths[row] = base + 1 + len(nodes)
        return event
