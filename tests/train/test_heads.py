"""Training on the shared TinyStories model: each trainer drives its loss down and beats its untrained start on
held-out prompts, writes a head the normal loaders read, resumes bit-exactly, and refuses mismatched state."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.files import PARTIAL_SUFFIX
from specserve.train.data import build_dataset
from specserve.train.heads import FrozenTarget, TrainSettings, build_module, train, write_head
from specserve.train.run import evaluate
from tests.conftest import STORY_HELD_OUT

STEPS = {"eagle3": 120, "eagle": 120, "medusa": 80, "draft": 80}


def settings_for(kind: str, steps: int | None = None, **overrides) -> TrainSettings:
    values = dict(kind=kind, steps=steps or STEPS[kind], batch_size=8, seq_len=80, draft_vocab_size=256, lr=3e-3,
                  warmup=10, save_every=1000)
    return TrainSettings(**{**values, **overrides})


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa", "draft"])
def test_training_lowers_loss_and_raises_tau(kind, story_data, tmp_path):
    target, data, records, _ = story_data
    settings = settings_for(kind)
    untrained = build_module(settings, target, records, data.aux_layer_ids).float().eval()
    write_head(untrained, settings, target, tmp_path / "untrained")
    train(settings, target, records, tmp_path / "trained", data.aux_layer_ids, progress=False)
    history = json.loads((tmp_path / "trained" / "train_history.json").read_text())
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    before = evaluate(target, kind, tmp_path / "untrained", STORY_HELD_OUT, max_tokens=48, max_draft_len=4)
    after = evaluate(target, kind, tmp_path / "trained", STORY_HELD_OUT, max_tokens=48, max_draft_len=4)
    assert after["outputs_equal_plain"] == before["outputs_equal_plain"] == len(STORY_HELD_OUT)
    assert after["tau"] > before["tau"] + 0.3, (before["tau"], after["tau"])


def test_resume_continues_bit_exactly(story_data, tmp_path):
    target, data, records, _ = story_data
    straight = train(settings_for("eagle3", 12, save_every=6), target, records, tmp_path / "a", data.aux_layer_ids,
                     progress=False)
    train(settings_for("eagle3", 6, save_every=6), target, records, tmp_path / "b", data.aux_layer_ids,
          progress=False)  # an interrupted run: its checkpoint is at step 6
    resumed = train(settings_for("eagle3", 12, save_every=6), target, records, tmp_path / "b", data.aux_layer_ids,
                    progress=False)
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    assert not list(tmp_path.glob(f"**/*{PARTIAL_SUFFIX}"))


def test_resume_refuses_other_settings_or_target(story_data, loaded, tmp_path):
    target, data, records, _ = story_data
    train(settings_for("eagle3", 2), target, records, tmp_path / "h", data.aux_layer_ids, progress=False)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        train(settings_for("eagle3", 4, **{"draft_vocab_size": 128}), target, records, tmp_path / "h",
              data.aux_layer_ids, progress=False)
    other = loaded("llama")  # another hidden size and vocabulary
    other_records = [{"tokens": r["tokens"] % 384, "labels": r["labels"] % 384,
                      "final": torch.zeros(r["tokens"].numel(), 64, dtype=torch.bfloat16),
                      "aux": torch.zeros(r["tokens"].numel(), 192, dtype=torch.bfloat16)} for r in records[:4]]
    with pytest.raises(ValueError, match="shapes"):
        train(settings_for("eagle3", 4), other, other_records, tmp_path / "h", [1, 1, 1], progress=False)


def test_data_directory_refuses_another_target(story_data, loaded):
    _, _, _, directory = story_data
    with pytest.raises(ValueError, match="other settings"):
        build_dataset(loaded("llama"), ["Once upon a time"], directory, max_tokens=64)


def test_eagle1_cross_entropy_reads_its_draft_vocabulary_rows(story_data):
    target = story_data[0]
    vocab = torch.tensor([3, 10, 50, 200])
    full, rows = FrozenTarget(target, torch.device("cpu")), FrozenTarget(target, torch.device("cpu"), vocab)
    hidden = torch.randn(2, 5, target.model.spec.hidden_size)
    assert rows.logits(hidden).shape[-1] == 4
    torch.testing.assert_close(rows.logits(hidden), full.logits(hidden)[..., vocab])
    assert rows.labels(torch.tensor([10, 11, 200])).tolist() == [1, -100, 3]
    assert full.labels(torch.tensor([10, 11])).tolist() == [10, 11]


def test_block_loss_takes_a_window_without_a_label_of_its_own(story_data):
    """A window whose labels are all the prompt's (none the target's) draws its anchors anywhere, position 0
    included: the loss is 0 there, and a window beside it still trains."""
    from specserve.speculative.dflash import new_dflash
    from specserve.train.blocks import block_loss

    target = story_data[0]
    spec = target.model.spec
    drafter = new_dflash(spec, 1, 4, 0, 1.0)
    b, length = 2, 12
    tokens = torch.randint(1, spec.vocab_size, (b, length), generator=torch.Generator().manual_seed(0))
    valid = torch.zeros(b, length, dtype=torch.bool)
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "valid": valid,
             "aux": torch.randn(b, length, 3 * spec.hidden_size)}
    frozen = FrozenTarget(target, torch.device("cpu"))
    loss, _ = block_loss(drafter, frozen, batch, 64, torch.Generator().manual_seed(0))
    assert float(loss.detach()) == 0.0
    valid[1, 2:] = True
    loss, _ = block_loss(drafter, frozen, batch, 64, torch.Generator().manual_seed(0))
    assert float(loss.detach()) > 0.0
    loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
