"""A rank's membership of the tensor-parallel group: the rendezvous, the build checks across ranks and the
collectives the sharded forward needs.

The rendezvous is a TCPStore on rank 0 (or torchrun's agent store): rank 0 waits up to the connect timeout for the
others and fails naming how many joined; a rank that cannot reach rank 0 fails naming the address. Setup exchanges
(build information, the model to load, each rank's "loaded") go through the store, whose waits are long and can
watch spawned processes; the serving loop uses the process group, whose timeout (the step timeout) bounds how long a
rank waits for a silent peer, so a lost rank is an error, never a hang.

The sum of the ranks' partial outputs must be the same whatever the number of rows (speculation is lossless only if
a token's logits do not depend on how many tokens share the forward). An all-reduce over two ranks adds a + b, and
IEEE addition commutes, so it is exact and row-invariant; over more ranks gloo's ring adds chunks in an order that
depends on the tensor's size, so there the partials are all-gathered and added in rank order, element by element.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

CONNECT_TIMEOUT_ENV = "SPECSERVE_TP_CONNECT_TIMEOUT"  # seconds the ranks have to join (and to load the model)
STEP_TIMEOUT_ENV = "SPECSERVE_TP_STEP_TIMEOUT"  # seconds a rank waits in one collective for a silent peer
DEFAULT_CONNECT_TIMEOUT = 120.0
DEFAULT_STEP_TIMEOUT = 60.0
STORE_PREFIX = "specserve/tp/"


class TensorParallelError(RuntimeError):
    """The tensor-parallel model cannot serve: a rank died, did not join, runs other code, or failed to load."""


def seconds_from_env(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise TensorParallelError(f"{name}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise TensorParallelError(f"{name} must be > 0, got {value}")
    return seconds


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class Rendezvous:
    """Where the ranks meet: rank 0's address and port (rank 0 hosts the store unless torchrun's agent does)."""

    addr: str
    port: int
    world_size: int
    agent_store: bool = False  # torchrun's elastic agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)

    @classmethod
    def local(cls, world_size: int) -> "Rendezvous":
        """Ranks spawned on this host, meeting on a free loopback port."""
        return cls("127.0.0.1", free_port(), world_size)

    @classmethod
    def from_env(cls) -> "Rendezvous | None":
        """torchrun's (or any launcher's) RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, when the world has more
        than one rank; None otherwise."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return None
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise TensorParallelError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the ranks with "
                                      "torchrun (--nnodes, --node-rank, --master-addr, --master-port)")
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                   os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def env_rank() -> int | None:
    """This process's rank under a multi-rank launcher (torchrun), else None."""
    rendezvous = Rendezvous.from_env()
    return None if rendezvous is None else int(os.environ["RANK"])


def build_info() -> dict:
    """What must match across ranks: the same specserve code (every source file), torch and Python."""
    root = Path(__file__).resolve().parent.parent
    sources = sorted(root.rglob("*.py")) + sorted((root / "csrc").glob("*.[ch]*"))
    digest = hashlib.sha256()
    for path in sources:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    try:
        version = importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"specserve": version, "code": digest.hexdigest()[:16], "torch": torch.__version__,
            "python": ".".join(map(str, sys.version_info[:2]))}


def _describe(info: dict) -> str:
    return (f"specserve {info.get('specserve')} (code {info.get('code')}), torch {info.get('torch')}, "
            f"python {info.get('python')}")


