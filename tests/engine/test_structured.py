"""Structured outputs in the engine: constrained output matches its guide, and speculation under a grammar is still
lossless (greedy: token for token the constrained plain decoding; sampling: the masked target distribution)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

import specserve.speculative.grammar as grammar_module
import specserve.speculative.verify as verify_module
from specserve.engine.engine import Engine, RequestError
from specserve.speculative.base import DraftKind, Proposal, Proposer, SpecMethod
from specserve.speculative.draft_model import DraftModelMethod, DraftModelProposer
from specserve.speculative.grammar import GrammarVocabulary, Guide, GuideError
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.tree import Chain, DraftTree
from specserve.speculative.verify import verify

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "n", "name"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "name": {"type": "string", "maxLength": 8}}}
GUIDES = [Guide("json_schema", SCHEMA), Guide("regex", r"(yes|no), [a-f]{2,6}\."),
          Guide("choice", ["the lazy dog", "the quick brown fox", "def add(a, b)"]), Guide("json_object")]
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The lazy"]


def matches_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"]) and isinstance(value["ok"], bool)
            and value["color"] in ("red", "green", "blue") and isinstance(value["n"], int)
            and 0 <= value["n"] <= 999 and isinstance(value["name"], str) and len(value["name"]) <= 8)


class BranchingProposer(Proposer):
    """A deterministic tree drafter: the target's own greedy chain under the grammar (a self-draft, so most of it is
    accepted) with a sibling at every depth, the next token id, which the grammar often forbids: the tree covers
    kept, pruned and rejected branches."""

    def __init__(self, chain: DraftModelProposer, vocab: int):
        self.chain, self.vocab = chain, vocab

    @property
    def grammar(self):
        return self.chain.grammar

    @grammar.setter
    def grammar(self, value):  # the engine hands the request's grammar over: the inner chain drafts under it
        self.chain.grammar = value

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        chain = self.chain.propose(tokens, max_len).tokens
        node_tokens, parents = [tokens[-1]], [-1]
        for depth, token in enumerate(chain):
            parent = 0 if depth == 0 else 2 * depth - 1
            node_tokens += [token, (token + 1) % self.vocab]
            parents += [parent, parent]
        return Proposal(DraftTree(node_tokens, parents))


class BranchingMethod(SpecMethod):
    name = "branching"

    def __init__(self, target):
        self.target = target

    def draft_slots(self, max_draft_len: int) -> int:
        return 2 * max_draft_len + 1

    def new_proposer(self, params, generator, capacity):
        vocab = self.target.model.spec.vocab_size
        return BranchingProposer(DraftModelProposer(self.target.model, vocab, params, generator, capacity), vocab)


def methods(loaded, target):
    vocab = target.model.spec.vocab_size
    return {"ngram": Engine(target, NGramMethod(1, 3), 4),
            "draft_target": Engine(target, DraftModelMethod(loaded("llama", seed=1).model, vocab), 3),
            "self_draft": Engine(target, DraftModelMethod(target.model, vocab), 5),
            "tree": Engine(target, BranchingMethod(target), 3)}


@pytest.fixture(scope="module")
def target(loaded):
    return loaded("llama")


def test_constrained_output_matches_its_guide(target):
    engine = Engine(target)
    for prompt in PROMPTS:
        result = engine.generate(prompt, SamplingParams(max_tokens=80, guide=GUIDES[0]))
        assert result.finish_reason == "stop", result.text
        assert matches_schema(json.loads(result.text)), result.text
        assert result.token_ids[-1] not in target.eos_token_ids  # the grammar ended it, not an EOS token
        regex = engine.generate(prompt, SamplingParams(max_tokens=40, guide=GUIDES[1]))
        assert regex.finish_reason == "stop"
        assert regex.text.split(", ")[0] in ("yes", "no") and regex.text.endswith("."), regex.text
        choice = engine.generate(prompt, SamplingParams(max_tokens=40, guide=GUIDES[2]))
        assert choice.text in GUIDES[2].spec and choice.finish_reason == "stop"


def test_max_tokens_still_applies(target):
    result = Engine(target).generate(PROMPTS[0], SamplingParams(max_tokens=5, guide=GUIDES[0]))
    assert result.finish_reason == "length" and len(result.token_ids) == 5  # truncated JSON, honestly reported


@pytest.mark.parametrize("guide", GUIDES, ids=[g.kind for g in GUIDES])
def test_speculative_greedy_equals_constrained_plain(guide, loaded, target):
    plain = Engine(target)
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=48, guide=guide)
        expected = plain.generate(prompt, params)
        for name, engine in methods(loaded, target).items():
            result = engine.generate(prompt, params)
            assert result.token_ids == expected.token_ids, (name, guide.kind, prompt)
            assert result.text == expected.text and result.finish_reason == expected.finish_reason


def test_speculation_under_a_grammar_accepts_drafts(loaded, target):
    params = SamplingParams(max_tokens=48, guide=GUIDES[0])
    for name, engine in methods(loaded, target).items():
        if name in ("self_draft", "tree"):
            metrics = engine.generate(PROMPTS[0], params).metrics
            assert metrics.total_accepted_draft_tokens >= 0.8 * metrics.total_draft_tokens > 0, name


def test_skipping_the_masks_at_draft_nodes_breaks_equality(monkeypatch, loaded, target):
    """Control: a verifier that masks only the root row (as if every node had the root's grammar state) must fail
    the equality test above, so that test can fail."""
    real = verify_module.mask_logits

    def root_only(logits, allowed):
        return real(logits, None if allowed is None else allowed[:1].expand_as(allowed))

    monkeypatch.setattr(verify_module, "mask_logits", root_only)
    params = SamplingParams(max_tokens=48, guide=GUIDES[0])
    expected = Engine(target).generate(PROMPTS[0], params).token_ids
    engine = methods(loaded, target)["self_draft"]
    try:
        broken = engine.generate(PROMPTS[0], params).token_ids
    except GuideError as exc:  # it emitted a token the grammar forbids
        assert "grammar error" in str(exc)
        broken = None
    assert broken != expected


def test_bad_guides_are_request_errors(target):
    engine = Engine(target)
    for guide in (Guide("regex", "a(b"), Guide("json_schema", {"type": "strin"}), Guide("grammar", "start: foo"),
                  Guide("choice", []), Guide("json_schema", "not a schema"), Guide("xml")):
        with pytest.raises(RequestError):
            engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, guide=guide))


# ---- sampling: the verifier under masks keeps the masked target distribution ------------------------------------

DELTA = 1e-4


def tv_bound(outcomes: int, samples: int) -> float:
    return math.sqrt(2 * (outcomes * math.log(2) + math.log(1 / DELTA)) / samples) / 2


def first_token_counts(grammar, p_logits, q, samples: int, gen) -> Counter:
    """Chains of 2 drawn from q (NOT masked: a grammar-unaware drafter), cut by the grammar, verified under its
    masks; the first emitted token's counts."""
    params = SamplingParams(temperature=1.0)
    counts = Counter()
    for _ in range(samples):
        draft = [int(t) for t in sample(q, gen)]
        keep, allowed = grammar.constrain(Chain(0, draft), q)
        tree = grammar_module.subtree(Chain(0, draft), keep)
        verdict = verify(tree, p_logits[: len(keep)], params, gen, grammar_module.sub_probs(q, keep),
                         allowed=allowed)
        counts[verdict.tokens[0]] += 1
    return counts


def sampling_case(tokenizer):
    """A grammar over the tiny tokenizer, target rows p, and a drafter q that puts 3/4 of its mass on tokens the
    grammar forbids and 1/4 on one allowed token the target finds less likely than that."""
    vocab = len(tokenizer)
    grammar = GrammarVocabulary(tokenizer, vocab, {2}).compile(Guide("regex", "[a-d]{2}"))
    allowed = grammar.allowed()
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(3, vocab, generator=gen) * 2
    target = probabilities(p_logits[:1].masked_fill(~allowed, float("-inf")), SamplingParams(temperature=1.0))[0]
    ranked = sorted(torch.nonzero(allowed).flatten().tolist(), key=lambda t: -float(target[t]))
    liked = [ranked[1]] + torch.nonzero(~allowed)[:3].flatten().tolist()
    q = torch.zeros(2, vocab)
    q[:, liked] = 0.25
    return grammar, p_logits, q, {t: float(target[t]) for t in ranked}, gen


def total_variation(counts: Counter, expected: dict) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(k, 0) / n - expected.get(k, 0.0)) for k in set(counts) | set(expected))


