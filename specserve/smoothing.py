"""The one moving estimate of the measured times and shares the speculation choices keep (the draft length's
drafting time per token, the draft gates' arms, the tree budgets' level time and child share, the greedy screen's
path times): an exponential moving mean, each caller naming the share of its old estimate that a reading keeps.
Acceptance rates are decayed counts with a prior instead (speculative/policy/acceptance.py)."""

from __future__ import annotations


def smoothed(estimate: float | None, reading: float | None, keep: float) -> float | None:
    """keep * estimate + (1 - keep) * reading; the first reading as it is; without a reading, the estimate."""
    if reading is None:
        return estimate
    return reading if estimate is None else keep * estimate + (1 - keep) * reading
