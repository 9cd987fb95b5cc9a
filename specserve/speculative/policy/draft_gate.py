"""Whether a request's drafting pays this step: the guard that keeps a speculative method from running slower than
plain decoding.

A method whose drafting runs a model pays that model's time every step it drafts, whatever the target then
accepts. For a chain (a draft model) the batch's draft-length choice prices that time per drafted token; a tree
method (an EAGLE or Medusa head) sizes its own trees, so this gate decides whether it drafts at all. Per request
the gate compares two ways of taking a step, from what that request actually got:

    full  : the method's draft.  tokens E_f per step for  d_f + v(n_f) seconds
    cheap : what costs no model: nothing (plain decoding), or the lookup branch of an EAGLE tree (`eagle3+ngram`).
            tokens E_c per step for  v(n_c) seconds

E: tokens a step emits (1 + accepted draft tokens), d: drafting seconds (measured around the proposer), v(n): the
target's measured cost of verifying n draft tokens (`StepCosts`, the batch's table, per row). It drafts in full while
E_f / S_f >= E_c / S_c, where S is the arm's measured seconds per step (this request's share of the step's wall
time) once the engine reports it, else d + v(n). The table times bare chain forwards; a step in the generation
loop also pays tree attention masks, feature capture, commit and sampling, and a tree's step costs more above the
table than a plain one (docs/design-notes.md, "Kept settings"), so prices from the table alone kept drafting a
head that lost. While the full draft has been measured and
the cheap step has not, the gate takes one cheap step to measure it. Estimates are exponentially smoothed (the
last few steps count most) and start from the method's pool (every request so far, forgetting slowly), so a new
request does not relearn a bad head.

A gate that stops drafting learns nothing more about the full draft, so while closed it probes: after `backoff`
cheap steps it drafts two steps in full; a probe that loses doubles the backoff (up to MAX_BACKOFF), one that wins
by REOPEN_MARGIN reopens the gate and halves the backoff (an open gate stays open while the full draft merely wins).
A head that never pays therefore costs two drafted steps in MAX_BACKOFF at most, and where two full steps cost more
than PROBE_SHARE of MAX_BACKOFF cheap ones, the backoff grows until they do not (the count of skipped steps carries
over from request to request through the pool). Drafting seconds are learnt only from a step that follows a drafted
step (hence probes of two): the first one after skipped steps also catches the head up on the tokens it skipped (a
one-off, like a prefill), which a steady step does not pay. Until one steady step is measured the gate stays open.

An open gate learns nothing more about the cheap step, and a slow reading of it (one noisy step) would keep a
losing head drafting for good; so where steps are measured, an open gate takes one cheap step after `recheck`
drafted ones. A recheck whose reading agrees that drafting pays doubles the wait (up to MAX_BACKOFF); one that
does not keeps it at RECHECK_FIRST until the estimate has followed the readings.

A batch keeps its gates in `StepGates`: one per request and kind of step (Proposer.situation), each kind with its
pool; per step it names the rows that take the cheap step and hands each gate its row's verdict and share of the
step's wall time.

Both kinds of step verify with the same verifier, so the gate changes speed only, never the output.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from specserve.smoothing import smoothed
from specserve.speculative.base import Proposal
from specserve.speculative.policy.request import Request

REOPEN_MARGIN = 1.1  # a closed gate reopens only where the full draft's rate beats the cheap step's by this
MAX_BACKOFF = 64  # cheap steps between probes of a draft that does not pay, at most (unless probes are dear)
PROBE_STEPS = 2
RECHECK_FIRST = 4  # drafted steps before an open gate first measures the cheap step again
PROBE_SHARE = 0.02  # of a gated request's time, what its probes may cost at most: a dear probe waits longer
DECAY = 0.8  # per observed step, the share of a request's estimate kept
POOL_DECAY = 0.97


@dataclass
class Arm:
    """Smoothed outcomes of one way of stepping: tokens per step, drafting seconds per step, draft tokens verified,
    and the whole step's measured seconds (None until the engine has reported one)."""

    tokens: float | None = None
    draft_seconds: float | None = None
    nodes: float = 0.0
    seconds: float | None = None

    def observe(self, tokens: int, nodes: int, draft_seconds: float | None, step_seconds: float | None,
                decay: float) -> None:
        self.nodes = float(nodes) if self.tokens is None else smoothed(self.nodes, nodes, decay)
        self.tokens = smoothed(self.tokens, float(tokens), decay)
        self.draft_seconds = smoothed(self.draft_seconds, draft_seconds, decay)
        self.seconds = smoothed(self.seconds, step_seconds, decay)

    def cost(self, verify_seconds) -> float:
        """Seconds per step: as measured, else the table's price."""
        return self.seconds if self.seconds is not None else self.table_cost(verify_seconds)

    def table_cost(self, verify_seconds) -> float:
        """Drafting plus the step-cost table's price of verifying this arm's draft tokens."""
        return (self.draft_seconds or 0.0) + verify_seconds(self.nodes)

    def copy(self) -> Arm:
        return Arm(self.tokens, self.draft_seconds, self.nodes, self.seconds)


