"""What every front end does with a generation request: turn its fields into SamplingParams, submit it to the
model's runner with its metrics and its place in the in-flight registry (Triton's cancel by id), and wait for the
first event of a streamed response.

    params = sampling_params(max_tokens=16, temperature=0.0, min_tokens=0)
    handle = await ctx.submit(model, prompt, params, request_id)   # runner.RequestHandle
    out = await with_disconnect(request, handle.collect())          # or: first = await first_event(request, handle)
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from specserve.engine.output import StreamEvent
from specserve.server.errors import InputError, failure_reason
from specserve.server.http import with_disconnect
from specserve.server.metrics import ServerMetrics
from specserve.server.repository import ModelRepository, ServedModel
from specserve.server.runner import RequestHandle, RequestObserver, RequestTiming
from specserve.speculative.grammar import Guide
from specserve.speculative.sampling import SamplingParams


def sampling_params(max_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                    seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                    ignore_eos: bool = False, min_tokens: int = 0, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, num_speculative_tokens: int | None = None,
                    suffix_cache: bool = True, guide: Guide | None = None) -> SamplingParams:
    """A request's sampling fields -> SamplingParams. The engine checks the values when the request is submitted.
    min_tokens >= max_tokens asks for exactly max_tokens tokens (genai-perf's fixed output length): EOS is
    ignored; a smaller positive min_tokens is refused. num_speculative_tokens caps the request's draft tokens per
    step (0: no speculation); suffix_cache false keeps the request out of the suffix method's shared cache."""
    if min_tokens and min_tokens >= max_tokens:
        ignore_eos = True
    elif min_tokens > 0:
        raise InputError("min_tokens below max_tokens is not supported by specserve (min_tokens = max_tokens is)",
                         param="min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          num_speculative_tokens=num_speculative_tokens, suffix_cache=suffix_cache, guide=guide)


log = logging.getLogger("specserve.server")

WARM_UP_PROMPT = "Warm-up: one, two, three, one, two, three, one, two,"


@dataclass
class RequestLimits:
    """What one request may ask of the server, refused with a 4xx before any work (prompt length: the model's
    context, checked at submit)."""

    max_body_bytes: int = 8 * 2**20  # a full 32k-token context is ~0.2 MB of text
    max_messages: int = 1024  # a chat's messages (OpenAI's own API allows 2048)


@dataclass
class ServerContext:
    """The app's shared state: the models, the metrics, readiness and the requests in flight by client id."""

    repository: ModelRepository
    metrics: ServerMetrics
    ready: bool = True
    limits: RequestLimits = field(default_factory=RequestLimits)
    model_control_mode: str = "none"  # Triton's: load/unload requests are honoured only in "explicit"
    chat_template: str | None = None  # --chat-template: overrides every served model's own
    tool_call_parser: str | None = None  # --tool-call-parser: the served models' tool-call format, for "auto"
    inflight: dict[str, set[RequestHandle]] = field(default_factory=lambda: defaultdict(set))

    def is_ready(self) -> bool:
        """The server's readiness: warm, and no loaded model failed since (a tensor-parallel rank lost)."""
        return self.ready and not self.repository.failures()

    async def submit(self, model: ServedModel, prompt: str | list[int], params: SamplingParams,
                     request_id: str = "") -> RequestHandle:
        """Queue a request on the model's runner, counted in the metrics and, with an id, cancellable by it.
        Raises what `Runner.submit` raises."""
        tracker = RequestTracker(self, model, request_id)
        handle = await model.runner.submit(prompt, params, observer=tracker)
        if request_id:
            self.inflight[request_id].add(handle)
        return handle

    async def warm_up(self, model: ServedModel) -> None:
        """One short request through the model's runner, so that what its first request would wait for (the batch
        engine and its cost table, the kernels' first calls) is done before the server says it is ready."""
        try:
            # kept out of the suffix method's shared cache: no client sent it
            handle = await model.runner.submit(WARM_UP_PROMPT, SamplingParams(max_tokens=8, ignore_eos=True,
                                                                              suffix_cache=False))
            await handle.collect()
        except Exception:  # noqa: BLE001 - a model that fails its warm-up fails its requests too; serve on
            log.exception("warm-up of %s failed", model.name)

    def cancel(self, request_id: str) -> None:
        for handle in list(self.inflight.get(request_id, ())):
            handle.cancel()

    def refused(self, model: ServedModel | None, exc: BaseException) -> None:
        """Count a request the front end refused after finding its model (bad input, before the runner)."""
        if model is not None and isinstance(exc, InputError):
            self.metrics.record_failure(model.name, model.version, failure_reason(exc))


class RequestTracker(RequestObserver):
    """One request in the metrics (pending gauge, success, failure with its reason) and the in-flight registry."""

    def __init__(self, ctx: ServerContext, model: ServedModel, request_id: str):
        self.ctx, self.model, self.request_id = ctx, model, request_id
        ctx.metrics.request_started(model.name, model.version)

    def succeeded(self, handle: RequestHandle, result) -> None:
        self.ctx.metrics.record_success(self.model.name, self.model.version, handle.timing, result)

    def failed(self, exc: BaseException, timing: RequestTiming | None) -> None:
        self.ctx.metrics.record_failure(self.model.name, self.model.version, failure_reason(exc), timing)

    def ended(self, handle: RequestHandle | None) -> None:
        handles = self.ctx.inflight.get(self.request_id) if self.request_id else None
        if handles is not None:
            handles.discard(handle)
            if not handles:
                self.ctx.inflight.pop(self.request_id, None)
        self.ctx.metrics.request_ended(self.model.name, self.model.version)


async def first_event(request: Request, handle: RequestHandle) -> StreamEvent:
    """The first event of a streamed response, awaited before the 200 goes out so that an early failure still gets
    its status; the handle is closed if it fails. StopAsyncIteration: the request ended without an event."""
    try:
        return await with_disconnect(request, handle.__anext__())
    except BaseException:
        await handle.aclose()
        raise
