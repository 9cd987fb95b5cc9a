"""Tiny random checkpoints of each supported family, built in the test session (seconds, no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

# Tests never reach a model hub (CI has no network to one): fail fast instead of waiting on connection timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen3Config)

from specserve.models import cpu_kernels
from specserve.models.loader import load_model

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time there was a little girl who loved to play in the park with her dog.",
    "The quick brown fox jumps over the lazy dog. The lazy dog sleeps all day long.",
    "for i in range(10):\n    print(i * i)\n",
] * 20


def runnable_kernel_variants() -> list[str]:
    """The kernel variants compiled in and run by this CPU (a collection error, not a skip, when the kernels do not
    load)."""
    ext = cpu_kernels.extension()
    return [name for name in ext.VARIANTS if ext.cpu_runs(name)]


VOCAB = 384
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "gemma3": lambda: Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3, "tie_word_embeddings": True},
                                       head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}


# The tiny models' chat format: a role-prefixed transcript (a model without a template gets no chat).
TRANSCRIPT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


def build_tokenizer(chat_template: str | None = TRANSCRIPT_TEMPLATE) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    from tokenizers.processors import TemplateProcessing
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=chat_template)


def make_checkpoint(directory, family: str, seed: int = 0, tokenizer=None) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]())
    model.save_pretrained(directory)
    (tokenizer or build_tokenizer()).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer):
    """checkpoint(family, seed) -> path of a tiny random HF checkpoint directory (cached per session)."""
    made: dict[tuple[str, int], str] = {}

    def get(family: str, seed: int = 0) -> str:
        if (family, seed) not in made:
            made[family, seed] = make_checkpoint(tmp_path_factory.mktemp(f"{family}{seed}"), family, seed, tokenizer)
        return made[family, seed]

    return get


@pytest.fixture(scope="session")
def loaded(checkpoint):
    """loaded(family, seed) -> LoadedModel in float32 (cached per session)."""
    cache: dict = {}

    def get(family: str, seed: int = 0):
        if (family, seed) not in cache:
            cache[family, seed] = load_model(checkpoint(family, seed), dtype=torch.float32)
        return cache[family, seed]

    return get


SHARED = Path(__file__).resolve().parents[2] / "shared"  # beside the checkout
STORIES = str(SHARED / "models" / "stories260K" / "stories260K.bin")
STORY_PROMPTS = [f"{start}{mood}" for mood in ("", " happy", " little", " sad")
                 for start in ("Once upon a time", "One day", "Tom and Lily", "The little dog", "There was a",
                               "In the park", "Mom said", "The sun was")]
STORY_HELD_OUT = ["Once upon a time, there was a cat", "Lily wanted to play", "The bird flew"]


@pytest.fixture(scope="session")
def story_data(tmp_path_factory):
    """The shared TinyStories model (real trained weights) and self-distillation data from its own stories:
    (target, data settings, records, data directory)."""
    from specserve.train.data import build_dataset, load_dataset

    if not Path(STORIES).exists():  # as the other tests of the shared models: skipped, with the reason
        pytest.skip("shared/models is not beside the checkout")
    target = load_model(STORIES, dtype=torch.float32)
    directory = build_dataset(target, STORY_PROMPTS, tmp_path_factory.mktemp("story_data"), max_tokens=64)
    settings, records = load_dataset(directory)
    return target, settings, records, directory
