"""OpenAI request fields -> SamplingParams and exceptions -> error objects, without a server."""

from __future__ import annotations

import pytest

from specserve.engine.engine import RequestError
from specserve.server.errors import InputError
from specserve.server.openai.fields import parse_common
from specserve.server.openai.protocol import build_params, exception_body
from specserve.server.runner import QueueFullError


def test_default_max_tokens_per_endpoint():
    fields = parse_common({"temperature": 0}, chat=False)
    assert build_params(fields, 10, 512, chat=False).max_tokens == 16
    assert build_params(parse_common({}, chat=True), 10, 512, chat=True).max_tokens == 502
    assert build_params(parse_common({}, chat=True), 10, 4096, chat=True).max_tokens == 2048
    chat = parse_common({"max_completion_tokens": 7, "max_tokens": 3}, chat=True)
    assert build_params(chat, 10, 512, chat=True).max_tokens == 7


def test_fields_refused_name_their_param():
    with pytest.raises(InputError) as info:
        parse_common({"n": 0}, chat=False)
    assert info.value.param == "n"
    with pytest.raises(InputError) as info:
        build_params(parse_common({"max_tokens": 8, "min_tokens": 2}, chat=False), 1, 512, chat=False)
    assert info.value.param == "min_tokens"


@pytest.mark.parametrize("body,param", [
    ({"user": 5}, "user"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stream": True, "stream_options": {"include_usage": "false"}}, "include_usage"),  # was read as true
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "continuous_usage_stats"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"stop": [1]}, "stop"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 17}, "n"),
    ({"logprobs": 3}, "logprobs"),
])
def test_fields_of_a_wrong_type_or_range_name_their_param(body, param):
    with pytest.raises(InputError) as info:
        parse_common(body, chat=True)
    assert info.value.param == param


@pytest.mark.parametrize("exc,code,kind,param,message", [
    (QueueFullError("Exceeds maximum queue size"), 429, "RateLimitError", None, "The server is busy"),
    (RequestError("temperature must be >= 0, got -1"), 400, "BadRequestError", "temperature", "temperature"),
    (RequestError("prompt has 900 tokens; the context is 512 tokens"), 400, "BadRequestError", None, "prompt"),
    (InputError("The model `x` does not exist.", "model", 404), 404, "NotFoundError", "model", "The model"),
    (RuntimeError("boom"), 500, "InternalServerError", None, "internal error: boom"),
])
def test_exceptions_become_error_objects(exc, code, kind, param, message):
    error = exception_body(exc)["error"]
    assert (error["code"], error["type"], error["param"]) == (code, kind, param)
    assert error["message"].startswith(message)
