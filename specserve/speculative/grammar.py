"""Structured outputs: a request's guide (JSON schema, regex, choice, grammar) as a token grammar, on llguidance.

llguidance (Microsoft's grammar engine, also a vLLM and SGLang backend) was measured here against outlines-core and
xgrammar on the default model's 262k-token vocabulary and chosen, with no dependencies (docs/structured-outputs.md,
`benchmarks/grammar_engines.py`).

Lossless speculation under a grammar needs, at every draft node, the allowed tokens *after that node's path*:

* `TokenGrammar.constrain` walks a draft tree depth first from the request's grammar state (consume a node's token,
  recurse, roll back one token), records each node's mask and cuts every child its parent's mask forbids. A
  deterministic child (n-gram, a tree's top-k candidate) is dropped: rejection sampling would reject it with
  certainty and leave p unchanged (p(x) = 0), so dropping it changes nothing but the wasted compute. A child drawn
  from a distribution q is kept as a leaf instead: its rejection turns p into the residual of p - q, which the
  verifier must still apply (a grammar-aware drafter never draws one: it samples from the masked q).
* the verifier (`verify.verify`) sets each node's forbidden tokens to -inf in the target's logits before greedy
  choice or rejection sampling; plain decoding is the root-only case, so constrained speculation and constrained
  plain decoding choose from the same masked distributions.
* `TokenGrammar.advance` then moves the grammar by the emitted tokens.

The engine's end-of-sequence tokens are the grammar's: they are allowed only where the grammar accepts, and a
grammar that can take no more tokens ends the request.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

from specserve.speculative.tree import Chain, DraftTree

GUIDE_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON as json.dumps writes it: a model that may put any whitespace anywhere can emit newlines until max_tokens
# (vLLM's `disable_any_whitespace` exists for this); a schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuideError(ValueError):
    """A guide that cannot be compiled (bad schema, regex or grammar, unsupported feature): the client's mistake."""


@dataclass(frozen=True)
class Guide:
    """What a request's output must match. `spec`: the schema (dict) for json_schema, the pattern for regex, the
    list of strings for choice, the grammar text (Lark, or GBNF / EBNF as llama.cpp and xgrammar write it) for
    grammar; None for json_object (any JSON object)."""

    kind: str
    spec: object = None

    def validate(self) -> None:
        """GuideError naming what is wrong with the spec's type (a grammar's content is checked by `compile`)."""
        if self.kind not in GUIDE_KINDS:
            raise GuideError(f"unknown guide kind {self.kind!r}; expected one of {', '.join(GUIDE_KINDS)}")
        if self.kind == "json_schema" and not isinstance(self.spec, dict):
            raise GuideError("a JSON schema must be a JSON object")
        if self.kind in ("regex", "grammar") and not (isinstance(self.spec, str) and self.spec):
            raise GuideError(f"a {self.kind} guide must be a non-empty string")
        if self.kind == "choice" and not (isinstance(self.spec, list) and self.spec
                                          and all(isinstance(c, str) and c for c in self.spec)):
            raise GuideError("a choice guide must be a non-empty list of non-empty strings")

    def grammar_text(self) -> str:
        """The guide as an llguidance grammar (GuideError when it cannot be translated)."""
        self.validate()
        try:
            if self.kind in ("json_object", "json_schema"):
                schema = {"type": "object"} if self.kind == "json_object" else self.spec
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(choice) for choice in self.spec))
            return llguidance.grammar_from("grammar", self.spec)  # Lark, or GBNF / EBNF converted to Lark
        except (ValueError, TypeError) as exc:
            raise GuideError(f"invalid {self.kind.replace('_', ' ')}: {exc}") from None


