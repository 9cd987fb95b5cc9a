"""Long prompts prefilled chunk by chunk (sequence.PREFILL_CHUNK tokens each), each in a cache of its own, between
the decoding steps of a batch's running requests. While others decode, chunks get at most SHARE of the time: each
decoding step's time earns chunks SHARE / (1 - SHARE) of it, each chunk spends its own, and a chunk runs when the
credit is not negative, so a long prompt slows the others by at most 1 / (1 - SHARE). With nobody decoding, chunks
run back to back and owe nothing. The shortest remaining prompt goes first."""

from __future__ import annotations

from specserve.engine.sequence import Sequence, kv_capacity
from specserve.models.kv_cache import KVCache


class ChunkedPrefills:
    SHARE = 0.25  # of the time, at most, for long prompts' chunks while other requests decode

    def __init__(self, model, draft_slots: int):
        self.model, self.draft_slots = model, draft_slots
        self.caches: dict[Sequence, KVCache] = {}  # the prompts being prefilled, each in its own cache
        self.credit = 0.0  # seconds of chunks the decoding requests' time has paid for

    def __len__(self) -> int:
        return len(self.caches)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self.caches

    def start(self, seq: Sequence) -> None:
        capacity = kv_capacity(len(seq.context), seq.params, self.draft_slots)
        self.caches[seq] = KVCache.for_model(self.model, 1, capacity)

    def cancel(self, seq: Sequence) -> None:
        self.caches.pop(seq, None)

    def due(self, decoding: bool) -> Sequence | None:
        """The prompt whose chunk runs now, or None (none waiting, or the decoding requests' turn)."""
        if not self.caches or (decoding and self.credit < 0):
            return None
        return min(self.caches, key=lambda seq: seq.uncached(int(self.caches[seq].lengths[0])))

    def spent(self, seconds: float, decoding: bool) -> None:
        """A chunk took `seconds`, and then others were decoding or not (nobody waited for it: it owes nothing)."""
        self.credit = self.credit - seconds if decoding else 0.0

    def paid(self, decoding_seconds: float) -> None:
        """A decoding step took `decoding_seconds`: what it earns the chunks."""
        self.credit += decoding_seconds * self.SHARE / (1 - self.SHARE)
