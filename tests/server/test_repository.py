"""Model repository parsing: vLLM model.json (old flat keys and speculative_config), config.pbtxt, kinds, the names
`--model` serves under, and load / unload / sharing of one engine between aliases."""

from __future__ import annotations

import json

import pytest

from specserve.config import ConfigError
from specserve.config_vllm import load_model_json
from specserve.server.app import build_repository
from specserve.server.repository import (DEFAULT_ALIASES, ENSEMBLE, LLMAPI, VLLM, ModelRepository, parse_pbtxt,
                                         read_model_dir)


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
    ({"model": "m", "tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"model": "m", "speculative_config": {"method": "ngram", "num_speculative_tokens": 0}},
     "num_speculative_tokens"),
    ({"speculative_model": "d"}, "model"),
])
def test_vllm_errors_name_the_key(tmp_path, data, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_model_json(model_json(tmp_path, data))


def test_pbtxt():
    text = '''name: "ensemble"
platform: "ensemble"
max_batch_size: 8
model_transaction_policy { decoupled: True }
dynamic_batching { default_queue_policy { max_queue_size: 5 } }
'''
    assert parse_pbtxt(text) == {"name": "ensemble", "platform": "ensemble", "max_batch_size": 8,
                                 "decoupled": True, "max_queue_size": 5}
    assert parse_pbtxt('backend: "vllm"') == {"backend": "vllm"}


def test_read_model_dir_kinds(repo_dir):
    kinds = {name: read_model_dir(repo_dir / name).kind
             for name in ("tensorrt_llm", "eagle_model", "draft_model", "ensemble", "plain")}
    assert kinds == {"tensorrt_llm": LLMAPI, "eagle_model": VLLM, "draft_model": VLLM, "ensemble": ENSEMBLE,
                     "plain": LLMAPI}
    ensemble = read_model_dir(repo_dir / "ensemble")
    assert ensemble.max_batch_size == 4 and ensemble.decoupled
    pre = read_model_dir(repo_dir / "preprocessing")
    assert pre.config is None and not pre.broken and "model.yaml" in pre.error


def test_latest_version_is_served(tmp_path, checkpoint):
    for version in ("1", "3", "2"):
        (tmp_path / "m" / version).mkdir(parents=True)
        (tmp_path / "m" / version / "model.yaml").write_text(f"model: {checkpoint('llama')}\ndtype: float32\n")
    source = read_model_dir(tmp_path / "m")
    assert source.version == "3" and source.versions == ("1", "2", "3")


def test_single_model_names(tmp_path, checkpoint):
    repo = build_repository(model=checkpoint("llama"))
    names = list(repo.models)
    assert names[0] == checkpoint("llama").rstrip("/").rsplit("/", 1)[-1]
    assert set(DEFAULT_ALIASES) <= set(names)
    assert {n: m.kind for n, m in repo.models.items() if n in DEFAULT_ALIASES} == DEFAULT_ALIASES
    assert all(m.source.config.speculative.method == "ngram" for m in repo.models.values())
    yaml_file = tmp_path / "my_model" / "1" / "model.yaml"
    yaml_file.parent.mkdir(parents=True)
    yaml_file.write_text(f"model: {checkpoint('llama')}\n")
    repo = build_repository(model=str(yaml_file))
    assert list(repo.models)[0] == "my_model" and repo.models["my_model"].source.config.speculative.method == "ar"
    default = build_repository()
    assert list(default.models)[0] == "gemma-3-270m" and "tensorrt_llm" in default.models


def test_aliases_share_one_engine_and_unload(checkpoint):
    repo = build_repository(model=checkpoint("llama"))
    for model in repo.models.values():
        model.source.config.model.dtype = "float32"
    assert repo.load_all() == {}
    engines = {id(m.engine) for m in repo.models.values()}
    assert len(engines) == 1
    runner = repo.models["tensorrt_llm"].runner
    repo.unload("tensorrt_llm")
    assert not repo.models["tensorrt_llm"].ready and repo.models["ensemble"].ready
    repo.load("tensorrt_llm")
    assert repo.models["tensorrt_llm"].runner is runner  # reattached to the live engine, nothing reloaded
    index = {e["name"]: e for e in repo.index()}
    assert index["tensorrt_llm"]["state"] == "READY"
    repo.close()


def test_repository_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        ModelRepository.from_directory(tmp_path / "missing")
    with pytest.raises(ConfigError, match="either"):
        build_repository(model_repository=tmp_path, model="x")
