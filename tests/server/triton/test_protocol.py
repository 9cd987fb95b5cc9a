"""Triton request inputs -> GenerateRequest, without a server: the three styles' spellings, their defaults, the
min_tokens rule, cancel requests; values are left for the engine to check (validation happens once, at submit)."""

from __future__ import annotations

import pytest

from specserve.server.errors import InputError
from specserve.server.repository import ENSEMBLE, LLMAPI, VLLM, ModelSource, ServedModel
from specserve.server.triton.protocol import (STREAMING_NOT_DECOUPLED, echoes_prompt, flatten_body,
                                              parse_generate)


def model(kind: str = LLMAPI, decoupled: bool = True) -> ServedModel:
    return ServedModel(ModelSource(name=f"{kind}_model", kind=kind, decoupled=decoupled))


def test_three_spellings_of_one_request_agree():
    llmapi = parse_generate({"text_input": "hi", "sampling_param_max_tokens": 5, "sampling_param_temperature": 0.5,
                             "sampling_param_stop": ["x"], "sampling_param_seed": 3}, model(LLMAPI))
    vllm = parse_generate(flatten_body({"text_input": "hi", "parameters": {
        "max_tokens": 5, "temperature": 0.5, "stop": ["x"], "seed": 3}}), model(VLLM))
    ensemble = parse_generate({"text_input": ["hi"], "max_tokens": [5], "temperature": [0.5],
                               "stop_words": [["x"]], "random_seed": [3]}, model(ENSEMBLE))
    assert llmapi.params == vllm.params == ensemble.params
    assert (llmapi.params.max_tokens, llmapi.params.temperature, llmapi.params.stop) == (5, 0.5, ["x"])


def test_style_defaults_and_vllm_sampling_parameters():
    assert parse_generate({"text_input": "hi"}, model(LLMAPI)).params.max_tokens == 32
    vllm = parse_generate({"text_input": "hi", "sampling_parameters": '{"max_tokens": 4, "top_p": 0.5}',
                           "top_p": 0.9}, model(VLLM))
    assert (vllm.params.max_tokens, vllm.params.temperature, vllm.params.top_p) == (4, 1.0, 0.9)
    with pytest.raises(InputError, match="max_tokens"):
        parse_generate({"text_input": "hi"}, model(ENSEMBLE))


def test_min_tokens_rule():
    req = parse_generate({"text_input": "hi", "max_tokens": 8, "min_length": 8}, model(ENSEMBLE))
    assert req.params.ignore_eos
    with pytest.raises(InputError, match="min_tokens below max_tokens"):
        parse_generate({"text_input": "hi", "max_tokens": 8, "min_tokens": 2}, model(ENSEMBLE))


def test_values_are_left_to_the_engine():
    req = parse_generate({"text_input": "hi", "sampling_param_temperature": -1, "max_tokens": 0}, model())
    assert (req.params.temperature, req.params.max_tokens) == (-1.0, 0)


def test_cancel_request_and_streaming_flags():
    cancel = parse_generate({"stop": True}, model(ENSEMBLE), "job-7")
    assert cancel.cancel and cancel.params is None and cancel.request_id == "job-7"
    cumulative = parse_generate({"text_input": "hi", "streaming": True}, model(LLMAPI))
    assert cumulative.stream and cumulative.cumulative and echoes_prompt(cumulative)
    deltas = parse_generate({"text_input": "hi", "stream": True, "stop": ["\n"]}, model(VLLM))
    assert deltas.stream and not deltas.cumulative and not echoes_prompt(deltas) and deltas.params.stop == ["\n"]
    with pytest.raises(InputError, match=STREAMING_NOT_DECOUPLED):
        parse_generate({"text_input": "hi", "stream": True}, model(LLMAPI, decoupled=False))


@pytest.mark.parametrize("values,fragment", [
    ({"text_input": "hi", "exclude": True}, "unexpected inference input 'exclude'"),
    ({"text_input": "hi", "n": 2}, "'n' must be 1"),
    ({"text_input": "hi", "repetition_penalty": 1.2}, "only 1.0"),
    ({"text_input": "hi", "image": "abc"}, "input 'image' is not supported"),
])
def test_refusals_name_the_input(values, fragment):
    with pytest.raises(InputError, match=fragment):
        parse_generate(values, model())
    assert parse_generate({"text_input": "hi", "n": 1, "repetition_penalty": 1.0, "image": "", "pad_id": 2},
                          model()).prompt == "hi"
