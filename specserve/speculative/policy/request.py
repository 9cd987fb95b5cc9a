"""What the policy reads of a request: engine.sequence.Sequence is one (the engine's state of a request, which
asks this policy; the policy sits below the engine and names the members it reads instead of that class)."""

from __future__ import annotations

from typing import Protocol

from specserve.speculative.base import Proposal, Proposer
from specserve.speculative.sampling import SamplingParams


class DraftCounts(Protocol):
    total_draft_tokens: int
    total_accepted_draft_tokens: int


class Request(Protocol):
    context: list[int]  # the tokens a draft continues
    params: SamplingParams
    metrics: DraftCounts
    proposer: Proposer
    proposal: Proposal  # the step's draft
    grammar: object | None  # structured outputs' state, or None

    @property
    def finished(self) -> bool: ...

    @property
    def draft_cap(self) -> int | float: ...

    def draft_room(self, max_len: int) -> int: ...
