"""The runner on its own: FIFO, bounded queue, cancellation (queued and running), failures don't stop the others."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specserve.engine.engine import RequestError
from specserve.engine.output import StreamEvent
from specserve.engine.request import GenerationResult, RequestMetrics
from specserve.server.runner import QueueFullError, RequestCancelledError, Runner, RunnerClosedError
from specserve.speculative.sampling import SamplingParams
from tests.server.stream_batch import StreamBatch


class FakeEngine:
    """Emits one token per step (sleeping `delay`); prompt "boom" raises mid-stream; records the order it ran."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.order: list[str] = []
        self.steps = 0
        self.gate = threading.Event()
        self.gate.set()

    def encode(self, text: str) -> list[int]:
        if not text:
            raise RequestError("prompt must be a non-empty string")
        return [ord(c) for c in text]

    def check_request(self, ids, params) -> None:
        try:
            params.validate()
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if len(ids) > 50:
            raise RequestError("prompt too long")

    def open_batch(self, max_active: int, adaptive_draft: bool = True) -> StreamBatch:
        return StreamBatch(self)

    def stream(self, prompt, params):
        self.order.append("".join(chr(i) for i in prompt))
        for i in range(params.max_tokens):
            self.gate.wait(5)
            time.sleep(self.delay)
            self.steps += 1
            if prompt == self.encode("boom") and i == 1:
                raise RuntimeError("kaboom")
            last = i == params.max_tokens - 1
            result = GenerationResult("x" * (i + 1), [7] * (i + 1), "length", RequestMetrics()) if last else None
            yield StreamEvent("x", [7], result)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def params(n: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=n)


def test_runs_fifo_and_collects():
    engine = FakeEngine()
    runner = Runner(engine, max_queue_size=8)

    async def main():
        handles = [await runner.submit(p, params()) for p in ("a", "b", "c")]
        return [await h.collect() for h in handles]

    outs = run(main())
    assert engine.order == ["a", "b", "c"]
    assert [o.text for o in outs] == ["xxx"] * 3
    assert all(o.result.finish_reason == "length" for o in outs)
    assert runner.stats()["finished"] == 3
    runner.close()


def count_hand_offs(handle) -> list[int]:
    """The number of items in each hand-off from the compute thread to the handle's event loop."""
    sizes, put = [], handle._put
    handle._put = lambda *items: (sizes.append(len(items)), put(*items))
    return sizes


def test_collected_request_gets_its_events_in_one_hand_off():
    """A consumer that waits for the end is handed the events once, at the end; a streaming one, step by step.
    Each hand-off wakes the event loop, which takes a core from the forward."""
    engine = FakeEngine()
    runner = Runner(engine)

    async def main():
        engine.gate.clear()
        collected = await runner.submit("a", params(5))
        collected_sizes = count_hand_offs(collected)
        task = asyncio.ensure_future(collected.collect())
        await asyncio.sleep(0)  # collect() has started
        engine.gate.set()
        out = await task
        streamed = await runner.submit("b", params(5))
        streamed_sizes = count_hand_offs(streamed)
        texts = [event.text async for event in streamed]
        return out, collected_sizes, texts, streamed_sizes

    out, collected_sizes, texts, streamed_sizes = run(main())
    assert (out.text, out.token_ids, out.result.text) == ("xxxxx", [7] * 5, "xxxxx")
    assert collected_sizes == [6]  # 5 events and the end
    assert texts == ["x"] * 5 and len(streamed_sizes) >= 4
    runner.close()


def test_bad_request_raises_at_submit():
    runner = Runner(FakeEngine())

    async def main():
        with pytest.raises(RequestError):
            await runner.submit("x" * 60, params())
        with pytest.raises(RequestError):
            await runner.submit("", params())
        with pytest.raises(RequestError, match="max_tokens"):
            await runner.submit("a", SamplingParams(max_tokens=-1))

    run(main())
    runner.close()


def test_queue_full_then_drains():
    engine = FakeEngine()
    engine.gate.clear()  # the first request blocks inside the engine
    runner = Runner(engine, max_queue_size=2)

    async def main():
        first = await runner.submit("a", params(1))
        for _ in range(100):  # the worker picks it up
            if runner.stats()["running"]:
                break
            await asyncio.sleep(0.01)
        queued = [await runner.submit(p, params(1)) for p in ("b", "c")]
        with pytest.raises(QueueFullError):
            await runner.submit("d", params(1))
        engine.gate.set()
        return [await h.collect() for h in [first, *queued]]

    outs = run(main())
    assert len(outs) == 3 and runner.stats()["rejected"] == 1
    runner.close()


def test_cancel_queued_is_dropped_and_running_stops_at_next_step():
    engine = FakeEngine(delay=0.01)
    runner = Runner(engine, max_queue_size=4)

    async def main():
        long = await runner.submit("long", params(1000))
        queued = await runner.submit("queued", params(3))
        await long.__anext__()
        queued.cancel()
        assert runner.stats()["queued"] == 0
        with pytest.raises(RequestCancelledError):
            await queued.collect()
        long.cancel()
        with pytest.raises(RequestCancelledError):
            async for _ in long:
                pass

    run(main())
    assert engine.order == ["long"]  # the cancelled queued request never ran
    assert engine.steps < 100
    stats = runner.stats()
    assert stats["cancelled"] == 2 and stats["running"] == 0
    runner.close()


