"""The deployment config: the seeds' model.yaml (TRT-LLM) and the vLLM backend's model.json, and the errors that
name the key."""

from __future__ import annotations

import json

import pytest

from specserve.config import ConfigError, load_model_yaml
from specserve.config_vllm import load_model_json


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
    assert base.model.tensor_parallel_size == 1
    sharded = load_model_yaml(write(tmp_path / "tp.yaml", "model: gemma-3-270m\ntensor_parallel_size: 2\n"))
    assert sharded.model.tensor_parallel_size == 2
    ngram = load_model_yaml(write(tmp_path / "ngram.yaml", "model: m\nspeculative_config:\n"
                                  "  decoding_type: NGram\n  max_draft_len: 5\n  max_matching_ngram_size: 4\n"))
    ngram = ngram.speculative
    assert (ngram.method, ngram.max_draft_len, ngram.options.prompt_lookup_max) == ("ngram", 5, 4)
    assert ngram.adaptive_draft_len
    fixed = load_model_yaml(write(tmp_path / "fixed.yaml", "model: m\nspeculative_config:\n"
                                  "  decoding_type: NGram\n  adaptive_draft_len: false\n"))
    assert not fixed.speculative.adaptive_draft_len


def test_draft_length_defaults_by_method_and_policy(tmp_path):
    """An unset max_draft_len is 4, except where each step chooses its draft length: n-gram 6 (priced by its
    matched n), suffix 16 (8 when every step drafts it), EAGLE trees with a lookup branch 6."""
    def spec_of(text):
        config = load_model_yaml(write(tmp_path / "m.yaml", "model: gemma-3-270m\nspeculative_config:\n" + text))
        return config.speculative

    ngram = spec_of("  decoding_type: NGram\n")
    assert ngram.draft_len == 6 and ngram.options.prompt_lookup_max == 5
    assert spec_of("  decoding_type: NGram\n  adaptive_draft_len: false\n").draft_len == 4
    assert spec_of("  decoding_type: NGram\n  max_draft_len: 3\n").draft_len == 3
    assert spec_of("  decoding_type: Suffix\n").draft_len == 16
    assert spec_of("  decoding_type: Suffix\n  adaptive_draft_len: false\n").draft_len == 8
    eagle3 = "  decoding_type: Eagle3\n  speculative_model: head\n"
    assert spec_of(eagle3).draft_len == 4
    assert spec_of(eagle3 + "  prompt_lookup_branch: true\n").draft_len == 6
    assert spec_of(eagle3 + "  prompt_lookup_branch: true\n  adaptive_draft_len: false\n").draft_len == 4
    assert load_model_yaml(write(tmp_path / "b.yaml", "model: gemma-3-270m\n")).speculative.draft_len == 4


@pytest.mark.parametrize("text,needle", [
    ("model: m\nbogus: 1\n", "bogus"),
    ("model: m\nspeculative_config:\n  decoding_type: NGram\n  typo_len: 3\n", "typo_len"),
    ("model: m\nspeculative_config:\n  decoding_type: Lookahead\n", "Lookahead"),
    ("model: m\nspeculative_config:\n  decoding_type: NGram\n  max_draft_len: 0\n", "max_draft_len"),
    ("model: m\ntensor_parallel_size: 0\n", "tensor_parallel_size"),
    ("model: m\npipeline_parallel_size: 2\n", "pipeline_parallel_size"),
    ("model: m\nspeculative_config:\n  decoding_type: NGram\n  adaptive_draft_len: maybe\n", "adaptive_draft_len"),
    ("speculative_config: {}\n", "model"),
    ("model: [unclosed\n", "cannot read"),
    ("model: m\ntriton_config:\n  decoupled: \"false\"\n", "triton_config.decoupled"),
    ("model: m\nmax_model_len: 0\n", "max_model_len"),
    ("model: m\nmax_model_len: 4k\n", "max_model_len"),
    ("model: m\nmax_model_len: -5\n", "max_model_len: .*greater than or equal to 2"),
    ("model: m\nmax_model_len: \"abc\"\n", "max_model_len: .*valid integer"),
    ("model: m\ntriton_config: {decoupled: \"maybe\"}\n", "triton_config.decoupled: .*valid boolean"),
    ("model: m\ntriton_config: {max_batch_size: 8.5}\n", "triton_config.max_batch_size"),
    ("model: 7\n", "model: .*valid string"),
    ("model: m\nspeculative_config:\n  decoding_type: Eagle\n  max_draft_len: 4\n  depth: 5\n",
     "max_draft_len and depth"),
])
def test_model_yaml_errors_name_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        load_model_yaml(write(tmp_path / "model.yaml", text))


