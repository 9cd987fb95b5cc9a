"""Model repository parsing: config.pbtxt, kinds, the names `--model` serves under, and load / unload / sharing of one engine between aliases."""

from __future__ import annotations

import pytest

from specserve.config import ConfigError
from specserve.server.app import build_repository
from specserve.server.repository import (DEFAULT_ALIASES, ENSEMBLE, LLMAPI, VLLM, ModelRepository, parse_pbtxt,
                                         read_model_dir)


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
    full = text + 'input [{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }]\n' \
        'parameters { key: "tokenizer_dir" value: { string_value: "/models/t" } }\n'
    assert parse_pbtxt(full)["max_queue_size"] == 5


@pytest.mark.parametrize("text,needle", [
    ('max_batch_sise: 8\n', "max_batch_sise"),  # a typo
    ('max_batch_size: ${triton_max_batch_size}\n', "2:|1:"),  # a template never filled
    ('model_transaction_policy { decoupled: "false" }\n', "decoupled"),
    ('max_batch_size: -1\n', "max_batch_size"),
])
def test_pbtxt_errors_name_the_field(text, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle):
        parse_pbtxt(text)
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text(text)
    (tmp_path / "m" / "1" / "model.yaml").write_text("model: gemma-3-270m\n")
    broken = ModelRepository.from_directory(tmp_path).models["m"].source
    assert broken.broken and "config.pbtxt" in broken.error


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
