"""OpenAI-compatible API on the HTTP port: /v1/models, /v1/completions, /v1/chat/completions (+ SSE streaming
ending in `data: [DONE]`, `stream_options.include_usage`), errors as {"error": {message, type, param, code}}."""

from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from specserve.engine.engine import RequestError
from specserve.server.http import (ClientDisconnected, EventStream, RequestStream, ServerContext, json_response,
                                   sse, with_disconnect)
from specserve.server.repository import RepositoryError, ServedModel
from specserve.server.runner import QueueFullError, RunnerError
from specserve.speculative.sampling import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
DEFAULT_CHAT_MAX_TOKENS_CAP = 2048  # chat default: the rest of the context, at most this
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 429: "RateLimitError",
               500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"), "param": param,
                      "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> Response:
    return json_response(error_body(message, status, param), status)


def _from_exception(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, QueueFullError):
        return OpenAIError("The server is busy: the request queue is full; retry later", 429)
    if isinstance(exc, RepositoryError):
        return OpenAIError(str(exc), exc.status)
    if isinstance(exc, RunnerError):
        return OpenAIError(str(exc), exc.status)
    if isinstance(exc, (RequestError, ValueError)):
        return OpenAIError(str(exc), 400)
    return OpenAIError(f"internal error: {exc}", 500)


# ------------------------------------------------------------------------------------------------------------------
# request parsing


