"""`specserve train` end to end on a tiny target, and its bad-input errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from specserve.cli import app
from specserve.config import DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine


def test_train_command_writes_a_loadable_head(checkpoint, loaded, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                               ["def add(a, b):", "Once upon a time", "for i in range(3):", "The quick brown fox"]))
    out = tmp_path / "head"
    result = CliRunner().invoke(app, ["train", "eagle3", "--target", checkpoint("llama"), "--prompts", str(prompts),
                                      "--out", str(out), "--steps", "3", "--max-tokens", "8", "--seq-len", "16",
                                      "--batch-size", "2", "--draft-vocab-size", "64", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["kind"] == "eagle3" and report["train_prompts"] == 3 and report["eval"]["prompts"] == 1
    assert report["eval"]["outputs_equal_plain"] == 1
    config = DeploymentConfig(ModelConfig(checkpoint("llama")),
                              speculative=SpeculativeConfig("eagle3", model=str(out), adaptive_draft_len=False))
    assert build_engine(config, loaded("llama")).method.head.config.draft_vocab_size == 64


def test_train_command_refuses_bad_input(tmp_path):
    runner = CliRunner()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = runner.invoke(app, ["train", "eagle3", "--prompts", str(empty), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "empty" in result.output and "Traceback" not in result.output
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n')
    result = runner.invoke(app, ["train", "eagle3", "--prompts", str(broken), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "broken.jsonl:2" in result.output
    result = runner.invoke(app, ["train", "lookahead", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "unknown head kind" in result.output
