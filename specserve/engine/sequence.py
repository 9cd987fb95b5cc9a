"""One request's decoding state (`Sequence`): its committed and pending tokens, its proposer's draft, and the
verify-and-commit of each step's draft against the target's logits, with its stop handling and metrics.

A prompt longer than PREFILL_CHUNK tokens is prefilled in chunks of PREFILL_CHUNK (positions [0, C), [C, 2C), ...;
the last piece, at most C tokens, is the ordinary forward that samples the first token). The boundaries depend on
the prompt alone, so a request computes the same cache whether it runs alone or a server interleaves its chunks
with other requests' steps; chunks of C = 64 run on the row-invariant kernels, as fast per token as one piece.
"""

from __future__ import annotations

import time

import torch

from specserve.engine.output import StopChecker, StreamEvent
from specserve.engine.request import GenerationResult, RequestMetrics
from specserve.models.kernel_forward import MAX_KERNEL_TOKENS
from specserve.speculative.base import Proposal
from specserve.speculative.grammar import TokenGrammar, sub_probs, subtree
from specserve.speculative.sampling import SamplingParams, TokenLogprobs, token_logprobs
from specserve.speculative.verify import mask_logits, verify

PREFILL_CHUNK = MAX_KERNEL_TOKENS  # a chunk runs on the row-invariant kernels


def kv_capacity(prompt_tokens: int, params: SamplingParams, draft_slots: int) -> int:
    """KV slots a request can ever use: its prompt, its output and one verify step's `draft_slots`."""
    return prompt_tokens + params.max_tokens + draft_slots


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

    def uncached(self, cached: int) -> int:
        """Prompt tokens, the pending last one included, not in the first `cached` slots (0 once prefilled)."""
        return len(self.tokens) + len(self.pending) - cached if not self.prefilled else 0

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