def model_json(tmp_path, data: dict):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(data))
    return path


def speculative(config):
    """(method, draft model, draft length, prompt lookup settings) of a config."""
    spec = config.speculative
    return spec.method, spec.model, spec.max_draft_len, spec.settings


def test_vllm_flat_keys(tmp_path):
    c = load_model_json(model_json(tmp_path, {"model": "m", "speculative_model": "d", "num_speculative_tokens": 5,
                                              "speculative_draft_tensor_parallel_size": 1,
                                              "gpu_memory_utilization": 0.1, "enforce_eager": True}))
    assert speculative(c)[:3] == ("draft_target", "d", 5) and c.serving.decoupled
    c = load_model_json(model_json(tmp_path, {"model": "m", "speculative_model": "[ngram]",
                                              "num_speculative_tokens": 4, "ngram_prompt_lookup_max": 4,
                                              "ngram_prompt_lookup_min": 2}))
    assert speculative(c) == ("ngram", None, 4, {"prompt_lookup_max": 4, "prompt_lookup_min": 2})
    c = load_model_json(model_json(tmp_path, {"model": "m", "dtype": "auto", "max_model_len": 256,
                                              "disable_log_requests": True}))
    assert (c.speculative.method, c.model.dtype, c.model.max_model_len) == ("ar", None, 256)


def test_vllm_eagle_and_medusa(tmp_path):
    from specserve.speculative.eagle import EagleConfig, EagleHead, save_eagle

    c = load_model_json(model_json(tmp_path, {"model": "m", "speculative_config": {
        "method": "eagle3", "model": "head", "num_speculative_tokens": 5}}))
    assert speculative(c)[:3] == ("eagle3", "head", 5)
    c = load_model_json(model_json(tmp_path, {"model": "m", "speculative_config": {
        "method": "medusa", "model": "heads", "num_speculative_tokens": 3}}))
    assert c.speculative.method == "medusa"
    # the seeds' older form names an EAGLE head as speculative_model: it is recognised by its weights
    head = EagleHead(EagleConfig(kind="eagle", hidden_size=16, num_heads=2, num_kv_heads=2, intermediate_size=32,
                                 vocab_size=40))
    eagle_dir = save_eagle(head, tmp_path / "EAGLE-LLaMA3-Instruct-8B")
    c = load_model_json(model_json(tmp_path, {"model": "m", "speculative_model": str(eagle_dir),
                                              "num_speculative_tokens": 5}))
    assert (c.speculative.method, c.speculative.max_draft_len) == ("eagle2", 5)


def test_vllm_speculative_config(tmp_path):
    c = load_model_json(model_json(tmp_path, {"model": "m", "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}}))
    assert speculative(c) == ("ngram", None, 3, {"prompt_lookup_max": 5, "prompt_lookup_min": 2})
    c = load_model_json(model_json(tmp_path, {"model": "m", "speculative_config": {
        "method": "draft_model", "model": "small", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}}))
    assert speculative(c)[:3] == ("draft_target", "small", 2)


@pytest.mark.parametrize("data,fragment", [
    ({"model": "m", "gpu_memory_fraction": 0.5}, "gpu_memory_fraction"),
    ({"model": "m", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}},
     "lookup"),
    ({"model": "m", "speculative_config": {"method": "mlp_speculator", "num_speculative_tokens": 3}},
     "mlp_speculator"),
    ({"model": "m", "speculative_config": {"method": "eagle3", "num_speculative_tokens": 3}}, "path"),
    ({"model": "m", "speculative_model": "d"}, "num_speculative_tokens"),
    ({"model": "m", "tensor_parallel_size": "two"}, "tensor_parallel_size"),
    ({"model": "m", "pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"model": "m", "speculative_config": {"method": "ngram", "num_speculative_tokens": 0}},
     "num_speculative_tokens"),
    ({"speculative_model": "d"}, "model"),
    ({"model": "m", "max_model_len": "256"}, "max_model_len: .*valid integer"),
    ({"model": "m", "enforce_eager": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": True}},
     "num_speculative_tokens: .*valid integer"),
    ({"model": "m", "speculative_model": "d", "speculative_config": {"method": "ngram"}}, "not both"),
])
def test_vllm_errors_name_the_key(tmp_path, data, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_model_json(model_json(tmp_path, data))
