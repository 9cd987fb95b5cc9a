"""The engine's side of a scheduled step (scheduler.py): the model calls a ScheduledStep asks for, and the
StepOutput the scheduler applies. A decoding step drafts every row (a row whose drafting failed is fed as an idle
row and fails alone), then runs one verify forward; a batched forward that raises is rerun row by row to find whose
failure it was (row-invariant kernels: the same tokens), so only that request fails. Nothing was committed when a
forward raises."""

from __future__ import annotations

import time

from specserve.engine.scheduler import ScheduledStep, StepKind, StepOutput
from specserve.engine.sequence import Sequence
from specserve.models.kv_cache import KVCache


def execute(engine, step: ScheduledStep) -> StepOutput:
    """Run `step` on `engine` (engine.Engine); the StepOutput holds one event or exception per scheduled sequence."""
    start = time.perf_counter()
    prefilled, proposals = True, []
    if step.kind is StepKind.DECODE:
        events, proposals = _decode(engine, step)
    elif step.kind is StepKind.CHUNK:
        try:
            prefilled = not engine.prefill_chunk(step.cache, step.seqs[0])
            events = engine.forward(step.cache, step.seqs) if prefilled else [None]
        except Exception as exc:  # noqa: BLE001 - this request's failure alone
            events = [exc]
    else:
        events = _forward_alone(engine, step.cache, step.seqs[0])
    return StepOutput(events, time.perf_counter() - start, proposals, prefilled)


def _decode(engine, step: ScheduledStep) -> tuple[list, list]:
    failed = dict(engine.draft(step.seqs, step.plan.draft_len, step.plan.cheap))
    fed = [None if seq in failed else seq for seq in step.seqs]
    proposals = [None if seq is None else seq.proposal for seq in fed]
    events = _forward_rows(engine, step.cache, fed) if any(seq is not None for seq in fed) else [None] * len(fed)
    return [failed.get(seq, event) for seq, event in zip(step.seqs, events)], proposals


def _forward_rows(engine, cache: KVCache, seqs: list[Sequence | None]) -> list:
    """The batched forward of rows 0..len(seqs)-1 (None: an idle row); if it fails, each row alone."""
    try:
        return engine.forward(cache, seqs)
    except Exception:  # noqa: BLE001 - find the row that broke it
        if len(seqs) == 1:
            raise
    return [None if seq is None else _forward_alone(engine, cache.view(row, 1), seq)[0]
            for row, seq in enumerate(seqs)]


def _forward_alone(engine, cache: KVCache, seq: Sequence) -> list:
    try:
        return engine.forward(cache, [seq])
    except Exception as exc:  # noqa: BLE001 - this request's failure alone
        return [exc]
