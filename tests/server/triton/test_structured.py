"""Structured outputs over Triton generate: TensorRT-LLM's guided_decoding_guide_type / guided_decoding_guide and,
for vLLM models, structured_outputs in sampling_parameters; bad guides are 400s in Triton's error format."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_structured import SCHEMA, matches_schema

PROMPT = "The quick brown fox jumps over the lazy dog. The lazy"


def generate(server, model: str, **inputs):
    return server.http.post(f"/v2/models/{model}/generate", json={
        "text_input": PROMPT, "max_tokens": 80, "temperature": 0, "exclude_input_in_output": True, **inputs})


def test_trtllm_json_schema_with_speculation_equals_plain(server):
    guide = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA)}
    speculative = generate(server, "tensorrt_llm", **guide)
    plain = generate(server, "plain", **guide)
    assert speculative.status_code == 200, speculative.text
    assert speculative.json()["text_output"] == plain.json()["text_output"]
    assert matches_schema(json.loads(speculative.json()["text_output"]))


def test_trtllm_regex_and_grammar(server):
    out = generate(server, "tensorrt_llm", guided_decoding_guide_type="regex",
                   guided_decoding_guide=r"(yes|no), [a-f]{2,6}\.").json()["text_output"]
    assert out.split(", ")[0] in ("yes", "no") and out.endswith(".")
    out = generate(server, "ensemble", guided_decoding_guide_type="ebnf_grammar",
                   guided_decoding_guide='root ::= "up" | "down"').json()["text_output"]
    assert out in ("up", "down")


def test_vllm_structured_outputs(server):
    params = json.dumps({"temperature": 0, "max_tokens": 40, "structured_outputs": {"choice": ["left", "right"]}})
    reply = server.http.post("/v2/models/eagle_model/generate", json={
        "text_input": PROMPT, "sampling_parameters": params, "exclude_input_in_output": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"] in ("left", "right")


@pytest.mark.parametrize("inputs, words", [
    ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{bad"}, "JSON"),
    ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"type": "strin"}'}, "strin"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a(b"}, "regex"),
    ({"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": "root ::= foo"}, "grammar"),
    ({"guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"}, "xml"),
    ({"guided_decoding_guide_type": "regex"}, "needs"),
    ({"guided_decoding_guide": "a"}, "guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a",
      "structured_outputs": json.dumps({"regex": "b"})}, "one structured-output guide"),
])
def test_bad_guides_are_400(server, inputs, words):
    reply = generate(server, "tensorrt_llm", **inputs)
    assert reply.status_code == 400 and words in reply.json()["error"], reply.text
