"""Heads shipped for the embedded default (specserve/heads): found when no head is named, never for another model,
overridden by a named head; greedy output with them equals plain decoding. The mechanism is tested on a tiny model
posing as the default; the real shipped heads on the real default model (slow)."""

from __future__ import annotations

import dataclasses

import pytest

import specserve.heads as heads
from specserve.config import ConfigError, DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine
from specserve.speculative.eagle import load_eagle
from specserve.speculative.sampling import SamplingParams
from tests.speculative.test_eagle import PROMPTS, save_random


@pytest.fixture
def posing_default(loaded, tmp_path, monkeypatch):
    """A tiny llama flagged as the embedded default, with a random EAGLE-3 head 'shipped' for it in tmp_path."""
    target = dataclasses.replace(loaded("llama"), embedded_default=True)
    monkeypatch.setattr(heads, "DEFAULT_MODEL_DIR", tmp_path / "shipped")
    save_random(target, "eagle3", tmp_path / "shipped" / "eagle3", seed=3, safetensors=True)
    return target


def engine(target, method: str, head: str | None = None):
    spec = SpeculativeConfig(method, 4, head, adaptive_draft_len=False)
    return build_engine(DeploymentConfig(ModelConfig(str(target.path)), speculative=spec), target)


def test_the_shipped_head_drafts_when_none_is_named_and_output_equals_plain(posing_default):
    assert heads.shipped_kinds() == ["eagle3"]
    plain, eagle3 = engine(posing_default, "ar"), engine(posing_default, "eagle3")
    params = SamplingParams(max_tokens=24)
    drafted = 0
    for prompt in PROMPTS:
        result = eagle3.generate(prompt, params)
        assert result.token_ids == plain.generate(prompt, params).token_ids
        drafted += result.metrics.total_draft_tokens
    assert drafted > 0


def test_no_head_ships_for_another_model_or_another_kind(posing_default, loaded):
    with pytest.raises(ConfigError, match="needs speculative_model.*no eagle3 head ships"):
        engine(loaded("llama"), "eagle3")  # the same weights, not flagged as the embedded default
    with pytest.raises(ConfigError, match="no medusa head ships"):
        engine(posing_default, "medusa")


def test_a_named_head_wins_over_the_shipped_one(posing_default, tmp_path, monkeypatch):
    own = save_random(posing_default, "eagle3", tmp_path / "own", seed=11)
    opened = []
    real = load_eagle

    def spy(path, *args, **kwargs):
        opened.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr("specserve.speculative.eagle_draft.load_eagle", spy)
    engine(posing_default, "eagle3", str(own))
    engine(posing_default, "eagle3")
    assert opened == [str(own), str(heads.DEFAULT_MODEL_DIR / "eagle3")]


@pytest.mark.slow
@pytest.mark.parametrize("kind", heads.shipped_kinds() or ["eagle3"])
def test_real_shipped_heads_on_the_default_model(kind):
    """Each shipped head loads for the real default, drafts tokens that get accepted, keeps plain output, and
    stays within the 32 MB a shipped head may take."""
    from specserve.models.loader import DEFAULT_MODEL, load_model

    path = heads.DEFAULT_MODEL_DIR / kind
    assert path.is_dir(), f"no {kind} head ships in {heads.DEFAULT_MODEL_DIR}"
    assert sum(f.stat().st_size for f in path.iterdir()) <= 32 * 2**20
    target = load_model(DEFAULT_MODEL)
    method = {"eagle": "eagle2"}.get(kind, kind)
    plain, spec = engine(target, "ar"), engine(target, method)
    params = SamplingParams(max_tokens=48)
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    result = spec.generate(prompt, params)
    assert result.token_ids == plain.generate(prompt, params).token_ids
    assert result.metrics.total_accepted_draft_tokens > 0
