"""Which grammar engine to build structured outputs on: llguidance, outlines-core and xgrammar, measured here on the
default model's tokenizer (Gemma-3, 262,144 tokens).

For each engine: the time to build its vocabulary index from the tokenizer (once per server), the time to compile a
JSON schema (once per request), and the time to compute the allowed-token bitmask at every step of a valid JSON
document (once per decoded token, and once per draft node with speculation). The document is the tokenizer's own
tokenization of a JSON value matching the schema; every engine must accept it token by token.

    python benchmarks/grammar_engines.py [--engines llguidance,outlines,xgrammar] [--repeats 3]

xgrammar pulls triton and apache-tvm-ffi; install it outside the venv for this comparison, e.g.
`pip install --no-deps --target /tmp/xg xgrammar==0.2.8 apache-tvm-ffi outlines-core==0.2.14` and run with
`PYTHONPATH=/tmp/xg`. Results are in docs/structured-outputs.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string"}},
        "coordinates": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False},
    },
    "required": ["name", "country", "population", "landmarks", "coordinates"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Lisbon", "country": "Portugal", "population": 545923,
            "landmarks": ["Belem Tower", "Jeronimos Monastery", "Sao Jorge Castle"],
            "coordinates": {"lat": 38.7223, "lon": -9.1393}}


def load_tokenizer():
    from specserve.models.loader import resolve_model_source  # the default model's directory, tokenizer included
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(resolve_model_source(None).directory))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def mask(self, matcher) -> None:
        matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)

    def allowed(self, token: int) -> bool:
        return bool((int(self.bitmask[token // 32]) >> (token % 32)) & 1)

    def advance(self, matcher, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(matcher.get_error())


class Outlines:
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int):
        from outlines_core import Vocabulary
        import outlines_core
        self.oc = outlines_core
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, outlines_vocabulary(tokenizer))
        self.bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict):
        from outlines_core.json_schema import build_regex_from_schema
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ \n]?")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def mask(self, guide) -> None:
        guide.write_mask_into(self.bitmask.data_ptr(), self.bitmask.numel(), 4)

    def allowed(self, token: int) -> bool:
        return bool((int(self.bitmask[token // 32]) >> (token % 32)) & 1)

    def advance(self, guide, token: int) -> None:
        guide.advance(token, return_tokens=False)


def outlines_vocabulary(tokenizer) -> dict:
    """outlines-core takes token -> ids with each token as the bytes it decodes to (SentencePiece's '▁' is a space,
    byte-fallback tokens '<0xAB>' one byte); special tokens have no text and are left out."""
    special = set(tokenizer.all_special_ids)
    vocab: dict[bytes, list[int]] = {}
    for piece, token in tokenizer.get_vocab().items():
        if token in special:
            continue
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            text = bytes([int(piece[3:5], 16)])
        else:
            text = piece.replace("\u2581", " ").encode()
        vocab.setdefault(text, []).append(token)
    return vocab


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def mask(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def allowed(self, token: int) -> bool:
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def advance(self, matcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")


ENGINES = {engine.name: engine for engine in (LLGuidance, Outlines, XGrammar)}


def measure(engine_cls, tokenizer, vocab_size: int, tokens: list[int], repeats: int) -> dict:
    engine, build_s = timed(lambda: engine_cls(tokenizer, vocab_size))
    compile_s, mask_s = [], []
    for _ in range(repeats):
        state, seconds = timed(lambda: engine.compile(SCHEMA))
        compile_s.append(seconds)
        for token in tokens:
            _, seconds = timed(lambda: engine.mask(state))
            mask_s.append(seconds)
            if not engine.allowed(token):
                raise RuntimeError(f"{engine.name} forbids token {token} of a valid document")
            engine.advance(state, token)
    return {"engine": engine.name, "vocabulary_build_s": round(build_s, 3),
            "compile_ms_median": round(1e3 * statistics.median(compile_s), 2),
            "mask_us_median": round(1e6 * statistics.median(mask_s), 1),
            "mask_us_mean": round(1e6 * statistics.fmean(mask_s), 1),
            "mask_us_max": round(1e6 * max(mask_s), 1), "tokens": len(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="llguidance,outlines,xgrammar")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    vocab_size = 262144
    tokens = tokenizer(json.dumps(DOCUMENT), add_special_tokens=False).input_ids
    for name in args.engines.split(","):
        try:
            print(json.dumps(measure(ENGINES[name], tokenizer, vocab_size, tokens, args.repeats)), flush=True)
        except ImportError as exc:
            print(json.dumps({"engine": name, "error": f"not installed: {exc}"}), flush=True)


if __name__ == "__main__":
    main()
