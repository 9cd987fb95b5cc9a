"""Measured draft acceptance by position: how often a draft's first token is accepted, and each later one given
its predecessor was, kept per kind of evidence, per request and pooled over requests. The draft-length choice
(speculative/policy/draft_length.py) and the lookup branch of EAGLE trees (lookup_branch.py) price drafts with it."""

from __future__ import annotations

from collections.abc import Hashable


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

    def path_probabilities(self, draft_len: int) -> list[float]:
        """The chance that the draft's first d tokens are all accepted, for d = 1 .. draft_len."""
        first, further = self.first.value, self.further.value
        return [first * further ** d for d in range(draft_len)]


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
