"""The draft length of a batch's step: the one with the most expected tokens per second, from the target's
measured cost per forward size (`StepCosts`) and each request's acceptance rate. Speculation so shrinks, or stops,
when the batch is large enough that verifying drafts costs more than it brings.

The acceptance estimate forgets old evidence (`Acceptance`: the first draft token's rate and each later one's,
given its predecessor), so a request alone keeps drafting wherever drafts pay. It is kept per kind of draft
(`AcceptanceByEvidence`, by `Proposal.evidence`: the matched n for n-gram), and a request's starts from all earlier
requests' (optimistic before any).

Each kind of drafting (`SpecMethod.draft_kind`) has its choice: a model's chain also prices the drafting time and
probes where drafting stopped paying (`ModelChainLengths`); lookup learns from full drafts scored against the tokens
the request then emits, verified or not (`ShadowDraft`), so a large batch that stopped drafting still learns when
drafts would pay (`LookupLengths`); a tree its proposer sizes from the measured costs gets the full depth
(`SizedTreeLengths`); a head's tree of fixed shape takes the choice as it is (`DraftLengthChoice`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from specserve.models.step_costs import StepCosts
from specserve.smoothing import smoothed
from specserve.speculative.base import DraftKind
from specserve.speculative.policy.acceptance import AcceptanceByEvidence
from specserve.speculative.policy.request import Request
from specserve.speculative.tree import DraftTree


@dataclass
class ShadowDraft:
    """A draft that was not verified, waiting for the tokens it guessed. For a deterministic draft, matching the
    emitted token is exactly as likely as verification accepting it (both happen with the target's probability of
    the drafted token, siblings included), so its score is the acceptance the draft would have had."""

    start: int  # the context length when it was drafted: its first level guesses context[start]
    tree: DraftTree  # a chain, or a tree of deterministic siblings (suffix decoding)
    evidence: Hashable = None  # the proposal's (Proposal.evidence)

    def verdict(self, seq: Request) -> tuple[int, int] | None:
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


class DraftLengthChoice:
    """A batch engine's draft-length choice and what it learns: each running request's acceptance, and their pool.
    As it is, the choice of a head's tree of fixed shape (Medusa; and of plain decoding, which drafts nothing):
    drafting is priced as part of the step."""

    def __init__(self, engine, costs: StepCosts | None):
        self.engine = engine  # its max_draft_len
        self.costs = costs  # None: no choice, every step drafts max_draft_len
        self.acceptance: dict[Request, AcceptanceByEvidence] = {}
        self.pooled = AcceptanceByEvidence.pooled()  # every request's, the prior of each new one's

    def forget(self) -> None:
        """Start the pool over (between runs of a benchmark); running requests keep their own estimates."""
        self.pooled.by_evidence.clear()

    def join(self, seq: Request) -> None:
        # a seeded request learns from its own drafts alone: draft lengths (and so the random numbers its
        # verification draws) then do not depend on which requests ran before it
        self.acceptance[seq] = AcceptanceByEvidence(None if seq.params.reproducible else self.pooled)

    def leave(self, seq: Request) -> None:
        del self.acceptance[seq]

    def observe(self, verdicts: list) -> None:
        """A verified step's verdicts (draft_gate.Verdict): each row's drafted and accepted tokens."""
        for v in verdicts:
            self.record(v.seq, v.drafted, v.accepted, v.proposal)

    def record(self, seq: Request, drafted: int, accepted: int, proposal) -> None:
        """A verified step's verdict on the request's draft (`proposal`): `accepted` of `drafted` tokens."""
        self.acceptance[seq].update(drafted, accepted, proposal.evidence)

    def choose(self, seqs: list[Request]) -> int:
        """The draft length (shared by the batch) with the most expected tokens per second (target time, plus the
        drafting time per drafted token where it is priced). A request with its own cap (`num_speculative_tokens`)
        drafts at most that many, and at most the draft it has now where that is known (`_draft_available`): it
        counts so in the expected tokens. The forward pads every row to the longest draft, so the cost is that of
        len(seqs) rows of k + 1 tokens, whoever drafts; only the lm_head skips the padding."""
        top = self.longest(seqs)
        if not top or self.costs is None:
            return top
        available = [self._draft_available(seq, top) for seq in seqs]
        caps = [min(seq.draft_cap, depth) for seq, (depth, _) in zip(seqs, available)]
        estimates = [self.acceptance.get(seq, self.pooled)[evidence]
                     for seq, (_, evidence) in zip(seqs, available)]
        drafting = self.drafting_seconds_per_token()

        def throughput(k: int) -> float:
            drafted = [min(k, cap) for cap in caps]
            tokens = sum(a.expected_tokens(d) for a, d in zip(estimates, drafted))
            return tokens / (self.costs(len(seqs) * (max(drafted) + 1), sum(d + 1 for d in drafted))
                             + drafting * sum(drafted))

        return self._probed(max(range(top + 1), key=throughput), top, throughput)

    def longest(self, seqs: list[Request]) -> int:
        """The longest draft any of the rows may take."""
        return min(self.engine.max_draft_len, max((seq.draft_cap for seq in seqs), default=0))

    def drafting_seconds_per_token(self) -> float:
        return 0.0

    def _probed(self, best: int, top: int, throughput) -> int:
        return best

    def _draft_available(self, seq: Request, top: int) -> tuple[int, Hashable]:
        """How long a draft the request has now, and its evidence: unknown before drafting, so `top`, and none."""
        return top, None


class ModelChainLengths(DraftLengthChoice):
    """A draft model's chain: its time per drafted token (smoothed) is priced beside the target's.

    A model drafter learns both its acceptance and its time only from the drafts it makes, so once its estimates
    say drafting does not pay it would never learn otherwise: after `PROBE_AFTER` steps without a draft it drafts
    one step anyway (the best positive length), the wait doubling after each probe up to `PROBE_MAX`; a step that
    chooses to draft resets it. A probe costs one draft, a small share of the steps it waits."""

    PROBE_AFTER = 8  # undrafted steps before a model drafter's first probe
    PROBE_MAX = 256  # the longest wait between probes
    DRAFT_TIME_KEEP = 0.8  # the share of the drafting time per token a new reading keeps

    def __init__(self, engine, costs: StepCosts | None):
        super().__init__(engine, costs)
        self.draft_seconds_per_token: float | None = None
        self.undrafted = 0  # steps without a draft since it last drafted
        self.probe_wait = self.PROBE_AFTER

    def record(self, seq: Request, drafted: int, accepted: int, proposal) -> None:
        super().record(seq, drafted, accepted, proposal)
        if drafted:
            per_token = proposal.seconds_per_token if proposal.seconds_per_token is not None else \
                proposal.seconds / drafted
            self.draft_seconds_per_token = smoothed(self.draft_seconds_per_token, per_token, self.DRAFT_TIME_KEEP)

    def drafting_seconds_per_token(self) -> float:
        return self.draft_seconds_per_token or 0.0

    def _probed(self, best: int, top: int, throughput) -> int:
        """`best`, or once the drafter has waited `probe_wait` undrafted steps, the best positive length."""
        if best:
            self.undrafted, self.probe_wait = 0, self.PROBE_AFTER
            return best
        self.undrafted += 1
        if self.undrafted < self.probe_wait:
            return 0
        self.undrafted, self.probe_wait = 0, min(2 * self.probe_wait, self.PROBE_MAX)
        return max(range(1, top + 1), key=throughput)


class LookupLengths(DraftLengthChoice):
    """Lookup (n-gram, suffix): drafting is free, so acceptance is learnt from full-length drafts that are not
    verified but scored against the tokens the request then emits (`ShadowDraft`), whatever the step's draft length.
    Learnt from verified drafts alone, a batch that stopped drafting learns nothing more and stays at its prior (at
    8 requests on a CPU the prior's choice is a coin toss between 0 and 2, and a batch whose drafts would be
    accepted 9 times in 10 decoded without them), and one drafting a token learns nothing about the next."""

    def __init__(self, engine, costs: StepCosts | None):
        super().__init__(engine, costs)
        self.shadows: dict[Request, list[ShadowDraft]] = {}  # drafts scored, not verified

    def leave(self, seq: Request) -> None:
        super().leave(seq)
        self.shadows.pop(seq, None)

    def observe(self, verdicts: list) -> None:
        if self.costs is None:  # no choice to make: nothing to learn beyond the verdicts
            super().observe(verdicts)
        else:
            self.score_shadows([v.seq for v in verdicts])

    def score_shadows(self, seqs: list[Request]) -> None:
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

    def _shadow_draft(self, seq: Request) -> list[ShadowDraft]:
        room = seq.draft_room(self.engine.max_draft_len)
        try:
            proposal = seq.proposer.propose(seq.context, room) if room else None
        except Exception:  # noqa: BLE001 - the request goes on undrafted; its next real draft reports the failure
            return []
        if proposal is None or not proposal.tree.draft:
            return []
        return [ShadowDraft(len(seq.context), proposal.tree, proposal.evidence)]

    def _draft_available(self, seq: Request, top: int) -> tuple[int, Hashable]:
        """Its latest shadow was drafted from where it stands (a deterministic proposer drafts the same again);
        none there: nothing to draft. Before its first shadow, or under a grammar: `top`, and no evidence."""
        if seq not in self.shadows or seq.grammar is not None:
            return top, None
        here = [shadow for shadow in self.shadows[seq] if shadow.start == len(seq.context)]
        return (here[-1].tree.max_depth, here[-1].evidence) if here else (0, None)


class SizedTreeLengths(DraftLengthChoice):
    """A tree its proposer sizes each step from the target's measured costs (EAGLE's tree budget): the batch
    hands it the full depth."""

    def choose(self, seqs: list[Request]) -> int:
        return self.longest(seqs)


CHOICES = {DraftKind.MODEL_CHAIN: ModelChainLengths, DraftKind.LOOKUP: LookupLengths,
           DraftKind.HEAD_TREE: DraftLengthChoice, DraftKind.SIZED_TREE: SizedTreeLengths}


def draft_length_choice(engine, costs: StepCosts | None) -> DraftLengthChoice:
    """The choice for `engine.method`'s kind of drafting (none: nothing to choose), priced by `costs` (None: every
    step drafts in full)."""
    method = engine.method
    return DraftLengthChoice(engine, costs) if method is None else CHOICES[method.draft_kind](engine, costs)
