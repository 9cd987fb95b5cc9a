"""llama2.c checkpoints (legacy "version 0": a 7 x int32 header, then float32 arrays) -> HF Llama directories.

llama2.c rotates adjacent pairs (2j, 2j+1) while HF Llama rotates halves, so the rows of wq and wk are permuted
the way transformers' own Meta-checkpoint converter does.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import torch

HEADER = struct.Struct("<7i")


def read_header(path: Path) -> dict:
    with open(path, "rb") as handle:
        values = HEADER.unpack(handle.read(HEADER.size))
    keys = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    return dict(zip(keys, values))


def looks_like_llama2c(path: Path) -> bool:
    if path.suffix != ".bin" or path.stat().st_size < HEADER.size:
        return False
    h = read_header(path)
    plausible = all(0 < h[k] < 1 << 20 for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "seq_len"))
    return plausible and h["vocab_size"] != 0 and h["dim"] % h["n_heads"] == 0


def _rotate_half_layout(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def read_state_dict(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    h = read_header(path)
    dim, hidden, layers, heads, kv_heads = h["dim"], h["hidden_dim"], h["n_layers"], h["n_heads"], h["n_kv_heads"]
    vocab, tied = abs(h["vocab_size"]), h["vocab_size"] > 0
    head_size = dim // heads
    kv_dim = head_size * kv_heads
    data = np.fromfile(path, dtype="<f4", offset=HEADER.size)
    offset = 0

    def take(*shape):
        nonlocal offset
        count = int(np.prod(shape))
        if offset + count > data.size:
            raise ValueError(f"{path} is truncated: not a llama2.c checkpoint of the header's size")
        out = torch.from_numpy(data[offset:offset + count].copy()).view(*shape)
        offset += count
        return out

    embed = take(vocab, dim)
    rms_att, wq, wk = take(layers, dim), take(layers, dim, dim), take(layers, kv_dim, dim)
    wv, wo, rms_ffn = take(layers, kv_dim, dim), take(layers, dim, dim), take(layers, dim)
    w1, w2, w3 = take(layers, hidden, dim), take(layers, dim, hidden), take(layers, hidden, dim)
    rms_final = take(dim)
    take(h["seq_len"], head_size // 2)  # stored RoPE tables (real, imag): recomputed instead
    take(h["seq_len"], head_size // 2)
    state = {"model.embed_tokens.weight": embed, "model.norm.weight": rms_final}
    if not tied:
        state["lm_head.weight"] = take(vocab, dim)
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": rms_att[i], p + "post_attention_layernorm.weight": rms_ffn[i],
            p + "self_attn.q_proj.weight": _rotate_half_layout(wq[i], heads),
            p + "self_attn.k_proj.weight": _rotate_half_layout(wk[i], kv_heads),
            p + "self_attn.v_proj.weight": wv[i], p + "self_attn.o_proj.weight": wo[i],
            p + "mlp.gate_proj.weight": w1[i], p + "mlp.down_proj.weight": w2[i], p + "mlp.up_proj.weight": w3[i],
        })
    config = dict(model_type="llama", hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  max_position_embeddings=h["seq_len"], rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, hidden_act="silu")
    return config, state


def convert(path: Path, tokenizer_model: Path, out: Path) -> Path:
    """Write an HF Llama directory (config, safetensors, tokenizer from a SentencePiece .model) for a llama2.c file."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    config_dict, state = read_state_dict(path)
    staging = out.with_name(out.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**{k: v for k, v in config_dict.items() if k != "model_type"}).save_pretrained(staging)
    save_file({k: v.contiguous() for k, v in state.items()}, str(staging / "model.safetensors"))
    shutil.copy(tokenizer_model, staging / "tokenizer.model")
    AutoTokenizer.from_pretrained(str(staging)).save_pretrained(staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out
