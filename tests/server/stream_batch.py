"""A batch of one request at a time over an engine's own `stream`: what test engines that wrap or replace
`Engine.stream` (fault injection, fakes) hand the runner from `open_batch` in place of a BatchEngine."""

from __future__ import annotations

from collections import deque

from specserve.engine.scheduler import BatchStats
from specserve.engine.output import StreamEvent
from specserve.speculative.sampling import SamplingParams


class StreamBatch:
    """The BatchEngine interface over anything with `stream(prompt_ids, params)`, one request at a time."""

    max_batch_size = 1

    def __init__(self, engine):
        self.engine = engine
        self.stats = BatchStats()
        self.waiting: deque = deque()
        self.current = None  # (token, generator)

    def add(self, prompt_ids: list[int], params: SamplingParams, checked=None):
        token = object()
        self.waiting.append((token, prompt_ids, params))
        return token

    def cancel(self, token) -> None:
        self.waiting = deque(item for item in self.waiting if item[0] is not token)
        if self.current and self.current[0] is token:
            self.current[1].close()
            self.current = None

    def has_work(self) -> bool:
        return bool(self.waiting) or self.current is not None

    def step(self) -> list[tuple[object, StreamEvent | Exception]]:
        if self.current is None:
            if not self.waiting:
                return []
            token, prompt_ids, params = self.waiting.popleft()
            self.current = (token, self.engine.stream(prompt_ids, params))
        token, generator = self.current
        try:
            event = next(generator)
        except StopIteration:
            self.current = None
            return []
        except Exception as exc:  # noqa: BLE001 - ends this request only
            self.current = None
            return [(token, exc)]
        if event.result is not None:
            generator.close()
            self.current = None
        return [(token, event)]