def test_consumer_task_cancelled_stops_request():
    engine = FakeEngine(delay=0.01)
    runner = Runner(engine)

    async def main():
        handle = await runner.submit("a", params(1000))

        async def consume():
            async for _ in handle:
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(200):
            if runner.stats()["running"] == 0:
                break
            await asyncio.sleep(0.01)

    run(main())
    assert runner.stats()["cancelled"] == 1 and engine.steps < 200
    runner.close()


def test_failing_request_does_not_stop_the_worker():
    runner = Runner(FakeEngine())

    async def main():
        bad = await runner.submit("boom", params(5))
        good = await runner.submit("fine", params(2))
        with pytest.raises(RuntimeError, match="kaboom"):
            await bad.collect()
        return await good.collect()

    assert run(main()).text == "xx"
    assert runner.stats()["failed"] == 1 and runner.stats()["finished"] == 1
    runner.close()


def test_close_fails_queued_and_refuses_new():
    engine = FakeEngine()
    engine.gate.clear()
    runner = Runner(engine)

    async def main():
        first = await runner.submit("a", params(1))
        for _ in range(200):  # the worker picks it up (blocked in the engine)
            if runner.stats()["running"]:
                break
            await asyncio.sleep(0.01)
        second = await runner.submit("b", params(1))
        closer = threading.Thread(target=runner.close)
        closer.start()
        await asyncio.sleep(0.05)
        with pytest.raises(RunnerClosedError):
            await second.collect()
        with pytest.raises(RunnerClosedError):
            await runner.submit("c", params(1))
        engine.gate.set()
        out = await first.collect()  # the running one finishes
        closer.join(5)
        return out

    assert run(main()).text == "x"


class Recorder:
    """A RequestObserver that lists what it heard."""

    def __init__(self):
        self.heard: list[tuple] = []

    def succeeded(self, handle, result):
        self.heard.append(("succeeded", result.finish_reason))

    def failed(self, exc, timing):
        self.heard.append(("failed", type(exc).__name__, timing is not None))

    def ended(self, handle):
        self.heard.append(("ended", handle is not None))


def test_observer_hears_each_outcome_once():
    runner = Runner(FakeEngine(delay=0.01), max_queue_size=8)
    done, refused, closed, broken = Recorder(), Recorder(), Recorder(), Recorder()

    async def main():
        handle = await runner.submit("a", params(2), observer=done)
        out = await handle.collect()
        await handle.aclose()  # closing again after the end changes nothing
        assert out.text == "xx" and out.token_ids == [7, 7] and out.result.finish_reason == "length"
        with pytest.raises(RequestError):
            await runner.submit("x" * 60, params(), observer=refused)
        handle = await runner.submit("b", params(1000), observer=closed)
        await handle.__anext__()
        await handle.aclose()  # the consumer leaves before the result: the request stops
        with pytest.raises(RuntimeError, match="kaboom"):
            await (await runner.submit("boom", params(5), observer=broken)).collect()

    run(main())
    assert done.heard == [("succeeded", "length"), ("ended", True)]
    assert refused.heard == [("failed", "RequestError", False), ("ended", False)]
    assert closed.heard == [("failed", "RequestCancelledError", True), ("ended", True)]
    assert broken.heard == [("failed", "RuntimeError", True), ("ended", True)]
    for _ in range(200):
        if runner.stats()["running"] == 0:
            break
        time.sleep(0.01)
    assert runner.stats()["cancelled"] == 1
    runner.close()


def test_runners_step_on_the_compute_thread_without_threads_of_their_own():
    """A request crosses the event loop, the tokenizer's thread and the compute thread: another runner (another
    model) adds no thread, and both answer."""
    async def ask(*runners):
        handles = [await runner.submit("a", params()) for runner in runners]
        return [(await handle.collect()).text for handle in handles]

    first = Runner(FakeEngine(), name="first")
    assert run(ask(first)) == ["xxx"]  # the compute and tokenizer threads are up
    threads = threading.active_count()
    second = Runner(FakeEngine(), name="second")
    assert run(ask(first, second)) == ["xxx", "xxx"]
    assert threading.active_count() == threads
    for runner in (first, second):
        runner.close()


def test_a_batch_that_cannot_be_opened_fails_the_queued_requests():
    class NoBatch(FakeEngine):
        def open_batch(self, max_active: int, adaptive_draft: bool = True):
            raise RuntimeError("no memory for the batch")

    runner = Runner(NoBatch())

    async def main():
        handle = await runner.submit("a", params())
        with pytest.raises(RuntimeError, match="no memory"):
            await handle.collect()

    run(main())
    assert runner.stats()["failed"] == 1
    runner.close(timeout=5)
    assert runner._stopped.is_set()  # the compute thread let it go