def test_sampling_under_a_grammar_keeps_the_masked_target_distribution(tokenizer):
    grammar, p_logits, q, expected, gen = sampling_case(tokenizer)
    counts = first_token_counts(grammar, p_logits, q, 6000, gen)
    assert set(counts) <= set(expected)  # never a forbidden token
    assert total_variation(counts, expected) < tv_bound(len(expected), 6000)


def test_dropping_sampled_forbidden_drafts_breaks_the_distribution(monkeypatch, tokenizer):
    """Control: dropping a forbidden child drawn from q (instead of keeping it for its rejection, which turns p
    into the residual) biases the output, and the test above sees it."""
    monkeypatch.setattr(grammar_module, "has_distribution", lambda probs, node: False)
    grammar, p_logits, q, expected, gen = sampling_case(tokenizer)
    counts = first_token_counts(grammar, p_logits, q, 6000, gen)
    assert total_variation(counts, expected) > tv_bound(len(expected), 6000)


def test_engine_sampling_with_a_grammar_stays_in_it(loaded, target):
    """Sampled guided requests, plain and speculative (a draft model drawing from its masked q), stay valid."""
    for name, engine in [("ar", Engine(target))] + list(methods(loaded, target).items())[:2]:
        for seed in range(3):
            regex = engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                               guide=GUIDES[1]))
            assert regex.finish_reason == "stop", (name, regex.text)
            assert regex.text.split(", ")[0] in ("yes", "no") and regex.text.endswith("."), (name, regex.text)
            choice = engine.generate(PROMPTS[1], SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                                guide=GUIDES[2]))
            assert choice.text in GUIDES[2].spec, (name, choice.text)


