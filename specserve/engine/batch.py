"""Continuous batching: requests join between steps, share one target forward per step, and leave when done.

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
failure ends only the request it belongs to: a per-row failure comes back as that row's exception, and a failed
batched forward is rerun row by row to find whose it was.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specserve.engine.chunked_prefill import ChunkedPrefills
from specserve.engine.output import StreamEvent
from specserve.engine.sequence import PREFILL_CHUNK, Sequence
from specserve.models.kv_cache import KVCache
from specserve.models.step_costs import StepCosts
from specserve.speculative.policy.step_policy import StepPolicy
from specserve.speculative.sampling import SamplingParams


@dataclass
class BatchStats:
    steps: int = 0
    last_batch_size: int = 0
    last_draft_len: int = 0

    def count(self, rows: int, draft_len: int) -> None:
        """One more decoding step, of `rows` rows drafting `draft_len` tokens."""
        self.steps, self.last_batch_size, self.last_draft_len = self.steps + 1, rows, draft_len


class BatchEngine:
    """The steps of an engine (engine.Engine: its model, method and forward) over many requests. Rows
    0..active-1 of the cache hold the running requests, densely (a leaving request's row is refilled with the last
    one), so a step's forward never pads with idle rows; the cache grows and shrinks with them."""

    def __init__(self, engine, max_batch_size: int, capacity: int | None = None,
                 adaptive_draft: bool = True, costs: StepCosts | None = None):
        self.engine = engine
        self.max_batch_size = max(1, max_batch_size)
        self.capacity = capacity or (engine.max_model_len + engine.draft_slots)
        self.cache = KVCache.growable(engine.model, self.max_batch_size, self.capacity)
        self.rows: list[Sequence] = []  # row i of the cache holds rows[i]
        self.waiting: deque[Sequence] = deque()
        self.prefilling = ChunkedPrefills(engine)  # long prompts, between the decoding steps
        self.policy = StepPolicy.for_batch(engine, self.max_batch_size, adaptive_draft, costs)
        self.stats = BatchStats()

    def forget_acceptance(self) -> None:
        """Start the policy's pools over (between runs of a benchmark); running requests keep their estimates."""
        self.policy.forget()

    @property
    def active(self) -> int:
        return len(self.rows)

    def add(self, prompt: str | list[int], params: SamplingParams, checked=None) -> Sequence:
        """Queue a request for a later step (RequestError for bad input; `checked`: Engine.check_request's verdict)."""
        seq = self.engine.new_sequence(prompt, params, checked=checked)
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

    def step(self) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """One forward: a waiting request's prefill (a short prompt's whole, or a long one's first chunk), else a
        long prompt's next chunk when its share of the time allows, else the running requests' decoding step.
        Returns each sequence's new event, or the exception that ended that sequence alone."""
        if self.waiting and self.active + len(self.prefilling) < self.max_batch_size:
            seq = self.waiting.popleft()
            if len(seq.context) <= PREFILL_CHUNK:
                return self._prefill(seq)
            self.prefilling.start(seq)
        chunked = self.prefilling.due(decoding=bool(self.rows))
        if chunked is not None:
            return self._prefill_chunk(chunked)
        if not self.rows:
            return []
        start = time.perf_counter()
        events = self._decode()
        self.prefilling.paid(time.perf_counter() - start)
        return events

    def _prefill_chunk(self, seq: Sequence) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """The next piece of a long prompt; after its last piece (which samples the first token) it joins."""
        start = time.perf_counter()
        done = self.prefilling.run(seq)
        if done is None:
            events = []
        else:
            cache, event = done
            events = [(seq, event)] if cache is None else self._join(seq, cache, event)
        self.prefilling.spent(time.perf_counter() - start, decoding=bool(self.rows))
        return events

    def _join(self, seq: Sequence, cache: KVCache, event) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """A prefilled request (its cache: row 0 of `cache`) becomes a row of the batch, unless it already ended."""
        if not isinstance(event, Exception) and not seq.finished:
            self.cache.copy_row_from(cache, 0, self._add_row(seq))
        return [] if event is None else [(seq, event)]

    def _add_row(self, seq: Sequence) -> int:
        """Give a request the next row of the batch (the cache grows to hold it); returns the row."""
        self.rows.append(seq)
        self.policy.join(seq)
        self._fit_cache()
        return len(self.rows) - 1

    def _decode(self) -> list[tuple[Sequence, StreamEvent | Exception]]:
        started = time.perf_counter()
        plan = self.policy.plan(self.rows)
        failed = self.engine.draft(self.rows, plan.draft_len, plan.cheap)  # a failed proposer ends its request alone
        for seq, _ in failed:
            self._remove(seq)
        if not self.rows:
            return failed
        seqs = list(self.rows)
        self._fit_cache()
        before = self.policy.before(seqs)
        events = self._forward(seqs)
        self.policy.observe(before, time.perf_counter() - started, plan)
        self.stats.count(len(seqs), plan.draft_len)
        return failed + self._collect(seqs, events)

    def _forward(self, seqs: list[Sequence]) -> list[StreamEvent | Exception | None]:
        """The batched forward of rows 0..len(seqs)-1; if it fails, each row alone (row-invariant kernels: the
        same tokens), so only the request that broke it fails. Nothing was committed when a forward raises."""
        try:
            return self.engine.forward(self.cache.view(0, len(seqs)), seqs)
        except Exception:  # noqa: BLE001 - find the row that broke it
            if len(seqs) == 1:
                raise
        events = []
        for row, seq in enumerate(seqs):
            try:
                events.append(self.engine.forward(self.cache.view(row, 1), [seq])[0])
            except Exception as exc:  # noqa: BLE001 - this row's own failure
                events.append(exc)
        return events

    def _prefill(self, seq: Sequence) -> list[tuple[Sequence, StreamEvent | Exception]]:
        row = self._add_row(seq)
        self.cache.lengths[row] = 0
        try:
            events = self.engine.forward(self.cache.view(row, 1), [seq])
        except Exception as exc:  # noqa: BLE001 - this request's failure alone
            events = [exc]
        return self._collect([seq], events)

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

    def _fit_cache(self) -> None:
        """Size the cache to the rows' committed, pending and draft tokens (slot == position)."""
        slots = max((len(seq.tokens) + len(seq.pending) + len(seq.proposal.tokens) for seq in self.rows), default=0)
        self.cache.fit(len(self.rows), slots)
