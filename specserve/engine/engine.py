"""The decoding loop for one request: prefill, then draft -> verify in one target forward -> commit, until a stop.

With no method (or max_draft_len 0) every step verifies an empty draft, which is plain autoregressive decoding
through the very same code path. A request runs through a one-row `BatchEngine`, the server's step: with
`adaptive_draft_len` its draft-length choice is the server's; without it, every step drafts max_draft_len.

A prompt longer than PREFILL_CHUNK tokens is prefilled in chunks of PREFILL_CHUNK (positions [0, C), [C, 2C), ...;
the last piece, at most C tokens, is the ordinary forward that samples the first token). The boundaries depend on
the prompt alone, so a request computes the same cache whether it runs alone or a server interleaves its chunks
with other requests' steps; chunks of C = 64 run on the row-invariant kernels, as fast per token as one piece.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specserve.checks import ConfigError
from specserve.engine.request import GenerationResult, RequestMetrics
from specserve.engine.verify_batch import VerifyBatch
from specserve.models.kv_cache import KVCache
from specserve.models.loader import LoadedModel
from specserve.models.transformer import MAX_KERNEL_TOKENS, CausalLM
from specserve.speculative.base import Proposal, SpecMethod
from specserve.speculative.grammar import (AfterForced, GrammarVocabulary, GuideError, TokenGrammar, sub_probs,
                                          subtree)
from specserve.speculative.sampling import SamplingParams, TokenLogprobs, token_logprobs
from specserve.speculative.tree import Chain, after_chain
from specserve.speculative.verify import mask_logits, verify

log = logging.getLogger("specserve.engine")

PREFILL_CHUNK = MAX_KERNEL_TOKENS  # a chunk runs on the row-invariant kernels


class RequestError(ValueError):
    """A request the engine refuses (bad parameters, prompt too long): the caller's mistake, not a crash."""


@dataclass
class StreamEvent:
    text: str  # new text since the previous event
    token_ids: list[int]  # new token ids since the previous event
    result: GenerationResult | None = None  # set on the last event
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asks for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first event, when the request asks


@functools.lru_cache(maxsize=8)
def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """The ids of a SentencePiece vocabulary's byte tokens (<0x00> .. <0xFF>); none in other vocabularies."""
    ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    return frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)


