"""The OpenAI-compatible endpoints on the HTTP port: /v1/models, /v1/completions and /v1/chat/completions (SSE
streaming ending in `data: [DONE]`, `stream_options.include_usage`), and /health."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from specserve.engine.output import StreamEvent
from specserve.server.errors import InputError
from specserve.server.http import EventStream, json_response, read_json, sse, with_disconnect
from specserve.server.openai.fields import CommonFields, parse_common
from specserve.server.openai.logprobs import TokenText, chat_logprobs, completion_logprobs, join_completion_logprobs
from specserve.server.openai.protocol import (build_params, check_unsupported, choice, chunk, chunk_object,
                                              completion_body, error_json, error_response, exception_body,
                                              find_model, read_prompt, usage)
from specserve.server.openai.tools import ToolRequest, parse_tools
from specserve.server.repository import ModelNotReadyError, RepositoryError
from specserve.server.request import ServerContext, first_event
from specserve.server.runner import RequestHandle, off_loop
from specserve.speculative.sampling import SEEDS, SamplingParams


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def _complete(request: Request, chat: bool) -> Response:
    ctx: ServerContext = request.app.state.ctx
    model, handles = None, []
    try:
        body = await read_json(request, empty_ok=False)
        model, name = find_model(ctx, body)
        check_unsupported(body, chat)
        fields = parse_common(body, chat)
        tools = await off_loop(request_tools, ctx, model, body, fields) if chat else None
        prompt, ids, echo = await off_loop(read_prompt, body, model.engine, chat, ctx.limits.max_messages,
                                          ctx.chat_template, tools and tools.template_tools())
        format_stop = model.engine.target.chat_stop if chat and not ctx.chat_template else ()
        params = build_params(fields, len(ids), model.engine.max_model_len, chat, format_stop)
        for index in range(fields.n):
            handles.append(await ctx.submit(model, prompt, choice_params(params, index)))
        if echo is None:  # a token-id prompt's text, decoded (off the event loop) once the runner accepted the ids
            echo = await off_loop(model.engine.tokenizer.decode, ids)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": name}
        reply = Reply(meta, fields, chat, echo, TokenText(model.engine.tokenizer), handles[0].prompt_ids, tools)
        if fields.stream:
            firsts = [await first_event(request, handle) for handle in handles]
            return EventStream(reply.chunks(handles, firsts))
        outs = await with_disconnect(request, asyncio.gather(*(handle.collect() for handle in handles)))
    except Exception as exc:  # noqa: BLE001 - the server stays up
        for handle in handles:
            await handle.aclose()
        ctx.refused(model, exc)
        return error_response(exc)
    choices = []
    for index, out in enumerate(outs):
        finish_reason, message = reply.ending(out.text, out.result.finish_reason)
        choices.append(choice(chat, index, echo + out.text, finish_reason, reply.logprobs(out.result), message))
    return json_response(completion_body(meta, chat, choices, reply.usage(sum(len(o.token_ids) for o in outs))))


def request_tools(ctx: ServerContext, model, body: dict, fields: CommonFields) -> ToolRequest | None:
    """The chat request's tools; a forced tool choice becomes the request's guide (at most one guide)."""
    template = ctx.chat_template or getattr(model.engine.tokenizer, "chat_template", None)
    tools = parse_tools(body, template, ctx.tool_call_parser)
    guide = tools and tools.guide()
    if guide is not None:
        if fields.guide is not None:
            raise InputError("a forced tool_choice is a structured output of its own: give it without "
                             "response_format or another guide", param="tool_choice")
        fields.guide = guide
    return tools


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a request with `n` choices: its own sample (seeded requests: seed + index)."""
    if index == 0 or params.seed is None:
        return params
    seed = params.seed + index
    return dataclasses.replace(params, seed=seed if seed in SEEDS else params.seed - index)


