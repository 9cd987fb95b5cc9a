"""The OpenAI-compatible endpoints on the HTTP port: /v1/models, /v1/completions and /v1/chat/completions (SSE
streaming ending in `data: [DONE]`, `stream_options.include_usage`), and /health."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from specserve.engine.engine import StreamEvent
from specserve.server.http import EventStream, json_response, read_json, sse, with_disconnect
from specserve.server.openai.protocol import (CommonFields, build_params, check_unsupported, chunk, chunk_object,
                                              completion_body, error_json, error_response, exception_body,
                                              find_model, parse_common, read_prompt, usage)
from specserve.server.repository import RepositoryError
from specserve.server.request import ServerContext, first_event
from specserve.server.runner import RequestHandle, off_loop


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def _complete(request: Request, chat: bool) -> Response:
    ctx: ServerContext = request.app.state.ctx
    model = None
    try:
        body = await read_json(request, empty_ok=False)
        model, name = find_model(ctx, body)
        check_unsupported(body, chat)
        fields = parse_common(body, chat)
        prompt, ids, echo = await off_loop(read_prompt, body, model.engine, chat, ctx.limits.max_messages)
        params = build_params(fields, len(ids), model.engine.max_model_len, chat)
        handle = await ctx.submit(model, prompt, params)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": name}
        if fields.stream:
            first = await first_event(request, handle)
            return EventStream(_chunks(handle, first, meta, fields, chat, echo))
        out = await with_disconnect(request, handle.collect())
    except Exception as exc:  # noqa: BLE001 - the server stays up
        ctx.refused(model, exc)
        return error_response(exc)
    body = completion_body(meta, chat, echo + out.text, out.result.finish_reason,
                           usage(len(handle.prompt_ids), len(out.token_ids)))
    return json_response(body)


async def _chunks(handle: RequestHandle, first: StreamEvent, meta: dict, fields: CommonFields, chat: bool,
                  echo: str):
    """The SSE chunks: the role (chat) or the echoed prompt, text deltas, the finish reason, the usage if asked
    for, then [DONE]. An error after the first chunk goes in-band, before [DONE]."""
    prompt_tokens, tokens = len(handle.prompt_ids), 0

    def usage_field() -> dict:
        if not fields.include_usage:
            return {}
        return {"usage": usage(prompt_tokens, tokens) if fields.continuous_usage else None}

    try:
        if chat:
            yield chunk(meta, chat, None, None, role=True, extra=usage_field())
        elif echo:
            yield chunk(meta, chat, echo, None, extra=usage_field())
        event = first
        while True:
            tokens += len(event.token_ids)
            if event.text:
                yield chunk(meta, chat, event.text, None, extra=usage_field())
            if event.result is not None:
                yield chunk(meta, chat, None if chat else "", event.result.finish_reason, extra=usage_field())
                break
            event = await handle.__anext__()
        if fields.include_usage:
            yield sse({**meta, "object": chunk_object(chat), "choices": [], "usage": usage(prompt_tokens, tokens)})
    except StopAsyncIteration:
        pass
    except Exception as exc:  # noqa: BLE001 - in-band error, then [DONE]
        yield sse(exception_body(exc))
    finally:
        await handle.aclose()
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
        return error_json(f"The model `{name}` does not exist.", 404, "model")
    return json_response({"id": name, "object": "model", "created": int(time.time()), "owned_by": "specserve"})


async def health(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    return Response(status_code=200 if ctx.ready else 503)
