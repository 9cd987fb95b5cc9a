"""Trained weights: the two TinyStories llama2.c models in ../shared/models (one tokenizer), target and draft."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.models.loader import load_model
from specserve.speculative.draft_model import DraftModelMethod
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams

SHARED = Path(__file__).resolve().parents[3] / "shared" / "models"
STORIES = SHARED / "stories260K"
# llama2.c's documented temperature-0 story for stories260K, from BOS alone (shared/models/README.md)
EXPECTED = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
            410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328]
BOS = 1

pytestmark = pytest.mark.skipif(not STORIES.exists(), reason="shared/models is not beside the checkout")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("SPECSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
    other = tmp_path_factory.mktemp("saltyduckegg")
    shutil.copy(SHARED / "tinystories-tok512-d64l5-saltyduckegg" / "model.bin", other / "model.bin")
    shutil.copy(STORIES / "tok512.model", other / "tok512.model")
    target = load_model(str(STORIES / "stories260K.bin"), dtype=torch.float32)
    draft = load_model(str(other / "model.bin"), dtype=torch.float32)
    return target, draft


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_converted_model_reproduces_the_documented_story(pair):
    target, _ = pair
    result = Engine(target).generate([BOS], SamplingParams(max_tokens=len(EXPECTED), ignore_eos=True))
    assert result.token_ids == EXPECTED
    assert result.text.strip().startswith("Once upon a time, there was a little girl named Lily.")


@pytest.mark.parametrize("draft_len", [2, 4, 7])
def test_trained_draft_is_lossless_with_partial_acceptance(pair, draft_len):
    target, draft = pair
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    want = Engine(target).generate([BOS], params)
    for method in (DraftModelMethod(draft.model, 512), NGramMethod(1, 3)):
        got = Engine(target, method, draft_len).generate([BOS], params)
        assert got.token_ids == want.token_ids
        assert 0.0 < got.metrics.acceptance_rate < 1.0
    reverse = Engine(draft, DraftModelMethod(target.model, 512), draft_len).generate([BOS], params)
    assert reverse.token_ids == Engine(draft).generate([BOS], params).token_ids
