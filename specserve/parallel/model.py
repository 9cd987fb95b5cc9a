"""Rank 0's view of a tensor-parallel target: the CausalLM interface the engine and the drafters use, run on every
rank.

Each call broadcasts one small command (the forward's tokens, positions, cache slots, tree mask, logits rows and the
cache's committed lengths; or an lm_head call from a drafter), then rank 0 runs its own shard, whose all-reduces
and vocabulary gather meet the other ranks', and returns the logits. The other ranks run the same commands in the
same order (worker.py), so their KV caches stay the same as rank 0's.

A KV cache of this model is a ShardedKVCache: rank 0's shard of the keys and values, whose every change outside a
forward (grow / shrink, a row moved or copied, an accepted tree path compacted, freed) is recorded and sent ahead of
the next command, with the committed lengths it was made under. The engine keeps using plain KVCache calls.

A collective that fails (a rank died: gloo reports the closed connection at once; a silent rank: the step timeout)
marks the model failed: `failure` says why, every later call raises TensorParallelError at once, the ranks this
process started are stopped, and the server reports the model not ready. While idle, rank 0 sends a heartbeat
every HEARTBEAT_SECONDS, so the other ranks' waits never reach the step timeout and a dead rank is noticed without a
request.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from specserve.models.kv_cache import KVCache
from specserve.models.transformer import CausalLM, ForwardOutput
from specserve.parallel.group import Group, TensorParallelError

HEARTBEAT_SECONDS = 2.0
log = logging.getLogger("specserve.parallel")


# ---- the commands rank 0 broadcasts ------------------------------------------------------------------------------

CacheRef = tuple  # (cache id, first row of a view or None for the whole cache, rows of the view)


@dataclass
class Forward:
    cache: CacheRef
    lengths: torch.Tensor  # the whole cache's committed lengths on rank 0
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tree_mask: torch.Tensor | None
    output_layers: tuple[int, ...]
    logits_rows: torch.Tensor | None


@dataclass
class Logits:
    """The lm_head over hidden states (an EAGLE-1 head drafts through the target's lm_head)."""

    hidden: torch.Tensor
    row_invariant: bool


@dataclass
class Heartbeat:
    pass


@dataclass
class Exit:
    pass


@dataclass
class Envelope:
    """One broadcast: the cache changes made since the last one (in order), then the command."""

    cache_ops: list = field(default_factory=list)
    command: object = None


# ---- the KV cache ------------------------------------------------------------------------------------------------

class ShardedKVCache(KVCache):
    """Rank 0's shard of a KV cache kept alike on every rank: each change is also recorded for the other ranks."""

    def __init__(self, owner: "TensorParallelModel", cache_id: int, batch: int, capacity: int,
                 max_batch: int | None, max_capacity: int | None):
        spec = owner.local.spec  # this rank's KV heads
        super().__init__(spec.num_layers, batch, spec.num_kv_heads, capacity, spec.head_dim, owner.local.dtype,
                         max_batch, max_capacity)
        self.owner, self.cache_id, self.root, self.offset = owner, cache_id, self, None
        weakref.finalize(self, owner.record, ("free", cache_id))

    @property
    def ref(self) -> CacheRef:
        return (self.cache_id, self.offset, self.batch if self.offset is not None else None)

    def _lengths(self) -> torch.Tensor:
        return self.root.lengths.clone()

    def fit(self, rows: int, slots: int) -> None:
        before, lengths = (self.batch, self.capacity), self._lengths()
        super().fit(rows, slots)
        if (self.batch, self.capacity) != before:  # a no-op on rank 0 is one on every rank
            self.owner.record(("fit", self.ref, lengths, rows, slots))

    def copy_row_from(self, other: KVCache, src: int, dst: int) -> None:  # move_row comes here too
        if not isinstance(other, ShardedKVCache) or other.owner is not self.owner:
            raise TypeError("a tensor-parallel cache copies rows only from another cache of the same model")
        self.owner.record(("copy_row", self.ref, self._lengths(), other.ref, other._lengths(), src, dst))
        super().copy_row_from(other, src, dst)

    def compact(self, row: int, src_slots: torch.Tensor, dst_start: int) -> None:
        self.owner.record(("compact", self.ref, row, src_slots.clone(), dst_start))
        super().compact(row, src_slots, dst_start)

    def view(self, start: int, count: int) -> "ShardedKVCache":
        part = super().view(start, count)
        part.offset = (self.offset or 0) + start
        return part


def replay(caches: dict[int, KVCache], op: tuple) -> None:
    """Apply one recorded cache change (ShardedKVCache) to this rank's caches `caches` (id -> KVCache)."""
    kind = op[0]
    if kind == "new":
        _, cache_id, args = op
        caches[cache_id] = KVCache(*args)
    elif kind == "free":
        caches.pop(op[1], None)
    elif kind == "fit":
        _, ref, lengths, rows, slots = op
        resolve(caches, ref, lengths).fit(rows, slots)
    elif kind == "copy_row":
        _, ref, lengths, src_ref, src_lengths, src, dst = op
        source = resolve(caches, src_ref, src_lengths)
        resolve(caches, ref, lengths).copy_row_from(source, src, dst)
    elif kind == "compact":
        _, ref, row, src_slots, dst_start = op
        resolve(caches, ref).compact(row, src_slots, dst_start)
    else:
        raise TensorParallelError(f"unknown cache operation {kind!r}")


def resolve(caches: dict[int, KVCache], ref: CacheRef, lengths: torch.Tensor | None = None) -> KVCache:
    """The cache (or view) `ref` names, its whole cache's committed lengths first set to rank 0's `lengths`."""
    cache_id, offset, count = ref
    cache = caches[cache_id]
    if lengths is not None:
        cache.lengths = lengths.clone()
    return cache if offset is None else cache.view(offset, count)


# ---- the model ---------------------------------------------------------------------------------------------------

class TensorParallelModel:
    """The target as the engine sees it (CausalLM's forward, logits, embed, spec, dtype, ...), on every rank."""

    def __init__(self, local: CausalLM, spec, group: Group, processes: list | None = None):
        self.local = local  # rank 0's shard
        self.spec = spec  # the whole model's (the shard's has its own head counts)
        self.group = group
        self.processes = processes or []  # the ranks this process started (single host)
        self.failure: str | None = None
        self.closed = False
        self.threads_before: int | None = None  # this process's torch threads before the ranks split the cores
        self._lock = threading.Lock()  # one command, with all its collectives, at a time
        self._ops: deque = deque()  # cache changes not yet sent
        self._ids = iter(range(1, 1 << 62))
        self._last_sent = time.monotonic()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="specserve-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    # ---- the CausalLM interface ------------------------------------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        return self.group.world_size

    @property
    def hf_config(self):
        return self.local.hf_config

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def quantization(self) -> str:
        return self.local.quantization

    @property
    def kernels_usable(self) -> bool:
        return self.local.kernels_usable

    @property
    def model(self):
        """The inner decoder (its embedding table is whole on every rank; its layers are rank 0's shards)."""
        return self.local.model

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.local.embed(tokens)

    def new_kv_cache(self, batch: int, capacity: int, max_batch: int | None = None,
                     max_capacity: int | None = None) -> ShardedKVCache:
        """A KV cache on every rank (KVCache.for_model and .growable come here)."""
        cache = ShardedKVCache(self, next(self._ids), batch, capacity, max_batch, max_capacity)
        args = (cache.num_layers, batch, cache.num_kv_heads, capacity, cache.head_dim, cache.dtype, max_batch,
                max_capacity)
        self.record(("new", cache.cache_id, args))
        return cache

    ragged_logits = False  # logits_counts and greedy are ignored: the ranks compute the padded form together

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                 tree_mask: torch.Tensor | None = None, output_layers: tuple[int, ...] = (),
                 logits_rows: torch.Tensor | None = None, logits_counts: list[int] | None = None,
                 greedy: bool = False) -> ForwardOutput:
        """CausalLM.forward on every rank; the logits (and hidden states) are rank 0's, for every logits row
        (`ragged_logits`)."""
        self._check_forward(tokens, cache, slots)
        command = Forward(cache.ref, cache.root.lengths.clone(), tokens, positions, slots, tree_mask,
                          tuple(output_layers), logits_rows)
        return self._run(command, lambda: self.local(tokens, positions, cache, slots, tree_mask=tree_mask,
                                                     output_layers=output_layers, logits_rows=logits_rows))

    forward = __call__

    def logits(self, hidden: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """The lm_head (every rank's vocabulary slice) over hidden states computed on rank 0."""
        hidden = hidden.contiguous()
        return self._run(Logits(hidden, row_invariant), lambda: self.local.logits(hidden, row_invariant))

    def _check_forward(self, tokens: torch.Tensor, cache: KVCache, slots: torch.Tensor) -> None:
        """The errors a forward can meet on its input, raised before any rank starts it: a rank that raised
        halfway would leave the others waiting in a collective."""
        if not isinstance(cache, ShardedKVCache) or cache.owner is not self:
            raise TypeError("a tensor-parallel model runs on its own caches (KVCache.for_model / growable)")
        span = int(slots.max()) + 1 if slots.numel() else 0
        if span > cache.capacity:
            raise ValueError(f"KV cache overflow: need {span} slots, capacity is {cache.capacity}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.spec.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")

    # ---- commands --------------------------------------------------------------------------------------------
    def record(self, op: tuple) -> None:
        """A cache change for the other ranks, sent ahead of the next command (any thread: the garbage collector
        frees caches)."""
        self._ops.append(op)

    def _take_ops(self) -> list:
        ops = []
        while True:
            try:
                ops.append(self._ops.popleft())
            except IndexError:
                return ops

    def _run(self, command, local):
        """Broadcast `command` and run rank 0's part; any failure once the ranks started is the group's."""
        with self._lock:
            self._raise_if_failed()
            try:
                self.group.broadcast(Envelope(self._take_ops(), command))
                result = local()
            except Exception as exc:  # noqa: BLE001 - a rank failed, or ranks may no longer be in step
                raise self._fail(exc) from exc
            self._last_sent = time.monotonic()
            return result

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self.closed:
            raise TensorParallelError("the tensor-parallel model was shut down")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS / 2):
            with self._lock:
                if self.failure is not None or self.closed:
                    return
                if time.monotonic() - self._last_sent < HEARTBEAT_SECONDS:
                    continue
                try:
                    self.group.broadcast(Envelope(self._take_ops(), Heartbeat()))
                except Exception as exc:  # noqa: BLE001 - a rank died while idle
                    self._fail(exc)
                    return
                self._last_sent = time.monotonic()

    def _fail(self, exc: BaseException) -> TensorParallelError:
        """Mark the model failed (the first failure's reason stays), stop the ranks this process started."""
        if self.failure is None:
            time.sleep(0.2)  # a killed rank's exit status shows a moment after its connection closed
            dead = [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]
            cause = "; ".join(dead) if dead else f"{type(exc).__name__}: {exc}"
            self.failure = f"tensor-parallel model failed: {cause}; restart the server"
            log.error("%s", self.failure)
            self._stop.set()
            self._stop_processes()
            self.group.close()
            self._restore_threads()
        return TensorParallelError(self.failure)

    def _restore_threads(self) -> None:
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)

    def _stop_processes(self, grace: float = 0.0) -> None:
        stop_processes(self.processes, grace)

    def close(self) -> None:
        """Tell the other ranks to exit and leave the group (idempotent)."""
        self._stop.set()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.failure is None:
                try:
                    self.group.broadcast(Envelope(self._take_ops(), Exit()))
                except Exception:  # noqa: BLE001 - a rank already gone: stopping is all that is left
                    pass
                self._stop_processes(grace=10.0)
                self.group.close()
                self._restore_threads()


def stop_processes(processes: list, grace: float = 0.0) -> None:
    """End the ranks this process started: `grace` seconds to exit by themselves, then SIGTERM, then SIGKILL."""
    for process in processes:
        process.join(grace)
        if process.exitcode is None:
            process.terminate()
            process.join(5)
        if process.exitcode is None:
            process.kill()
            process.join(5)