def test_a_grammar_that_fails_mid_batch_ends_its_request_alone(target):
    """Guided and unguided requests decode together (n-gram drafts cut per row); one request's grammar breaks
    while drafting: it fails alone, the others give what they give alone."""
    from specserve.engine.batch import BatchEngine

    from tests.engine.test_isolation import run

    engine = Engine(target, NGramMethod(1, 3), 3)
    requests = [(PROMPTS[0], SamplingParams(max_tokens=40, guide=GUIDES[0])),
                (PROMPTS[1], SamplingParams(max_tokens=24)),
                (PROMPTS[1], SamplingParams(max_tokens=40, guide=GUIDES[1])),
                (PROMPTS[1], SamplingParams(max_tokens=60, guide=GUIDES[0]))]
    batch = BatchEngine(engine, max_batch_size=4)
    seqs = [batch.add(prompt, params) for prompt, params in requests]
    victim = seqs[3]

    def poison(step: int) -> None:
        if step == 6:
            def broken(*args, **kwargs):
                raise RuntimeError("grammar error: broken on purpose")
            victim.grammar.constrain = broken

    results, errors = run(batch, seqs, poison)
    assert list(errors) == [victim] and "broken on purpose" in str(errors[victim])
    for (prompt, params), seq in zip(requests, seqs):
        if seq is not victim:
            assert results[seq] == engine.generate(prompt, params).token_ids


# ---- tokens the grammar forces -----------------------------------------------------------------------------------

class NoDraft(SpecMethod):
    """A method that drafts from tokens alone but never proposes anything: every draft is the grammar's forced one."""

    name = "no_draft"
    draft_kind = DraftKind.LOOKUP

    def new_proposer(self, params, generator, capacity) -> Proposer:
        class Nothing(Proposer):
            def propose(self, tokens, max_len):
                return Proposal.chain(tokens[-1], [])
        return Nothing()


def test_the_grammar_forces_a_schemas_first_key_and_keeps_its_state(target):
    grammar = GrammarVocabulary(target.tokenizer, target.model.spec.vocab_size, target.eos_token_ids).compile(
        GUIDES[0])
    before = grammar.bits()
    forced = grammar.forced(16)
    # required keys come in order; the value is not forced (a boolean's token may carry the space before it)
    assert target.tokenizer.decode(forced) in ('{"ok":', '{"ok": ')
    assert torch.equal(grammar.bits(), before)
    assert grammar.forced(2) == forced[:2]


def test_forced_tokens_are_drafted_and_always_accepted(target):
    params = SamplingParams(max_tokens=48, guide=GUIDES[0])
    expected = Engine(target).generate(PROMPTS[0], params)
    result = Engine(target, NoDraft(), 8).generate(PROMPTS[0], params)
    assert result.token_ids == expected.token_ids
    m = result.metrics
    assert m.total_draft_tokens >= 8 and m.total_accepted_draft_tokens == m.total_draft_tokens


def test_a_token_that_is_not_forced_is_not_always_accepted(monkeypatch, target):
    """Control: taking the first allowed token for a forced one (where several are allowed) drafts tokens the
    target rejects, so the always-accepted check above can fail."""
    def first_allowed(bits):
        words = torch.nonzero(bits).flatten()
        word = int(bits[int(words[0])]) & 0xFFFFFFFF
        return 32 * int(words[0]) + (word & -word).bit_length() - 1

    monkeypatch.setattr(grammar_module, "only_token", first_allowed)
    m = Engine(target, NoDraft(), 8).generate(PROMPTS[0], SamplingParams(max_tokens=48, guide=GUIDES[0])).metrics
    assert m.total_accepted_draft_tokens < m.total_draft_tokens


def test_sampling_with_forced_drafts_keeps_the_constrained_distribution(target):
    """Sampled outputs of a regex whose ', ' is forced: the same distribution with forced drafting as plain."""
    guide = Guide("regex", r"(yes|no), [a-c]\.")
    samples = 500
    counts = {}
    for name, engine in (("plain", Engine(target)), ("forced", Engine(target, NoDraft(), 4))):
        counts[name] = Counter(engine.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=1.0, seed=s,
                                                                         guide=guide)).text for s in range(samples))
    assert sum(counts["forced"].values()) == samples and set(counts["forced"]) <= {
        f"{a}, {b}." for a in ("yes", "no") for b in "abc"}
    expected = {k: v / samples for k, v in counts["plain"].items()}
    assert total_variation(counts["forced"], expected) < 2 * tv_bound(6, samples)
