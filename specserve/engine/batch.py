"""Continuous batching: requests join between steps, share one target forward per step, and leave when done.

Each request owns a row of one KV cache. A new request's prefill runs alone (as in plain decoding); then every
decoding request, each with its own draft and cache length, goes through one batched verify forward. The
row-invariant kernels make a request's tokens independent of its batch mates, so batching stays lossless.

The draft length is chosen per step from the target's measured cost per forward size and each request's
running acceptance rate: it maximizes expected tokens per second, so speculation shrinks, or stops, when the
batch is large enough that verifying drafts costs more than it brings.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from specserve.engine.engine import Engine, Sequence, StreamEvent
from specserve.models.kv_cache import KVCache
from specserve.spec.sampling import SamplingParams


@dataclass
class BatchStats:
    steps: int = 0
    last_batch_size: int = 0
    last_draft_len: int = 0


class StepCosts:
    """Seconds per target forward by total tokens in it, measured once (interpolated in between)."""

    SIZES = (1, 2, 4, 8, 16, 32, 64)

    def __init__(self, engine: Engine | None, rows: int, seconds: list[float] | None = None):
        self.sizes = list(self.SIZES)
        if seconds is not None:  # measured earlier (a cached table)
            self.seconds = list(seconds)
            return
        # rounds over all sizes, least disturbed reading per size: a burst of load hits one round, not one size
        rounds = [[self._measure(engine, s, rows) for s in self.sizes] for _ in range(3)]
        measured = [min(readings) for readings in zip(*rounds)]
        # a bigger forward never costs less: a smaller reading is noise (another process took the CPU)
        self.seconds = [max(measured[: i + 1]) for i in range(len(measured))]

    @staticmethod
    def _measure(engine: Engine, total: int, rows: int) -> float:
        batch = min(rows, total)
        width = -(-total // batch)
        cache = KVCache.for_model(engine.model, batch, width + 1)
        positions = torch.arange(width)[None].expand(batch, width)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        engine.model(tokens, positions, cache, positions)
        timings = []
        for _ in range(3):
            start = time.perf_counter()
            engine.model(tokens, positions, cache, positions)
            timings.append(time.perf_counter() - start)
        return min(timings)  # the least disturbed run

    def __call__(self, total: int) -> float:
        for (s0, c0), (s1, c1) in zip(zip(self.sizes, self.seconds), zip(self.sizes[1:], self.seconds[1:])):
            if total <= s1:
                return c0 + (c1 - c0) * max(total - s0, 0) / (s1 - s0)
        return self.seconds[-1] * total / self.sizes[-1]


def expected_tokens(acceptance: float, draft_len: int) -> float:
    """Tokens a verify step emits on average when each draft token is accepted with probability `acceptance`."""
    if acceptance >= 1.0:
        return draft_len + 1.0
    return (1.0 - acceptance ** (draft_len + 1)) / (1.0 - acceptance)


class BatchEngine:
    def __init__(self, engine: Engine, max_batch_size: int, capacity: int | None = None,
                 adaptive_draft: bool = True):
        self.engine = engine
        self.max_batch_size = max(1, max_batch_size)
        self.capacity = capacity or (engine.max_model_len + engine.draft_slots)
        self.cache = KVCache.for_model(engine.model, self.max_batch_size, self.capacity)
        self.rows: list[Sequence | None] = [None] * self.max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.costs = StepCosts(engine, self.max_batch_size) if adaptive_draft and engine.max_draft_len else None
        self.stats = BatchStats()

    @property
    def active(self) -> int:
        return sum(seq is not None for seq in self.rows)

    def add(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Queue a request (RequestError for bad input); it starts at a later step."""
        seq = self.engine.new_sequence(prompt, params, self.capacity)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a request, waiting or running; its row is free for the next request."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        for row, held in enumerate(self.rows):
            if held is seq:
                self._free(row)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.active > 0

    def step(self) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """Admit one waiting request (its prefill is this step's forward), else one batched decode forward.
        Returns each sequence's new event, or the exception that ended that sequence alone."""
        if self.waiting and None in self.rows:
            return self._prefill(self.waiting.popleft())
        running = [row for row, seq in enumerate(self.rows) if seq is not None]
        if not running:
            return []
        width = running[-1] + 1
        seqs = list(self.rows[:width])
        draft_len = self.choose_draft_len([seq for seq in seqs if seq is not None])
        failed = []
        for row, seq in enumerate(seqs):
            if seq is None:
                continue
            try:
                seq.draft(draft_len)
            except Exception as exc:  # noqa: BLE001 - one request's proposer failed: only that request ends
                failed.append((seq, exc))
                self._free(row)
                seqs[row] = None
        events = self.engine.forward(self.cache.view(0, width), seqs)
        self.stats.steps += 1
        self.stats.last_batch_size, self.stats.last_draft_len = len(running), draft_len
        return failed + self._collect(list(enumerate(seqs)), events)

    def _prefill(self, seq: Sequence) -> list[tuple[Sequence, StreamEvent]]:
        row = self.rows.index(None)
        self.rows[row] = seq
        self.cache.lengths[row] = 0
        seq.draft(0)
        events = self.engine.forward(self.cache.view(row, 1), [seq])
        return self._collect([(row, seq)], events)

    def _collect(self, placed, events) -> list[tuple[Sequence, StreamEvent]]:
        out = []
        for (row, seq), event in zip(placed, events):
            if seq is None:
                continue
            if event is not None:
                out.append((seq, event))
            if seq.finished:
                self._free(row)
        return out

    def _free(self, row: int) -> None:
        self.rows[row] = None
        self.cache.lengths[row] = 0

    def choose_draft_len(self, seqs: list[Sequence]) -> int:
        """The draft length (shared by the batch) with the most expected tokens per second of target time."""
        top = self.engine.max_draft_len
        if not top or self.costs is None or self.engine.method.budgets_itself:
            return top
        # Laplace-smoothed acceptance: 0.5 before any draft, never exactly 0 or 1 from a few samples
        rates = [(seq.metrics.total_accepted_draft_tokens + 1) / (seq.metrics.total_draft_tokens + 2)
                 for seq in seqs]

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
