"""RopeTables computes the rotary tables itself: they must equal those of transformers' own rotary module of each
family, for every rope type the supported families' checkpoints use (bit for bit, fp32 and bf16)."""

import importlib

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

from specserve.models.transformer import RopeTables

CONFIGS = {
    "qwen2 default": Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "gemma3 per layer type": Gemma3TextConfig(),
    "llama3": LlamaConfig(max_position_embeddings=131072, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "linear": LlamaConfig(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "yarn": Qwen2Config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                         "original_max_position_embeddings": 32768}),
    # past max_position_embeddings the dynamic frequencies change with the table's length
    "dynamic": LlamaConfig(max_position_embeddings=256, rope_parameters={"rope_type": "dynamic",
                                                                         "rope_theta": 10000.0, "factor": 2.0}),
}


def transformers_tables(config, dtype: torch.dtype, size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    family = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding"))(config)
    probe, positions = torch.zeros(1, dtype=dtype), torch.arange(size)[None]
    tables = {}
    for layer_type in ("full_attention", "sliding_attention"):
        cos, sin = rotary(probe, positions, layer_type) if family == "gemma3" else rotary(probe, positions)
        tables[layer_type] = (cos[0], sin[0])
    return tables


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [256, 1024])
def test_tables_equal_transformers(name: str, dtype: torch.dtype, size: int) -> None:
    config = CONFIGS[name]
    ours = RopeTables(config, dtype)
    ours._build(size)
    for layer_type, (cos, sin) in transformers_tables(config, dtype, size).items():
        assert torch.equal(ours.tables[layer_type][0], cos), layer_type
        assert torch.equal(ours.tables[layer_type][1], sin), layer_type


def test_gemma3_layer_types_differ() -> None:
    """The control: sliding layers use their own (local) theta, so the two tables must not be one."""
    tables = RopeTables(CONFIGS["gemma3 per layer type"], torch.float32)
    tables._build(256)
    assert not torch.equal(tables.tables["full_attention"][0], tables.tables["sliding_attention"][0])
