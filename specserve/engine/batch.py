"""Continuous batching: requests join between steps, share one target forward per step, and leave when done.

Each request owns a row of one KV cache. A new request's prefill runs alone (as in plain decoding); then every
decoding request, each with its own draft and cache length, goes through one batched verify forward. The
row-invariant kernels make a request's tokens independent of its batch mates, so batching stays lossless.

The draft length is chosen per step from the target's measured cost per forward size and each request's
acceptance rate: it maximizes expected tokens per second, so speculation shrinks, or stops, when the batch is
large enough that verifying drafts costs more than it brings. The acceptance estimate forgets old evidence
(`Acceptance`: the first draft token's rate and each later one's, given its predecessor), so a request alone keeps
drafting wherever drafts pay. It is kept per kind of draft (`AcceptanceByEvidence`, by `Proposal.evidence`: the
matched n for n-gram), and a request's starts from all earlier requests' (optimistic before any). Where drafting
runs no model (n-gram), the evidence is a full draft scored against the tokens the request then emits, verified or
not (`ShadowDraft`), so a large batch that stopped drafting still learns when drafts would pay.

The KV cache holds only the running rows, sized to their longest (`KVCache.fit`): an idle server holds none.

A prompt longer than one prefill chunk (sequence.PREFILL_CHUNK) is prefilled chunk by chunk in a cache of its own,
between the decoding steps of the running requests, and joins the batch once its first token is out. While others
decode, chunks get at most PREFILL_SHARE of the time, so a long prompt slows them by at most 1 / (1 - share); a
cancelled request stops between chunks. A failure ends only the request it belongs to: a per-row failure comes back
as that row's exception, and a failed batched forward is rerun row by row to find whose it was.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from specserve.engine.draft_gate import DraftGate, GatePool
from specserve.engine.output import StreamEvent
from specserve.engine.sequence import PREFILL_CHUNK, Sequence
from specserve.models.step_costs import StepCosts, measured_step_costs
from specserve.models.kv_cache import KVCache
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.tree import DraftTree


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

    def __init__(self, prior: float, weight: float, decay: float = DECAY):
        self.prior, self.weight = prior, weight  # the prior counts as `weight` trials
        self.decay = decay
        self.trials = self.successes = 0.0

    def update(self, trials: int, successes: int) -> None:
        self.trials = self.trials * self.decay + trials
        self.successes = self.successes * self.decay + successes

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

    def __init__(self, prior_first: float = PRIOR_FIRST, prior_further: float = PRIOR_FURTHER,
                 decay: float = Rate.DECAY):
        # one first-token trial per step, up to max_draft_len - 1 later ones: priors worth about one step each
        self.first = Rate(prior_first, 1.0, decay)
        self.further = Rate(prior_further, 3.0, decay)

    def update(self, drafted: int, accepted: int) -> None:
        """One verify step's verdict: `accepted` of the `drafted` tokens (a prefix) were accepted."""
        self.first.update(int(drafted > 0), int(accepted > 0))
        # draft token j > 0 is reached when token j - 1 was accepted
        self.further.update(min(accepted, max(drafted - 1, 0)), max(accepted - 1, 0))

    def expected_tokens(self, draft_len: int) -> float:
        return expected_tokens(self.first.value, draft_len, self.further.value)


def reproducible(seq: Sequence) -> bool:
    """A request that asked for a seed: its speculation must not depend on other requests or on timing, so that
    the same seed gives the same output."""
    return seq.params.seed is not None


class AcceptanceByEvidence:
    """Draft acceptance kept apart per the evidence the drafts rest on (`Proposal.evidence`): a 3-gram match is
    accepted far more often than a 1-gram one, and one estimate for both drafts too long after a 1-gram match and
    too short after a 3-gram one. A request's estimate for an evidence starts from the `pool`'s (all requests' so
    far, forgetting slowly) rather than from a fixed prior, and feeds it."""

    POOL_DECAY = 0.99  # about the last hundred verdicts of an evidence count

    def __init__(self, pool: AcceptanceByEvidence | None = None, decay: float = Rate.DECAY):
        self.pool, self.decay = pool, decay
        self.by_evidence: dict[Hashable, Acceptance] = {}

    @classmethod
    def pooled(cls) -> AcceptanceByEvidence:
        return cls(decay=cls.POOL_DECAY)

    def __getitem__(self, evidence: Hashable) -> Acceptance:
        if evidence not in self.by_evidence:
            pooled = None if self.pool is None else self.pool[evidence]
            prior = () if pooled is None else (pooled.first.value, pooled.further.value)
            self.by_evidence[evidence] = Acceptance(*prior, decay=self.decay)
        return self.by_evidence[evidence]

    def update(self, drafted: int, accepted: int, evidence: Hashable = None) -> None:
        self[evidence].update(drafted, accepted)
        if self.pool is not None:
            self.pool.update(drafted, accepted, evidence)