def _get(body: dict, key: str, kinds, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    if kinds is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and kinds is not bool:
        raise OpenAIError(f"'{key}' must be of type {kinds.__name__}, got {value!r}", param=key)
    if not isinstance(value, kinds):
        name = kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
        raise OpenAIError(f"'{key}' must be of type {name}, got {value!r}", param=key)
    return value


def _stop_list(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise OpenAIError("'stop' must be a string or a list of strings", param="stop")


def parse_common(body: dict, chat: bool) -> dict:
    """The sampling fields both endpoints share -> keyword arguments (max_tokens may be None: decided later)."""
    n = _get(body, "n", int, 1)
    if n != 1:
        raise OpenAIError("n must be 1: specserve returns one choice per request", param="n")
    if _get(body, "best_of", int, 1) != 1:
        raise OpenAIError("best_of must be 1", param="best_of")
    max_tokens = _get(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    for key in ("presence_penalty", "frequency_penalty"):
        if _get(body, key, float, 0.0) != 0.0:
            raise OpenAIError(f"'{key}' is not supported by specserve (only 0)", param=key)
    if _get(body, "repetition_penalty", float, 1.0) != 1.0:
        raise OpenAIError("'repetition_penalty' is not supported by specserve (only 1)", param="repetition_penalty")
    if body.get("logit_bias"):
        raise OpenAIError("'logit_bias' is not supported by specserve", param="logit_bias")
    top_k = _get(body, "top_k", int, 0)
    min_tokens = _get(body, "min_tokens", int, 0)
    stream = _get(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise OpenAIError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise OpenAIError("Stream options can only be defined when `stream=True`.", param="stream_options")
    options = options or {}
    seed = _get(body, "seed", int)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise OpenAIError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    return {
        "max_tokens": max_tokens, "temperature": _get(body, "temperature", float, 1.0),
        "top_p": _get(body, "top_p", float, 1.0), "top_k": max(top_k, 0), "seed": seed, "stop": _stop_list(body),
        "stop_token_ids": list(stop_ids), "ignore_eos": _get(body, "ignore_eos", bool, False),
        "min_tokens": min_tokens, "stream": stream,
        "include_usage": bool(options.get("include_usage", False)),
        "continuous_usage": bool(options.get("continuous_usage_stats", False)),
    }


def build_params(fields: dict, prompt_len: int, engine, chat: bool) -> SamplingParams:
    max_tokens = fields["max_tokens"]
    if max_tokens is None:
        remaining = engine.max_model_len - prompt_len
        max_tokens = min(max(remaining, 1), DEFAULT_CHAT_MAX_TOKENS_CAP) if chat else DEFAULT_COMPLETION_MAX_TOKENS
    ignore_eos = fields["ignore_eos"]
    if fields["min_tokens"] >= max_tokens:
        ignore_eos = True
    elif fields["min_tokens"] > 0:
        raise OpenAIError("min_tokens below max_tokens is not supported by specserve", param="min_tokens")
    params = SamplingParams(max_tokens=max_tokens, temperature=fields["temperature"], top_p=fields["top_p"],
                            top_k=fields["top_k"], seed=fields["seed"], stop=fields["stop"],
                            stop_token_ids=fields["stop_token_ids"], ignore_eos=ignore_eos)
    try:
        params.validate()
    except ValueError as exc:
        raise OpenAIError(str(exc), param=str(exc).split(" ", 1)[0]) from None
    return params


def completion_prompt(body: dict, engine) -> tuple[str | list[int], list[int], str]:
    """prompt (str | [str] | [int] | [[int]], one prompt) -> (prompt for the runner, token ids, text to echo)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError("prompt must be a non-empty string", param="prompt")
        ids = engine.encode(prompt)
        return ids, ids, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt, prompt, engine.tokenizer.decode(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise OpenAIError("batched prompts are not supported: send one prompt per request", param="prompt")
    raise OpenAIError("prompt must be a string or a list of token ids", param="prompt")


def _message_text(message, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise OpenAIError(f"messages[{index}] must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise OpenAIError(f"messages[{index}].role must be a string", param="messages")
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return role, "".join(parts)
    raise OpenAIError(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def chat_prompt(body: dict, engine) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    pairs = [_message_text(m, i) for i, m in enumerate(messages)]
    tokenizer = engine.tokenizer
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise OpenAIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in pairs], tokenize=False,
                                                 add_generation_prompt=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja raises for conversations the template refuses
            raise OpenAIError(f"cannot apply the chat template: {exc}", param="messages") from None
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:  # no template: a plain transcript
        text = "".join(f"{role}: {content}\n" for role, content in pairs) + "assistant:"
        ids = engine.encode(text)
    if not ids:
        raise OpenAIError("the conversation is empty", param="messages")
    return ids


def _check_unsupported(body: dict, chat: bool) -> None:
    if body.get("tools"):
        raise OpenAIError("tool calling is not supported by specserve", param="tools")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise OpenAIError("tool calling is not supported by specserve", param="tool_choice")
    response_format = body.get("response_format")
    if response_format not in (None, {}) and (not isinstance(response_format, dict)
                                              or response_format.get("type") != "text"):
        raise OpenAIError("only response_format {'type': 'text'} is supported", param="response_format")
    if chat:
        if body.get("logprobs") or body.get("top_logprobs"):
            raise OpenAIError("logprobs are not supported by specserve", param="logprobs")
    else:
        if body.get("logprobs") not in (None, 0):
            raise OpenAIError("logprobs are not supported by specserve", param="logprobs")
        if body.get("suffix"):
            raise OpenAIError("'suffix' is not supported", param="suffix")


# ------------------------------------------------------------------------------------------------------------------
# endpoints


async def _read(request: Request) -> dict:
    body = await request.body()
    try:
        payload = json.loads(body.decode("utf-8")) if body.strip() else None
    except UnicodeDecodeError:
        raise OpenAIError("the request body is not valid UTF-8") from None
    except ValueError as exc:
        raise OpenAIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise OpenAIError("the request body must be a JSON object")
    return payload


def _model(ctx: ServerContext, body: dict) -> tuple[ServedModel, str]:
    name = body.get("model")
    if name is None:
        ready = ctx.repository.ready_models()
        if not ready:
            raise OpenAIError("no model is loaded", 503)
        return ready[0], ready[0].name
    if not isinstance(name, str):
        raise OpenAIError("'model' must be a string", param="model")
    try:
        return ctx.repository.get(name), name
    except RepositoryError:
        raise OpenAIError(f"The model `{name}` does not exist.", 404, "model") from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def _handle(request: Request, chat: bool) -> Response:
    ctx: ServerContext = request.app.state.ctx
    model = None
    try:
        body = await _read(request)
        model, name = _model(ctx, body)
        _check_unsupported(body, chat)
        fields = parse_common(body, chat)
        engine = model.engine
        if chat:
            prompt = ids = chat_prompt(body, engine)
            echo = ""
        else:
            prompt, ids, echo_text = completion_prompt(body, engine)
            echo = echo_text if _get(body, "echo", bool, False) else ""
        params = build_params(fields, len(ids), engine, chat)
        stream = RequestStream(ctx, model, prompt, params)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": name}
        streaming = False
        try:
            await stream.start()
            if fields["stream"]:
                first = await with_disconnect(request, stream.__anext__())
                streaming = True
                return EventStream(_stream(stream, first, meta, fields, chat, echo))
            text, tokens = await with_disconnect(request, _collect(stream))
        finally:
            if not streaming:  # the event stream closes it otherwise
                await stream.aclose()
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001 - the server stays up
        if isinstance(exc, OpenAIError) and model is not None:  # refused before it reached the runner
            ctx.metrics.record_failure(model.name, model.version, "OTHER")
        err = _from_exception(exc)
        return error_response(str(err), err.status, err.param)
    result = stream.result
    usage = _usage(stream.prompt_tokens, tokens)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": result.finish_reason}
        return json_response({**meta, "object": "chat.completion", "choices": [choice], "usage": usage})
    choice = {"index": 0, "text": echo + text, "logprobs": None, "finish_reason": result.finish_reason}
    return json_response({**meta, "object": "text_completion", "choices": [choice], "usage": usage})


async def _collect(stream: RequestStream) -> tuple[str, int]:
    texts, tokens = [], 0
    async for event in stream:
        texts.append(event.text)
        tokens += len(event.token_ids)
    return "".join(texts), tokens


async def _stream(stream: RequestStream, first, meta: dict, fields: dict, chat: bool, echo: str):
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage_field = {"usage": None} if fields["include_usage"] else {}
    tokens = 0

    def chunk(delta_text: str | None, finish_reason: str | None, role: bool = False) -> bytes:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {"content": delta_text} if delta_text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish_reason}
        extra = usage_field
        if fields["continuous_usage"] and fields["include_usage"]:
            extra = {"usage": _usage(stream.prompt_tokens, tokens)}
        return sse({**meta, "object": obj, "choices": [choice], **extra})

    try:
        if chat:
            yield chunk(None, None, role=True)
        elif echo:
            yield chunk(echo, None)
        event = first
        while True:
            tokens += len(event.token_ids)
            result = event.result
            if result is not None:
                if event.text:
                    yield chunk(event.text, None)
                yield chunk(None if chat else "", result.finish_reason)
                break
            if event.text:
                yield chunk(event.text, None)
            event = await stream.__anext__()
        if fields["include_usage"]:
            yield sse({**meta, "object": obj, "choices": [], "usage": _usage(stream.prompt_tokens, tokens)})
    except StopAsyncIteration:
        pass
    except Exception as exc:  # noqa: BLE001 - in-band error, then [DONE]
        err = _from_exception(exc)
        yield sse(error_body(str(err), err.status, err.param))
    finally:
        await stream.aclose()
    yield b"data: [DONE]\n\n"


async def list_models(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    created = int(time.time())
    data = [{"id": m.name, "object": "model", "created": created, "owned_by": "specserve"}
            for m in ctx.repository.ready_models()]
    return json_response({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    name = request.path_params["model"]
    try:
        ctx.repository.get(name)
    except RepositoryError:
        return error_response(f"The model `{name}` does not exist.", 404, "model")
    return json_response({"id": name, "object": "model", "created": int(time.time()), "owned_by": "specserve"})


async def health(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    return Response(status_code=200 if ctx.ready else 503)


def routes() -> list[Route]:
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health/ready", health, methods=["GET"]),
    ]