@functools.lru_cache(maxsize=8)
def skipped_special_ids(tokenizer) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` drops: the special tokens and the added tokens marked
    special (Gemma's thousands of <unusedN>)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in added.items() if t.special}


class IncrementalDetokenizer:
    """The text of a growing list of token ids, as `tokenizer.decode(ids, skip_special_tokens=True)` gives it,
    for a few tokens' decoding per step instead of all of them (a full decode per step made a long output
    quadratic: 0.74 ms a step at 2,048 tokens for Gemma's tokenizer).

    Windowed as vLLM's detokenize_incrementally: the text up to `read` is settled; each step decodes the ids
    from `prefix` (the settled window's start, at a character boundary) on, and the new text is what that
    decode adds to the decode of ids[prefix:read]. Both decodes start at the same token, so whatever a decoder
    does to a string's start (a stripped leading space) cancels out. The window settles once its text does not
    end in U+FFFD (an incomplete UTF-8 character) and its last id that the decode keeps (special ids are skipped)
    is not a byte token (SentencePiece's <0xNN> byte fallback decodes a run of byte tokens together, across a
    skipped special id, and an invalid run turns every byte of it into U+FFFD, the ones before too). A tokenizer that cleans up spaces between tokens (`clean_up_tokenization_spaces`)
    rewrites earlier text, so it is decoded whole."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.windowed = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.byte_ids = byte_fallback_ids(tokenizer) if self.windowed else frozenset()
        self.special_ids = skipped_special_ids(tokenizer) if self.windowed else frozenset()
        self.ids: list[int] = []
        self.settled = ""  # the text of ids[:read]
        self.prefix = self.read = 0

    def extend(self, ids: list[int]) -> str:
        """Append ids; returns the text of all ids so far."""
        self.ids += ids
        if not self.windowed:
            return self._decode(self.ids)
        before = self._decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        tail = self._decode(self.ids[self.prefix:])[len(before):]
        if tail and not tail.endswith("\ufffd") and not self._ends_in_a_byte_run():
            self.settled += tail
            self.prefix, self.read, tail = self.read, len(self.ids), ""
        return self.settled + tail

    def _ends_in_a_byte_run(self) -> bool:
        kept = next((i for i in reversed(self.ids[self.read:]) if i not in self.special_ids), None)
        return kept in self.byte_ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class StopChecker:
    """Applies EOS / stop ids / max_tokens per token and stop strings on the decoded text."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: set[int]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self.output: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    def add(self, tokens: list[int]) -> None:
        """Append emitted tokens until one of them ends the request. The text never includes a stop token or a
        stop string (as vLLM and OpenAI do); the token ids include the token that stopped it."""
        text_tokens = []  # decoded together after the loop (without stop strings)
        for token in tokens:
            self.output.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            if not self.params.stop:
                text_tokens.append(token)
            elif self._hit_stop_string(token):
                self.finish_reason = "stop"
                return
            if len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        if text_tokens:
            self.text = self.detokenizer.extend(text_tokens)

    def _hit_stop_string(self, token: int) -> bool:
        """Decode `token`; a stop string in the text ends it there."""
        text = self.detokenizer.extend([token])
        for stop in self.params.stop:
            index = text.find(stop, max(0, len(self.text) - len(stop)))
            if index >= 0:
                self.text = text[:index]
                return True
        self.text = text
        return False

    def stable_text_length(self) -> int:
        """How much of the text can be streamed: hold back a partial UTF-8 character or a partial stop string."""
        text = self.text
        end = len(text.rstrip("\ufffd")) if self.finish_reason is None else len(text)
        if self.finish_reason is None:
            for stop in self.params.stop:
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if text[:end].endswith(stop[:k]):
                        end -= k
                        break
        return end


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
        self.ragged_logits = isinstance(self.model, CausalLM)
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

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
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
        if params.guide is not None:
            try:
                self.grammar_vocab.check(params.guide)
            except GuideError as exc:
                raise RequestError(str(exc)) from None

    def compile_guide(self, params: SamplingParams) -> TokenGrammar | None:
        """The request's grammar state, or None when it has no guide (RequestError for a guide that fails)."""
        if params.guide is None:
            return None
        try:
            return self.grammar_vocab.compile(params.guide)
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

    def new_sequence(self, prompt: str | list[int], params: SamplingParams, capacity: int | None = None
                     ) -> "Sequence":
        """Validate a request and set up its decoding state (RequestError for bad input). Its proposer's caches
        get `capacity` slots, by default the request's own size rather than the full context."""
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(prompt_ids, params)
        capacity = capacity or self.capacity_for(prompt_ids, params)
        generator = params.make_generator()
        proposer = self.method.new_proposer(params, generator, capacity) if self.max_draft_len else None
        grammar = self.compile_guide(params)
        if proposer is not None:
            proposer.grammar = grammar
        return Sequence(prompt_ids, params, generator, proposer, StopChecker(self.tokenizer, params, self.eos_ids),
                        grammar)

    def capacity_for(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """KV slots a request can ever use: its prompt, its output and one verify step's draft."""
        return len(prompt_ids) + params.max_tokens + self.draft_slots

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """One request through a one-row batch engine, the server's step, kept across requests. With
        `adaptive_draft_len` each step drafts the length with the most expected tokens per second (the target's
        measured step costs, the request's acceptance per evidence, learnt from the requests before it too), as
        the server does; without it every step drafts max_draft_len (or the request's own cap). The same tokens
        either way: only the speed differs."""
        from specserve.engine.batch import BatchEngine
        from specserve.engine.step_costs import measured_step_costs

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

    def prefill_remaining(self, cache: KVCache, seq: Sequence) -> int:
        """Prompt tokens of `seq` (row 0 of `cache`) not yet in the cache, its pending last token included."""
        return len(seq.tokens) + len(seq.pending) - int(cache.lengths[0]) if not seq.prefilled else 0

    def prefill_chunk(self, cache: KVCache, seq: Sequence) -> bool:
        """Run the next PREFILL_CHUNK prompt tokens of `seq` (row 0 of `cache`) into the cache when more than one
        chunk remains; False when the rest fits in the ordinary forward (or the prompt is done)."""
        if self.prefill_remaining(cache, seq) <= PREFILL_CHUNK:
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
        if seq.grammar is None or not self.method.drafts_for_free:
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
        # a sharded model takes neither argument (see ragged_logits)
        local = {"logits_counts": batch.wanted, "greedy": all(
            seq is None or seq.greedy_only(int(cache.lengths[row])) for row, seq in enumerate(seqs))}
        out = self.model(batch.tokens, batch.positions, cache, batch.slots, tree_mask=batch.tree_mask,
                         logits_rows=batch.logits_rows, output_layers=self.hidden_layers,
                         **(local if self.ragged_logits else {}))
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


class Sequence:
    """One request's decoding state: committed tokens, the token not yet fed to the target, its proposer and
    draft, stop handling and metrics. The engine's forward feeds it; `commit` applies the verdict."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator, proposer,
                 stops: StopChecker, grammar: TokenGrammar | None = None):
        self.params = params
        self.grammar = grammar  # structured outputs: the grammar state after the emitted tokens
        self.generator = generator
        self.proposer = proposer
        self.stops = stops
        self.metrics = RequestMetrics(prompt_tokens=len(prompt_ids))
        self.tokens = prompt_ids[:-1]  # committed; their keys/values are (or will be) in the cache
        self.pending = [prompt_ids[-1]]  # emitted but not yet fed to the target
        self.proposal = Proposal.chain(self.pending[0], [])
        self.logprobs: list[TokenLogprobs] = []  # of the output tokens, when params.logprobs is set
        self.prompt_logprobs: list[TokenLogprobs | None] = [None]  # the first prompt token has none
        self.start = time.perf_counter()
        self.sent_text = self.sent_tokens = 0

    @property
    def finished(self) -> bool:
        return self.stops.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        return self.metrics.target_forwards > 0

    @property
    def context(self) -> list[int]:
        """Prompt and generated tokens; the last one is the pending root of the next draft."""
        return self.tokens + self.pending

    def draft_room(self, max_len: int) -> int:
        """Draft tokens this request may take now: none before its prefill (which runs alone, exactly as in plain
        decoding), none beyond the request's own cap, and none that would pass max_tokens."""
        if self.proposer is None or not self.prefilled:
            return 0
        return max(min(max_len, self.draft_cap, self.params.max_tokens - len(self.stops.output) - 1), 0)

    @property
    def draft_cap(self) -> int | float:
        """The request's own limit on draft tokens per step (`num_speculative_tokens`; none: unbounded)."""
        cap = self.params.num_speculative_tokens
        return float("inf") if cap is None else cap

    def feed(self, cached: int) -> list[int]:
        """The tokens the next forward must run: those not yet in the cache, then the draft."""
        return self.tokens[cached:] + self.pending + self.proposal.tokens

    def prompt_to_score(self, cached: int) -> int:
        """Prompt tokens before the root, from slot `cached` on, whose logits the next forward must return: all
        of them when the request scores its prompt and is not prefilled yet, else none."""
        return max(len(self.tokens) - cached, 0) if self.params.prompt_logprobs is not None and not self.prefilled \
            else 0

    def greedy_only(self, cached: int) -> bool:
        """Whether the next forward's logits serve only their argmaxes: greedy, no logprobs of any kind, no
        grammar masks (the forward may then return GreedyChoices)."""
        params = self.params
        return (params.greedy and params.logprobs is None and self.grammar is None
                and not self.prompt_to_score(cached))

    def score_prompt(self, logits: torch.Tensor, start: int) -> None:
        """logits [n, V] at prompt slots start..start+n-1: each scores the prompt token after it."""
        following = self.context[start + 1: start + 1 + logits.shape[0]]
        self.prompt_logprobs += token_logprobs(logits, following, self.params, self.params.prompt_logprobs)

    def constrain_draft(self) -> None:
        """A guided request's draft cut where its grammar forbids a token, with each node's mask of allowed tokens
        attached (`grammar.TokenGrammar.constrain`); nothing without a guide or once done for this proposal."""
        proposal = self.proposal
        if self.grammar is None or proposal.allowed is not None:
            return
        keep, allowed = self.grammar.constrain(proposal.tree, proposal.probs)
        if len(keep) < len(proposal.tree):
            proposal = Proposal(subtree(proposal.tree, keep), sub_probs(proposal.probs, keep), proposal.typical,
                                evidence=proposal.evidence)
        proposal.allowed = allowed
        self.proposal = proposal

    def commit(self, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[list[int], StreamEvent | None]:
        """Verify the draft against the target's logits [k+1, V] (one row per draft node, root first); returns
        (accepted draft nodes, event or None). `hidden` [fed, F]: the target's features at every fed row (the
        uncached tokens, the root, then one row per draft node)."""
        if self.params.max_tokens == 0:  # the prompt scored, nothing to generate
            self.metrics.record_step(0, 0)
            self.stops.finish_reason = "length"
            return [], self._event()
        self.constrain_draft()  # a step without a draft (the prefill) still needs the root's mask
        proposal = self.proposal
        nodes, emitted = verify(proposal.tree, logits, self.params, self.generator, proposal.probs, proposal.typical,
                                proposal.allowed)
        if self.params.logprobs is not None:  # row 0 (the root) scores the first emitted token, node n the next
            path = [0] + nodes  # a guided request's: those of the masked distribution it was drawn from
            rows = mask_logits(logits[path], None if proposal.allowed is None else proposal.allowed[path])
            self.logprobs += token_logprobs(rows, emitted, self.params, self.params.logprobs)
        if hidden is not None:  # the features of the tokens this step commits: fed rows up to the root, accepted nodes
            root = hidden.shape[0] - len(logits)
            self.proposer.observe_hidden(hidden[list(range(root + 1)) + [root + n for n in nodes]])
        self.metrics.record_step(len(proposal.tokens), len(nodes), proposal.tree.max_depth)
        if self.grammar is not None:
            emitted = self.grammar.advance(emitted)
        self.tokens += self.pending + emitted[:-1]
        self.pending = emitted[-1:]
        self.proposal = Proposal.chain(self.pending[0], [])  # this one's masks are spent
        self.stops.add(emitted)
        if self.grammar is not None and self.grammar.finished and not self.finished:
            self.stops.finish_reason = "stop"  # complete (a JSON value closed, a choice matched): nothing may follow
        if self.finished and self.proposer is not None:
            self.proposer.request_finished(self.stops.output)
        del self.logprobs[len(self.stops.output):]  # tokens after a stop are not output
        if self.metrics.time_to_first_token_s == 0.0:
            self.metrics.time_to_first_token_s = time.perf_counter() - self.start
        return nodes, self._event()

    def _event(self) -> StreamEvent | None:
        stops = self.stops
        end = stops.stable_text_length()
        if not (end > self.sent_text or len(stops.output) > self.sent_tokens or stops.finish_reason):
            return None
        first = self.sent_tokens == 0 and self.sent_text == 0
        event = StreamEvent(stops.text[self.sent_text:end], stops.output[self.sent_tokens:],
                            logprobs=self.logprobs[self.sent_tokens:] if self.params.logprobs is not None else None,
                            prompt_logprobs=self.prompt_logprobs if first and self.params.prompt_logprobs is not None
                            else None)
        self.sent_text, self.sent_tokens = end, len(stops.output)
        if stops.finish_reason is not None:
            self.metrics.output_tokens = len(stops.output)
            self.metrics.total_time_s = time.perf_counter() - self.start
            event.result = GenerationResult(
                stops.text, stops.output, stops.finish_reason, self.metrics,
                logprobs=self.logprobs if self.params.logprobs is not None else None,
                prompt_logprobs=self.prompt_logprobs if self.params.prompt_logprobs is not None else None)
        return event
