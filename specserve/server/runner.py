"""The asyncio side of one Engine: a FIFO queue, and continuous batching in slices of steps on the compute thread.

    handle = await runner.submit(prompt, params)   # RequestError / QueueFullError / RunnerClosedError here
    result = (await handle.collect()).result       # or: async for event in handle (StreamEvents; the last has
                                                   # .result), then await handle.aclose()

The compute thread (compute.py) runs a runner's slices of steps while it has work: between `BatchEngine.step`s
a slice admits queued requests into free batch rows (up to `max_active`) and hands each request its event.
`handle.cancel()` drops a queued request or stops a running one before its next step; a consumer that goes away
(its task cancelled) cancels too.
A front end passes a `RequestObserver` to `submit` to learn how the request ended (metrics, cancel by id).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine, RequestError
from specserve.engine.output import StreamEvent
from specserve.server.compute import COMPUTE
from specserve.speculative.sampling import SamplingParams

log = logging.getLogger("specserve.server")

_END = object()


_TOKENIZER = ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenizer")


async def off_loop(fn, *args):
    """fn(*args) on the tokenizer thread: tokenizing a long prompt (or rendering a long chat) on the event loop
    would stall every other client's responses meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER, fn, *args)


class RunnerError(RuntimeError):
    """A request the runner could not run (HTTP statuses: server/errors.py)."""


class QueueFullError(RunnerError):
    pass


class RunnerClosedError(RunnerError):
    pass


class RequestCancelledError(RunnerError):
    pass


@dataclass
class RequestTiming:
    """perf_counter() seconds (durations) and time.time_ns() wall-clock stamps (the perf-metric outputs)."""

    submitted: float = 0.0
    started: float | None = None
    first_event: float | None = None
    finished: float | None = None
    arrival_ns: int = 0
    started_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0

    @property
    def queue_s(self) -> float:
        return (self.started or self.finished or time.perf_counter()) - self.submitted

    @property
    def compute_s(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.perf_counter()) - self.started

    @property
    def total_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.submitted


class RequestObserver:
    """How a request ended, for whoever submitted it; this base class ignores it. Per request: at most one of
    `succeeded` / `failed`, then `ended` exactly once."""

    def succeeded(self, handle: RequestHandle, result) -> None:
        """The consumer received the final event (its GenerationResult)."""

    def failed(self, exc: BaseException, timing: RequestTiming | None) -> None:
        """The request failed, was cancelled, or its consumer left before the result."""

    def ended(self, handle: RequestHandle | None) -> None:
        """The request is over for the consumer (None: `submit` refused it)."""


