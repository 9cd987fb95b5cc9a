"""End to end on the real embedded default (Gemma-3-270m GGUF): dequantized once, cached, then lossless n-gram."""

from __future__ import annotations

import json

import pytest

from specserve.config import DeploymentConfig, SpeculativeConfig, build_engine
from specserve.models.loader import DEFAULT_MODEL, load_model
from specserve.speculative.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    "    \"\"\" Check if in given list of numbers, are any two numbers closer to each other than\n"
    "    given threshold.\n    \"\"\"\n",
]


@pytest.fixture(scope="module")
def default_model():
    return load_model(DEFAULT_MODEL)


def test_default_model_ngram_equals_plain(default_model):
    plain = build_engine(DeploymentConfig(), default_model)
    ngram = build_engine(DeploymentConfig(speculative=SpeculativeConfig("ngram", max_draft_len=4)), default_model)
    params = SamplingParams(max_tokens=48)
    for prompt in PROMPTS:
        want, got = plain.generate(prompt, params), ngram.generate(prompt, params)
        assert got.token_ids == want.token_ids
        assert got.metrics.total_draft_tokens > 0


def test_default_model_greedy_screen_keeps_the_outputs(default_model, monkeypatch):
    """The embedded GGUF's Q8_0 lm_head is screened for greedy choices: the same tokens as the full logits."""
    assert default_model.model.greedy_screen is not None
    engine = build_engine(DeploymentConfig(), default_model)
    params = SamplingParams(max_tokens=32)
    outputs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("SPECSERVE_GREEDY_SCREEN", setting)
        outputs[setting] = [engine.generate(prompt, params).token_ids for prompt in PROMPTS]
    assert outputs["0"] == outputs["1"]


def test_cli_generate_on_the_default(default_model):
    from typer.testing import CliRunner

    from specserve.cli import app
    result = CliRunner().invoke(app, ["generate", "def add(a, b):", "--method", "ngram", "--max-tokens", "16",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["metrics"]["output_tokens"] >= 1


# Written for this test (not from any benchmark): plain prose and code the model should find unsurprising.
PERPLEXITY_TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. On weekends it stays open until "
    "noon. Visitors can borrow up to five books at a time, and each loan lasts two weeks.\n\n"
    "def mean(values):\n    \"\"\"Return the arithmetic mean of a list of numbers.\"\"\"\n"
    "    return sum(values) / len(values)\n"
)


def perplexity(model, ids: list[int]) -> float:
    import torch

    from specserve.models.kv_cache import KVCache

    pos = torch.arange(len(ids))[None]
    logits = model(torch.tensor([ids]), pos, KVCache.for_model(model, 1, len(ids)), pos).logits[0, :-1]
    return float(torch.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))))


def test_gguf_blocks_keep_the_perplexity_of_the_dequantized_model(default_model):
    assert default_model.model.quantization == "gguf"
    dense = load_model(DEFAULT_MODEL, quantization="none")
    ids = default_model.tokenizer(PERPLEXITY_TEXT).input_ids
    packed, reference = perplexity(default_model.model, ids), perplexity(dense.model, ids)
    assert reference < 20  # the text is easy for the model: a broken reference fails here
    assert packed < reference * 1.05, (packed, reference)


def test_the_cached_tokenizer_lists_its_added_tokens_and_loads_as_the_gguf_s(default_model):
    """The converted directory's tokenizer_config.json names the added tokens (transformers otherwise parses all of
    tokenizer.json in Python to find them); loaded from it, the tokenizer is the GGUF's own."""
    import json

    from transformers import AutoTokenizer

    from specserve.models.gguf_convert import gguf_to_hf_dir
    from specserve.models.loader import embedded_default_gguf

    directory = gguf_to_hf_dir(embedded_default_gguf())
    listed = json.loads((directory / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    cached = AutoTokenizer.from_pretrained(str(directory))  # the model's own may be the GGUF's (a first start)
    assert len(listed) == len(cached.added_tokens_decoder) > 0
    gguf = embedded_default_gguf()
    original = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in ("def fibonacci(n):\n    return n", "<start_of_turn>user\nhi <unused5> 😀<end_of_turn>\n"):
        ids = original(text).input_ids
        assert cached(text).input_ids == ids and cached.decode(ids) == original.decode(ids)
    assert cached.all_special_ids == original.all_special_ids


def test_the_tokenizer_drops_its_python_vocabulary_and_still_tokenizes_the_same(default_model, tmp_path):
    """The loaded BPE tokenizer holds no Python copy of its vocabulary or merges (they held ~190 MB for Gemma 3)
    and encodes, decodes, lists its vocabulary and saves as one loaded by transformers alone."""
    from transformers import AutoTokenizer

    loaded = default_model.tokenizer
    assert not hasattr(loaded, "_merges") and not hasattr(loaded, "_vocab")
    fresh = AutoTokenizer.from_pretrained(str(default_model.path))
    assert hasattr(fresh, "_merges")  # the control: transformers keeps them
    text = "Héllo wörld!\n\tdef f(x):  return x ** 2  # 🙂 <start_of_turn>user"
    assert loaded(text).input_ids == fresh(text).input_ids
    ids = fresh(text).input_ids
    assert loaded.decode(ids) == fresh.decode(ids)
    assert loaded.get_vocab() == fresh.get_vocab()
    loaded.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path))(text).input_ids == ids