class Group:
    """This rank in the initialized process group, with the store the setup exchanges go through."""

    def __init__(self, rendezvous: Rendezvous, rank: int, store, backend: str):
        self.rendezvous, self.rank, self.store, self.backend = rendezvous, rank, store, backend
        self.world_size = rendezvous.world_size
        self.closed = False

    # ---- setup, through the store ----------------------------------------------------------------------------
    def publish(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def wait_for(self, key: str, timeout: float, alive: Callable[[], None] | None = None, waiting: str = ""):
        """The value another rank publishes under `key`, polling so that `alive` (which raises for a dead peer)
        is checked meanwhile; TensorParallelError after `timeout` seconds (`waiting` describes the wait)."""
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):
            if alive is not None:
                alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"{waiting or f'rank {self.rank}: no {key!r} from the other ranks'} "
                                          f"within {timeout:.0f} s")
            time.sleep(0.05)
        return json.loads(self.store.get(key))

    def check_builds(self, info: dict, timeout: float) -> None:
        """Every rank runs the same code: each publishes its build, each compares with every other (so all fail)."""
        self.publish(f"build/{self.rank}", info)
        infos = [self.wait_for(f"build/{rank}", timeout) for rank in range(self.world_size)]
        different = [rank for rank, other in enumerate(infos) if other != infos[0]]
        if different:
            raise TensorParallelError(
                "tensor-parallel ranks run different builds: rank 0 runs " + _describe(infos[0]) + "; " +
                "; ".join(f"rank {rank} runs {_describe(infos[rank])}" for rank in different) +
                ". Install the same specserve and torch on every host")

    # ---- the collectives of a forward ------------------------------------------------------------------------
    def reduce_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's `partial` (fp32 inside, returned in its dtype); the same bits for an
        element whatever the tensor's size (see the module's docstring)."""
        total = partial.float().contiguous()
        if self.world_size == 2:
            dist.all_reduce(total)
        else:
            parts = [torch.empty_like(total) for _ in range(self.world_size)]
            dist.all_gather(parts, total)
            total = parts[0]
            for part in parts[1:]:  # rank order, element by element
                total = total + part
        return total.to(partial.dtype)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int, shard: int) -> torch.Tensor | None:
        """Rank 0: the full logits [..., vocab_size] from every rank's slice [..., <= shard] (each rank holds
        vocabulary [rank * shard, (rank + 1) * shard)); the other ranks: None."""
        padded = F.pad(logits, (0, shard - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0)
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def broadcast(self, message=None):
        """Rank 0's `message` (any picklable object), on every rank."""
        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if not self.closed and dist.is_initialized():
            self.closed = True
            dist.destroy_process_group()


def connect(rendezvous: Rendezvous, rank: int, alive: Callable[[], None] | None = None,
            backend: str = "gloo") -> Group:
    """Join the group as `rank`: TensorParallelError when a rank does not join (rank 0; `alive` raises meanwhile
    for a rank known dead) or rank 0 cannot be reached (the others) within the connect timeout."""
    if dist.is_initialized():
        raise TensorParallelError("this process already serves a tensor-parallel model: one per process")
    connect_timeout = seconds_from_env(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT)
    step_timeout = seconds_from_env(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT)
    where, world = f"{rendezvous.addr}:{rendezvous.port}", rendezvous.world_size
    try:
        store = dist.TCPStore(rendezvous.addr, rendezvous.port, world,
                              is_master=rank == 0 and not rendezvous.agent_store,
                              timeout=datetime.timedelta(seconds=connect_timeout), wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - DistStoreError, DistNetworkError, TimeoutError, OSError
        raise TensorParallelError(f"tensor parallel: rank {rank} cannot reach rank 0 at {where} within "
                                  f"{connect_timeout:.0f} s ({exc})") from None
    group = Group(rendezvous, rank, dist.PrefixStore(STORE_PREFIX, store), backend)
    group.publish(f"joined/{rank}", True)
    if rank == 0:
        for other in range(1, world):
            group.wait_for(f"joined/{other}", connect_timeout, alive,
                           f"tensor parallel: rank {other} of {world} did not join rank 0 at {where}")
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("group/", group.store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=step_timeout))
    except Exception as exc:  # noqa: BLE001
        raise TensorParallelError(f"tensor parallel: rank {rank} could not form the {backend} group at {where}: "
                                  f"{exc}") from None
    return group
