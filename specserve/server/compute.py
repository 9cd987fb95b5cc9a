"""One thread for all of the server's tensor work: model loading, cost tables and every engine call.

PyTorch's OpenMP runtime (libgomp) gives every thread that opens a parallel region its own team of workers. With
the model loaded on the main thread and stepped on a runner thread there are two teams, more OpenMP threads than
cores, and libgomp then stops spinning between parallel regions: each of the ~100 regions of a decoding step waits
for sleeping workers to wake. On 2 cores the server decoded at half the offline engine's speed (the same
`BatchEngine` made 32 tok/s on a second thread and 69 on the first). Keeping every parallel region on this one
thread keeps one team.

The thread also runs the models' continuous batching (server/runner.py): each runner with work gets a slice of
steps in turn, between the calls other threads hand it, so a request crosses the event loop, the tokenizer's thread
and this one, and no runner needs a thread of its own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol


class Stepper(Protocol):
    """What the thread schedules besides calls: a runner's slices of steps."""

    def has_work(self) -> bool: ...

    def run_slice(self) -> bool:
        """A slice of steps; False once the stepper is done for good (it is then dropped)."""


class ComputeThread:
    """Runs callables one at a time on a single daemon thread; `run` blocks its caller until the result. Between
    calls it runs a slice of each attached stepper that has work."""

    def __init__(self, name: str = "specserve-compute"):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._steppers: list[Stepper] = []

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

    def attach(self, stepper: Stepper) -> None:
        """Schedule `stepper`'s slices from now on, until one returns False."""
        with self._lock:
            self._steppers.append(stepper)
        self.wake()

    def wake(self) -> None:
        """Look again at the steppers' work (one has some now, or is closing)."""
        self._start()
        self._jobs.put(None)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                busy = [stepper for stepper in self._steppers if stepper.has_work()]
            try:
                job = self._jobs.get(block=not busy)  # idle: wait for a call or a wake-up
            except queue.Empty:
                job = None
            if job is not None:
                future, fn, args, kwargs = job
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - delivered to the caller, the thread goes on
                    future.set_exception(exc)
            for stepper in busy:
                if not stepper.run_slice():
                    with self._lock:
                        self._steppers.remove(stepper)


COMPUTE = ComputeThread()
