"""Unit tests: n-gram matcher, KV cache rollback and compaction, model.yaml parsing, prompt files."""

from __future__ import annotations

import pytest
import torch

from specserve.bench.offline import load_prompts
from specserve.config import ConfigError, load_model_yaml
from specserve.models.kv_cache import KVCache
from specserve.speculative.ngram import NGramMethod, longest_ngram_continuation


def test_ngram_prefers_the_longest_match():
    tokens = [5, 6, 7, 1, 2, 6, 7, 8, 9, 4, 6, 7]
    # the 2-gram [6, 7] occurs twice; the most recent earlier occurrence is followed by 8, 9, 4
    assert longest_ngram_continuation(tokens, 3, 1, 3) == [8, 9, 4]
    # now the 3-gram [6, 7, 8] recurs and wins over the 1- and 2-grams
    assert longest_ngram_continuation(tokens + [8], 2, 1, 3) == [9, 4]


def test_ngram_respects_bounds_and_misses():
    assert longest_ngram_continuation([1, 2, 3, 4], 5, 1, 3) == []  # nothing recurs
    assert longest_ngram_continuation([1, 2, 1], 5, 2, 3) == []  # only a 1-gram recurs, min_n is 2
    assert longest_ngram_continuation([1, 2, 1], 5, 1, 3) == [2, 1]
    assert longest_ngram_continuation([1, 2, 3, 1, 2], 1, 1, 3) == [3]
    assert longest_ngram_continuation([1, 2, 3, 1, 2], 0, 1, 3) == []
    assert longest_ngram_continuation([7], 3, 1, 3) == []


def test_ngram_method_validates_its_bounds():
    with pytest.raises(ValueError):
        NGramMethod(3, 2)
    with pytest.raises(ValueError):
        NGramMethod(0, 2)


def run(model, cache, tokens, start):
    positions = torch.arange(start, start + len(tokens))[None]
    return model(torch.tensor([tokens]), positions, cache, positions).logits[0]


def test_rollback_discards_rejected_tokens(loaded):
    model = loaded("llama").model
    prompt = [1, 40, 41, 42, 43]
    clean, dirty = KVCache.for_model(model, 1, 32), KVCache.for_model(model, 1, 32)
    run(model, clean, prompt, 0)
    run(model, dirty, prompt, 0)
    clean.lengths[0] = dirty.lengths[0] = 5
    run(model, clean, [50], 5)
    clean.lengths[0] = 6
    run(model, dirty, [50, 99, 98, 97], 5)  # three rejected drafts written after the accepted token
    dirty.lengths[0] = 6
    want, got = run(model, clean, [60, 61], 6), run(model, dirty, [60, 61], 6)
    torch.testing.assert_close(got, want)
    for layer in range(len(clean.keys)):
        torch.testing.assert_close(dirty.keys[layer][:, :, :8], clean.keys[layer][:, :, :8])


def test_compact_moves_an_accepted_path_into_place():
    cache = KVCache(2, 1, 1, 10, 2, torch.float32)
    for layer in range(2):
        cache.keys[layer][0, 0, :, 0] = torch.arange(10.0)
        cache.values[layer][0, 0, :, 1] = torch.arange(10.0) * 10
    cache.compact(0, torch.tensor([4, 6, 9]), 3)
    assert cache.keys[1][0, 0, :7, 0].tolist() == [0, 1, 2, 4, 6, 9, 6]
    assert cache.values[0][0, 0, 3:6, 1].tolist() == [40, 60, 90]


def test_mask_hides_stale_slots_and_applies_the_sliding_window():
    cache = KVCache(1, 1, 1, 16, 2, torch.float32)
    cache.lengths[0] = 6
    positions = torch.tensor([[6, 7]])
    masks = cache.attention_masks(positions, positions, None, sliding_window=4)
    full = masks["full_attention"][0, 0]
    assert full[0].tolist() == [True] * 7 + [False]
    assert full[1].tolist() == [True] * 8
    assert masks["sliding_attention"][0, 0, 1].tolist() == [False] * 4 + [True] * 4
    with pytest.raises(ValueError, match="overflow"):
        cache.attention_masks(torch.tensor([[16]]), torch.tensor([[16]]), None, None)


def write(path, text):
    path.write_text(text)
    return path


def test_model_yaml_in_the_seeds_form(tmp_path):
    (tmp_path / "draft").mkdir()
    config = load_model_yaml(write(tmp_path / "model.yaml", """
model: gemma-3-270m
backend: pytorch
tensor_parallel_size: 1
pipeline_parallel_size: 1
speculative_config:
  decoding_type: Draft_Target
  max_draft_len: 3
  speculative_model: draft
triton_config:
  max_batch_size: 0
  decoupled: False
"""))
    spec = config.speculative
    assert (config.model.source, spec.method, spec.max_draft_len) == ("gemma-3-270m", "draft_target", 3)
    assert spec.model == str(tmp_path / "draft")
    base = load_model_yaml(write(tmp_path / "base.yaml", "model: gemma-3-270m\n"))
    assert base.speculative.method == "ar"
    ngram = load_model_yaml(write(tmp_path / "ngram.yaml", "model: m\nspeculative_config:\n"
                                  "  decoding_type: NGram\n  max_draft_len: 5\n  max_matching_ngram_size: 4\n"))
    ngram = ngram.speculative
    assert (ngram.method, ngram.max_draft_len, ngram.options.prompt_lookup_max) == ("ngram", 5, 4)
    assert ngram.adaptive_draft_len
    fixed = load_model_yaml(write(tmp_path / "fixed.yaml", "model: m\nspeculative_config:\n"
                                  "  decoding_type: NGram\n  adaptive_draft_len: false\n"))
    assert not fixed.speculative.adaptive_draft_len


@pytest.mark.parametrize("text,needle", [
    ("model: m\nbogus: 1\n", "bogus"),
    ("model: m\nspeculative_config:\n  decoding_type: NGram\n  typo_len: 3\n", "typo_len"),
    ("model: m\nspeculative_config:\n  decoding_type: Lookahead\n", "Lookahead"),
    ("model: m\nspeculative_config:\n  decoding_type: NGram\n  max_draft_len: 0\n", "max_draft_len"),
    ("model: m\ntensor_parallel_size: 2\n", "tensor_parallel_size"),
    ("model: m\nspeculative_config:\n  decoding_type: NGram\n  adaptive_draft_len: maybe\n", "adaptive_draft_len"),
    ("speculative_config: {}\n", "model"),
    ("model: [unclosed\n", "cannot read"),
])
def test_model_yaml_errors_name_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        load_model_yaml(write(tmp_path / "model.yaml", text))


def test_prompt_files(tmp_path):
    eagle = write(tmp_path / "q.jsonl", '{"question_id": 0, "turns": ["first", "second"]}\n\n'
                                        '{"question_id": 1, "turns": ["other"]}\n')
    assert load_prompts(eagle) == ["first", "other"]
    assert load_prompts(eagle, 1) == ["first"]
    assert load_prompts(write(tmp_path / "g.jsonl", '{"text": "hi"}\n')) == ["hi"]
    for bad, needle in [("", "no prompts"), ("{not json\n", "not valid JSON"), ('{"turns": []}\n', "expected")]:
        with pytest.raises(ConfigError, match=needle):
            load_prompts(write(tmp_path / "bad.jsonl", bad))
