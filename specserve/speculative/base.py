"""What a speculation method is made of.

At run time a method is a `SpecMethod` (shared resources such as draft weights, built once per engine) that makes
one `Proposer` per request (per-request state such as a draft KV cache); each step a proposer returns a
`Proposal`: a draft tree (a chain for chain methods) that the target verifies in one forward.

To the configuration a method is a `MethodEntry` in `registry.py`: its names (canonical and vendor spellings), its
`MethodOptions` (the `speculative_config` keys it reads, their defaults and checks) and `build(options, target)`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Protocol

import torch

from specserve.checks import ConfigError
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.tree import Chain, DraftTree
from specserve.speculative.verify import TypicalAcceptance

DEFAULT_DRAFT_LEN = 4  # max_draft_len when a config gives none (trees: the depth limit)


@dataclass
class Proposal:
    tree: DraftTree  # node 0: the root (the pending token); the nodes below it: the draft
    probs: torch.Tensor | None = None  # [N-1, V]: row i the q node i's children were drawn from; None: deterministic
    typical: TypicalAcceptance | None = None  # verify with Medusa's typical acceptance when sampling (lossy)
    allowed: torch.Tensor | None = None  # [N, V] bool: a guided request's tokens allowed after each node's path
    # what the draft rests on, where its acceptance depends on it (n-gram: the matched n): the draft-length choice
    # keeps a request's acceptance apart per value (None: one estimate for all its drafts)
    evidence: Hashable | None = None
    seconds: float = 0.0  # the time the proposer took to draft it (the draft gate's cost of drafting)
    # a model drafter's time per drafted token, without a one-time catch-up of its cache (None: seconds / tokens)
    seconds_per_token: float | None = None
    cheap: bool = False  # drafted without running a model (the draft gate counts it as its cheap kind of step)

    @classmethod
    def chain(cls, root: int, draft: list[int], probs: torch.Tensor | None = None, evidence: Hashable | None = None,
              cheap: bool = False) -> Proposal:
        return cls(Chain(root, draft), probs, evidence=evidence, cheap=cheap)

    @property
    def tokens(self) -> list[int]:
        """The draft tokens (the tree's nodes below the root, in node order)."""
        return self.tree.draft


class Proposer(ABC):
    grammar = None  # a guided request's TokenGrammar (grammar.py), for proposers that draft under its masks

    @abstractmethod
    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        """Draft up to max_len tokens (a tree: up to max_len deep) to follow `tokens` (prompt + generated); the
        root is tokens[-1]."""

    def propose_cheap(self, tokens: list[int], max_len: int) -> Proposal:
        """The draft to verify when drafting in full does not pay (`speculative/policy/draft_gate.py`): what costs no
        model (none by default; an EAGLE tree's lookup branch). Must leave the proposer able to draft in full later."""
        return Proposal.chain(tokens[-1], [])

    def situation(self, tokens: list[int], max_len: int) -> Hashable:
        """The kind of step this one is (drafting up to `max_len` tokens), for the draft gate
        (`speculative/policy/draft_gate.py`), which weighs drafting in full against the cheap step apart for each kind:
        None (one kind) by default; an EAGLE tree with a lookup branch tells steps where the branch has a chain to offer
        (full: the merged tree, cheap: the chain) from steps where it has none (full: the head's tree, cheap: a
        plain step). One gate for both closed the head wherever lookup chains paid more on average, also in the
        steps where only the head had anything to draft."""
        return None

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """The target's features [n, F] of the n tokens the last forward committed, in order (for methods that
        draft from them): the method's `hidden_layers` concatenated."""

    def request_finished(self, output: list[int]) -> None:
        """The request ended with these output tokens (for methods that learn from earlier responses)."""


class Drafting(Protocol):
    """A request as `propose_batch` sees it."""

    proposer: Proposer
    context: list[int]  # prompt + generated tokens; the last one is the root of the next draft

    def draft_room(self, max_len: int) -> int:
        """max_len, cut to what the request may still emit."""


class DraftKind(Enum):
    """How a method drafts, which decides how a batch's step policy prices and learns its drafts
    (speculative/policy/step_policy.py)."""

    MODEL_CHAIN = "model chain"  # a chain from a model (a draft model): its drafting time is priced per drafted
    # token, and it is probed where drafting stopped paying
    LOOKUP = "lookup"  # from the tokens alone (n-gram, suffix): free to draft, so its acceptance is also learnt
    # from drafts not verified; it drafts on after a grammar's forced tokens
    HEAD_TREE = "head tree"  # trees from a head on the target's features (Medusa; EAGLE without measured costs):
    # the batch's choice sets their depth, and per request a draft gate decides whether they pay
    SIZED_TREE = "sized tree"  # a head's trees that the proposer sizes each step from the target's measured costs
    # (EAGLE's tree budget): the batch hands them the full depth; gated as HEAD_TREE


class SpecMethod(ABC):
    name: str
    needs_hidden_states = False  # whether proposers want observe_hidden() after every target forward
    hidden_layers: tuple[int, ...] = (-1,)  # the target layers whose outputs form a feature (-1: final normed)
    draft_kind = DraftKind.MODEL_CHAIN
    lossless = True  # False: sampled outputs do not follow the target's distribution exactly

    def draft_slots(self, max_draft_len: int) -> int:
        """KV slots a verify step may take beyond the committed tokens (a tree: all its nodes)."""
        return max_draft_len + 1

    @abstractmethod
    def new_proposer(self, params: SamplingParams, generator: torch.Generator, capacity: int) -> Proposer:
        """A proposer for one request whose sequence will not exceed `capacity` tokens."""

    def reset(self) -> None:
        """Forget what was learnt from earlier requests (the bench's warm-up must not draft its timed requests)."""

    def stats(self) -> dict:
        """What the method holds across requests (e.g. its shared cache's size), for reports."""
        return {}

    def propose_batch(self, seqs: list[Drafting], max_len: int) -> list[Proposal | Exception]:
        """A draft for each request; a method that drafts a whole batch in one call overrides this loop. A
        proposer's failure ends only its own request, so it is returned in that request's place."""
        out: list[Proposal | Exception] = []
        for seq in seqs:
            try:
                start = time.perf_counter()
                proposal = seq.proposer.propose(seq.context, seq.draft_room(max_len))
                proposal.seconds = time.perf_counter() - start
                out.append(proposal)
            except Exception as exc:  # noqa: BLE001 - the engine ends that request alone
                out.append(exc)
        return out


@dataclass
class MethodOptions:
    """The settings every method takes; a method's subclass adds the `speculative_config` keys it reads."""

    name: str = ""  # the method's canonical name
    model: str | None = None  # the draft model or the head's directory (`speculative_model`)
    max_draft_len: int = DEFAULT_DRAFT_LEN
    adaptive_draft_len: bool = True
    KEYS: ClassVar[frozenset[str]] = frozenset()  # the speculative_config keys `read` understands
    # keys that only mean something for this method, and the owner as the error names it when another method has them
    EXCLUSIVE: ClassVar[dict[str, str]] = {}

    @classmethod
    def read(cls, settings: dict) -> dict:
        """This method's fields from speculative_config settings (ConfigError naming the key if one is bad)."""
        return {}

    def check(self) -> None:
        """ConfigError for a combination of values that cannot work."""

    @property
    def label(self) -> str:
        """The method as the command line and the metrics name it."""
        return self.name


@dataclass(frozen=True)
class MethodEntry:
    """A method as the configuration knows it."""

    name: str  # canonical: the command line's, the metrics' and the bench's name
    options: type[MethodOptions]
    build: Callable[[MethodOptions, object], SpecMethod]  # (options, target LoadedModel) -> the method
    aliases: tuple[str, ...] = ()  # other spellings (TRT-LLM decoding_type, SGLang), lower case
    trtllm: str | None = None  # TRT-LLM's decoding_type, as TRT-LLM writes it
    vllm: tuple[str, ...] = ()  # vLLM's `method` spellings; they win over `aliases` in a vLLM model.json
    model_needed: str | None = None  # what speculative_model must name, when the method needs one
    any_model: bool = False  # its model may be any checkpoint (a vLLM draft naming a head becomes that head's)
    holds_head: Callable[[str], bool] | None = None  # whether a directory holds this method's head
    trains: str | None = None  # the `specserve train` kind that makes its head
    head_kind: str | None = None  # the kind of head it drafts with (the one shipped for the default model: heads/)
    # `NAME+OTHER` on the command line: (OTHER's entry, the boolean setting it turns on), one pair per OTHER
    combines: tuple[tuple[MethodEntry, str], ...] = ()
    variant: Callable[[dict], MethodEntry] | None = None  # a model.yaml's settings may pick a sibling method
    sized_trees: bool = False  # drafts trees sized by top_k / max_total_draft_tokens (bench --tree-costs)
    vllm_keys: frozenset[str] = frozenset()  # its speculative_config keys that vLLM's model.json has too
    # the draft length when a vLLM config gives none, from its settings (vLLM's rule; None: it must be given)
    vllm_default_draft_len: Callable[[dict], int] | None = None
    # max_draft_len when none is given and every step drafts it (adaptive_draft_len: false)
    fixed_draft_len: int = DEFAULT_DRAFT_LEN
    # max_draft_len when none is given and each step chooses its draft length (which prices a long draft by its
    # evidence, so a higher cap costs nothing where drafts are unsure); None: fixed_draft_len
    adaptive_draft_cap: int | None = None
    # the same when a `combines` setting is on: a merged lookup chain drafts as deep as that method alone would
    combined_draft_cap: int | None = None

    def default_draft_len(self, adaptive: bool, settings: dict | None = None) -> int:
        """max_draft_len when the config gives none (each method's, chosen by its benchmark: docs/benchmarks.md)."""
        if not adaptive:
            return self.fixed_draft_len
        if self.combined_draft_cap and any((settings or {}).get(key) for _, key in self.combines):
            return self.combined_draft_cap
        return self.adaptive_draft_cap or self.fixed_draft_len

    def parse(self, spec) -> MethodOptions:
        """Typed, checked options from a SpeculativeConfig (its common fields and its settings)."""
        common = {"name": self.name, "model": spec.model, "max_draft_len": spec.draft_len,
                  "adaptive_draft_len": spec.adaptive_draft_len}
        options = self.options(**{**common, **self.options.read(spec.settings)})
        options.check()
        return options

    def create(self, spec, target) -> SpecMethod:
        options = self.parse(spec)
        if self.model_needed and not options.model:
            options.model = self.shipped_model(target)
        return self.build(options, target)

    def shipped_model(self, target) -> str:
        """The head shipped for `target` (specserve/heads), for a config that names none; ConfigError if none
        ships."""
        from specserve.heads import shipped_head

        path = shipped_head(self.head_kind, target) if self.head_kind else None
        if path is None:
            raise ConfigError(f"{self.name} needs speculative_model ({self.model_needed}); no {self.name} head "
                              f"ships for {getattr(target, 'name', 'this model')}")
        return str(path)
