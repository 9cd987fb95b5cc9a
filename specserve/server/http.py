"""HTTP plumbing both front ends share: JSON bodies in and out, client-disconnect detection, and an SSE response
that stops its request when the client leaves."""

from __future__ import annotations

import asyncio
import json
import re

import anyio
import numpy as np
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from specserve.server.errors import ClientDisconnected, InputError


def json_bytes(payload) -> bytes:
    """Compact JSON with keys sorted, as Triton writes its generate responses."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()


def json_response(payload, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json_bytes(payload), status_code=status, media_type="application/json", headers=headers)


MAX_JSON_DEPTH = 64  # arrays and objects nested deeper than any API here needs (KServe data: a few levels)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_body(request: Request) -> bytes:
    """The raw body, refused with 413 once it passes the server's limit (`RequestLimits`) before the rest is
    read."""
    limit = request.app.state.ctx.limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise InputError(f"the request body is {declared} bytes; the limit is {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise InputError(f"the request body exceeds the limit of {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, empty_ok: bool = True) -> dict:
    """The request body as a JSON object ({} for an empty body when `empty_ok`); InputError says what is wrong."""
    body = await read_body(request)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding not in ("", "identity"):
        raise InputError(f"unsupported Content-Encoding '{encoding}'")
    if not body.strip() and empty_ok:
        return {}
    payload = parse_json(body)
    if not isinstance(payload, dict):
        raise InputError("failed to parse the request JSON buffer: the request must be a JSON object")
    return payload


def parse_json(body: bytes):
    """UTF-8 JSON text -> its value, refusing what Python's parser would take but the server cannot use: nesting
    deeper than MAX_JSON_DEPTH (the parser recurses) and lone UTF-16 surrogates (no tokenizer can encode them)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"failed to parse the request JSON buffer: invalid UTF-8 at byte {exc.start}") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise InputError(f"failed to parse the request JSON buffer: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise InputError(f"failed to parse the request JSON buffer: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):
        try:  # paired surrogate escapes decode to one character; a lone one stays and cannot be encoded
            json.dumps(payload, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InputError("failed to parse the request JSON buffer: a string holds a lone UTF-16 surrogate "
                             "(\\ud800-\\udfff escape), which is not a Unicode character") from None
    return payload


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in JSON text (brackets inside strings do not count)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0  # too few brackets to nest too deep: the usual request costs two counts
    brackets = _JSON_STRING.sub("", text).encode()
    steps = np.frombuffer(brackets, dtype=np.uint8)
    depth = np.cumsum((steps == ord("[")).astype(np.int32) + (steps == ord("{"))
                      - (steps == ord("]")) - (steps == ord("}")))
    return int(depth.max(initial=0))


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
