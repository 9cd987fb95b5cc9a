"""Every exception a client can cause or meet, mapped once to its HTTP status and to the failure reason the
metrics count (`nv_inference_request_failure{reason=...}`). Both front ends use this table; each writes the error
in its own format (Triton `{"error": "..."}`, OpenAI `{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

import asyncio

from specserve.parallel.group import TensorParallelError
from specserve.server.repository import ModelNotFoundError, ModelNotReadyError, RepositoryError
from specserve.server.runner import QueueFullError, RequestCancelledError, RunnerClosedError, RunnerError


class InputError(ValueError):
    """A request refused before it reaches the runner (a bad body or field: 400, or OpenAI's model lookup: 404 /
    503); `param` names the field (OpenAI's `error.param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


class UnsupportedError(Exception):
    """A request for a Triton feature specserve does not implement (501)."""


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads the response

# (exception type, HTTP status, failure reason); the first row the exception is an instance of applies.
# Status None: the exception's own `.status`.
ERRORS: tuple[tuple[type[BaseException], int | None, str], ...] = (
    (ClientDisconnected, CLIENT_CLOSED, "CANCELED"),
    (asyncio.CancelledError, CLIENT_CLOSED, "CANCELED"),  # the task serving a gone client was cancelled
    (GeneratorExit, CLIENT_CLOSED, "CANCELED"),  # an event stream closed by its client
    (InputError, None, "OTHER"),
    (QueueFullError, 503, "REJECTED"),
    (RequestCancelledError, 400, "CANCELED"),  # Triton answers CANCELLED with 400
    (RunnerClosedError, 503, "OTHER"),  # the model is unloading
    (RunnerError, 500, "BACKEND"),
    (ModelNotFoundError, 404, "OTHER"),
    (ModelNotReadyError, 503, "OTHER"),
    (TensorParallelError, 503, "BACKEND"),  # a rank of a tensor-parallel model failed: the model is not ready
    (RepositoryError, 400, "OTHER"),  # a failed load or unload
    (UnsupportedError, 501, "OTHER"),
    (ValueError, 400, "OTHER"),  # the engine's RequestError (bad parameters, prompt too long)
)
UNEXPECTED_STATUS, UNEXPECTED_REASON = 500, "BACKEND"  # anything else: the engine or the server failed
OPENAI_STATUS = {QueueFullError: 429}  # OpenAI clients back off and retry on 429 (rate limited), not on 503


def _row(exc: BaseException) -> tuple[type[BaseException], int | None, str] | None:
    return next((row for row in ERRORS if isinstance(exc, row[0])), None)


def is_expected(exc: BaseException) -> bool:
    """Whether the exception is in the table: its message is meant for the client as it is."""
    return _row(exc) is not None


def http_status(exc: BaseException, openai: bool = False) -> int:
    row = _row(exc)
    if row is None:
        return UNEXPECTED_STATUS
    if openai and type(exc) in OPENAI_STATUS:
        return OPENAI_STATUS[type(exc)]
    return exc.status if row[1] is None else row[1]


def failure_reason(exc: BaseException) -> str:
    row = _row(exc)
    return UNEXPECTED_REASON if row is None else row[2]
