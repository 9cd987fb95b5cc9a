"""Continuous batching: requests join between steps, share one target forward per step, and leave when done.

Each request owns a row of one KV cache. A new request's prefill runs alone (as in plain decoding); then every
decoding request, each with its own draft and cache length, goes through one batched verify forward. The
row-invariant kernels make a request's tokens independent of its batch mates, so batching stays lossless.

The draft length is chosen per step from the target's measured cost per forward size and each request's
acceptance rate: it maximizes expected tokens per second, so speculation shrinks, or stops, when the batch is
large enough that verifying drafts costs more than it brings. The acceptance estimate starts optimistic and
forgets old evidence (`Acceptance`: the first draft token's rate and each later one's, given its predecessor),
so a request alone keeps drafting wherever drafts pay.

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


def expected_tokens(first: float, draft_len: int, further: float | None = None) -> float:
    """Tokens a verify step emits on average when the first draft token is accepted with probability `first` and
    each later one, its predecessor accepted, with probability `further` (default: `first`, independent tokens)."""
    further = first if further is None else further
    if draft_len == 0:
        return 1.0
    reached = draft_len if further >= 1.0 else (1.0 - further ** draft_len) / (1.0 - further)
    return 1.0 + first * reached


class Rate:
    """A success rate that starts from a prior and forgets old evidence: after a run of failures with no new
    trials it drifts back to the prior, so a request tries again. A plain running mean starves: once it says
    "do not draft", no draft brings new evidence and it never drafts again (the server then ran n-gram requests
    at plain-decoding speed)."""

    DECAY = 0.9  # the share of the evidence kept per step: about the last ten steps count

    def __init__(self, prior: float, weight: float):
        self.prior, self.weight = prior, weight  # the prior counts as `weight` trials
        self.trials = self.successes = 0.0

    def update(self, trials: int, successes: int) -> None:
        self.trials = self.trials * self.DECAY + trials
        self.successes = self.successes * self.DECAY + successes

    @property
    def value(self) -> float:
        return (self.successes + self.prior * self.weight) / (self.trials + self.weight)


class Acceptance:
    """A request's draft acceptance, as the draft-length choice sees it: the rate of its first draft token and the
    rate of each later one given the one before was accepted. Drafts are not independent tokens: a prompt-lookup
    continuation that is right at its first token is usually right for many more, so one per-token rate (the
    geometric model) undervalues long drafts: for n-gram on general questions, a request alone drafted 2 tokens
    more often than 4 with one rate, and drafts 4 in two steps of three with two."""

    PRIOR_FIRST = 0.7  # before any evidence: optimistic, so a new request drafts at once
    PRIOR_FURTHER = 0.8

    def __init__(self):
        # one first-token trial per step, up to max_draft_len - 1 later ones: priors worth about one step each
        self.first, self.further = Rate(self.PRIOR_FIRST, 1.0), Rate(self.PRIOR_FURTHER, 3.0)

    def update(self, drafted: int, accepted: int) -> None:
        """One verify step's verdict: `accepted` of the `drafted` tokens (a prefix) were accepted."""
        self.first.update(int(drafted > 0), int(accepted > 0))
        # draft token j > 0 is reached when token j - 1 was accepted
        self.further.update(min(accepted, max(drafted - 1, 0)), max(accepted - 1, 0))

    def expected_tokens(self, draft_len: int) -> float:
        return expected_tokens(self.first.value, draft_len, self.further.value)


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
        estimates = [self.acceptance.get(seq) or Acceptance() for seq in seqs]

        def throughput(k: int) -> float:
            return sum(a.expected_tokens(k) for a in estimates) / self.costs(len(seqs) * (k + 1))

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
