"""Greedy losslessness: every method's output equals plain decoding, which equals transformers' generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.config import DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine
from specserve.engine.engine import Engine, RequestError
from specserve.speculative.draft_model import DraftModelMethod
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "Once upon a time", "The quick brown fox jumps over the lazy dog. The lazy"]
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


def hf_greedy(path: str, prompt_ids: list[int], new_tokens: int, eos: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_decoding_matches_transformers(family, loaded, checkpoint):
    target = loaded(family)
    engine = Engine(target)
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ours = engine.generate(ids, SamplingParams(max_tokens=24)).token_ids
        assert ours == hf_greedy(checkpoint(family), ids, 24, eos=2), (family, prompt)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_len", [1, 3, 6])
def test_speculative_greedy_equals_plain(family, draft_len, loaded):
    target = loaded(family)
    plain = Engine(target)
    methods = {
        "ngram": NGramMethod(1, 3),
        "draft_target": DraftModelMethod(loaded(family, seed=1).model, target.model.spec.vocab_size),
        "self_draft": DraftModelMethod(target.model, target.model.spec.vocab_size),  # accepts everything
    }
    params = SamplingParams(max_tokens=40)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, params)
        for name, method in methods.items():
            result = Engine(target, method, draft_len).generate(prompt, params)
            assert result.token_ids == expected.token_ids, (family, name, draft_len, prompt)
            assert result.text == expected.text
            assert result.finish_reason == expected.finish_reason


def test_self_draft_accepts_everything(loaded):
    target = loaded("llama")
    engine = Engine(target, DraftModelMethod(target.model, target.model.spec.vocab_size), 4)
    m = engine.generate(PROMPTS[0], SamplingParams(max_tokens=41, ignore_eos=True)).metrics
    assert m.acceptance_rate == 1.0
    assert m.target_forwards == 1 + 8  # prefill, then 8 steps of 4 accepted + 1 bonus
    assert m.acceptance_length == pytest.approx(41 / 9)
    assert m.accepted_per_position == m.drafts_per_position == [8, 8, 8, 8]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_stop_token_and_stop_string_inside_accepted_draft(family, loaded):
    target = loaded(family)
    plain = Engine(target)
    spec = Engine(target, DraftModelMethod(target.model, target.model.spec.vocab_size), 6)
    free = plain.generate(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))
    stop_token = free.token_ids[9]  # reached mid-draft: every draft is accepted here
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token])
    want, got = plain.generate(PROMPTS[1], params), spec.generate(PROMPTS[1], params)
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop_token
    assert got.finish_reason == want.finish_reason == "stop"
    assert len(got.token_ids) <= 10
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])
    want, got = plain.generate(PROMPTS[1], params), spec.generate(PROMPTS[1], params)
    assert got.text == want.text == text[: text.find(stop)]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"


def test_eos_ends_generation_inside_a_draft(loaded):
    target = loaded("qwen2")
    free = Engine(target).generate(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    eos = free.token_ids[7]
    target_with_eos = type(target)(**{**target.__dict__, "eos_token_ids": {eos}})
    want = Engine(target_with_eos).generate(PROMPTS[0], SamplingParams(max_tokens=30))
    got = Engine(target_with_eos, DraftModelMethod(target.model, target.model.spec.vocab_size), 5) \
        .generate(PROMPTS[0], SamplingParams(max_tokens=30))
    assert got.token_ids == want.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert got.finish_reason == "stop"


def test_max_tokens_is_exact_with_long_drafts(loaded):
    target = loaded("llama")
    for max_tokens in (1, 2, 5, 13):
        engine = Engine(target, DraftModelMethod(target.model, target.model.spec.vocab_size), 6)
        result = engine.generate(PROMPTS[0], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        assert len(result.token_ids) == max_tokens and result.finish_reason == "length"


def test_same_seed_same_output(loaded):
    target = loaded("llama")
    engine = Engine(target, NGramMethod(1, 3), 4)
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=1234)
    assert engine.generate(PROMPTS[0], params).token_ids == engine.generate(PROMPTS[0], params).token_ids


def test_speculation_off_the_row_invariant_kernels_warns(loaded, checkpoint, caplog):
    """fp32 verifies on PyTorch's kernels, whose sums may round by forward size: the engine says so at start;
    bf16 on the CPU kernels does not warn, and neither does plain decoding."""
    from specserve.models.loader import load_model

    target = loaded("llama")
    with caplog.at_level("WARNING", logger="specserve.engine"):
        Engine(target)
    assert not caplog.records
    with caplog.at_level("WARNING", logger="specserve.engine"):
        Engine(target, NGramMethod(1, 3), 4)
    assert ["float32" in r.getMessage() and "row-invariant" in r.getMessage() for r in caplog.records] == [True]
    caplog.clear()
    bf16 = load_model(checkpoint("llama"), dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="specserve.engine"):
        Engine(bf16, NGramMethod(1, 3), 4)
    assert not caplog.records


def test_streaming_concatenates_to_the_full_text(loaded):
    target = loaded("gemma3")
    engine = Engine(target, NGramMethod(1, 3), 4)
    params = SamplingParams(max_tokens=30)
    events = list(engine.stream(PROMPTS[2], params))
    assert "".join(e.text for e in events) == events[-1].result.text == engine.generate(PROMPTS[2], params).text
    assert sum(len(e.token_ids) for e in events) == len(events[-1].result.token_ids)


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
    dict(max_tokens=10_000),
])
def test_bad_sampling_parameters_are_request_errors(bad, loaded):
    with pytest.raises(RequestError):
        Engine(loaded("llama")).generate("hello", SamplingParams(**bad))


def test_prompt_longer_than_context_is_a_request_error(loaded):
    engine = Engine(loaded("llama"))
    with pytest.raises(RequestError, match="context"):
        engine.generate(list(range(3, 3 + 600)), SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="non-empty"):
        engine.generate("", SamplingParams(max_tokens=4))


def test_max_model_len_caps_the_context_within_the_models(loaded):
    target = loaded("llama")
    engine = Engine(target, max_model_len=64)
    assert engine.max_model_len == 64
    with pytest.raises(RequestError, match="context"):
        engine.generate(list(range(3, 3 + 80)), SamplingParams(max_tokens=4))
    for bad in (1, target.max_model_len + 1):
        with pytest.raises(ValueError, match="max_model_len"):
            Engine(target, max_model_len=bad)


def test_build_engine_from_config(loaded, checkpoint):
    config = DeploymentConfig(ModelConfig(checkpoint("mistral"), dtype="float32"),
                              speculative=SpeculativeConfig("draft_target", 3, checkpoint("mistral", seed=1)))
    engine = build_engine(config)
    assert engine.method_name == "draft_target" and engine.max_draft_len == 3
    assert engine.generate(PROMPTS[0], SamplingParams(max_tokens=12)).token_ids == \
        Engine(loaded("mistral")).generate(PROMPTS[0], SamplingParams(max_tokens=12)).token_ids


def test_stop_token_ids_are_not_in_the_text(loaded):
    target = loaded("llama")
    engine = Engine(target, NGramMethod(1, 3), 3)
    free = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    got = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop]))
    assert got.token_ids == free.token_ids[: first + 1]
    assert got.text == target.tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)
