"""Tiny checkpoints for the tensor-parallel tests: a Gemma-3 with one KV head (as the embedded default: KV heads
replicated over the ranks, tied embeddings, sliding windows) and the shared Llama (KV heads split, its own lm_head)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from specserve.models.loader import load_model
from tests.conftest import COMMON


def gemma_one_kv_head() -> Gemma3TextConfig:
    return Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 1,
                               "tie_word_embeddings": True},
                            head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"])


@pytest.fixture(scope="session")
def gemma_kv1(tmp_path_factory, tokenizer) -> str:
    directory = tmp_path_factory.mktemp("gemma_kv1")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gemma_one_kv_head()).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def gemma_kv1_fp32(gemma_kv1):
    """The unsharded model (TP = 1), float32."""
    return load_model(gemma_kv1, dtype=torch.float32)
