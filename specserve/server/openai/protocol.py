"""The OpenAI request and response formats for /v1/completions and /v1/chat/completions: request fields ->
prompt and SamplingParams (the shared sampling fields typed in fields.py), the response and stream-chunk bodies,
and errors as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import dataclasses

from starlette.responses import Response

from specserve.engine.engine import RequestError
from specserve.server.errors import CLIENT_CLOSED, InputError, http_status, is_expected
from specserve.server.http import json_response, sse
from specserve.server.openai.fields import CommonFields
from specserve.server.openai.messages import chat_prompt
from specserve.server.repository import ModelNotReadyError, RepositoryError, ServedModel
from specserve.server.request import ServerContext, sampling_params
from specserve.server.runner import QueueFullError
from specserve.speculative.sampling import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
DEFAULT_CHAT_MAX_TOKENS_CAP = 2048  # chat default: the rest of the context, at most this
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 429: "RateLimitError",
               500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}
QUEUE_FULL_MESSAGE = "The server is busy: the request queue is full; retry later"
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


# ------------------------------------------------------------------------------------------------------------------
# errors


def error_json(message: str, status: int = 400, param: str | None = None) -> Response:
    return json_response(error_body(message, status, param), status)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"), "param": param,
                      "code": status}}


def error_response(exc: BaseException) -> Response:
    status = http_status(exc, openai=True)
    if status == CLIENT_CLOSED:
        return Response(status_code=status)
    return json_response(exception_body(exc), status)


def exception_body(exc: BaseException) -> dict:
    """The error object for an exception (also sent in-band when a stream fails)."""
    if isinstance(exc, QueueFullError):
        message = QUEUE_FULL_MESSAGE
    else:
        message = str(exc) if is_expected(exc) else f"internal error: {exc}"
    return error_body(message, http_status(exc, openai=True), _param(exc))


def _param(exc: BaseException) -> str | None:
    """The request field an error is about: named by the front end, or the SamplingParams field the engine's check
    names first."""
    if isinstance(exc, InputError):
        return exc.param
    if isinstance(exc, RequestError):
        word = str(exc).split(" ", 1)[0]
        return word if word in SAMPLING_FIELDS else None
    return None


# ------------------------------------------------------------------------------------------------------------------
# requests


def build_params(fields: CommonFields, prompt_len: int, max_model_len: int, chat: bool,
                 format_stop: tuple[str, ...] = ()) -> SamplingParams:
    """The request's SamplingParams; without max_tokens: 16 for completions, the rest of the context (at most
    2048) for chat. `format_stop`: the chat format's own stop strings, besides the request's."""
    max_tokens = fields.max_tokens
    if max_tokens is None:
        remaining = max_model_len - prompt_len
        max_tokens = min(max(remaining, 1), DEFAULT_CHAT_MAX_TOKENS_CAP) if chat else DEFAULT_COMPLETION_MAX_TOKENS
    return sampling_params(max_tokens=max_tokens, temperature=fields.temperature, top_p=fields.top_p,
                           top_k=fields.top_k, seed=fields.seed, stop=fields.stop + list(format_stop),
                           stop_token_ids=fields.stop_token_ids, ignore_eos=fields.ignore_eos,
                           min_tokens=fields.min_tokens, logprobs=fields.logprobs,
                           prompt_logprobs=fields.prompt_logprobs,
                           num_speculative_tokens=fields.num_speculative_tokens, suffix_cache=fields.suffix_cache,
                           guide=fields.guide)


def read_prompt(body: dict, engine, chat: bool, max_messages: int, chat_template: str | None = None,
                tools: list[dict] | None = None) -> tuple[str | list[int], list[int], str]:
    """(prompt for the runner, its token ids, the text to echo before the completion: None where it is the token
    ids' text, which the caller decodes once the runner checked them); `chat_template` is the server's override of
    the model's own, `tools` the functions the template is shown."""
    if chat:
        ids = chat_prompt(body, engine, max_messages, chat_template, tools)
        return ids, ids, ""
    prompt, ids, text = completion_prompt(body, engine)
    return prompt, ids, text if body.get("echo") else ""  # a flag: parse_common checked it


def completion_prompt(body: dict, engine) -> tuple[str | list[int], list[int], str | None]:
    """prompt (str | [str] | [int] | [[int]], one prompt) -> (prompt for the runner, token ids, text to echo: None
    for token ids, whose range the runner checks)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InputError("prompt must be a non-empty string", param="prompt")
        ids = engine.encode(prompt)
        return ids, ids, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt, prompt, None
    if isinstance(prompt, list) and len(prompt) > 1:
        raise InputError("batched prompts are not supported: send one prompt per request", param="prompt")
    raise InputError("prompt must be a string or a list of token ids", param="prompt")


def check_unsupported(body: dict, chat: bool) -> None:
    """Refuse completions' tools and suffix (chat's tools: `tools.parse_tools`; structured outputs:
    `guides.openai_guide`)."""
    if not chat and (body.get("tools") or body.get("tool_choice") not in (None, "none", "auto")):
        raise InputError("tools are taken by /v1/chat/completions, not /v1/completions",
                         param="tools" if body.get("tools") else "tool_choice")
    if not chat and body.get("suffix"):
        raise InputError("'suffix' is not supported", param="suffix")


# ------------------------------------------------------------------------------------------------------------------


def find_model(ctx: ServerContext, body: dict) -> tuple[ServedModel, str]:
    """The model the request names (the first ready one when it names none) and the name to answer with."""
    name = body.get("model")
    if name is None:
        ready = ctx.repository.ready_models()
        if not ready:
            raise InputError("no model is loaded", status=503)
        return ready[0], ready[0].name
    if not isinstance(name, str):
        raise InputError("'model' must be a string", param="model")
    try:
        return ctx.repository.get(name), name
    except ModelNotReadyError as exc:  # loaded, but it can no longer serve (a tensor-parallel rank failed)
        raise InputError(str(exc), param="model", status=503) from None
    except RepositoryError:
        raise InputError(f"The model `{name}` does not exist.", param="model", status=404) from None


# ------------------------------------------------------------------------------------------------------------------
# responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(chat: bool, index: int, text: str, finish_reason: str, logprobs: dict | None,
           message: dict | None = None) -> dict:
    """One choice of a response that does not stream (`text` includes the echoed prompt; chat: `message`, when
    given, instead of the text as the assistant's content)."""
    if chat:
        return {"index": index, "message": message or {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(meta: dict, chat: bool, choices: list[dict], usage_: dict) -> dict:
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices, "usage": usage_}


def chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def chunk(meta: dict, chat: bool, text: str | None, finish_reason: str | None, role: bool = False,
          extra: dict | None = None, index: int = 0, logprobs: dict | None = None, delta: dict | None = None) -> bytes:
    """One SSE chunk of choice `index`: a text delta (chat: the assistant role first, then content, or the given
    `delta`), or the finish reason."""
    if chat:
        if delta is None:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice_ = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice_ = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return sse({**meta, "object": chunk_object(chat), "choices": [choice_], **(extra or {})})
