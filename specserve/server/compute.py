"""One thread for all of the server's tensor work: model loading, cost tables and every engine call.

PyTorch's OpenMP runtime (libgomp) gives every thread that opens a parallel region its own team of workers. With
the model loaded on the main thread and stepped on a runner thread there are two teams, more OpenMP threads than
cores, and libgomp then stops spinning between parallel regions: each of the ~100 regions of a decoding step waits
for sleeping workers to wake. On 2 cores the server decoded at half the offline engine's speed (the same
`BatchEngine` made 32 tok/s on a second thread and 69 on the first). Keeping every parallel region on this one
thread keeps one team.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class ComputeThread:
    """Runs callables one at a time on a single daemon thread; `run` blocks its caller until the result."""

    def __init__(self, name: str = "specserve-compute"):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def ident(self) -> int | None:
        return None if self._thread is None else self._thread.ident

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the compute thread (inline when called from it); its exception is re-raised."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        self._start()
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future.result()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller, the thread goes on
                future.set_exception(exc)


COMPUTE = ComputeThread()
