"""Random-weight GGUF files in the shapes users serve, for speed and step costs on models no hub can send here.

    python benchmarks/random_gguf.py llama-3.2-1b --type Q4_0 --out /tmp/llama-3.2-1b-q4_0.gguf
    specserve bench --model /tmp/llama-3.2-1b-q4_0.gguf --dataset benchmarks/general_questions.jsonl \\
        --methods ar,ngram --step-costs

Each file has the architecture, dimensions, vocabulary size and tensor formats of the named model; the weights are
random blocks (scales chosen so activations stay finite through every layer) and the tokenizer is a synthetic
byte-level BPE of the model's vocabulary size (merges of ASCII characters, then the model's special tokens). So
timings, memory and losslessness checks are those of the real model; what it writes is noise, and acceptance
rates measured on it say nothing about a real model's. `--type Q4_K_M` follows llama.cpp's mix: Q4_K, with Q6_K
for attn_v, half the ffn_down and the output. Not shipped in the wheel; no test needs it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture: llama or qwen2
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool  # the output projection is the embedding table
    rope_theta: float
    qkv_bias: bool = False
    context: int = 8192
    norm_eps: float = 1e-5


SHAPES = {  # from each model's published config.json
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, tied=True, rope_theta=500000.0),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True, rope_theta=1000000.0, qkv_bias=True,
                          norm_eps=1e-6),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, tied=False, rope_theta=500000.0),
}
TYPES = ("Q4_0", "Q8_0", "Q4_K_M")
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                 "{{ m['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def tensor_types(shape: Shape, kind: str) -> dict[str, Q]:
    """The format of each kind of tensor, by GGUF name suffix (per layer) or full name."""
    if kind in ("Q4_0", "Q8_0"):
        base = Q[kind]
        return {"default": base, "token_embd": base, "output": Q.Q8_0 if kind == "Q4_0" else base}
    return {"default": Q.Q4_K, "attn_v": Q.Q6_K, "ffn_down_even": Q.Q6_K, "token_embd": Q.Q4_K, "output": Q.Q6_K}


def random_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks whose fp16 scales are `scale`-sized (the quantized values are
    uniform over their range, so a dot product over K inputs has a spread of about scale * sqrt(K))."""
    block, nbytes = GGML_QUANT_SIZES[kind]
    blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(blocks, nbytes), dtype=np.uint8)
    d = (scale * rng.uniform(0.5, 1.5, size=blocks)).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    if kind in (Q.Q4_0, Q.Q8_0):
        raw[:, 0:2] = d
    elif kind == Q.Q4_K:  # d, dmin, then 12 bytes of 6-bit sub-block scales and mins
        raw[:, 0:2] = d
        raw[:, 2:4] = (d.view(np.float16) / 4).view(np.uint8)
    elif kind == Q.Q6_K:  # ql, qh, 16 int8 sub-block scales, then d
        raw[:, 192:208] = rng.integers(1, 32, size=(blocks, 16), dtype=np.uint8)
        raw[:, 208:210] = d
    else:
        raise ValueError(f"no random blocks for {kind.name}")
    return raw.reshape(rows, cols // block * nbytes)


def unit_scale(kind: Q, cols: int) -> float:
    """A block scale that gives each output a spread of about 1 for unit inputs."""
    spread = {Q.Q4_0: 4.6, Q.Q8_0: 73.9, Q.Q4_K: 4.6 * 32, Q.Q6_K: 18.5 * 16}[kind]  # |code| spread x sub-scale
    return 1.0 / (spread * cols ** 0.5)


def synthetic_vocabulary(size: int) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of exactly `size` tokens: the 256 byte symbols, merges that append one ASCII
    letter or digit to an earlier token (each merge makes a new token), then SPECIALS as control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()
    tokens = [symbols[b] for b in range(256)]
    alphabet = [symbols[ord(c)] for c in " etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789"]
    merges, known, frontier = [], set(tokens), list(alphabet)
    room = size - len(SPECIALS)
    while len(tokens) < room:
        grown = []
        for left in frontier:
            for right in alphabet:
                if len(tokens) == room:
                    break
                if left + right not in known:
                    merges.append(f"{left} {right}")
                    tokens.append(left + right)
                    known.add(left + right)
                    grown.append(left + right)
        frontier = grown
    types = [TokenType.NORMAL] * len(tokens) + [TokenType.CONTROL] * len(SPECIALS)
    return tokens + list(SPECIALS), merges, types


def write(name: str, kind: str, out: Path, seed: int = 0, shape: Shape | None = None) -> None:
    """The GGUF of SHAPES[name] (or of `shape`, named `name`) with `kind` blocks."""
    shape = shape or SHAPES[name]
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(out), shape.arch)
    head_dim = shape.hidden // shape.heads
    writer.add_name(f"{name} random weights ({kind})")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(1)  # what the fields below say, not a llama.cpp ftype number
    tokens, merges, types = synthetic_vocabulary(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|eot_id|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    formats = tensor_types(shape, kind)

    def matrix(tensor: str, rows: int, cols: int, fmt: Q) -> None:
        # a uint8 [rows, bytes per row] array: the writer reads the logical shape off the format's block size
        writer.add_tensor(tensor, random_blocks(fmt, rows, cols, rng, unit_scale(fmt, cols)), raw_dtype=fmt)

    def vector(tensor: str, values: np.ndarray) -> None:
        writer.add_tensor(tensor, values.astype(np.float32))

    matrix("token_embd.weight", shape.vocab, shape.hidden, formats["token_embd"])
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", np.ones(shape.hidden))
        for part, rows in (("attn_q", shape.hidden), ("attn_k", kv), ("attn_v", kv)):
            matrix(p + part + ".weight", rows, shape.hidden, formats.get(part, formats["default"]))
            if shape.qkv_bias:
                vector(p + part + ".bias", rng.normal(0, 0.02, rows))
        matrix(p + "attn_output.weight", shape.hidden, shape.hidden, formats["default"])
        vector(p + "ffn_norm.weight", np.ones(shape.hidden))
        matrix(p + "ffn_gate.weight", shape.ffn, shape.hidden, formats["default"])
        matrix(p + "ffn_up.weight", shape.ffn, shape.hidden, formats["default"])
        down = formats.get("ffn_down_even", formats["default"]) if i % 2 == 0 else formats["default"]
        matrix(p + "ffn_down.weight", shape.hidden, shape.ffn, down)
    vector("output_norm.weight", np.ones(shape.hidden))
    if not shape.tied:
        matrix("output.weight", shape.vocab, shape.hidden, formats["output"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument("--type", choices=TYPES, default="Q4_0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.model, args.type, args.out, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