@dataclass
class Reply:
    """What a response is built from: the request's fields and how to write its tokens' log-probabilities."""

    meta: dict
    fields: CommonFields
    chat: bool
    echo: str
    text_of: TokenText
    prompt_ids: list[int]
    tools: ToolRequest | None = None

    def ending(self, text: str, finish_reason: str) -> tuple[str, dict | None]:
        """(finish reason, the assistant message) of a whole choice: its tool calls, when it has tools."""
        output = self.tools and self.tools.output()
        if output is None:
            return finish_reason, None
        message, finish_reason = output.message(text, finish_reason)
        return finish_reason, message

    def usage(self, completion_tokens: int) -> dict:
        return usage(len(self.prompt_ids), completion_tokens)

    def logprobs(self, result) -> dict | None:
        """A whole choice's log-probabilities (completions that echo and score: the prompt's first)."""
        if self.fields.logprobs is None:
            return None
        return self.token_logprobs(result.token_ids, result.logprobs, prompt=result.prompt_logprobs)

    def token_logprobs(self, token_ids: list[int], entries, offset: int | None = None, prompt=None) -> dict:
        if self.chat:
            return chat_logprobs(self.text_of, entries)
        offset = len(self.echo) if offset is None else offset
        parts = [completion_logprobs(self.text_of, self.prompt_ids, prompt)] if prompt is not None else []
        return join_completion_logprobs(parts + [completion_logprobs(self.text_of, token_ids, entries, offset)])

    async def chunks(self, handles: list[RequestHandle], firsts: list[StreamEvent]):
        """The SSE chunks: per choice the role (chat) or the echoed prompt, then every choice's text deltas and
        finish reason as they come, the usage if asked for, then [DONE]. An error after the first chunk goes
        in-band, before [DONE]."""
        fields, chat, tokens = self.fields, self.chat, 0
        offsets = [len(self.echo)] * len(handles)  # completions' text_offset of each choice's next token

        def usage_field() -> dict:
            if not fields.include_usage:
                return {}
            return {"usage": self.usage(tokens) if fields.continuous_usage else None}

        outputs = [self.tools and self.tools.output() for _ in handles]
        events: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(index, handle, first, events))
                 for index, (handle, first) in enumerate(zip(handles, firsts))]
        try:
            for index in range(len(handles)):
                if chat:
                    yield chunk(self.meta, chat, None, None, role=True, extra=usage_field(), index=index)
                elif self.echo:
                    scored = firsts[index].prompt_logprobs
                    yield chunk(self.meta, chat, self.echo, None, extra=usage_field(), index=index,
                                logprobs=None if scored is None else
                                completion_logprobs(self.text_of, self.prompt_ids, scored))
            ended = 0
            while ended < len(handles):
                index, event = await events.get()
                if event is None:
                    ended += 1
                    continue
                if isinstance(event, BaseException):
                    raise event
                tokens += len(event.token_ids)
                logprobs = None
                if event.logprobs is not None and event.token_ids:
                    logprobs = self.token_logprobs(event.token_ids, event.logprobs, offsets[index])
                    offsets[index] += sum(len(t) for t in logprobs.get("tokens", []))
                output = outputs[index]
                if output is None:
                    if event.text or logprobs:
                        yield chunk(self.meta, chat, event.text, None, extra=usage_field(), index=index,
                                    logprobs=logprobs)
                else:
                    for delta in output.feed(event.text) or ([{}] if logprobs else []):
                        yield chunk(self.meta, chat, None, None, extra=usage_field(), index=index,
                                    logprobs=logprobs, delta=delta)
                        logprobs = None
                if event.result is not None:
                    finish_reason = event.result.finish_reason
                    if output is not None:
                        deltas, finish_reason = output.close(finish_reason)
                        for delta in deltas:
                            yield chunk(self.meta, chat, None, None, extra=usage_field(), index=index, delta=delta)
                    yield chunk(self.meta, chat, None if chat else "", finish_reason, extra=usage_field(),
                                index=index)
            if fields.include_usage:
                yield sse({**self.meta, "object": chunk_object(chat), "choices": [], "usage": self.usage(tokens)})
        except Exception as exc:  # noqa: BLE001 - in-band error, then [DONE]
            yield sse(exception_body(exc))
        finally:
            for pump in pumps:
                pump.cancel()
            for handle in handles:
                await handle.aclose()
        yield b"data: [DONE]\n\n"


async def _pump(index: int, handle: RequestHandle, first: StreamEvent, events: asyncio.Queue) -> None:
    """Put a choice's events on the shared queue as (index, event), then (index, None) when it ends (after an
    exception, as its event)."""
    try:
        event = first
        while True:
            events.put_nowait((index, event))
            if event.result is not None:
                break
            event = await handle.__anext__()
    except StopAsyncIteration:
        pass
    except Exception as exc:  # noqa: BLE001 - the consumer raises it in-band
        events.put_nowait((index, exc))
    events.put_nowait((index, None))


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
    except ModelNotReadyError as exc:
        return error_json(str(exc), 503, "model")
    except RepositoryError:
        return error_json(f"The model `{name}` does not exist.", 404, "model")
    return json_response({"id": name, "object": "model", "created": int(time.time()), "owned_by": "specserve"})


async def health(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    return Response(status_code=200 if ctx.is_ready() else 503)
