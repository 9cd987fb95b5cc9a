"""Every input a Triton model declares, and every field of the OpenAI request bodies, given a value of the wrong
type: a 400 whose error names it, and the server serves the next request."""

from __future__ import annotations

import json

import pytest

from specserve.server.openai.fields import ChatFields, CompletionFields
from specserve.server.repository import ENSEMBLE, LLMAPI, VLLM
from specserve.server.triton.schema import INPUTS

WRONG = {"BOOL": "maybe", "INT32": "abc", "UINT64": "abc", "FP32": "hot", "BYTES": {"an": "object"}}
MODELS = {LLMAPI: "tensorrt_llm", VLLM: "eagle_model", ENSEMBLE: "ensemble"}
CASES = [(style, tensor.name, tensor.datatype) for style, tensors in INPUTS.items() for tensor in tensors]


@pytest.mark.parametrize("style,name,datatype", CASES, ids=[f"{s}-{n}" for s, n, _ in CASES])
def test_each_triton_input_of_the_wrong_type_is_a_400_naming_it(server, style, name, datatype):
    body = {"text_input": "def add(a, b):", "max_tokens": 2} if style == ENSEMBLE else {"text_input": "def add(a, b):"}
    body[name] = WRONG[datatype]
    r = server.http.post(f"/v2/models/{MODELS[style]}/generate", content=json.dumps(body))
    assert r.status_code == 400, (name, r.text)
    assert name in r.json()["error"], r.json()
    good = {"text_input": "def add(a, b):", "max_tokens": 2}
    assert server.http.post(f"/v2/models/{MODELS[style]}/generate", content=json.dumps(good)).status_code == 200


OBJECT = {"an": "object"}
BODY_FIELDS = ["model", "response_format", "structured_outputs"]  # read outside the sampling fields' model
OPENAI_CASES = ([("completions", f) for f in [*CompletionFields.model_fields, *BODY_FIELDS, "prompt"]]
                + [("chat/completions", f) for f in [*ChatFields.model_fields, *BODY_FIELDS, "messages", "tools",
                                                     "tool_choice"]])
# a value of the wrong type for each: an object, except where the field takes one (then text)
WRONG_OPENAI = {"logit_bias": "abc", "stream_options": "abc", "response_format": "abc", "tools": "abc",
                "structured_outputs": "abc"}


@pytest.mark.parametrize("endpoint,field", OPENAI_CASES, ids=[f"{e}-{f}" for e, f in OPENAI_CASES])
def test_each_openai_field_of_the_wrong_type_is_a_400_naming_it(server, endpoint, field):
    body = {"model": "tensorrt_llm", "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if endpoint.startswith("chat") else {"prompt": "hi"})
    body[field] = WRONG_OPENAI.get(field, OBJECT)
    r = server.http.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == 400, (field, r.text)
    error = r.json()["error"]
    assert field in (error.get("param") or "") or field in error["message"], error
    assert server.http.post("/v1/completions", json={"model": "tensorrt_llm", "prompt": "hi",
                                                     "max_tokens": 2}).status_code == 200
