"""Continuous batching's decisions, as data: which forward runs next, over which rows, drafting how much; and what
its outcome changes. The scheduler runs no model: `schedule()` returns a ScheduledStep, the engine executes it
(execute.py), and `update` applies the StepOutput it returns (as vLLM v1's scheduler does).

Each request owns a row of one KV cache. A new request's prefill runs alone (as in plain decoding); then every
decoding request, each with its own draft and cache length, goes through one batched verify forward. The
row-invariant kernels make a request's tokens independent of its batch mates, so batching stays lossless.

What each step drafts is its policy's plan (step_policy.py: the draft length from the target's measured cost per
forward size and each request's acceptance, and a tree method's draft gates), and the verified step goes back to
the policy.

The KV cache holds only the running rows, sized to their longest (`KVCache.fit`): an idle server holds none.

A prompt longer than one prefill chunk (sequence.PREFILL_CHUNK) is prefilled chunk by chunk in a cache of its own,
between the decoding steps of the running requests, and joins the batch once its first token is out; while others
decode, chunks get a bounded share of the time (chunked_prefill.py), and a cancelled request stops between chunks. A
failure ends only the request it belongs to: it comes back as that row's exception.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from specserve.engine.chunked_prefill import ChunkedPrefills
from specserve.engine.output import StreamEvent
from specserve.engine.sequence import PREFILL_CHUNK, Sequence
from specserve.models.kv_cache import KVCache
from specserve.speculative.base import Proposal
from specserve.speculative.policy.step_policy import StepPlan, StepPolicy


class StepKind(Enum):
    PREFILL = "prefill"  # a waiting short prompt's whole forward, in its new row of the batch
    CHUNK = "chunk"  # a long prompt's next piece, in its own cache
    DECODE = "decode"  # the running rows: each drafts, one verify forward, each commits


@dataclass(frozen=True)
class ScheduledStep:
    kind: StepKind
    seqs: list[Sequence]
    cache: KVCache  # what the forward writes: a view of the batch's rows, or a long prompt's own cache
    plan: StepPlan | None = None  # DECODE: the draft length the rows share, and the rows that draft cheaply
    counts: list[tuple] = field(default_factory=list)  # DECODE: the rows' draft counts as the step starts


@dataclass
class StepOutput:
    events: list[StreamEvent | Exception | None]  # per scheduled sequence; an exception ended that request alone
    seconds: float  # the step's wall time, drafting included
    # DECODE: each row's verified draft (None: its drafting failed)
    proposals: list[Proposal | None] = field(default_factory=list)
    prefilled: bool = True  # CHUNK: False while more of the prompt is left


@dataclass
class BatchStats:
    steps: int = 0
    last_batch_size: int = 0
    last_draft_len: int = 0

    def count(self, rows: int, draft_len: int) -> None:
        """One more decoding step, of `rows` rows drafting `draft_len` tokens."""
        self.steps, self.last_batch_size, self.last_draft_len = self.steps + 1, rows, draft_len


class Scheduler:
    """The steps of up to `max_batch_size` requests. Rows 0..active-1 of the cache hold the running requests,
    densely (a leaving request's row is refilled with the last one), so a step's forward never pads with idle
    rows; the cache grows and shrinks with them. `draft_slots`: the KV slots a verify step may take beyond a row's
    committed tokens."""

    def __init__(self, model, policy: StepPolicy, max_batch_size: int, capacity: int, draft_slots: int):
        self.max_batch_size = max(1, max_batch_size)
        self.draft_slots = draft_slots
        self.cache = KVCache.growable(model, self.max_batch_size, capacity)
        self.rows: list[Sequence] = []  # row i of the cache holds rows[i]
        self.waiting: deque[Sequence] = deque()
        self.prefilling = ChunkedPrefills(model, draft_slots)  # long prompts, between the decoding steps
        self.policy = policy
        self.stats = BatchStats()

    def forget_acceptance(self) -> None:
        """Start the policy's pools over (between runs of a benchmark); running requests keep their estimates."""
        self.policy.forget()

    @property
    def active(self) -> int:
        return len(self.rows)

    def enqueue(self, seq: Sequence) -> Sequence:
        """Queue a request for a later step."""
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a request, waiting, prefilling or running; its row (and memory) is free for the next request."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.prefilling.cancel(seq)
        if seq in self.rows:
            self._remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.prefilling) or self.active > 0

    def schedule(self) -> ScheduledStep | None:
        """The next forward: a waiting request's prefill (a short prompt's whole, or a long one's first chunk), else
        a long prompt's next chunk when its share of the time allows, else the running requests' decoding step;
        None with nothing to run."""
        if self.waiting and self.active + len(self.prefilling) < self.max_batch_size:
            seq = self.waiting.popleft()
            if len(seq.context) <= PREFILL_CHUNK:
                row = self._add_row(seq)
                self.cache.lengths[row] = 0
                return ScheduledStep(StepKind.PREFILL, [seq], self.cache.view(row, 1))
            self.prefilling.start(seq)
        chunked = self.prefilling.due(decoding=bool(self.rows))
        if chunked is not None:
            return ScheduledStep(StepKind.CHUNK, [chunked], self.prefilling.caches[chunked])
        if not self.rows:
            return None
        plan = self.policy.plan(self.rows)
        self._fit_cache(self.draft_slots)
        return ScheduledStep(StepKind.DECODE, list(self.rows), self.cache.view(0, self.active), plan,
                             self.policy.counts(self.rows))

    def update(self, step: ScheduledStep, output: StepOutput) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """Apply an executed step: each sequence's new event, or the exception that ended that sequence alone."""
        if step.kind is StepKind.CHUNK:
            return self._chunk_done(step.seqs[0], step.cache, output)
        if step.kind is StepKind.DECODE:
            self.prefilling.paid(output.seconds)
            self.policy.observe(step.counts, output.proposals, output.seconds, step.plan)
            self.stats.count(len(step.seqs), step.plan.draft_len)
        return self._collect(step.seqs, output.events)

    def _chunk_done(self, seq: Sequence, cache: KVCache, output: StepOutput):
        """After a long prompt's last piece (which sampled its first token) it joins the batch, unless it ended."""
        events = []
        if output.prefilled:
            self.prefilling.cancel(seq)
            event = output.events[0]
            if not isinstance(event, Exception) and not seq.finished:
                self.cache.copy_row_from(cache, 0, self._add_row(seq))
            events = [] if event is None else [(seq, event)]
        self.prefilling.spent(output.seconds, decoding=bool(self.rows))
        return events

    def _add_row(self, seq: Sequence) -> int:
        """Give a request the next row of the batch (the cache grows to hold it); returns the row."""
        self.rows.append(seq)
        self.policy.join(seq)
        self._fit_cache()
        return len(self.rows) - 1

    def _collect(self, seqs: list[Sequence], events) -> list[tuple[Sequence, StreamEvent | Exception]]:
        out = [(seq, event) for seq, event in zip(seqs, events) if event is not None]
        for seq, event in zip(seqs, events):
            if seq.finished or isinstance(event, Exception):
                self._remove(seq)
        return out

    def _remove(self, seq: Sequence) -> None:
        """Free a request's row: the last row moves into it, and the cache shrinks once it is mostly unused."""
        row, last = self.rows.index(seq), len(self.rows) - 1
        if row != last:
            self.cache.move_row(last, row)
            self.rows[row] = self.rows[last]
        self.rows.pop()
        self.policy.leave(seq)
        self.cache.lengths[last] = 0
        self._fit_cache()

    def _fit_cache(self, draft_slots: int = 0) -> None:
        """Size the cache to the rows' committed and pending tokens and `draft_slots` more (slot == position)."""
        slots = max((len(seq.tokens) + len(seq.pending) for seq in self.rows), default=0)
        self.cache.fit(len(self.rows), slots + draft_slots if self.rows else 0)
