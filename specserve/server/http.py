"""What the Triton and OpenAI front ends share: the server context, one request's lifetime (runner + metrics +
cancellation), client-disconnect detection and an SSE response that stops the request when the client leaves."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from specserve.engine.engine import RequestError, StreamEvent
from specserve.server.metrics import ServerMetrics
from specserve.server.repository import ModelRepository, ServedModel
from specserve.server.runner import QueueFullError, RequestCancelledError, RequestHandle, RunnerClosedError

log = logging.getLogger("specserve.server")


@dataclass
class ServerContext:
    repository: ModelRepository
    metrics: ServerMetrics
    ready: bool = True
    inflight: dict[str, set[RequestHandle]] = field(default_factory=lambda: defaultdict(set))  # by request "id"


class ClientDisconnected(Exception):
    pass


def json_bytes(payload) -> bytes:
    """Compact JSON with keys sorted, as Triton writes its generate responses."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()


def json_response(payload, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json_bytes(payload), status_code=status, media_type="application/json", headers=headers)


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, QueueFullError):
        return "REJECTED"
    if isinstance(exc, (RequestCancelledError, asyncio.CancelledError, GeneratorExit, ClientDisconnected)):
        return "CANCELED"
    if isinstance(exc, (RequestError, ValueError, RunnerClosedError)):
        return "OTHER"
    return "BACKEND"


class RequestStream:
    """One request through a model's runner, with metrics and the in-flight registry (for cancel-by-id).

        stream = RequestStream(ctx, model, prompt, params, request_id)
        await stream.start()          # RequestError / QueueFullError / RunnerClosedError: pick the HTTP status
        async for event in stream: ...
        await stream.aclose()         # always; stops the request if it is still running

    Cancelling the task that awaits the next event also stops the request."""

    def __init__(self, ctx: ServerContext, model: ServedModel, prompt, params, request_id: str = ""):
        self.ctx, self.model, self.prompt, self.params, self.request_id = ctx, model, prompt, params, request_id
        self.handle: RequestHandle | None = None
        self.result = None
        self._ended = False
        ctx.metrics.request_started(model.name, model.version)

    @property
    def timing(self):
        return self.handle.timing if self.handle else None

    @property
    def prompt_tokens(self) -> int:
        return len(self.handle.prompt_ids) if self.handle else 0

    async def start(self) -> RequestStream:
        try:
            self.handle = await self.model.runner.submit(self.prompt, self.params)
        except BaseException as exc:
            self._fail(exc)
            raise
        if self.request_id:
            self.ctx.inflight[self.request_id].add(self.handle)
        return self

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._ended:
            raise StopAsyncIteration
        try:
            event = await self.handle.__anext__()
        except StopAsyncIteration:
            self._end()
            raise
        except BaseException as exc:
            self._fail(exc)
            raise
        if event.result is not None and self.result is None:
            self.result = event.result
            self.ctx.metrics.record_success(self.model.name, self.model.version, self.handle.timing, event.result)
        return event

    async def aclose(self) -> None:
        if not self._ended:
            self._fail(ClientDisconnected() if self.result is None else None)

    def _fail(self, exc: BaseException | None) -> None:
        if self._ended:
            return
        if exc is not None and self.result is None:
            self.ctx.metrics.record_failure(self.model.name, self.model.version, failure_reason(exc), self.timing)
        self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self.handle is not None:
            self.handle.cancel()
            if self.request_id:
                handles = self.ctx.inflight.get(self.request_id)
                if handles is not None:
                    handles.discard(self.handle)
                    if not handles:
                        self.ctx.inflight.pop(self.request_id, None)
        self.ctx.metrics.request_ended(self.model.name, self.model.version)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_disconnect(request: Request, awaitable):
    """Await `awaitable`, cancelling it (and raising ClientDisconnected) if the HTTP client goes away first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class EventStream(StreamingResponse):
    """text/event-stream that closes its body iterator (so the request stops) as soon as the client disconnects,
    whatever the ASGI spec version (Starlette otherwise notices only at the next write)."""

    media_type = "text/event-stream"

    def __init__(self, content, status_code: int = 200, headers: dict | None = None):
        super().__init__(content, status_code=status_code, headers=headers,
                         media_type="text/event-stream; charset=utf-8")

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # client gone mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def sse(payload) -> bytes:
    data = payload if isinstance(payload, (bytes, str)) else json_bytes(payload)
    if isinstance(data, str):
        data = data.encode()
    return b"data: " + data + b"\n\n"
