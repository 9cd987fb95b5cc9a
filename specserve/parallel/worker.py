"""Ranks 1..N-1: join the group, load the model rank 0 names, keep this rank's shard, and run rank 0's commands
until it says exit.

A worker never decides anything: it replays rank 0's cache changes and runs each forward with rank 0's inputs, so
its KV caches stay those of rank 0 (for its own heads). Any error ends it with a non-zero exit status: a worker
that skipped a step would leave the ranks out of step, and rank 0 sees the closed connection and fails the model.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from functools import partial

import torch

from specserve.models import cpu_kernels
from specserve.models.loader import load_model
from specserve.models.transformer import CausalLM
from specserve.parallel.group import Group, Rendezvous, TensorParallelError, build_info, connect, seconds_from_env
from specserve.parallel.model import Envelope, Exit, Forward, Heartbeat, Logits, replay, resolve
from specserve.parallel.shard import ShardPlan, shard_model

LOAD_TIMEOUT_ENV = "SPECSERVE_TP_LOAD_TIMEOUT"  # seconds a rank waits for the others to load the model
DEFAULT_LOAD_TIMEOUT = 900.0


def load_shard(group: Group, setting: dict) -> CausalLM:
    """The model rank 0 loaded (`setting`: its source, dtype and quantization), as this rank's shard."""
    dtype = getattr(torch, setting["dtype"])
    target = load_model(setting["source"], dtype=dtype, quantization=setting["quantization"])
    model = target.model
    plan = ShardPlan.make(model.spec, group.rank, group.world_size, model.quantization != "none")
    shard_model(model, plan, group.reduce_sum,
                partial(group.gather_vocab, vocab_size=model.spec.vocab_size, shard=plan.vocab_shard))
    warm_kernels(model)
    return model


def warm_kernels(model: CausalLM) -> None:
    """Build (or load) the kernels the forward will call now: a first call inside a step would keep the other
    ranks waiting in a collective for as long as a compile takes."""
    cpu_kernels.available()
    if model.dtype == torch.float32:
        cpu_kernels.f32_linear_available()
    if model.quantization != "none":
        from specserve.models import quant

        quant.quant_path()


@torch.inference_mode()
def serve_commands(model: CausalLM, group: Group) -> None:
    """Run rank 0's commands until Exit."""
    caches: dict = {}
    while True:
        envelope: Envelope = group.broadcast()
        for op in envelope.cache_ops:
            replay(caches, op)
        command = envelope.command
        if isinstance(command, Forward):
            cache = resolve(caches, command.cache, command.lengths)
            model(command.tokens, command.positions, cache, command.slots, tree_mask=command.tree_mask,
                  output_layers=command.output_layers, logits_rows=command.logits_rows)
        elif isinstance(command, Logits):
            model.logits(command.hidden, command.row_invariant)
        elif isinstance(command, Exit):
            return
        elif not isinstance(command, Heartbeat):
            raise TensorParallelError(f"unknown command {type(command).__name__}")


def run_worker(rendezvous: Rendezvous, rank: int, threads: int | None = None) -> int:
    """A worker rank from start to exit; its exit status (0: rank 0 said exit)."""
    if threads:
        torch.set_num_threads(threads)
    try:
        group = connect(rendezvous, rank)
    except TensorParallelError as exc:
        return _failed(rank, exc)
    try:
        load_timeout = seconds_from_env(LOAD_TIMEOUT_ENV, DEFAULT_LOAD_TIMEOUT)
        group.check_builds(build_info(), load_timeout)
        setting = group.wait_for("load", load_timeout)
        try:
            model = load_shard(group, setting)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which names this rank in its error
            group.publish(f"loaded/{rank}", f"{type(exc).__name__}: {exc}")
            raise
        group.publish(f"loaded/{rank}", "ok")
        serve_commands(model, group)
        return 0
    except Exception as exc:  # noqa: BLE001 - any error ends this rank (see the module's docstring)
        return _failed(rank, exc)
    finally:
        group.close()


def _failed(rank: int, exc: BaseException) -> int:
    print(f"specserve tensor-parallel rank {rank}: {exc}", file=sys.stderr, flush=True)
    return 1


def spawned_worker(rendezvous: Rendezvous, rank: int, threads: int) -> None:
    """The entry of a rank started by rank 0 on this host (torch.multiprocessing): it dies with rank 0."""
    _die_with_parent()
    code = run_worker(rendezvous, rank, threads)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: gloo's threads can still be joinable when their C++ objects are destroyed
    # there, and std::terminate then turned a clean exit into SIGABRT (seen with four ranks on two cores)
    os._exit(code)


def _die_with_parent() -> None:
    """Linux: SIGTERM when the parent (rank 0) dies, however it dies; elsewhere the closed connection does it."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
