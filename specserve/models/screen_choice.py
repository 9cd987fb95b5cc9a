"""Which path a greedy lm_head call takes: the 5-bit screen (`screen_argmax`) or the whole 8-bit lm_head.

Both give each row's exact argmax, so the choice is about time only. The screen reads ~2/3 of the lm_head's bytes
and then computes exactly only the tiles whose upper bound reaches a row's best lower bound. Where the rows' logits
are peaked (text the model predicts well) that is a few hundred of the default model's 16k tiles, and a call costs
less than the plain lm_head. Where they are flat (random-token prompts, text the model has no guess for) most
tiles become candidates, and the screen pass plus their exact pass cost more than the plain lm_head (the figures:
docs/quantization.md, docs/design-notes.md).

Each path's time is followed per row count (buckets 1, 2, 3-4, 5-8, ...) as a moving mean of its calls, and a
call takes the path whose mean is lower; the screen keeps ties within `margin` (the VM's noise), as it wins on
text. The other path is still read now and then, so that a change is seen: the screen every `probe_every`-th call
of a row count while the plain lm_head is taken, the plain lm_head every `refresh_every`-th while the screen is
(its time hardly depends on the rows' values: it reads every byte and computes every output).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specserve.smoothing import smoothed


class ScreenChoice:
    """Per row-count bucket: each path's moving mean time and the bucket's calls."""

    KEEP = 0.75  # the share of a path's mean time that a new reading keeps

    def __init__(self, margin: float = 1.1, probe_every: int = 8, refresh_every: int = 64,
                 clock: Callable[[], float] = time.perf_counter):
        self.margin = margin
        self.probe_every = probe_every
        self.refresh_every = refresh_every
        self.clock = clock
        self.screen: dict[int, float] = {}  # bucket -> moving mean seconds
        self.plain: dict[int, float] = {}
        self.calls: dict[int, int] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return max(rows - 1, 0).bit_length()

    def uses_screen(self, rows: int) -> bool:
        """Whether the next call of `rows` rows should read the screen."""
        b = self.bucket(rows)
        if b not in self.screen:  # a bucket's first call reads the screen (and warms the caches), its second the
            return True  # plain lm_head
        if b not in self.plain:
            return False
        calls = self.calls[b]
        if self.screen[b] <= self.margin * self.plain[b]:
            return calls % self.refresh_every != 0
        return calls % self.probe_every == 0

    def timed(self, rows: int, screen: bool, run: Callable[[], torch.Tensor]):
        """run() timed as a call of `rows` rows on the path `screen` names."""
        start = self.clock()
        out = run()
        seconds = self.clock() - start
        b = self.bucket(rows)
        self.calls[b] = self.calls.get(b, 0) + 1
        means = self.screen if screen else self.plain
        means[b] = smoothed(means.get(b), seconds, self.KEEP)
        return out
