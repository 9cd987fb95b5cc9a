"""Triton's generate extension: `generate` (one JSON response) and `generate_stream` (SSE: one event per engine
step with text, or one event with the whole response when the request does not stream), and the LLM-API
cancel-by-id request (`{"id": X, "stop": true}`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from specserve.engine.output import StreamEvent
from specserve.server.errors import InputError
from specserve.server.http import EventStream, json_response, read_json, sse, with_disconnect
from specserve.server.repository import ServedModel
from specserve.server.request import ServerContext, first_event
from specserve.server.runner import RequestHandle
from specserve.server.triton.protocol import (GenerateRequest, build_outputs, echoes_prompt, error_json,
                                              error_message, error_response, flatten_body, parse_generate,
                                              request_id, resolve_model, response_head)

MULTI_RESPONSE_ERROR = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                        "generates various number of responses")

Respond = Callable[[Request, ServerContext, ServedModel, GenerateRequest], Awaitable[Response]]


async def generate(request: Request) -> Response:
    return await _serve(request, _respond_once)


async def generate_stream(request: Request) -> Response:
    return await _serve(request, _respond_streaming)


async def _serve(request: Request, respond: Respond) -> Response:
    """Read the request, answer a cancel request, let `respond` run any other; errors in Triton's format."""
    ctx: ServerContext = request.app.state.ctx
    model = None
    try:
        model = resolve_model(request)
        body = await read_json(request)
        req = parse_generate(flatten_body(body), model, request_id(body))
        if req.cancel:
            return cancel_by_id(ctx, req)
        return await respond(request, ctx, model, req)
    except Exception as exc:  # noqa: BLE001 - the server stays up
        ctx.refused(model, exc)
        return error_response(model, exc)


def cancel_by_id(ctx: ServerContext, req: GenerateRequest) -> Response:
    return error_json(cancel_in_flight(ctx, req))


def cancel_in_flight(ctx: ServerContext, req: GenerateRequest) -> str:
    """llmapi `stop: true`: cancel the in-flight requests that carry this request's id. Returns the error TRT-LLM
    answers such a request with (HTTP 400 / gRPC INVALID_ARGUMENT): "Request cancelled by client"."""
    if not req.request_id:
        return "A request id must be provided for request cancellation"
    ctx.cancel(req.request_id)
    return "Request cancelled by client"


async def complete(ctx: ServerContext, model: ServedModel, req: GenerateRequest) -> dict:
    """Run a request to the end: the outputs of its single response."""
    handle = await ctx.submit(model, req.prompt, req.params, req.request_id)
    out = await handle.collect()
    text = (req.prompt if echoes_prompt(req) else "") + out.text
    scored = (out.result.logprobs if out.result else None) or []
    return {**response_head(model, req), **build_outputs(model, req, text, len(out.token_ids),
                                                         len(handle.prompt_ids), out.result, handle.timing,
                                                         scored, sum(e.logprob for e in scored))}


async def _respond_once(request: Request, ctx: ServerContext, model: ServedModel, req: GenerateRequest) -> Response:
    if req.stream:
        raise InputError(MULTI_RESPONSE_ERROR)
    return json_response(await with_disconnect(request, complete(ctx, model, req)))


async def _respond_streaming(request: Request, ctx: ServerContext, model: ServedModel,
                             req: GenerateRequest) -> Response:
    handle = await ctx.submit(model, req.prompt, req.params, req.request_id)
    try:
        first = await first_event(request, handle)
    except StopAsyncIteration:
        raise RuntimeError("the model produced no response") from None
    return EventStream(_events(model, req, handle, first))


async def _events(model: ServedModel, req: GenerateRequest, handle: RequestHandle, first: StreamEvent):
    """The SSE events; errors after the first event go in-band: `data: {"error": ...}`."""
    try:
        async for outputs, _ in response_outputs(model, req, handle, first):
            yield sse(outputs)
    except Exception as exc:  # noqa: BLE001 - mid-stream errors go in-band
        yield sse({"error": error_message(model, exc)})
    finally:
        await handle.aclose()


async def response_outputs(model: ServedModel, req: GenerateRequest, handle: RequestHandle,
                           first: StreamEvent | None = None):
    """The responses of a request answered in several (HTTP generate_stream, gRPC ModelStreamInfer) as (outputs
    with the response head, final): one per engine step with text (deltas, or llmapi's cumulative text), or one
    with the whole text at the end when the request does not stream. Raises what the request fails with; the
    caller closes the handle."""
    echo = req.prompt if echoes_prompt(req) else ""
    texts: list[str] = []
    scored: list = []  # the log-probabilities of every token so far (when the request returns them)
    tokens = sent = 0  # output tokens so far; those the responses sent so far cover
    event = first
    while True:
        if event is None:
            try:
                event = await handle.__anext__()
            except StopAsyncIteration:  # ended without a result (cancelled by id): nothing more to send
                return
        texts.append(event.text)
        tokens += len(event.token_ids)
        scored += event.logprobs or []
        final = event.result is not None
        if req.stream and (event.text or final):
            # a step whose tokens made no text yet sent no response: the next one counts them
            new, sent = (tokens if req.cumulative else tokens - sent), tokens
            text = echo + "".join(texts) if req.cumulative else event.text
            yield _outputs(model, req, handle, text, new, event, scored), final
        if final:
            break
        event = None
    if not req.stream:
        yield _outputs(model, req, handle, echo + "".join(texts), tokens, event, scored), True


def _outputs(model: ServedModel, req: GenerateRequest, handle: RequestHandle, text: str, new_tokens: int,
             event: StreamEvent, scored: list) -> dict:
    """A response's outputs; `scored`: the log-probabilities of every token so far (the response's are the
    last `new_tokens`)."""
    mine = scored[len(scored) - new_tokens:] if new_tokens else []
    outputs = build_outputs(model, req, text, new_tokens, len(handle.prompt_ids), event.result, handle.timing,
                            mine, sum(e.logprob for e in scored))
    return {**response_head(model, req), **outputs}