@dataclass
class ShadowDraft:
    """A draft that was not verified, waiting for the tokens it guessed. For a deterministic draft, matching the
    emitted token is exactly as likely as verification accepting it (both happen with the target's probability of
    the drafted token, siblings included), so its score is the acceptance the draft would have had."""

    start: int  # the context length when it was drafted: its first level guesses context[start]
    tree: DraftTree  # a chain, or a tree of deterministic siblings (suffix decoding)
    evidence: Hashable = None  # the proposal's (Proposal.evidence)

    def verdict(self, seq: Sequence) -> tuple[int, int] | None:
        """(drafted, accepted: the root path the emitted tokens follow) once the request has emitted enough to
        tell, else None."""
        tree, draft = self.tree, self.tree.draft
        node = accepted = 0
        for token in seq.context[self.start:]:
            child = next((c for c in tree.children(node) if draft[c - 1] == token), None)
            if child is None:  # the target left the tree here
                return len(draft), accepted
            node, accepted = child, accepted + 1
            if not tree.children(node):  # a leaf: all of its path would have been accepted
                return len(draft), accepted
        return None


class BatchEngine:
    """The steps of an engine (engine.Engine: its model, method and forward) over many requests. Rows
    0..active-1 of the cache hold the running requests, densely (a leaving request's row is refilled with the last
    one), so a step's forward never pads with idle rows; the cache grows and shrinks with them."""

    PREFILL_SHARE = 0.25  # of the time, at most, for long prompts' chunks while other requests decode

    def __init__(self, engine, max_batch_size: int, capacity: int | None = None,
                 adaptive_draft: bool = True, costs: StepCosts | None = None):
        self.engine = engine
        self.max_batch_size = max(1, max_batch_size)
        self.capacity = capacity or (engine.max_model_len + engine.draft_slots)
        self.cache = KVCache.growable(engine.model, self.max_batch_size, self.capacity)
        self.rows: list[Sequence] = []  # row i of the cache holds rows[i]
        self.acceptance: dict[Sequence, AcceptanceByEvidence] = {}
        self.pooled_acceptance = AcceptanceByEvidence.pooled()  # every request's, the prior of each new one's
        self.shadows: dict[Sequence, list[ShadowDraft]] = {}  # drafts scored, not verified (`_learns_from_shadows`)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: dict[Sequence, KVCache] = {}  # long prompts being prefilled, each in its own cache
        self.prefill_credit = 0.0  # seconds of chunks the decoding requests' time has paid for
        # `costs`: a table measured before (StepCosts over up to max_batch_size rows)
        self.costs = (costs or measured_step_costs(engine.target, self.max_batch_size, engine.ragged_logits)) \
            if adaptive_draft and engine.max_draft_len else None
        self.stats = BatchStats()
        # tree drafting that runs a model is gated per request by what it pays (draft_gate.py); a chain's length,
        # its drafting time included, is chosen per step below
        self.gated = self.costs is not None and engine.method.drafts_trees
        self.draft_seconds_per_token: float | None = None  # a model-drafted chain's, smoothed
        self.gates: dict[Sequence, DraftGate] = {}
        self.gate_pool = GatePool()

    def forget_acceptance(self) -> None:
        """Start the acceptance pool and the draft gates' pool over (between runs of a benchmark); running requests
        keep their own estimates."""
        self.pooled_acceptance.by_evidence.clear()
        self.gate_pool = GatePool()

    @property
    def active(self) -> int:
        return len(self.rows)

    def add(self, prompt: str | list[int], params: SamplingParams, checked=None) -> Sequence:
        """Queue a request (RequestError for bad input; `checked`: Engine.check_request's verdict on it, which
        spares the check); it starts at a later step."""
        seq = self.engine.new_sequence(prompt, params, checked=checked)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a request, waiting, prefilling or running; its row (and memory) is free for the next request."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.prefilling.pop(seq, None)
        if seq in self.acceptance:
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
            self.prefilling[seq] = KVCache.for_model(self.engine.model, 1, self.engine.capacity_for(
                seq.context, seq.params))
        if self.prefilling and (not self.rows or self.prefill_credit >= 0):
            return self._prefill_chunk(min(self.prefilling, key=self._prefill_left))
        if not self.rows:
            return []
        start = time.perf_counter()
        events = self._decode()
        self.prefill_credit += (time.perf_counter() - start) * self.PREFILL_SHARE / (1 - self.PREFILL_SHARE)
        return events

    def _prefill_left(self, seq: Sequence) -> int:
        return self.engine.prefill_remaining(self.prefilling[seq], seq)

    def _prefill_chunk(self, seq: Sequence) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """The next piece of a long prompt; its last piece samples the first token and moves it into the batch."""
        cache, start = self.prefilling[seq], time.perf_counter()
        try:
            if self.engine.prefill_chunk(cache, seq):
                events = []
            else:
                del self.prefilling[seq]
                events = self._join(seq, cache, self.engine.forward(cache, [seq])[0])
        except Exception as exc:  # noqa: BLE001 - this request's failure alone
            self.prefilling.pop(seq, None)
            events = [(seq, exc)]
        if self.rows:
            self.prefill_credit -= time.perf_counter() - start
        else:  # nobody waited for this chunk: it owes nothing
            self.prefill_credit = 0.0
        return events

    def _join(self, seq: Sequence, cache: KVCache, event) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """A prefilled request (its cache: row 0 of `cache`) becomes a row of the batch, unless it already ended."""
        if not isinstance(event, Exception) and not seq.finished:
            self.cache.copy_row_from(cache, 0, self._add_row(seq))
        return [] if event is None else [(seq, event)]

    def _add_row(self, seq: Sequence) -> int:
        """Give a request the next row of the batch (the cache grows to hold it); returns the row."""
        self.rows.append(seq)
        # a seeded request learns from its own drafts alone: draft lengths (and so the random numbers its
        # verification draws) then do not depend on which requests ran before it
        self.acceptance[seq] = AcceptanceByEvidence(None if reproducible(seq) else self.pooled_acceptance)
        self._fit_cache()
        return len(self.rows) - 1

    def _decode(self) -> list[tuple[Sequence, StreamEvent | Exception]]:
        started = time.perf_counter()
        draft_len = self.choose_draft_len(self.rows)
        verify = self._verify_share(len(self.rows))
        cheap = frozenset(seq for seq in self.rows if self.gated and not self._gate(seq).decide(verify))
        failed = self.engine.draft(self.rows, draft_len, cheap)  # a failed proposer ends its request alone
        for seq, _ in failed:
            self._remove(seq)
        if not self.rows:
            return failed
        seqs = list(self.rows)
        self._fit_cache()
        if self._learns_from_shadows:
            events = self._forward(seqs)
            self._score_shadows(seqs)
        else:
            before = [(seq.metrics.total_draft_tokens, seq.metrics.total_accepted_draft_tokens, seq.proposal)
                      for seq in seqs]
            events = self._forward(seqs)
            shares = self._step_shares(time.perf_counter() - started, [p for _, _, p in before], verify) \
                if self.gated else {}
            for seq, (drafted, accepted, proposal) in zip(seqs, before):
                drafted = seq.metrics.total_draft_tokens - drafted
                accepted = seq.metrics.total_accepted_draft_tokens - accepted
                self.acceptance[seq].update(drafted, accepted, proposal.evidence)
                if drafted and not (self.engine.method.drafts_for_free or self.engine.method.drafts_trees):
                    per_token = proposal.seconds / drafted
                    self.draft_seconds_per_token = per_token if self.draft_seconds_per_token is None else \
                        0.8 * self.draft_seconds_per_token + 0.2 * per_token
                if self.gated and seq in self.gates:
                    self.gates[seq].observe(not proposal.cheap, 1 + accepted, drafted, proposal.seconds, verify,
                                            None if reproducible(seq) else shares.get(id(proposal)))
        self.stats.steps += 1
        self.stats.last_batch_size, self.stats.last_draft_len = len(seqs), draft_len
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

    @property
    def _learns_from_shadows(self) -> bool:
        """Where drafting is free, acceptance is learnt from full-length drafts that are not verified but scored
        against the tokens the request then emits (`ShadowDraft`), whatever the step's draft length. Learnt
        from verified drafts alone, a batch that stopped drafting learns nothing more and stays at its prior (at
        8 requests on a CPU the prior's choice is a coin toss between 0 and 2, and a batch whose drafts would be
        accepted 9 times in 10 decoded without them), and one drafting a token learns nothing about the next."""
        return self.costs is not None and self.engine.method.drafts_for_free

    def _score_shadows(self, seqs: list[Sequence]) -> None:
        """Score the drafts the step's tokens decide, and draft from where each request now stands: one draft
        per step, as verified drafts would be."""
        for seq in seqs:
            open_drafts = []
            for shadow in self.shadows.get(seq, []):
                verdict = shadow.verdict(seq)
                if verdict is None:
                    open_drafts.append(shadow)
                else:
                    self.acceptance[seq].update(*verdict, shadow.evidence)
            if not seq.finished:
                open_drafts += self._shadow_draft(seq)
            self.shadows[seq] = open_drafts

    def _shadow_draft(self, seq: Sequence) -> list[ShadowDraft]:
        room = seq.draft_room(self.engine.max_draft_len)
        try:
            proposal = seq.proposer.propose(seq.context, room) if room else None
        except Exception:  # noqa: BLE001 - the request goes on undrafted; its next real draft reports the failure
            return []
        if proposal is None or not proposal.tree.draft:
            return []
        return [ShadowDraft(len(seq.context), proposal.tree, proposal.evidence)]

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
        del self.acceptance[seq]
        self.shadows.pop(seq, None)
        self.gates.pop(seq, None)
        self.cache.lengths[last] = 0
        self._fit_cache()

    def _fit_cache(self) -> None:
        """Size the cache to the rows' committed, pending and draft tokens (slot == position)."""
        slots = max((len(seq.tokens) + len(seq.pending) + len(seq.proposal.tokens) for seq in self.rows), default=0)
        self.cache.fit(len(self.rows), slots)

    def _gate(self, seq: Sequence) -> DraftGate:
        if seq not in self.gates:  # a seeded request's gate starts afresh and prices from the table alone (below)
            self.gates[seq] = DraftGate(GatePool() if reproducible(seq) else self.gate_pool)
        return self.gates[seq]

    @staticmethod
    def _step_shares(wall: float, proposals, verify) -> dict[int, float]:
        """Each row's share of a step's measured wall time (keyed by its proposal's id): its own drafting, and the
        rest in proportion to the table's price of its part of the forward (at one row: the whole step)."""
        priced = [verify(len(p.tree.draft)) for p in proposals]
        drafting = sum(p.seconds for p in proposals)
        rest = max(wall - drafting, 0.0)
        return {id(p): p.seconds + rest * price / sum(priced) for p, price in zip(proposals, priced)}

    def _verify_share(self, rows: int):
        """n -> one row's share of a step of `rows` rows in which that row verifies n draft tokens: the undrafted
        step's cost per row plus what the n tokens add to the forward."""
        if self.costs is None:
            return None
        base = self.costs(rows, rows)
        return lambda n: base / rows + self.costs(rows + n, rows + n) - base

    def choose_draft_len(self, seqs: list[Sequence]) -> int:
        """The draft length (shared by the batch) with the most expected tokens per second (target time, plus a
        draft model's time per drafted token). A request
        with its own cap (`num_speculative_tokens`) drafts at most that many, and where drafting is free, at most
        the draft it has now (its latest shadow draft): it counts so in the expected tokens. The forward pads every
        row to the longest draft, so the cost is that of len(seqs) rows of k + 1 tokens, whoever drafts; only the
        lm_head skips the padding."""
        caps = [seq.draft_cap for seq in seqs]
        top = min(self.engine.max_draft_len, max(caps, default=0))
        if not top or self.costs is None or self.engine.method.budgets_itself:
            return top
        available = [self._draft_available(seq, top) for seq in seqs]
        caps = [min(cap, depth) for cap, (depth, _) in zip(caps, available)]
        estimates = [self.acceptance.get(seq, self.pooled_acceptance)[evidence]
                     for seq, (_, evidence) in zip(seqs, available)]

        drafting = self.draft_seconds_per_token or 0.0  # a draft model's time per drafted token (n-gram: none)

        def throughput(k: int) -> float:
            drafted = [min(k, cap) for cap in caps]
            tokens = sum(a.expected_tokens(d) for a, d in zip(estimates, drafted))
            return tokens / (self.costs(len(seqs) * (max(drafted) + 1), sum(d + 1 for d in drafted))
                             + drafting * sum(drafted))

        return max(range(top + 1), key=throughput)

    def _draft_available(self, seq: Sequence, top: int) -> tuple[int, Hashable]:
        """How long a draft the request has now, and its evidence, where drafts are scored as shadows: its latest
        shadow was drafted from where it stands (a deterministic proposer drafts the same again); none there:
        nothing to draft. Otherwise (or before its first shadow) `top`, and no evidence."""
        if not self._learns_from_shadows or seq not in self.shadows or seq.grammar is not None:
            return top, None
        here = [shadow for shadow in self.shadows[seq] if shadow.start == len(seq.context)]
        return (here[-1].tree.max_depth, here[-1].evidence) if here else (0, None)


class StreamBatch:
    """The BatchEngine interface over anything with `stream(prompt_ids, params)`, one request at a time: for
    engines that wrap or replace `Engine.stream` (fault-injection and fake engines in tests, for instance)."""

    max_batch_size = 1

    def __init__(self, engine):
        self.engine = engine
        self.waiting: deque = deque()
        self.current = None  # (token, generator)

    def add(self, prompt_ids: list[int], params: SamplingParams, checked=None):
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