class RequestHandle:
    """One submitted request: an async iterator of StreamEvents (the last has `.result`), `collect()`, `cancel()`
    and `timing`. Consuming it reports the outcome to its observer."""

    def __init__(self, runner: Runner, request_id: int, prompt_ids: list[int], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop, observer: RequestObserver, checked=None):
        self.runner = runner
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.checked = checked  # the engine's check_request verdict (its compiled grammar), for batch.add
        self.observer = observer
        self.timing = RequestTiming(submitted=time.perf_counter(), arrival_ns=time.time_ns())
        self.state = "queued"  # queued | running | finished | failed | cancelled
        self.result = None  # GenerationResult once finished
        self.error: BaseException | None = None
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self._done = False  # the consumer has seen the end (or closed the handle)
        self._delivered = False  # the consumer has received the result
        self.streaming = True  # the consumer takes events as they come; `collect` waits for the end
        self._held: list[StreamEvent] = []  # events kept for a collecting consumer (compute thread only)
        self.sequence = None  # the engine's Sequence once admitted

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop the request: dropped from the queue, or stopped before its next step. No-op once it ended."""
        if self._cancel.is_set() or self.state in ("finished", "failed", "cancelled"):
            return
        self._cancel.set()
        self.runner._drop(self)

    def _put(self, *items: Any) -> None:
        """Called from the compute thread (or the loop): hand items to the consumer, in one wake-up of its loop."""
        try:
            self._loop.call_soon_threadsafe(self._put_now, items)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self._cancel.set()

    def _put_now(self, items: tuple) -> None:
        for item in items:
            self._events.put_nowait(item)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._events.get()
        except BaseException as exc:  # CancelledError: the consumer went away (client disconnect)
            self._end(exc)
            raise
        if item is _END:
            self._end(None)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._end(item)
            raise item
        if item.result is not None and not self._delivered:
            self._delivered = True
            self.observer.succeeded(self, item.result)
        return item

    async def aclose(self) -> None:
        """Stop the request if it still runs; closing before the result counts as cancelling it."""
        self._end(None if self._delivered else RequestCancelledError("the consumer closed the request"))

    async def collect(self) -> StreamEvent:
        """Run to the end and close: one StreamEvent with the whole text and token ids, and the result. The runner
        then hands over the events at the end, not step by step: each hand-off wakes the event loop, which takes
        a core from the forward."""
        self.streaming = False
        texts, ids, last = [], [], None
        try:
            async for event in self:
                texts.append(event.text)
                ids.extend(event.token_ids)
                last = event
        finally:
            await self.aclose()
        return StreamEvent("".join(texts), ids, last.result if last else None)

    def _end(self, exc: BaseException | None) -> None:
        """The consumer is done with the request: stop it, report the failure (if any, before the result)."""
        if self._done:
            return
        self._done = True
        self.cancel()
        if exc is not None and not self._delivered:
            self.observer.failed(exc, self.timing)
        self.observer.ended(self)


DEFAULT_MAX_ACTIVE = 8  # requests decoding together when the config sets no max_batch_size


class Runner:
    """Runs one Engine's requests with continuous batching (up to max_active at once), in slices of steps that the
    compute thread schedules (a `compute.Stepper`)."""

    SLICE_SECONDS = 0.05  # steps run back to back on the compute thread before other runners get a turn

    def __init__(self, engine: Engine, max_queue_size: int = 64, name: str = "model",
                 max_active: int = DEFAULT_MAX_ACTIVE, adaptive_draft: bool = True):
        self.engine = engine
        self.adaptive_draft = adaptive_draft
        self.max_active = max(1, max_active)
        self._running_count = 0
        self._batch: BatchEngine | None = None  # opened on the compute thread by the first slice
        self.batch_stats = None  # the BatchEngine's step statistics (batch size, draft length chosen)
        self._owners: dict[int, RequestHandle] = {}  # id(Sequence) -> handle of each admitted request
        self.name = name
        self.max_queue_size = max_queue_size
        self._queue: deque[RequestHandle] = deque()
        self._lock = threading.Lock()
        self._closing = False
        self._stopped = threading.Event()  # closing, and its last request over: the compute thread let it go
        self._ids = itertools.count(1)
        self.counts = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0, "rejected": 0}
        COMPUTE.attach(self)

    # ---- the interface ------------------------------------------------------------------------------------------
    async def submit(self, prompt: str | list[int], params: SamplingParams,
                     observer: RequestObserver | None = None) -> RequestHandle:
        """Queue a request. Raises RequestError (bad params, prompt too long), QueueFullError, RunnerClosedError;
        the observer hears of that refusal too."""
        observer = observer or RequestObserver()
        try:
            prompt_ids, checked = await off_loop(self._check, prompt, params)
            return self._enqueue(prompt_ids, params, observer, checked)
        except BaseException as exc:
            observer.failed(exc, None)
            observer.ended(None)
            raise

    def _enqueue(self, prompt_ids: list[int], params: SamplingParams, observer: RequestObserver,
                 checked=None) -> RequestHandle:
        handle = RequestHandle(self, 0, prompt_ids, params, asyncio.get_running_loop(), observer, checked)
        with self._lock:
            if self._closing:
                raise RunnerClosedError(f"model '{self.name}' is not accepting requests (unloading)")
            if len(self._queue) >= self.max_queue_size:
                self.counts["rejected"] += 1
                raise QueueFullError("Exceeds maximum queue size")
            handle.id = next(self._ids)
            self.counts["submitted"] += 1
            self._queue.append(handle)
        COMPUTE.wake()
        return handle

    def stats(self) -> dict:
        with self._lock:
            return {"queued": len(self._queue), "running": self._running_count, **self.counts}

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + self._running_count

    def close(self, cancel_running: bool = False, timeout: float | None = 30.0) -> None:
        """Stop accepting requests, fail the queued ones, let (or not) the running ones finish; then (up to
        `timeout`) wait until the compute thread has let the runner go."""
        with self._lock:
            self._closing = True
            dropped = list(self._queue)
            self._queue.clear()
        for handle in dropped:
            handle.state = "cancelled"
            handle._put(RunnerClosedError(f"model '{self.name}' was unloaded"))
        if cancel_running:
            for handle in list(self._owners.values()):
                handle._cancel.set()
        COMPUTE.wake()
        if threading.get_ident() != COMPUTE.ident:
            self._stopped.wait(timeout)

    # ---- what the compute thread calls ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue or self._owners or self._closing)

    def run_slice(self) -> bool:
        """A slice of steps (False once closed with nothing left to run: the compute thread lets the runner go)."""
        with self._lock:
            if self._closing and not self._queue and not self._owners:
                self._stopped.set()
                return False
        if self._batch is None:
            try:
                self._batch = self.engine.open_batch(self.max_active, adaptive_draft=self.adaptive_draft)
            except Exception as exc:  # noqa: BLE001 - no batch, no requests: each queued one fails, the next retries
                log.exception("runner %s: the batch engine could not be opened", self.name)
                self._fail_queued(exc)
                return True
            self.batch_stats = self._batch.stats
        try:
            self._run_slice(self._batch)
        except Exception as exc:  # noqa: BLE001 - a bug between steps must not stop the thread or hang requests
            log.exception("runner %s: a slice of steps failed", self.name)
            self._fail_all(self._batch, exc)
        return True

    def _fail_queued(self, exc: Exception) -> None:
        with self._lock:
            failed = list(self._queue)
            self._queue.clear()
            self.counts["failed"] += len(failed)
        for handle in failed:
            handle.state, handle.error = "failed", exc
            handle.timing.finished = time.perf_counter()
            handle._put(exc)

    # ---- internals ----------------------------------------------------------------------------------------------
    def _check(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], object]:
        """(prompt ids, the engine's check_request verdict: its grammar compiled here, off the compute thread)."""
        if isinstance(prompt, str):
            prompt_ids = self.engine.encode(prompt)
        elif isinstance(prompt, list):  # check_request checks the ids
            prompt_ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a list of token ids")
        return prompt_ids, self.engine.check_request(prompt_ids, params)

    def _drop(self, handle: RequestHandle) -> None:
        with self._lock:
            try:
                self._queue.remove(handle)
            except ValueError:
                return  # running (the worker sees the flag) or already over
            self.counts["cancelled"] += 1
        handle.state = "cancelled"
        handle.timing.finished = time.perf_counter()
        handle._put(RequestCancelledError("Request cancelled by client"))

    def _run_slice(self, batch) -> None:
        """For up to SLICE_SECONDS (runners of other models share the thread): admit queued requests into free rows
        between steps, run a step, deliver its events."""
        owners = self._owners
        deadline = time.perf_counter() + self.SLICE_SECONDS
        while time.perf_counter() < deadline:
            with self._lock:
                admitted = []
                while self._queue and len(owners) + len(admitted) < batch.max_batch_size:
                    admitted.append(self._queue.popleft())
                self._running_count = len(owners) + len(admitted)
            for handle in admitted:
                self._admit(batch, handle, owners)
            self._drop_cancelled(batch, owners)
            if not owners:
                return
            self._step(batch, owners)

    def _step(self, batch, owners: dict) -> None:
        try:
            outputs = batch.step()
        except Exception as exc:  # noqa: BLE001 - the requests in this batch fail, the worker goes on
            log.exception("runner %s: engine step failed", self.name)
            self._fail_all(batch, exc)
            return
        for seq, event in outputs:
            handle = owners[id(seq)]
            if isinstance(event, Exception):
                if not isinstance(event, RequestError):
                    log.error("runner %s: request %d failed: %s", self.name, handle.id, event)
                handle.error = event
                self._finish(handle, owners, "failed", event)
            else:
                self._deliver(handle, event, owners)

    def _fail_all(self, batch, exc: Exception) -> None:
        """End every admitted request with `exc` (the last resort: a failure that no single request owns)."""
        for handle in list(self._owners.values()):
            batch.cancel(handle.sequence)
            self._finish(handle, self._owners, "failed", exc)

    def _admit(self, batch: BatchEngine, handle: RequestHandle, owners: dict) -> None:
        timing = handle.timing
        timing.started = time.perf_counter()
        timing.started_ns = time.time_ns()
        handle.state = "running"
        try:
            handle.sequence = batch.add(handle.prompt_ids, handle.params, handle.checked)
        except Exception as exc:  # noqa: BLE001 - e.g. RequestError: delivered to this caller only
            handle.error = exc
            self._finish(handle, owners, "failed", exc)
            return
        owners[id(handle.sequence)] = handle

    def _drop_cancelled(self, batch: BatchEngine, owners: dict) -> None:
        for handle in [h for h in owners.values() if h.cancelled]:
            batch.cancel(handle.sequence)
            self._finish(handle, owners, "cancelled", RequestCancelledError("Request cancelled by client"))

    def _deliver(self, handle: RequestHandle, event: StreamEvent, owners: dict) -> None:
        timing = handle.timing
        now_ns = time.time_ns()
        if timing.first_event is None:
            timing.first_event = time.perf_counter()
            timing.first_token_ns = now_ns
        timing.last_token_ns = now_ns
        if event.result is not None:
            handle.result = event.result
            self._finish(handle, owners, "finished", event, _END)
        elif handle.streaming:
            handle._put(event)
        else:
            handle._held.append(event)

    def _finish(self, handle: RequestHandle, owners: dict, outcome: str, *terminal) -> None:
        """End an admitted request: the events held for it (if it is collected), then `terminal`."""
        owners.pop(id(handle.sequence), None)
        handle.timing.finished = time.perf_counter()
        handle.state = outcome
        with self._lock:
            self.counts[outcome] += 1
            self._running_count = len(owners)
        handle._put(*handle._held, *terminal)
        handle._held = []
