"""The draft-model proposer: greedy drafts from the draft's argmaxes alone, and its price per drafted token."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specserve.models.loader import load_model
from specserve.speculative import draft_model
from specserve.speculative.draft_model import DraftModelProposer
from specserve.speculative.sampling import SamplingParams


def proposer(model, params: SamplingParams | None = None) -> DraftModelProposer:
    return DraftModelProposer(model, model.spec.vocab_size, params or SamplingParams(max_tokens=8),
                              torch.Generator().manual_seed(0), 256)


def test_greedy_drafts_from_argmaxes_alone_are_the_full_logits_drafts(checkpoint, monkeypatch):
    """A greedy draft reads the draft's greedy screen (argmaxes only) and drafts what its full logits would."""
    draft = load_model(checkpoint("llama", seed=1), dtype=torch.bfloat16, quantization="int8").model
    assert draft.greedy_screen is not None
    monkeypatch.setattr(draft.screen_choice, "uses_screen", lambda rows: True)
    tokens = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    argmaxes, full = proposer(draft), proposer(draft)
    monkeypatch.setattr(full, "_greedy_choices", lambda: False)
    answers = []
    feed = argmaxes._feed
    monkeypatch.setattr(argmaxes, "_feed", lambda *args: answers.append(feed(*args)) or answers[-1])
    for end in range(20, 60, 7):
        assert argmaxes.propose(tokens[:end], 4).tokens == full.propose(tokens[:end], 4).tokens
    assert answers and all(isinstance(answer, int) for answer in answers)
    sampled = proposer(draft, SamplingParams(max_tokens=8, temperature=0.8))
    assert not sampled._greedy_choices()  # a sampled draft needs the draft's distribution


def test_the_price_per_drafted_token_leaves_out_the_catch_up(loaded, monkeypatch):
    """Many tokens to feed (the prompt, or a run of steps drafted without) go into the draft's cache in a forward of
    their own: the proposal's seconds count it, its seconds per token only the drafting forwards."""
    clock = [0.0]
    model = loaded("llama", seed=1).model
    drafter = proposer(model)
    feed = drafter._feed

    def timed_feed(tokens, greedy):  # a forward of n tokens takes 1 + 10 n seconds on this clock
        clock[0] += 1 + 10 * len(tokens)
        return feed(tokens, greedy)

    monkeypatch.setattr(drafter, "_feed", timed_feed)
    monkeypatch.setattr(draft_model, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    tokens = list(range(3, 43))
    proposal = drafter.propose(tokens, 3)  # 39 tokens caught up, then three one-token forwards
    assert len(proposal.tokens) == 3 and proposal.seconds_per_token == 11.0
    rejected = 3 if proposal.tokens[0] != 3 else 4  # the target's token in place of the first draft token
    after = drafter.propose(tokens + [rejected, 7], 2)  # two tokens to feed: a step, not a catch-up
    assert after.seconds_per_token == (21.0 + 11.0) / 2


def test_the_draft_length_choice_prices_a_model_draft_by_its_one_token_forwards():
    """The choice's time per drafted token is the proposal's seconds_per_token where it gives one (a 40-token
    catch-up inside `seconds` would make drafting look four times dearer), else seconds / tokens."""
    from specserve.speculative.policy.draft_length import ModelChainLengths
    from specserve.speculative.policy.acceptance import AcceptanceByEvidence
    from specserve.speculative.base import Proposal

    choice = ModelChainLengths(SimpleNamespace(), None)
    request = object()
    choice.acceptance[request] = AcceptanceByEvidence()
    caught_up = Proposal.chain(1, [5, 6, 7])
    caught_up.seconds, caught_up.seconds_per_token = 0.12, 0.01
    choice.record(request, 3, 2, caught_up)
    assert choice.draft_seconds_per_token == 0.01
    plain = Proposal.chain(1, [5, 6])
    plain.seconds = 0.06
    choice.record(request, 2, 1, plain)
    assert abs(choice.draft_seconds_per_token - (0.8 * 0.01 + 0.2 * 0.03)) < 1e-12


def test_a_model_drafter_that_stopped_drafting_probes_again_ever_more_rarely():
    """Where its estimates say a draft does not pay, a model drafter still drafts one step after 8, then 16, 32 ...
    undrafted steps (it learns nothing otherwise); a drafter that drafts for free never needs to."""
    from specserve.speculative.policy.draft_length import draft_length_choice
    from specserve.speculative.base import DraftKind

    def drafted_steps(drafting: DraftKind) -> list[int]:
        engine = SimpleNamespace(method=SimpleNamespace(draft_kind=drafting), max_draft_len=4)
        choice = draft_length_choice(engine, lambda rows, tokens: rows)
        choice.drafting_seconds_per_token = lambda: 10.0  # each drafted token costs ten target forwards: never worth it
        request = type("Request", (), {"draft_cap": 4})()
        return [step for step in range(1, 130) if choice.choose([request])]

    assert drafted_steps(DraftKind.MODEL_CHAIN) == [8, 24, 56, 120]
    assert drafted_steps(DraftKind.LOOKUP) == []


def test_a_packed_draft_s_vocabulary_stays_packed_and_the_output_stays_plain_decoding_s(checkpoint, tmp_path):
    """A quantized draft restricted to a vocabulary scores those rows from an int8 copy of them (its dense rows'
    logits to int8's rounding; -inf elsewhere), and drafting over it leaves the output plain decoding's."""
    from specserve.engine.engine import Engine
    from specserve.speculative.draft_model import DraftModelMethod

    target = load_model(checkpoint("llama"), dtype=torch.bfloat16, quantization="int8")
    draft = load_model(checkpoint("llama", seed=1), dtype=torch.bfloat16, quantization="int8").model
    vocab = torch.arange(0, draft.spec.vocab_size, 3)
    hidden = torch.randn(4, draft.spec.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    dense = hidden.float() @ draft.lm_head_packed.rows(vocab).T
    draft.restrict_vocab(vocab)
    assert draft._subset_packed is not None and draft._subset_weight is None
    logits = draft.logits(hidden, True)
    outside = torch.ones(draft.spec.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isinf(logits[:, outside]).all()
    assert (logits[:, vocab] - dense).norm() <= 0.02 * dense.norm()
    engine = Engine(target, DraftModelMethod(draft, target.model.spec.vocab_size), 3)
    params = SamplingParams(max_tokens=24)
    drafted = 0
    for prompt in ("def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The lazy"):
        got = engine.generate(prompt, params)
        assert got.token_ids == Engine(target).generate(prompt, params).token_ids
        drafted += got.metrics.total_draft_tokens
    assert drafted > 0
    draft.restrict_vocab(None)


def test_a_gguf_draft_s_vocabulary_lies_beside_the_file(tmp_path):
    from specserve.speculative.weights import draft_vocab_file, read_draft_vocab, write_draft_vocab

    gguf = tmp_path / "draft-q4_k_m.gguf"
    gguf.write_bytes(b"")
    assert draft_vocab_file(gguf) == tmp_path / "draft-q4_k_m.draft_vocab.json"
    assert draft_vocab_file(tmp_path) == tmp_path / "draft_vocab.json"
    assert read_draft_vocab(gguf, 100) is None
    write_draft_vocab(gguf, torch.tensor([9, 3, 5]))
    assert read_draft_vocab(gguf, 100).tolist() == [9, 3, 5]