@dataclass
class GatePool:
    """A method's estimates over every request so far: the start of each new request's gate."""

    full: Arm = field(default_factory=Arm)
    cheap: Arm = field(default_factory=Arm)
    backoff: int = 1
    skipped: int = 0  # cheap steps since the last probe, over requests (a long backoff spans several)
    recheck: int = RECHECK_FIRST
    drafted: int = 0  # drafted steps since the last cheap one, over requests


class DraftGate:
    def __init__(self, pool: GatePool, times_catch_up: bool = False):
        """`times_catch_up`: learn drafting seconds from every full step, the head's catch-up on skipped tokens
        included: for a gate that shares its request with another gate (Proposer.situation), whose steps in
        between skip the head as a matter of course, so that the catch-up is part of this gate's steady cost."""
        self.pool = pool
        self.times_catch_up = times_catch_up
        self.full, self.cheap = pool.full.copy(), pool.cheap.copy()
        self.backoff = pool.backoff
        self.skipped = pool.skipped
        self.drafted_last = False  # whether the previous step drafted in full (its drafting cost is steady)
        self.probe_steps = 0  # full steps left in the current probe
        self.closed = False  # whether the last decision outside a probe was a cheap step
        self.recheck, self.drafted = pool.recheck, pool.drafted
        self.rechecking = False  # whether this step is an open gate's cheap step

    def rate(self, arm: Arm, verify_seconds) -> float:
        measured = self.full.seconds is not None and self.cheap.seconds is not None  # compare like with like
        return (arm.tokens or 1.0) / (arm.cost(verify_seconds) if measured else arm.table_cost(verify_seconds))

    def pays(self, verify_seconds, margin: float = 1.0) -> bool:
        """Whether the full draft's tokens/s beat the cheap step's (by `margin`), by the estimates so far (True
        until a steady full step has been measured)."""
        if self.full.tokens is None or self.full.draft_seconds is None:
            return True
        return self.rate(self.full, verify_seconds) >= margin * self.rate(self.cheap, verify_seconds)

    def reopen_margin(self) -> float:
        """A closed gate reopens on a clear win only: two probe steps are noisy, and a head near break-even that
        reopened on every lucky probe drafted on at a loss until its estimate fell back (Medusa on code)."""
        return REOPEN_MARGIN if self.closed else 1.0

    def cheap_unmeasured(self) -> bool:
        return self.full.seconds is not None and self.cheap.seconds is None

    def decide(self, verify_seconds) -> bool:
        """Draft in full this step? `verify_seconds(n)`: this request's share of a step verifying n draft tokens."""
        if self.probe_steps:
            return True
        if self.cheap_unmeasured():
            return False
        if self.pays(verify_seconds, self.reopen_margin()):
            self.closed = False
            self.rechecking = self.cheap.seconds is not None and self.drafted >= self.recheck
            return not self.rechecking
        self.closed = True
        self.skipped += 1
        self.pool.skipped = self.skipped
        if self.skipped > self.backoff:
            self.probe_steps = PROBE_STEPS  # the first catches up on the skipped tokens, the next is steady
            return True
        return False

    def observe(self, drafted_in_full: bool, tokens: int, nodes: int, draft_seconds: float,
                verify_seconds, step_seconds: float | None = None) -> None:
        """The step's outcome: tokens emitted, draft tokens verified, seconds spent drafting, and (when the engine
        measures it) this request's share of the step's wall time."""
        steady = drafted_in_full and (self.drafted_last or self.times_catch_up)
        arm, pooled = (self.full, self.pool.full) if drafted_in_full else (self.cheap, self.pool.cheap)
        timed = steady or not drafted_in_full
        seconds, step = (draft_seconds, step_seconds) if timed else (None, None)
        arm.observe(tokens, nodes, seconds, step, DECAY)
        pooled.observe(tokens, nodes, seconds, step, POOL_DECAY)
        self.drafted_last = drafted_in_full
        self.drafted = self.pool.drafted = self.drafted + 1 if drafted_in_full else 0
        if not drafted_in_full:
            if self.rechecking:
                self._rechecked(tokens, step_seconds, verify_seconds)
            return
        self.skipped = self.pool.skipped = 0
        probing = self.probe_steps > 0
        self.probe_steps = max(self.probe_steps - 1, 0)
        if self.probe_steps:
            return
        if self.pays(verify_seconds, self.reopen_margin()):
            if probing:  # halved, not reset: a head near break-even reopens on a lucky probe, loses again, and
                # with a reset backoff probed every 1, 2, 4, ... steps at a loss before its wait was long again
                self.backoff = max(self.backoff // 2, 1)
            self.closed = False
        elif probing:
            self.backoff = min(2 * self.backoff, self.longest_backoff(verify_seconds))
        self.pool.backoff = self.backoff

    def _rechecked(self, tokens: int, step_seconds: float | None, verify_seconds) -> None:
        """Wait longer for the next recheck only where this one's reading, by itself, says drafting pays."""
        self.rechecking = False
        agrees = step_seconds is not None and self.rate(self.full, verify_seconds) >= tokens / step_seconds
        self.recheck = self.pool.recheck = min(2 * self.recheck, MAX_BACKOFF) if agrees else RECHECK_FIRST

    def longest_backoff(self, verify_seconds) -> int:
        """MAX_BACKOFF, or longer where a probe's extra time would be more than PROBE_SHARE of the cheap steps
        between probes (a static EAGLE-1 tree through the target's lm_head costs several plain steps)."""
        cheap, full = self.cheap.cost(verify_seconds), self.full.cost(verify_seconds)
        extra = PROBE_STEPS * max(full - cheap, 0.0)
        return max(MAX_BACKOFF, math.ceil(extra / (PROBE_SHARE * cheap)))


@dataclass
class Verdict:
    """What a row's verified step did: `drafted` draft tokens of which `accepted`, from `proposal`."""

    seq: Request
    drafted: int
    accepted: int
    proposal: Proposal


class StepGates:
    """A batch's draft gates: one per request and kind of step (Proposer.situation), each started from the pool of
    its kind of step; which rows take the cheap step, and what each verified step teaches their gates."""

    def __init__(self):
        self.gates: dict[tuple[Request, Hashable], DraftGate] = {}
        self.step_gates: dict[Request, DraftGate] = {}  # the gate each request's current step went through
        self.pools: dict[Hashable, GatePool] = {}  # per kind of step

    def forget(self) -> None:
        """Start the pools over (between runs of a benchmark); running requests keep their gates."""
        self.pools = {}

    def leave(self, seq: Request) -> None:
        self.gates = {key: gate for key, gate in self.gates.items() if key[0] is not seq}
        self.step_gates.pop(seq, None)

    def gate(self, seq: Request, draft_len: int) -> DraftGate:
        """The request's gate for the kind of step it is at, now its step's gate."""
        situation = seq.proposer.situation(seq.context, seq.draft_room(draft_len))
        key = (seq, situation)
        if key not in self.gates:  # a seeded request's gate starts afresh and prices from the table alone (below)
            pool = GatePool() if seq.params.reproducible else self.pools.setdefault(situation, GatePool())
            self.gates[key] = DraftGate(pool, times_catch_up=situation is not None)
        self.step_gates[seq] = self.gates[key]
        return self.gates[key]

    def cheap_rows(self, rows: list[Request], draft_len: int, verify) -> frozenset:
        """The rows whose gates take the cheap step this step (`verify`: a row's share of the step's price)."""
        return frozenset(seq for seq in rows if not self.gate(seq, draft_len).decide(verify))

    def observe(self, verdicts: list[Verdict], wall: float, verify) -> None:
        """A step's verdicts and its measured wall time; a seeded request's gate learns from the table alone, so
        that its choices (and the random numbers its verification draws) do not depend on the machine's speed."""
        shares = self._shares(wall, [v.proposal for v in verdicts], verify)
        for v in verdicts:
            if v.seq in self.step_gates:
                share = None if v.seq.params.reproducible else shares.get(id(v.proposal))
                self.step_gates[v.seq].observe(not v.proposal.cheap, 1 + v.accepted, v.drafted, v.proposal.seconds,
                                               verify, share)

    @staticmethod
    def _shares(wall: float, proposals, verify) -> dict[int, float]:
        """Each row's share of a step's measured wall time (keyed by its proposal's id): its own drafting, and the
        rest in proportion to the table's price of its part of the forward (at one row: the whole step)."""
        priced = [verify(len(p.tree.draft)) for p in proposals]
        drafting = sum(p.seconds for p in proposals)
        rest = max(wall - drafting, 0.0)
        return {id(p): p.seconds + rest * price / sum(priced) for p, price in zip(proposals, priced)}