class GrammarVocabulary:
    """The target's tokenizer as llguidance sees it (each token's bytes), built once per engine on the first guided
    request: about 5 s for a 262k vocabulary. Masks are `vocab_size` wide (the model's logits), so padding rows
    beyond the tokenizer are never allowed."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()  # requests are checked off the compute thread

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_ids or None)
            return self._tokenizer

    def compile_checked(self, guide: Guide) -> TokenGrammar:
        """`compile`, and its first mask computed: llguidance builds its lexer lazily, so a regex such as
        `a{99999999}` fails only there (GuideError, llguidance's message)."""
        grammar = self.compile(guide)
        grammar.bits()
        return grammar

    def compile(self, guide: Guide) -> TokenGrammar:
        """A request's grammar state at the start of its output (GuideError for a guide that does not compile)."""
        matcher = llguidance.LLMatcher(self.tokenizer, guide.grammar_text(), log_level=0)
        if matcher.is_error():
            raise GuideError(f"invalid {guide.kind.replace('_', ' ')}: {matcher.get_error()}")
        return TokenGrammar(matcher, self.vocab_size, set(self.eos_ids))


class TokenGrammar:
    """One request's grammar state: the tokens it allows next, per draft node, and its advance by emitted tokens."""

    def __init__(self, matcher, vocab_size: int, eos_ids: set[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids  # llguidance keeps no history for them: a draft stops at one, never rolls it back
        self._bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    @property
    def finished(self) -> bool:
        """Whether the grammar can take no token but end-of-sequence (a complete JSON value, a matched choice)."""
        return self.matcher.is_stopped()

    def bits(self) -> torch.Tensor:
        """The allowed next tokens as a bitmask [ceil(V / 32)] int32 (a copy)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        self._raise_on_error()
        if not bool(self._bits.any()):
            raise GuideError("the grammar allows no next token")
        return self._bits.clone()

    def allowed(self) -> torch.Tensor:
        """The allowed next tokens as a bool mask [V]."""
        return unpack(self.bits()[None], self.vocab_size)[0]

    def forced(self, limit: int) -> list[int]:
        """The next tokens the grammar forces, at most `limit`: each the only token its mask allows, never an
        end-of-sequence token (a JSON schema's keys and punctuation). The masked target gives such a token
        probability 1, so a draft of them is accepted whatever the sampling. The state is left as it was."""
        out: list[int] = []
        while len(out) < limit and not self.finished:
            token = only_token(self.bits())
            if token is None or token in self.eos_ids:
                break
            self.push(token)
            out.append(token)
        self.pop(len(out))
        return out

    def push(self, token: int) -> None:
        """Take one drafted token (allowed by the current mask, not end-of-sequence); `pop` undoes it."""
        self.matcher.consume_token(token)
        self._raise_on_error()

    def pop(self, count: int) -> None:
        if count:
            self.matcher.rollback(count)

    def advance(self, tokens: list[int]) -> list[int]:
        """Move the grammar by emitted tokens (each allowed by the mask it was chosen under); returns those up to
        the one that finished the grammar: with a draft, the target may have emitted an end-of-sequence token
        after it, which plain decoding never reaches (the request ends when the grammar does)."""
        for count, token in enumerate(tokens, start=1):
            if not self.matcher.consume_token(token):
                self._raise_on_error()
            if self.finished:
                return tokens[:count]
        return tokens

    def constrain(self, tree: DraftTree, draft_probs=None) -> tuple[list[int], torch.Tensor]:
        """The nodes of `tree` to keep (node indices, in order, the root first) and their masks [len(keep), V]
        bool: the tokens allowed after each node's path. A child its parent forbids is dropped with its subtree
        when deterministic; one drawn from a distribution (draft_probs has a row for its parent) stays as a leaf
        with an all-true mask (it is never accepted: the masked target gives it probability 0). An allowed
        end-of-sequence token is a leaf too: the request ends there, so its mask is never used."""
        rows: dict[int, torch.Tensor | None] = {}
        tokens = tree.tokens.tolist()

        def walk(node: int) -> None:
            bits = rows[node] = self.bits()
            for child in tree.children(node):
                token = tokens[child]
                if is_allowed(bits, token) and token not in self.eos_ids:
                    self.matcher.consume_token(token)
                    walk(child)
                    self.matcher.rollback(1)
                elif token in self.eos_ids and is_allowed(bits, token) or has_distribution(draft_probs, node):
                    rows[child] = None  # an allowed end of sequence ends the output: nothing after it counts
            self._raise_on_error()

        walk(0)
        keep = sorted(rows)
        full = torch.full_like(self._bits, -1)
        return keep, unpack(torch.stack([full if rows[n] is None else rows[n] for n in keep]), self.vocab_size)

    def _raise_on_error(self) -> None:
        """A grammar that fails while decoding (a resource limit of llguidance's) is still the client's: a 400."""
        if self.matcher.is_error():
            raise GuideError(f"grammar error: {self.matcher.get_error().strip().splitlines()[0]}")


def unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmasks [N, ceil(V / 32)] int32 (bit j of word i: token 32 i + j) -> bool masks [N, V]. The words are
    little-endian, so byte k of word i holds tokens 32 i + 8 k .. 32 i + 8 k + 7, lowest bit first."""
    unpacked = np.unpackbits(bits.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(unpacked[..., :vocab_size].view(np.bool_))


def only_token(bits: torch.Tensor) -> int | None:
    """The token a bitmask allows when it allows exactly one, else None."""
    words = torch.nonzero(bits).flatten()
    if words.numel() != 1:
        return None
    index = int(words[0])
    word = int(bits[index]) & 0xFFFFFFFF
    return 32 * index + word.bit_length() - 1 if word & (word - 1) == 0 else None


def is_allowed(bits: torch.Tensor, token: int) -> bool:
    return 0 <= token < 32 * bits.numel() and bool((int(bits[token >> 5]) >> (token & 31)) & 1)


@dataclass
class AfterForced:
    """A guided request as its method's drafter sees it once the tokens its grammar forces are drafted: the method
    drafts on from the end of them (`Drafting`, speculative/base.py), and its draft hangs below them."""

    seq: object  # the engine's Sequence
    forced: list[int]

    @property
    def proposer(self):
        return self.seq.proposer

    @property
    def context(self) -> list[int]:
        return self.seq.context + self.forced

    def draft_room(self, max_len: int) -> int:
        return self.seq.draft_room(max_len) - len(self.forced)


def has_distribution(draft_probs, node: int) -> bool:
    """Whether node's children were drawn from a distribution q (rather than picked deterministically)."""
    return draft_probs is not None and node < len(draft_probs) and draft_probs[node] is not None


class DraftWalk:
    """A model drafter's chain under a guided request's grammar (None: no grammar, everything passes): each
    position drafts from its logits masked by what the grammar allows after the tokens drafted before it, so no
    draft token is forbidden and a sampled q is the distribution it was drawn from. On exit the grammar is rolled
    back to where the request's emitted tokens left it."""

    def __init__(self, grammar: TokenGrammar | None):
        self.grammar = grammar
        self.pushed = 0

    def __enter__(self) -> "DraftWalk":
        return self

    def __exit__(self, *exc) -> None:
        if self.grammar is not None:
            self.grammar.pop(self.pushed)

    def masked(self, logits: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The next position's logits [V'] (`vocab_ids`: the target ids of their rows, None: all) masked by the
        grammar; None when it allows none of them."""
        if self.grammar is None:
            return logits
        allowed = self.grammar.allowed()
        masked = logits.masked_fill(~(allowed if vocab_ids is None else allowed[vocab_ids]), float("-inf"))
        return masked if bool(torch.isfinite(masked).any()) else None

    def take(self, token: int) -> bool:
        """Move the grammar by a drafted token; False where it ends the output (nothing to draft after it)."""
        if self.grammar is None:
            return True
        if token in self.grammar.eos_ids:
            return False
        self.grammar.push(token)
        self.pushed += 1
        return True


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The tree of the kept nodes (a parent kept before each child), renumbered in the same order."""
    if tree.is_chain:
        return Chain(tree.root, tree.draft[: len(keep) - 1])
    index = {node: i for i, node in enumerate(keep)}
    parents = tree.parents.tolist()
    return DraftTree(tree.tokens[keep], [-1] + [index[parents[node]] for node in keep[1:]])


def sub_probs(draft_probs, keep: list[int]):
    """The draft distributions of the kept nodes (row i: the q node i's children were drawn from)."""
    if draft_probs is None:
        return None
    if isinstance(draft_probs, torch.Tensor) and keep == list(range(len(keep))):
        return draft_probs[: len(keep) - 1] if len(keep) > 1 else None
    return [draft_probs[n] if n < len(draft_probs) else None for n in keep]
