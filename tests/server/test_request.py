"""What the front ends share: one SamplingParams builder and one table of statuses and failure reasons."""

from __future__ import annotations

import asyncio

import pytest

from specserve.engine.engine import RequestError
from specserve.server.errors import (ClientDisconnected, InputError, UnsupportedError, failure_reason, http_status,
                                     is_expected)
from specserve.server.repository import ModelNotFoundError, ModelNotReadyError, RepositoryError
from specserve.server.request import sampling_params
from specserve.server.runner import QueueFullError, RequestCancelledError, RunnerClosedError, RunnerError


def test_sampling_params_min_tokens_rule():
    params = sampling_params(max_tokens=4, temperature=0.0, stop=("a",), stop_token_ids=(2,))
    assert (params.max_tokens, params.stop, params.stop_token_ids, params.ignore_eos) == (4, ["a"], [2], False)
    assert sampling_params(max_tokens=4, temperature=0.0, min_tokens=4).ignore_eos
    assert sampling_params(max_tokens=4, temperature=0.0, min_tokens=9).ignore_eos
    with pytest.raises(InputError, match="min_tokens below max_tokens"):
        sampling_params(max_tokens=4, temperature=0.0, min_tokens=3)


@pytest.mark.parametrize("exc,status,openai_status,reason", [
    (ClientDisconnected(), 499, 499, "CANCELED"),
    (asyncio.CancelledError(), 499, 499, "CANCELED"),
    (InputError("bad"), 400, 400, "OTHER"),
    (InputError("no model", status=503), 503, 503, "OTHER"),
    (QueueFullError("full"), 503, 429, "REJECTED"),
    (RequestCancelledError("cancelled"), 400, 400, "CANCELED"),
    (RunnerClosedError("unloading"), 503, 503, "OTHER"),
    (RunnerError("?"), 500, 500, "BACKEND"),
    (ModelNotFoundError("nope"), 404, 404, "OTHER"),
    (ModelNotReadyError("later"), 503, 503, "OTHER"),
    (RepositoryError("failed to load"), 400, 400, "OTHER"),
    (UnsupportedError("no"), 501, 501, "OTHER"),
    (RequestError("prompt is empty"), 400, 400, "OTHER"),
])
def test_every_user_facing_exception_has_a_status_and_reason(exc, status, openai_status, reason):
    assert (http_status(exc), http_status(exc, openai=True), failure_reason(exc)) == (status, openai_status, reason)
    assert is_expected(exc)


def test_anything_else_is_a_backend_failure():
    exc = RuntimeError("the engine failed")
    assert (http_status(exc), failure_reason(exc), is_expected(exc)) == (500, "BACKEND", False)
