"""`specserve distill`'s data: token shards that resume and refuse other prompts, features recorded in the
generating pass (equal to one forward over the sequence), and training records with the prompt kept out of the
loss."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.speculative.sampling import SamplingParams
from specserve.train.distill import (distill_tokens, feature_file, load_distilled, load_token_data,
                                     recompute_features, saved_prompts, unseen_prompts)
from specserve.train.heads import TrainSettings, sample_windows
from specserve.train.run import train_distilled
from tests.conftest import STORY_PROMPTS

PROMPTS = STORY_PROMPTS[:6]


@pytest.fixture(scope="module")
def distilled(story_data, tmp_path_factory):
    target = story_data[0]
    root = tmp_path_factory.mktemp("distilled")
    report = distill_tokens(target, "stories", PROMPTS, root / "tokens", root / "features", max_tokens=12,
                            batch_size=4, shard_size=4)
    return target, root, report


def test_responses_are_greedy_decoding_and_resume_skips_finished_shards(distilled):
    target, root, report = distilled
    assert report["shards"] == 2 and report["new_response_tokens"] > 0
    sequences = load_token_data(root / "tokens")
    for prompt, seq in zip(PROMPTS, sequences):
        plain = Engine(target).generate(prompt, SamplingParams(max_tokens=12))
        assert seq["ids"][seq["prompt_tokens"]:] == plain.token_ids
    assert saved_prompts(root / "tokens") == PROMPTS  # a resumed run elsewhere continues this list
    again = distill_tokens(target, "stories", PROMPTS, root / "tokens", root / "features", max_tokens=12,
                           batch_size=4, shard_size=4)
    assert again["new_response_tokens"] == 0


def test_other_prompts_or_settings_are_refused(distilled):
    target, root, _ = distilled
    with pytest.raises(ValueError, match="other prompts"):
        distill_tokens(target, "stories", PROMPTS[::-1], root / "tokens", root / "features", max_tokens=12,
                       batch_size=4, shard_size=4)
    with pytest.raises(ValueError, match="max_tokens"):
        distill_tokens(target, "stories", PROMPTS, root / "tokens", root / "features", max_tokens=20,
                       batch_size=4, shard_size=4)


def test_recorded_features_are_one_forward_over_the_sequence(distilled):
    target, root, _ = distilled
    sequences = load_token_data(root / "tokens")
    recorded = torch.load(feature_file(root / "features", 0), weights_only=True)
    for seq, features in zip(sequences, recorded):
        assert features.shape[0] == len(seq["ids"]) - 1
        # float32 here runs PyTorch's kernels, whose sums may round by forward size: close, not bit-equal
        torch.testing.assert_close(features.float(), recompute_features(target, seq["ids"]).float(),
                                   atol=0.05, rtol=0.02)


def test_records_keep_the_prompt_out_of_the_loss_and_recompute_missing_features(distilled, tmp_path):
    target, root, _ = distilled
    records = load_distilled(root / "tokens", root / "features")
    first = records[0]
    assert torch.equal(first["labels"][:-1], first["tokens"][1:])
    settings = TrainSettings(kind="eagle3", batch_size=1, seq_len=64)  # longer than the sequence: one window at 0
    valid = sample_windows([first], settings, step=0, micro=0)["valid"][0]
    assert first["loss_from"] > 0 and not valid[: first["loss_from"]].any()
    assert valid[first["loss_from"]: first["tokens"].numel()].all()
    # a machine without the features: they are recomputed from the ids
    missing = tmp_path / "features"
    rebuilt = load_distilled(root / "tokens", missing, target)
    assert len(rebuilt) == len(records) and (missing / "features_00000.pt").exists()
    with pytest.raises(FileNotFoundError, match="features_"):
        load_distilled(root / "tokens", tmp_path / "none")
    manifest = json.loads((root / "tokens" / "manifest.json").read_text())
    assert manifest["target"] == "stories"


def test_more_data_goes_in_a_second_directory_and_trains_with_the_first(distilled, tmp_path):
    target, root, _ = distilled
    more = STORY_PROMPTS[6:8]
    assert unseen_prompts(PROMPTS + more, [root / "tokens"]) == more
    with pytest.raises(FileNotFoundError, match="prompts.jsonl"):
        unseen_prompts(more, [tmp_path])
    distill_tokens(target, "stories", more, tmp_path / "tokens", tmp_path / "features", max_tokens=12,
                   batch_size=4, shard_size=4)
    settings = TrainSettings(kind="eagle3", steps=2, batch_size=2, seq_len=32, draft_vocab_size=256)
    report = train_distilled(target, target, "eagle3", [root / "tokens", tmp_path / "tokens"],
                             [root / "features", tmp_path / "features"], tmp_path / "head", [], settings)
    assert report["train_sequences"] == len(PROMPTS) + len(more)
    assert (tmp_path / "head" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="one --features per --distilled"):
        train_distilled(target, target, "eagle3", [root / "tokens", tmp_path / "tokens"], [root / "features"],
                        tmp_path / "other", [], settings)


def test_features_batched_on_transformers_equal_specserves_own_forward(distilled, tmp_path):
    """`specserve.train.accelerated` computes features with transformers' model in padded, length-sorted batches:
    the same records as `load_distilled` recomputing them with specserve's forward, sequence by sequence."""
    from transformers import AutoModelForCausalLM

    from specserve.speculative.eagle import default_aux_layer_ids
    from specserve.train.accelerated import records_of

    target, root, _ = distilled
    model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=torch.float32).eval()
    aux = default_aux_layer_ids(target.model.spec.num_layers)
    batched = records_of([root / "tokens"], model, aux, torch.device("cpu"), tokens_per_batch=40)
    expected = load_distilled(root / "tokens", tmp_path / "recomputed", target)
    assert len(batched) == len(expected)
    for got, want in zip(batched, expected):
        assert got["loss_from"] == want["loss_from"]
        assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["labels"], want["labels"])
        for key in ("aux", "final"):
            assert got[key].shape == want[key].shape
            error = (got[key].float() - want[key].float()).norm() / want[key].float().norm()
            assert error < 1e-2, (key, float(error))  # bf16 rounding of near-equal fp32 values


def test_chat_data_asks_each_prompt_through_the_chat_template(loaded, tmp_path):
    from specserve.models.chat_template import chat_texts

    target = loaded("llama")
    prompts = ["What is a star?", "Name a colour."]
    distill_tokens(target, "llama", prompts, tmp_path / "tokens", tmp_path / "features", max_tokens=6, batch_size=2,
                   shard_size=2, chat=True)
    engine = Engine(target)
    for text, seq in zip(chat_texts(target.tokenizer, prompts), load_token_data(tmp_path / "tokens")):
        assert seq["ids"][: seq["prompt_tokens"]] == engine.encode(text)
        assert seq["ids"][seq["prompt_tokens"]:] == engine.generate(text, SamplingParams(max_tokens=6)).token_ids
    with pytest.raises(ValueError, match="chat"):  # a chat directory is never resumed as plain text
        distill_tokens(target, "llama", prompts, tmp_path / "tokens", tmp_path / "features", max_tokens=6,
                       batch_size=2, shard_size=2)
