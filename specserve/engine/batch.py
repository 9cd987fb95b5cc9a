"""Continuous batching: requests join between steps, share one target forward per step, and leave when done.

Each request owns a row of one KV cache. A new request's prefill runs alone (as in plain decoding); then every
decoding request, each with its own draft and cache length, goes through one batched verify forward. The
row-invariant kernels make a request's tokens independent of its batch mates, so batching stays lossless.

The draft length is chosen per step from the target's measured cost per forward size and each request's
acceptance rate: it maximizes expected tokens per second, so speculation shrinks, or stops, when the batch is
large enough that verifying drafts costs more than it brings. The acceptance estimate starts optimistic and
forgets old evidence (`Acceptance`), so a request alone keeps drafting wherever drafts pay.

The KV cache holds only the running rows, sized to their longest (`KVCache.fit`): an idle server holds none.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.engine.engine import Engine, Sequence, StreamEvent
from specserve.engine.step_costs import StepCosts
from specserve.models.kv_cache import KVCache
from specserve.speculative.sampling import SamplingParams


@dataclass
class BatchStats:
    steps: int = 0
    last_batch_size: int = 0
    last_draft_len: int = 0


def expected_tokens(acceptance: float, draft_len: int) -> float:
    """Tokens a verify step emits on average when each draft token is accepted with probability `acceptance`."""
    if acceptance >= 1.0:
        return draft_len + 1.0
    return (1.0 - acceptance ** (draft_len + 1)) / (1.0 - acceptance)


class Acceptance:
    """A request's draft acceptance rate, as the draft-length choice sees it.

    It starts from an optimistic prior, so a new request drafts at once, and its evidence fades every step, so
    after a run of rejected drafts the estimate drifts back to the prior and the request tries again. A plain
    running mean starves: once it says "do not draft", no draft brings new evidence and it never drafts again
    (the server then ran n-gram requests at plain-decoding speed)."""

    PRIOR = 0.7  # acceptance per draft token before any evidence
    WEIGHT = 4.0  # the prior counts as this many draft tokens
    DECAY = 0.9  # the share of the evidence kept per step: about the last ten steps count

    def __init__(self):
        self.drafted = self.accepted = 0.0

    def update(self, drafted: int, accepted: int) -> None:
        self.drafted = self.drafted * self.DECAY + drafted
        self.accepted = self.accepted * self.DECAY + accepted

    @property
    def rate(self) -> float:
        return (self.accepted + self.PRIOR * self.WEIGHT) / (self.drafted + self.WEIGHT)


class BatchEngine:
    """Rows 0..active-1 of the cache hold the running requests, densely (a leaving request's row is refilled
    with the last one), so a step's forward never pads with idle rows; the cache grows and shrinks with them."""

    def __init__(self, engine: Engine, max_batch_size: int, capacity: int | None = None,
                 adaptive_draft: bool = True):
        self.engine = engine
        self.max_batch_size = max(1, max_batch_size)
        self.capacity = capacity or (engine.max_model_len + engine.draft_slots)
        self.cache = KVCache.growable(engine.model, self.max_batch_size, self.capacity)
        self.rows: list[Sequence] = []  # row i of the cache holds rows[i]
        self.acceptance: dict[Sequence, Acceptance] = {}
        self.waiting: deque[Sequence] = deque()
        self.costs = StepCosts(engine.model, self.max_batch_size) if adaptive_draft and engine.max_draft_len else None
        self.stats = BatchStats()

    @property
    def active(self) -> int:
        return len(self.rows)

    def add(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Queue a request (RequestError for bad input); it starts at a later step."""
        seq = self.engine.new_sequence(prompt, params)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a request, waiting or running; its row (and memory) is free for the next request."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.acceptance:
            self._remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.active > 0

    def step(self) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """Admit one waiting request (its prefill is this step's forward), else one batched decode forward.
        Returns each sequence's new event, or the exception that ended that sequence alone."""
        if self.waiting and self.active < self.max_batch_size:
            return self._prefill(self.waiting.popleft())
        if not self.rows:
            return []
        draft_len = self.choose_draft_len(self.rows)
        failed = self.engine.draft(self.rows, draft_len)  # a failed proposer ends its request alone
        for seq, _ in failed:
            self._remove(seq)
        if not self.rows:
            return failed
        seqs = list(self.rows)
        before = [(seq.metrics.total_draft_tokens, seq.metrics.total_accepted_draft_tokens) for seq in seqs]
        self._fit_cache()
        events = self.engine.forward(self.cache.view(0, len(seqs)), seqs)
        for seq, (drafted, accepted) in zip(seqs, before):
            self.acceptance[seq].update(seq.metrics.total_draft_tokens - drafted,
                                        seq.metrics.total_accepted_draft_tokens - accepted)
        self.stats.steps += 1
        self.stats.last_batch_size, self.stats.last_draft_len = len(seqs), draft_len
        return failed + self._collect(seqs, events)

    def _prefill(self, seq: Sequence) -> list[tuple[Sequence, StreamEvent]]:
        row = len(self.rows)
        self.rows.append(seq)
        self.acceptance[seq] = Acceptance()
        self._fit_cache()
        self.cache.lengths[row] = 0
        return self._collect([seq], self.engine.forward(self.cache.view(row, 1), [seq]))

    def _collect(self, seqs: list[Sequence], events) -> list[tuple[Sequence, StreamEvent]]:
        out = [(seq, event) for seq, event in zip(seqs, events) if event is not None]
        for seq in seqs:
            if seq.finished:
                self._remove(seq)
        return out

    def _remove(self, seq: Sequence) -> None:
        """Free a request's row: the last row moves into it, and the cache shrinks once it is mostly unused."""
        row, last = self.rows.index(seq), len(self.rows) - 1
        if row != last:
            self.cache.move_row(last, row)
            self.rows[row] = self.rows[last]
        self.rows.pop()
        del self.acceptance[seq]
        self.cache.lengths[last] = 0
        self._fit_cache()

    def _fit_cache(self) -> None:
        """Size the cache to the rows' committed, pending and draft tokens (slot == position)."""
        slots = max((len(seq.tokens) + len(seq.pending) + len(seq.proposal.tokens) for seq in self.rows), default=0)
        self.cache.fit(len(self.rows), slots)

    def choose_draft_len(self, seqs: list[Sequence]) -> int:
        """The draft length (shared by the batch) with the most expected tokens per second of target time."""
        top = self.engine.max_draft_len
        if not top or self.costs is None or self.engine.method.budgets_itself:
            return top
        rates = [self.acceptance[seq].rate if seq in self.acceptance else Acceptance.PRIOR for seq in seqs]

        def throughput(k: int) -> float:
            return sum(expected_tokens(a, k) for a in rates) / self.costs(len(seqs) * (k + 1))

        return max(range(top + 1), key=throughput)


class StreamBatch:
    """The BatchEngine interface over anything with `stream(prompt_ids, params)`, one request at a time: for
    engines that wrap or replace `Engine.stream` (fault-injection and fake engines in tests, for instance)."""

    max_batch_size = 1

    def __init__(self, engine):
        self.engine = engine
        self.waiting: deque = deque()
        self.current = None  # (token, generator)

    def add(self, prompt_ids: list[int], params: SamplingParams):
        token = object()
        self.waiting.append((token, prompt_ids, params))
        return token

    def cancel(self, token) -> None:
        self.waiting = deque(item for item in self.waiting if item[0] is not token)
        if self.current and self.current[0] is token:
            self.current[1].close()
            self.current = None

    def has_work(self) -> bool:
        return bool(self.waiting) or self.current is not None

    def step(self) -> list[tuple[object, StreamEvent | Exception]]:
        if self.current is None:
            if not self.waiting:
                return []
            token, prompt_ids, params = self.waiting.popleft()
            self.current = (token, self.engine.stream(prompt_ids, params))
        token, generator = self.current
        try:
            event = next(generator)
        except StopIteration:
            self.current = None
            return []
        except Exception as exc:  # noqa: BLE001 - ends this request only
            self.current = None
            return [(token, exc)]
        if event.result is not None:
            generator.close()
            self.current = None
        return [(token, event)]
