"""The command line: JSON output, model.yaml, the bench contract, and clear errors (exit 2, no traceback)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from specserve.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_generate_json(checkpoint):
    result = invoke("generate", "def fibonacci(n):", "--model", checkpoint("llama"), "--method", "ngram",
                    "--max-tokens", 16, "--dtype", "float32", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["method"] == "ngram" and isinstance(payload["text"], str)
    for key in ("total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate", "acceptance_length",
                "time_to_first_token_s", "tokens_per_s"):
        assert key in payload["metrics"]


def test_generate_chat_asks_the_prompt_through_the_chat_template(checkpoint, tmp_path):
    from specserve.cli import chat_turn, deployment_config
    from specserve.config import build_engine
    from specserve.speculative.sampling import SamplingParams
    from tests.conftest import build_tokenizer, make_checkpoint

    question = "What is ML?"
    engine = build_engine(deployment_config(checkpoint("llama"), None, None, None, None, None, "float32"))
    ids = chat_turn(engine, question)
    assert engine.tokenizer.decode(ids) == f"<s>user: {question}\nassistant:"  # the tiny models' transcript format
    expected = engine.generate(ids, SamplingParams(max_tokens=12)).text
    result = invoke("generate", question, "--model", checkpoint("llama"), "--dtype", "float32", "--max-tokens", 12,
                    "--chat", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] == expected

    no_template = make_checkpoint(tmp_path / "plain", "llama", tokenizer=build_tokenizer(chat_template=None))
    refused = invoke("generate", question, "--model", no_template, "--dtype", "float32", "--chat")
    assert refused.exit_code == 2 and "no chat template" in refused.output and "Traceback" not in refused.output


def test_generate_from_model_yaml_equals_plain(checkpoint, tmp_path):
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text(f"model: {checkpoint('qwen3')}\ndtype: float32\nspeculative_config:\n"
                         f"  decoding_type: Draft_Target\n  max_draft_len: 3\n"
                         f"  speculative_model: {checkpoint('qwen3', 1)}\n")
    spec = json.loads(invoke("generate", "Once upon a time", "--model", yaml_file, "--max-tokens", 20,
                             "--json").stdout)
    plain = json.loads(invoke("generate", "Once upon a time", "--model", checkpoint("qwen3"), "--dtype", "float32",
                              "--max-tokens", 20, "--json").stdout)
    assert spec["method"] == "draft_target" and plain["method"] == "ar"
    assert spec["text"] == plain["text"]
    assert spec["metrics"]["total_draft_tokens"] > 0


def test_bench_chat_asks_each_prompt_as_the_chat_endpoint_does(checkpoint, tmp_path, monkeypatch):
    """--chat hands every runner the chat template's text of each prompt, whose ids are those /v1/chat/completions
    makes (the template writes the BOS the tokenizer adds: one BOS, not two)."""
    from specserve.bench import offline
    from specserve.cli import chat_turn, deployment_config
    from specserve.config import build_engine
    from specserve.models.chat_template import chat_texts

    question = "What is ML?"
    engine = build_engine(deployment_config(checkpoint("llama"), None, None, None, None, None, "float32"))
    [text] = chat_texts(engine.tokenizer, [question])
    assert engine.tokenizer(text).input_ids == chat_turn(engine, question)
    seen, run_bench = [], offline.run_bench
    monkeypatch.setattr(offline, "run_bench", lambda config, target, prompts, *rest: seen.extend(prompts) or
                        run_bench(config, target, prompts, *rest))
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"turns": [question]}) + "\n")
    result = invoke("bench", "--dataset", data, "--methods", "ar,ngram", "--chat", "--max-tokens", 6, "--model",
                    checkpoint("llama"), "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert seen == [text]


def test_bench_writes_the_contract(checkpoint, tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text('{"turns": ["def add(a, b):"]}\n{"text": "Once upon a time"}\n')
    out = tmp_path / "not-yet" / "bench.json"  # missing folders are made
    result = invoke("bench", "--dataset", data, "--methods", "ar,ngram,hf,hf-pld", "--num-prompts", 2,
                    "--max-tokens", 12, "--model", checkpoint("llama"), "--dtype", "float32", "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"ar", "ngram", "hf", "hf-pld"}
    for name, row in report["methods"].items():
        assert set(row) >= {"tokens_per_s", "acceptance_length", "acceptance_rate", "speedup_vs_ar",
                            "outputs_equal_ar"}
        assert row["tokens_per_s"] > 0
    assert report["methods"]["ngram"]["outputs_equal_ar"] is True
    assert report["methods"]["hf"]["outputs_equal_ar"] is True  # transformers agrees with plain decoding


def test_bench_and_generate_eagle_with_the_lookup_branch(loaded, checkpoint, tmp_path):
    from tests.speculative.test_eagle import save_random
    head = save_random(loaded("llama"), "eagle3", tmp_path / "head")
    data = tmp_path / "q.jsonl"
    data.write_text('{"text": "def add(a, b):\\n    return add(a, b)\\ndef add("}\n')
    out = tmp_path / "bench.json"
    result = invoke("bench", "--dataset", data, "--methods", "eagle3,Eagle3+prompt_lookup", "--head",
                    f"eagle3={head}", "--max-tokens", 12, "--model", checkpoint("llama"), "--dtype", "float32",
                    "--json", out)
    assert result.exit_code == 0, result.output
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"ar", "eagle3", "eagle3+ngram"}  # the +ngram run found eagle3's head
    assert methods["eagle3+ngram"]["outputs_equal_ar"] is True
    result = invoke("generate", "def add(a, b):", "--model", checkpoint("llama"), "--dtype", "float32",
                    "--method", "eagle3+ngram", "--draft-model", head, "--max-tokens", 8, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["method"] == "eagle3+ngram"


def test_bench_tree_costs_time_each_tree_size_at_each_depth(loaded, checkpoint, tmp_path):
    from specserve.bench.offline import TREE_DEPTHS, TREE_SIZES, TREE_WIDTH
    from tests.speculative.test_eagle import save_random
    head = save_random(loaded("llama"), "eagle3", tmp_path / "head")
    data = tmp_path / "q.jsonl"
    data.write_text('{"text": "def add(a, b):"}\n')
    out = tmp_path / "bench.json"
    result = invoke("bench", "--dataset", data, "--methods", "eagle3", "--head", f"eagle3={head}", "--max-tokens", 4,
                    "--model", checkpoint("llama"), "--dtype", "float32", "--tree-costs", "--json", out)
    assert result.exit_code == 0, result.output
    costs = json.loads(out.read_text())["step_ms_by_tree_nodes"]["eagle3"]
    assert costs["plain"] > 0
    assert list(costs["levels"]) == [str(depth) for depth in TREE_DEPTHS]
    assert list(costs["levels"]["1"]) == [str(size) for size in TREE_SIZES if size <= TREE_WIDTH]  # one level: 8
    assert list(costs["levels"]["6"]) == [str(size) for size in TREE_SIZES]
    # a tree of one node is one level deep however deep the others go: timed once
    assert len({row["1"] for row in costs["levels"].values()}) == 1
    assert all(ms > 0 for row in costs["levels"].values() for ms in row.values())
    assert "3 levels deep: 1:" in result.output


def test_mismatched_draft_tokenizer_is_an_error(checkpoint, tmp_path):
    from transformers import AutoTokenizer

    from tests.conftest import make_checkpoint
    other = AutoTokenizer.from_pretrained(checkpoint("llama"))
    other.add_tokens(["<extra_token>"])
    draft = make_checkpoint(tmp_path / "draft", "llama", 3, other)
    result = invoke("generate", "hi", "--model", checkpoint("llama"), "--method", "draft_target",
                    "--draft-model", draft, "--json")
    assert result.exit_code == 2 and "tokenizer" in result.output


@pytest.mark.parametrize("args,needle", [
    (["generate", "", "--max-tokens", 4], "non-empty"),
    (["generate", "hi", "--max-tokens", 0], "max_tokens"),
    (["generate", "hi", "--max-tokens", 100000], "context"),
    (["generate", "hi " * 700, "--max-tokens", 4], "context"),
    (["generate", "hi", "--temperature", -1], "temperature"),
    (["generate", "hi", "--method", "telepathy"], "telepathy"),
    (["generate", "hi", "--method", "draft_target"], "speculative_model"),
    (["generate", "hi", "--method", "ngram+ngram"], "'+ngram' follows eagle"),
])
def test_bad_input_exits_2_with_a_message(checkpoint, args, needle):
    result = invoke(*args, "--model", checkpoint("llama"), "--dtype", "float32")
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output


def test_bad_models_exit_2(tmp_path):
    missing = invoke("generate", "hi", "--model", tmp_path / "nope")
    assert missing.exit_code == 2 and "not found" in missing.output
    (tmp_path / "empty").mkdir()
    empty = invoke("generate", "hi", "--model", tmp_path / "empty")
    assert empty.exit_code == 2 and "config.json" in empty.output
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    assert invoke("generate", "hi", "--model", broken).exit_code == 2
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text('{"model_type": "gpt2"}')
    result = invoke("generate", "hi", "--model", unsupported)
    assert result.exit_code == 2 and "gpt2" in result.output
    bad_yaml = tmp_path / "model.yaml"
    bad_yaml.write_text("model: x\nspeculative_config:\n  decoding_type: NGram\n  bogus_key: 1\n")
    result = invoke("generate", "hi", "--model", bad_yaml)
    assert result.exit_code == 2 and "bogus_key" in result.output


def test_bench_bad_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    result = invoke("bench", "--dataset", tmp_path / "empty.jsonl", "--model", tmp_path)
    assert result.exit_code == 2 and "no prompts" in result.output


def test_bench_refuses_an_unwritable_result_file_before_running(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"text": "hi"}\n')
    result = invoke("bench", "--dataset", tmp_path / "q.jsonl", "--model", tmp_path / "no-model", "--json", tmp_path)
    assert result.exit_code == 2 and "cannot write" in result.output


def test_bench_llamacpp_methods_say_what_they_need(checkpoint):
    """llama.cpp peers need llama-cpp-python and a GGUF file: a tiny HF checkpoint gets a clear error, not a crash."""
    from specserve.bench.offline import run_bench
    from specserve.config import ConfigError, DeploymentConfig, ModelConfig
    from specserve.models.loader import load_model

    target = load_model(checkpoint("llama"), dtype=torch.float32)
    with pytest.raises(ConfigError, match="llama-cpp-python|GGUF models only"):
        run_bench(DeploymentConfig(ModelConfig(checkpoint("llama"))), target, ["def f():"], ["ar", "llamacpp"], 4)


def test_bench_native_llamacpp_says_what_it_needs(checkpoint, monkeypatch, tmp_path):
    from specserve.bench.native_llamacpp import SERVER_ENV
    from specserve.bench.offline import run_bench
    from specserve.config import ConfigError, DeploymentConfig, ModelConfig
    from specserve.models.loader import load_model

    target = load_model(checkpoint("llama"), dtype=torch.float32)
    config = DeploymentConfig(ModelConfig(checkpoint("llama")))
    with pytest.raises(ConfigError, match="GGUF models only"):
        run_bench(config, target, ["def f():"], ["ar", "llamacpp-native"], 4)
    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "no-such-llama-server"))
    from specserve.bench import native_llamacpp

    with pytest.raises(ConfigError, match="python -m specserve.bench.native_llamacpp"):
        native_llamacpp.native_runner(replace(target, gguf=tmp_path / "m.gguf"), "def f():", 4)


@pytest.mark.parametrize("amx,crashes,builds", [(True, True, 2), (True, False, 1), (False, True, 1)])
def test_a_native_build_that_crashes_on_amx_is_built_again_without_it(amx, crashes, builds, monkeypatch, tmp_path):
    """Where the first build's llama-bench crashes and the CPU has AMX, the tools are built again with ggml's AMX
    backend compiled out; a build that runs, or a CPU without AMX, is built once."""
    from specserve.bench import native_llamacpp

    flags = []
    monkeypatch.setattr(native_llamacpp, "compile_tools", lambda source, build, jobs, extra=(): (
        build.mkdir(exist_ok=True), flags.append(extra)))
    monkeypatch.setattr(native_llamacpp, "runs", lambda binary: not crashes)
    monkeypatch.setattr(native_llamacpp, "cpu_has_amx", lambda: amx)
    uses_amx = native_llamacpp.compile_working_tools(tmp_path, tmp_path / "build", 2)
    assert len(flags) == builds and uses_amx == (amx and not crashes)
    if builds == 2:
        assert flags[1] == (f"-DCMAKE_C_FLAGS={native_llamacpp.NO_AMX}", f"-DCMAKE_CXX_FLAGS={native_llamacpp.NO_AMX}")


def test_native_llamacpp_runner_times_by_llamacpps_own_timings():
    """Each request's seconds are llama.cpp's prompt_ms + predicted_ms; decode and prefill rates apart."""
    from specserve.bench.native_llamacpp import NativeRunner

    class Server:
        sent: list = []

        def complete(self, ids, max_tokens):
            self.sent.append((ids, max_tokens))
            return {"tokens": [7, 8, 9], "timings": {"prompt_n": len(ids), "prompt_ms": 20.0, "predicted_n": 4,
                                                     "predicted_ms": 80.0}}

        def close(self):
            self.closed = True

    server = Server()
    runner = NativeRunner(server, lambda text: type("Ids", (), {"input_ids": [1] + [ord(c) for c in text]})(),
                          "warm", 4)
    runner.step("ab")
    runner.step("abcd")
    run = runner.finish()
    assert server.sent[1:] == [([1, 97, 98], 4), ([1, 97, 98, 99, 100], 4)] and server.closed
    assert run.outputs == [[7, 8, 9]] * 2 and run.output_tokens == 8 and run.seconds == pytest.approx(0.2)
    assert run.method_state["decode_tokens_per_s"] == pytest.approx(50.0)
    assert run.method_state["prefill_tokens_per_s"] == pytest.approx(8 / 0.04)


def test_kernels_off_runs_without_the_compiled_kernels(checkpoint, monkeypatch):
    from specserve.models import cpu_kernels

    monkeypatch.setenv(cpu_kernels.ENV, "auto")  # the flag sets it for the process: put back after the test
    result = invoke("--kernels", "off", "generate", "def fibonacci(n):", "--model", checkpoint("llama"),
                    "--max-tokens", 8, "--json")
    assert result.exit_code == 0, result.output
    assert 1 <= json.loads(result.stdout)["metrics"]["output_tokens"] <= 8
    bad = invoke("--kernels", "avx9000", "generate", "x", "--model", checkpoint("llama"))
    assert bad.exit_code == 2 and "not one of auto, off" in bad.output


def test_bench_methods_take_turns_prompt_by_prompt(checkpoint, monkeypatch):
    """Every method answers a prompt before the next prompt starts, so a drift in the machine's speed during a run
    moves every method alike."""
    from specserve.bench import offline
    from specserve.config import DeploymentConfig, ModelConfig
    from specserve.models.loader import load_model

    calls = []
    step = offline.EngineRunner.step
    monkeypatch.setattr(offline.EngineRunner, "step", lambda self, prompt: (calls.append((id(self), prompt)),
                                                                          step(self, prompt)))
    target = load_model(checkpoint("llama"), dtype=torch.float32)
    prompts = ["def f(x):", "Once upon a time", "a b a b a b"]
    results = offline.run_bench(DeploymentConfig(ModelConfig(checkpoint("llama"))), target, prompts, ["ar", "ngram"], 8)
    assert [prompt for _, prompt in calls] == [p for p in prompts for _ in range(2)]
    assert len({runner for runner, _ in calls[:2]}) == 2 and calls[0][0] == calls[2][0]
    assert results["ngram"]["outputs_equal_ar"] and results["ngram"]["total_output_tokens"] > 0


def test_roofline_counts_the_weights_a_step_reads(checkpoint):
    from specserve.bench.offline import roofline, streamed_weight_bytes
    from specserve.models.loader import load_model

    dense = load_model(checkpoint("llama"), dtype=torch.float32)
    packed = load_model(checkpoint("llama"), dtype=torch.float32, quantization="int4")
    spec = dense.model.spec
    embedding = spec.vocab_size * spec.hidden_size * 4
    assert streamed_weight_bytes(dense.model) == sum(p.numel() * 4 for p in dense.model.parameters()) - embedding
    assert streamed_weight_bytes(packed.model) < streamed_weight_bytes(dense.model) / 3
    report = roofline(dense.model, rounds=3, megabytes=64)
    assert report["read_gb_per_s"] > 0 and report["plain_step_ms"] > 0
    # the reported pair's own ratio, within the range of the pairs
    assert report["step_over_roofline"] == pytest.approx(report["plain_step_ms"] / report["roofline_ms"], rel=0.01)
    low, high = report["ratio_range"]
    assert low <= report["step_over_roofline"] <= high
