"""What a batch's decoding step drafts, and what the step teaches, behind the calls the scheduler makes a step:
`plan(rows)` and `counts(rows)` as it schedules the step, and `observe` once it ran.

A plan holds the draft length the rows share (draft_length.py, by the method's kind of drafting: the most expected
tokens per second from the target's measured cost per forward size and each request's acceptance), the price of a
row's share of the step (from the same table), and for a tree method the rows whose draft gates take the cheap step
(StepGates).
`observe` hands each row's verdict back to both: its drafted and accepted tokens, and for the gates the step's
wall time. Without a cost table (adaptive drafting off) every step drafts the method's full length, ungated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specserve.models.step_costs import StepCosts, measured_step_costs
from specserve.speculative.base import DraftKind
from specserve.speculative.policy.draft_gate import StepGates, Verdict
from specserve.speculative.policy.draft_length import draft_length_choice
from specserve.speculative.policy.request import Request


@dataclass(frozen=True)
class StepPlan:
    draft_len: int
    verify: Callable[[int], float] | None  # n -> a row's share of the step's price when it verifies n draft tokens
    cheap: frozenset  # the rows that take the cheap step (their gates' decision)


class StepPolicy:
    def __init__(self, engine, costs: StepCosts | None):
        self.costs = costs
        self.draft_length = draft_length_choice(engine, costs)
        # tree drafting that runs a model is gated per request by what it pays (draft_gate.py); a chain's length,
        # its drafting time included, is the draft length's choice
        kind = engine.method.draft_kind if engine.method is not None else None
        trees = kind in (DraftKind.HEAD_TREE, DraftKind.SIZED_TREE)
        self.gates = StepGates() if costs is not None and trees else None

    @classmethod
    def for_batch(cls, engine, max_rows: int, adaptive: bool, costs: StepCosts | None) -> StepPolicy:
        """The policy of a batch of up to `max_rows` rows, priced by `costs` (a table measured before) or by one
        measured now; with adaptive drafting off, or nothing to draft, none."""
        if not adaptive or not engine.max_draft_len:
            return cls(engine, None)
        return cls(engine, costs or measured_step_costs(engine.target, max_rows, engine.ragged_logits))

    def join(self, seq: Request) -> None:
        self.draft_length.join(seq)

    def leave(self, seq: Request) -> None:
        self.draft_length.leave(seq)
        if self.gates is not None:
            self.gates.leave(seq)

    def forget(self) -> None:
        """Start the pools over (between runs of a benchmark); running requests keep their own estimates."""
        self.draft_length.forget()
        if self.gates is not None:
            self.gates.forget()

    def plan(self, rows: list[Request]) -> StepPlan:
        draft_len = self.draft_length.choose(rows)
        verify = self._verify_share(len(rows))
        cheap = self.gates.cheap_rows(rows, draft_len, verify) if self.gates is not None else frozenset()
        return StepPlan(draft_len, verify, cheap)

    @staticmethod
    def counts(seqs: list[Request]) -> list[tuple]:
        """The rows' draft counts as a step starts (observe's `counts`)."""
        return [(seq, seq.metrics.total_draft_tokens, seq.metrics.total_accepted_draft_tokens) for seq in seqs]

    def observe(self, counts: list[tuple], proposals: list, wall: float, plan: StepPlan) -> None:
        """The verified step of the rows in `counts`, which drafted `proposals` (None: a row whose drafting failed,
        which teaches nothing) and took `wall` seconds."""
        verdicts = [Verdict(seq, seq.metrics.total_draft_tokens - drafted,
                            seq.metrics.total_accepted_draft_tokens - accepted, proposal)
                    for (seq, drafted, accepted), proposal in zip(counts, proposals) if proposal is not None]
        if not verdicts:
            return
        self.draft_length.observe(verdicts)
        if self.gates is not None:
            self.gates.observe(verdicts, wall, plan.verify)

    def _verify_share(self, rows: int):
        """n -> one row's share of a step of `rows` rows in which that row verifies n draft tokens: the undrafted
        step's cost per row plus what the n tokens add to the forward."""
        if self.costs is None:
            return None
        base = self.costs(rows, rows)
        return lambda n: base / rows + self.costs(rows + n, rows + n) - base
