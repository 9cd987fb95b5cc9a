"""Long prompts prefilled chunk by chunk (sequence.PREFILL_CHUNK tokens each), each in a cache of its own, between
the decoding steps of a batch's running requests. While others decode, chunks get at most SHARE of the time: each
decoding step's time earns chunks SHARE / (1 - SHARE) of it, each chunk spends its own, and a chunk runs when the
credit is not negative, so a long prompt slows the others by at most 1 / (1 - SHARE). With nobody decoding, chunks
run back to back and owe nothing. The shortest remaining prompt goes first."""

from __future__ import annotations

from specserve.engine.sequence import Sequence
from specserve.models.kv_cache import KVCache


class ChunkedPrefills:
    SHARE = 0.25  # of the time, at most, for long prompts' chunks while other requests decode

    def __init__(self, engine):
        self.engine = engine
        self.caches: dict[Sequence, KVCache] = {}  # the prompts being prefilled, each in its own cache
        self.credit = 0.0  # seconds of chunks the decoding requests' time has paid for

    def __len__(self) -> int:
        return len(self.caches)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self.caches

    def start(self, seq: Sequence) -> None:
        self.caches[seq] = KVCache.for_model(self.engine.model, 1, self.engine.capacity_for(seq.context, seq.params))

    def cancel(self, seq: Sequence) -> None:
        self.caches.pop(seq, None)

    def due(self, decoding: bool) -> Sequence | None:
        """The prompt whose chunk runs now, or None (none waiting, or the decoding requests' turn)."""
        if not self.caches or (decoding and self.credit < 0):
            return None
        return min(self.caches, key=lambda seq: self.engine.prefill_remaining(self.caches[seq], seq))

    def run(self, seq: Sequence) -> tuple[KVCache | None, object] | None:
        """The prompt's next chunk: None while more are left; after its last, (its cache, the event of the forward
        that sampled its first token); (None, the exception) where it failed, which ends this request alone."""
        cache = self.caches[seq]
        try:
            if self.engine.prefill_chunk(cache, seq):
                done = None
            else:
                del self.caches[seq]
                done = cache, self.engine.forward(cache, [seq])[0]
        except Exception as exc:  # noqa: BLE001 - this request's failure alone
            self.caches.pop(seq, None)
            done = None, exc
        return done

    def spent(self, seconds: float, decoding: bool) -> None:
        """A chunk took `seconds`, and then others were decoding or not (nobody waited for it: it owes nothing)."""
        self.credit = self.credit - seconds if decoding else 0.0

    def paid(self, decoding_seconds: float) -> None:
        """A decoding step took `decoding_seconds`: what it earns the chunks."""
        self.credit += decoding_seconds * self.SHARE / (1 - self.SHARE)
