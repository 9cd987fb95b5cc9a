"""Continuous batching: requests join between steps, share one target forward per step, and leave when done.

A BatchEngine is a scheduler (scheduler.py: the decisions and the rows' state) bound to the engine that executes
its steps (execute.py). A step is three moves, as in vLLM v1's engine core: the scheduler's plan of the next
forward, the engine's run of it, and the scheduler's update from what it returned.
"""

from __future__ import annotations

from specserve.engine.execute import execute
from specserve.engine.output import StreamEvent
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence
from specserve.models.step_costs import StepCosts
from specserve.speculative.policy.step_policy import StepPolicy
from specserve.speculative.sampling import SamplingParams


class BatchEngine(Scheduler):
    """The scheduled steps of an engine (engine.Engine: its model, method and forward) over up to
    `max_batch_size` requests, priced by `costs` (by default measured when adaptive drafting needs them)."""

    def __init__(self, engine, max_batch_size: int, capacity: int | None = None,
                 adaptive_draft: bool = True, costs: StepCosts | None = None):
        policy = StepPolicy.for_batch(engine, max(1, max_batch_size), adaptive_draft, costs)
        super().__init__(engine.model, policy, max_batch_size,
                         capacity or (engine.max_model_len + engine.draft_slots), engine.draft_slots)
        self.engine = engine

    def add(self, prompt: str | list[int], params: SamplingParams, checked=None) -> Sequence:
        """Queue a request for a later step (RequestError for bad input; `checked`: Engine.check_request's verdict)."""
        return self.enqueue(self.engine.new_sequence(prompt, params, checked=checked))

    def step(self) -> list[tuple[Sequence, StreamEvent | Exception]]:
        """One forward; returns each sequence's new event, or the exception that ended that sequence alone."""
        step = self.schedule()
        return [] if step is None else self.update(step, execute(self.engine, step))
