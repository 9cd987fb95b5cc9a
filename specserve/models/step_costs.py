"""The target's measured cost of one forward by the number of tokens in it: what drafting trades against.

`StepCosts` times forwards of 1..64 tokens once; the batch engine picks draft lengths from it and EAGLE's tree
budget sizes trees with it (`measured_step_costs`, kept in the cache directory across starts).
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specserve.files import write_text_atomically
from specserve.models import cpu_kernels
from specserve.models.kv_cache import KVCache
from specserve.models.loader import LoadedModel, cache_root


class StepCosts:
    """Seconds per target forward by total tokens in it, measured once (interpolated in between). With
    `lm_head`, also the lm_head's share by rows of logits, so a forward whose padded rows get no logits
    (CausalLM's logits_counts) is priced as it runs."""

    # The kernels' tiles take up to 9 rows a pass (an 8-node tree and its root), so 10 and 19 rows start another
    # pass over the weights: a step up in cost that interpolating between powers of two misses
    SIZES = (1, 2, 4, 8, 9, 10, 16, 19, 32, 64)

    def __init__(self, model, rows: int, seconds: list[float] | None = None, lm_head: bool = False,
                 head: list[float] | None = None):
        self.sizes = list(self.SIZES)
        self.head: list[float] | None = None if head is None else list(head)
        if seconds is not None:  # measured earlier (a cached table)
            self.seconds = list(seconds)
            return
        self.seconds = self._monotone(self.least_disturbed([self.forward_run(model, s, rows) for s in self.sizes]))
        if lm_head:
            head = self._monotone(self.least_disturbed([self.head_run(model, s) for s in self.sizes]))
            self.head = [min(h, total) for h, total in zip(head, self.seconds)]

    @staticmethod
    def _monotone(measured: list[float]) -> list[float]:
        # a smaller forward never costs more: a bigger reading is noise (another process took the CPU; noise only
        # adds time), so it is clipped to the sizes above, rather than raising them all (which made drafting
        # look far dearer than it is and stopped it at concurrency 1)
        return [min(measured[i:]) for i in range(len(measured))]

    @staticmethod
    def forward_run(model, total: int, rows: int) -> Callable[[], object]:
        """A forward of `total` new tokens over up to `rows` rows, to be timed."""
        batch = min(rows, total)
        width = -(-total // batch)
        cache = KVCache.for_model(model, batch, width + 1)
        positions = torch.arange(width)[None].expand(batch, width)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        return lambda: model(tokens, positions, cache, positions)

    @staticmethod
    def head_run(model, rows: int) -> Callable[[], object]:
        """The lm_head over `rows` rows, to be timed."""
        hidden = torch.zeros(rows, model.spec.hidden_size, dtype=model.dtype)
        return lambda: model.logits(hidden, model.kernels_usable)

    @staticmethod
    def least_disturbed(runs: list[Callable[[], object]], rounds: int = 3) -> list[float]:
        """Each run's least disturbed time over `rounds` rounds through all of them: a burst of load hits one
        round, not every reading of one size, and the first round's first touches (the weights' pages, each
        size's buffers) are slower than the later rounds, so no run needs a warm-up of its own."""
        timings = [[] for _ in runs]
        for _ in range(rounds):
            for run, times in zip(runs, timings):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
        return [min(times) for times in timings]

    def __call__(self, total: int, with_logits: int | None = None) -> float:
        """A forward of `total` tokens, of which `with_logits` (default: all) get logits."""
        seconds = self._interpolate(self.seconds, total)
        if with_logits is None or self.head is None:
            return seconds
        return seconds - self._interpolate(self.head, total) + self._interpolate(self.head, with_logits)

    def _interpolate(self, table: list[float], total: int) -> float:
        for (s0, c0), (s1, c1) in zip(zip(self.sizes, table), zip(self.sizes[1:], table[1:])):
            if total <= s1:
                return c0 + (c1 - c0) * max(total - s0, 0) / (s1 - s0)
        return table[-1] * total / self.sizes[-1]


_MEASURED: dict[tuple[int, int, bool], StepCosts] = {}
TABLES_KEPT = 32  # in the cache directory's verify_costs.json


def code_version() -> str:
    """A digest of the forward's code (kernels and the model): a table measured on older code is measured again,
    since a faster forward changes the draft lengths and tree sizes the table leads to."""
    import hashlib

    models = Path(__file__).resolve().parent
    sources = sorted(models.glob("*.py")) + sorted((models.parent / "csrc").glob("*.[chi]*"))  # .cpp .h .inc
    return hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:12]


def measured_step_costs(target: LoadedModel, rows: int = 1, lm_head: bool = False) -> StepCosts:
    """StepCosts over up to `rows` rows (with the lm_head's share when `lm_head`): measured once per model, rows,
    dtype, machine and code version, and kept in the cache directory (a 64-token forward of a 1.5B model is most of
    a second, and the table runs each size 4 times)."""
    memo = (id(target.model), rows, lm_head)
    if memo in _MEASURED:
        return _MEASURED[memo]
    key = f"{Path(target.path).resolve()}|{target.model.dtype}|{target.model.quantization}|" \
          f"{platform.processor() or platform.machine()}|{torch.get_num_threads()}|{torch.__version__}|" \
          f"{target.model.kernels_usable}|{cpu_kernels.f32_linear_available()}|{code_version()}" \
          f"|tp{getattr(target.model, 'tensor_parallel_size', 1)}|rows{rows}|head{int(lm_head)}"
    file = cache_root() / "verify_costs.json"
    try:
        table = json.loads(file.read_text()) if file.exists() else {}
    except ValueError:
        table = {}
    entry = table.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("seconds"), list):
        costs = StepCosts(None, rows, entry["seconds"], head=entry.get("head"))
    else:
        costs = StepCosts(target.model, rows, lm_head=lm_head)
        # the most recent entries only: every new code version, model path or thread count adds one
        table = dict(list(table.items())[-(TABLES_KEPT - 1):])
        table[key] = {"seconds": costs.seconds, "head": costs.head}
        try:
            write_text_atomically(file, json.dumps(table))
        except OSError:  # a read-only cache: the next start measures again
            pass
    _MEASURED[memo] = costs
    return costs
