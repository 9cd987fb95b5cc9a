"""Per-request speculation controls over HTTP (`num_speculative_tokens`, `suffix_cache`) on OpenAI and Triton
generate routes, their errors in each route's format, and the operator's `--suffix-cache-scope`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specserve.cli import app
from specserve.server.app import build_repository
from specserve.server.repository import ModelRepository

from .conftest import start_server

PROMPTS = iter(f"Story {i}: once upon a time there was a dog" for i in range(100))


@pytest.fixture(scope="module")
def suffix_server(tmp_path_factory, checkpoint):
    """`shared`: suffix decoding with the model-wide cache; `private`: the same with scope request."""
    root = tmp_path_factory.mktemp("suffix_repo")
    for name, scope in (("shared", "model"), ("private", "request")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.yaml").write_text(
            f"model: {checkpoint('llama')}\ndtype: float32\nspeculative_config:\n  decoding_type: Suffix\n"
            f"  max_draft_len: 4\n  adaptive_draft_len: false\n  suffix_cache_scope: {scope}\n"
            "triton_config:\n  max_batch_size: 0\n  decoupled: false\n")
    running = start_server(ModelRepository.from_directory(root))
    yield running
    running.close()


def generate(server, model: str, prompt: str, **fields) -> dict:
    r = server.http.post(f"/v2/models/{model}/generate", json={
        "text_input": prompt, "max_tokens": 24, "ignore_eos": True, "return_perf_metrics": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def drafted(body: dict) -> tuple[int, int]:
    return int(body["total_draft_tokens"]), int(body["total_accepted_draft_tokens"])


def test_a_repeated_request_is_drafted_from_the_shared_cache_unless_isolated(suffix_server):
    prompt = next(PROMPTS)
    first, second = (generate(suffix_server, "shared", prompt) for _ in range(2))
    assert first["text_output"] == second["text_output"]
    assert drafted(second)[1] > drafted(first)[1]  # the first response drafted the second
    prompt = next(PROMPTS)
    alone, again = (generate(suffix_server, "private", prompt) for _ in range(2))
    assert drafted(again) == drafted(alone)  # scope request: nothing learnt from the first
    prompt = next(PROMPTS)
    out, back = (generate(suffix_server, "shared", prompt, suffix_cache=False) for _ in range(2))
    assert drafted(back) == drafted(out)  # opted out: neither cached nor drafted from the cache


@pytest.mark.parametrize("cap", [0, 1])
def test_triton_num_speculative_tokens_caps_the_drafts(suffix_server, cap):
    prompt = next(PROMPTS)
    generate(suffix_server, "shared", prompt)
    capped = generate(suffix_server, "shared", prompt, num_speculative_tokens=cap)
    assert drafted(capped)[0] <= 24 * cap and (cap > 0 or drafted(capped) == (0, 0))
    uncapped = generate(suffix_server, "shared", prompt)
    assert capped["text_output"] == uncapped["text_output"]
    assert drafted(uncapped)[1] > drafted(capped)[1]


def draft_tokens_counted(server, model: str) -> float:
    lines = [line for line in server.metrics_text().splitlines()
             if line.startswith("vllm:spec_decode_num_draft_tokens_total") and f'"{model}"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_openai_num_speculative_tokens_zero_turns_speculation_off(suffix_server):
    prompt = next(PROMPTS)
    body = {"model": "shared", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    first = suffix_server.http.post("/v1/completions", json=body).json()
    before = draft_tokens_counted(suffix_server, "shared")
    off = suffix_server.http.post("/v1/completions", json={**body, "num_speculative_tokens": 0}).json()
    assert draft_tokens_counted(suffix_server, "shared") == before
    assert off["choices"][0]["text"] == first["choices"][0]["text"]
    suffix_server.http.post("/v1/completions", json={**body, "num_speculative_tokens": 2})
    assert draft_tokens_counted(suffix_server, "shared") > before


@pytest.mark.parametrize("field, value", [("num_speculative_tokens", -1), ("num_speculative_tokens", 1.5),
                                          ("num_speculative_tokens", "4"), ("suffix_cache", "yes")])
def test_openai_bad_fields_are_400_naming_the_field(suffix_server, field, value):
    r = suffix_server.http.post("/v1/chat/completions", json={
        "model": "shared", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("field, value", [("num_speculative_tokens", -1), ("num_speculative_tokens", 2.5),
                                          ("num_speculative_tokens", "many"), ("suffix_cache", "maybe")])
def test_triton_bad_fields_are_400(suffix_server, field, value):
    r = suffix_server.http.post("/v2/models/shared/generate", json={"text_input": "hi", "max_tokens": 4,
                                                                    field: value})
    assert r.status_code == 400 and field in r.json()["error"]


def test_the_scope_flag_reaches_suffix_models_only(tmp_path, checkpoint):
    model = tmp_path / "model.yaml"
    model.write_text(f"model: {checkpoint('llama')}\ndtype: float32\nspeculative_config:\n"
                     "  decoding_type: Suffix\n  max_draft_len: 4\n")
    repository = build_repository(None, str(model), method_settings={"suffix_cache_scope": "request"})
    try:
        assert not repository.load_all()
        engine = repository.ready_models()[0].engine
        assert engine.method.cache_scope == "request"
    finally:
        repository.close()
    result = CliRunner().invoke(app, ["serve", "--model", str(model), "--suffix-cache-scope", "global"])
    assert result.exit_code == 2 and "--suffix-cache-scope must be model or request" in result.output
