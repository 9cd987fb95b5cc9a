"""Starting a tensor-parallel target: rank 0 (the process that serves) and its N - 1 other ranks.

On one host specserve starts the other ranks itself (torch.multiprocessing, spawned: a fresh interpreter each), on
a free loopback port, splitting the cores between the ranks. Across hosts torchrun starts one process per rank with
the same command line everywhere; its environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) says where rank 0 is,
and `specserve serve` / `generate` on a rank other than 0 becomes a worker (cli.py).

The model is checked against N before any process starts (heads, KV heads, MLP width, quantization blocks). Rank 0
loads first (a GGUF's first conversion and the kernels' first build happen once, in one process), then names the
model to the other ranks, which load it too and report; a failure anywhere stops every rank this process started
and raises with the failing rank's reason.
"""

from __future__ import annotations

import atexit
import os
from functools import partial

import torch

from specserve.checks import ConfigError
from specserve.models.loader import (LoadedModel, load_hf_config, load_model, parse_dtype, resolve_model_source,
                                     resolve_quantization)
from specserve.models.transformer import ArchSpec
from specserve.parallel.group import Group, Rendezvous, TensorParallelError, build_info, connect, seconds_from_env
from specserve.parallel.model import TensorParallelModel, stop_processes
from specserve.parallel.shard import ShardPlan, check_shardable, shard_model
from specserve.parallel.worker import DEFAULT_LOAD_TIMEOUT, LOAD_TIMEOUT_ENV, spawned_worker, warm_kernels


def load_tensor_parallel(source: str, dtype: str | None, quantization: str | None, world: int,
                         worker=spawned_worker) -> LoadedModel:
    """The model sharded over `world` ranks, as rank 0's LoadedModel (its `.model` a TensorParallelModel).
    `worker`: the entry of the ranks started here (tests substitute one)."""
    model_source = resolve_model_source(source)
    quantization = resolve_quantization(quantization, model_source, "cpu")
    torch_dtype = parse_dtype(dtype)
    spec = ArchSpec.from_hf_config(load_hf_config(model_source.directory))
    check_shardable(spec, world, quantization != "none")
    rendezvous = Rendezvous.from_env()
    processes, threads_before = [], torch.get_num_threads()
    if rendezvous is None:
        rendezvous = Rendezvous.local(world)
        threads = max(1, (os.cpu_count() or 1) // world)  # the ranks share this host's cores
        processes = spawn_ranks(rendezvous, threads, worker)
        torch.set_num_threads(threads)
    else:
        check_launcher(rendezvous, world)
    group = None
    try:
        group = connect(rendezvous, 0, partial(check_alive, processes, "starting"))
        target = _load_rank0(group, source, torch_dtype, quantization, processes)
    except BaseException:
        stop_processes(processes)
        if group is not None:
            group.close()
        torch.set_num_threads(threads_before)
        raise
    target.model.threads_before = threads_before
    return target


def check_launcher(rendezvous: Rendezvous, world: int) -> None:
    rank = int(os.environ["RANK"])
    if rendezvous.world_size != world:
        raise ConfigError(f"the launcher started {rendezvous.world_size} ranks (WORLD_SIZE) but "
                          f"tensor_parallel_size is {world}")
    if rank != 0:
        raise ConfigError(f"rank {rank} loads the model as a worker (specserve serve / generate), not rank 0")


def spawn_ranks(rendezvous: Rendezvous, threads: int, worker) -> list:
    context = torch.multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, rendezvous.world_size):
        process = context.Process(target=worker, args=(rendezvous, rank, threads), daemon=True,
                                  name=f"specserve-tp-rank{rank}")
        process.start()
        processes.append(process)
    return processes


def _load_rank0(group: Group, source: str, dtype: torch.dtype, quantization: str, processes: list) -> LoadedModel:
    load_timeout = seconds_from_env(LOAD_TIMEOUT_ENV, DEFAULT_LOAD_TIMEOUT)
    alive = partial(check_alive, processes, "loading")
    group.check_builds(build_info(), load_timeout)
    target = load_model(source, dtype=dtype, quantization=quantization)
    model = target.model
    full_spec = model.spec
    plan = ShardPlan.make(full_spec, 0, group.world_size, quantization != "none")
    shard_model(model, plan, group.reduce_sum,
                partial(group.gather_vocab, vocab_size=full_spec.vocab_size, shard=plan.vocab_shard))
    warm_kernels(model)
    group.publish("load", {"source": source, "dtype": str(dtype).removeprefix("torch."),
                           "quantization": quantization})
    for rank in range(1, group.world_size):
        status = group.wait_for(f"loaded/{rank}", load_timeout, alive)
        if status != "ok":
            raise TensorParallelError(f"tensor-parallel rank {rank} could not load {source}: {status}")
    parallel = TensorParallelModel(model, full_spec, group, processes)
    atexit.register(parallel.close)
    target.model = parallel
    return target


def check_alive(processes: list, stage: str) -> None:
    for rank, process in enumerate(processes, start=1):
        if process.exitcode is not None:
            raise TensorParallelError(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                                      f"{process.exitcode} while {stage}")
