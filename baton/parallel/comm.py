"""The process group and the collectives the model's split layers call. Rank 0 is the driver
(scheduler, KV manager, API); every rank holds its own heads' weights, KV and state."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from baton.config import ParallelConfig

# a rank waits this long for the others inside one collective; a dead rank's socket closes and
# fails the call at once, so this bounds only a rank that hangs
COLLECTIVE_TIMEOUT = timedelta(seconds=600)
_LISTENERS: list[socket.socket] = []


@dataclass
class CommStats:
    """What the collectives cost on this rank: calls, seconds inside them, bytes each rank sent."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0
    by_op: dict[str, list[float]] = field(default_factory=dict)  # op -> [calls, seconds, bytes]

    def add(self, op: str, seconds: float, nbytes: int) -> None:
        self.calls += 1
        self.seconds += seconds
        self.bytes += nbytes
        entry = self.by_op.setdefault(op, [0, 0.0, 0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] += nbytes

    def reset(self) -> None:
        self.calls, self.seconds, self.bytes = 0, 0.0, 0
        self.by_op.clear()


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts added pairwise in order, as a balanced tree: (p0 + p1) + (p2 + p3), ..."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


@dataclass
class TPGroup:
    """This rank's place in the tensor-parallel group (size 1: no group, no communication)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    stats: CommStats = field(default_factory=CommStats)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (the row-parallel projections' partial sums), as a balanced
        tree in rank order ((r0 + r1) + (r2 + r3), ...): the order in which one rank adds the K parts
        of an integer-kernel linear (gguf_blocks.BlockTensor.k_parts), so the sum has its bits. Two
        ranks: one all-reduce (a + b either way round); more: an all-gather, then the tree (every
        rank holds all ranks' tensors for a moment and sends n - 1 times its own, against a ring's
        2 (n - 1) / n: the price of one rank's bits)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        if self.size == 2:
            dist.all_reduce(x, group=self.group)
            # a ring all-reduce sends 2 (n - 1) / n of the tensor from every rank
            self.stats.add("all_reduce", time.perf_counter() - start, 2 * (self.size - 1) * x.nbytes // self.size)
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        x.copy_(tree_sum(parts))
        self.stats.add("all_reduce", time.perf_counter() - start, (self.size - 1) * x.nbytes)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x concatenated along the last dimension (vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        self.stats.add("all_gather", time.perf_counter() - start, (self.size - 1) * x.nbytes)
        return torch.cat(parts, dim=-1)

    def reduce_to_first(self, x: torch.Tensor) -> None:
        """Sum x over the ranks into the group's first rank's x."""
        start = time.perf_counter()
        dist.reduce(x, dist.get_global_rank(self.group, 0), group=self.group)
        self.stats.add("reduce", time.perf_counter() - start, x.nbytes)

    def gather_heads(self, x: torch.Tensor, heads: list[range], num_heads: int) -> torch.Tensor | None:
        """Every rank's x [..., its heads, dim] (dim -2) put together on rank 0 as [..., num_heads,
        dim]; None elsewhere. Shares may differ in size (padded for the gather) and overlap
        (replicated KV heads: the same values)."""
        width = max(len(h) for h in heads)
        padded = torch.zeros((*x.shape[:-2], width, x.shape[-1]), dtype=x.dtype)
        padded[..., : x.shape[-2], :] = x
        start = time.perf_counter()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        self.stats.add("gather", time.perf_counter() - start, padded.nbytes)
        if parts is None:
            return None
        out = torch.empty((*x.shape[:-2], num_heads, x.shape[-1]), dtype=x.dtype)
        for part, share in zip(parts, heads):
            out[..., share.start : share.stop, :] = part[..., : len(share), :]
        return out


def backend_for(parallel: ParallelConfig) -> str:
    """gloo: baton's ranks compute on the CPU, and NCCL moves only CUDA tensors."""
    if parallel.distributed_backend == "nccl":
        raise ValueError("baton's ranks compute on the CPU and nccl moves only CUDA tensors: use gloo (or auto)")
    return "gloo"


def init_process_group(parallel: ParallelConfig, rank: int, listener: socket.socket | None = None) -> TPGroup:
    """Join the world (torchrun's conventions: rank 0 listens at master_addr:master_port, on
    `listener` when it bound one already) and return this rank's tensor-parallel group. Ranks
    r*tp .. r*tp + tp - 1 form pipeline stage r."""
    backend = backend_for(parallel)
    if ipaddress.ip_address(socket.gethostbyname(parallel.master_addr)).is_loopback:
        # gloo picks the hostname's interface unless told; ranks on one host talk over loopback only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        store=_store(parallel, rank, listener),
        rank=rank,
        world_size=parallel.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    tp = parallel.tensor_parallel_size
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(parallel.pipeline_parallel_size)]
    return TPGroup(rank % tp, tp, groups[rank // tp])


def listen(parallel: ParallelConfig) -> socket.socket:
    """Rank 0's rendezvous socket on master_addr only (torch's own store binds every interface):
    with the default 127.0.0.1, nothing off this host can reach it. Port: master_port, else a free
    one (read back from the socket), so two engines on one host never collide."""
    addr, port = parallel.master_addr, parallel.master_port or 0
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on master_addr {addr}:{port} for the ranks: {e.strerror}") from None
    sock.listen(128)
    return sock


def _store(parallel: ParallelConfig, rank: int, listener: socket.socket | None) -> dist.TCPStore:
    addr = parallel.master_addr
    if rank != 0:
        assert parallel.master_port is not None, "the driver passes its port to the other ranks"
        return dist.TCPStore(addr, parallel.master_port, parallel.world_size, False, COLLECTIVE_TIMEOUT)
    sock = listener or listen(parallel)
    port = sock.getsockname()[1]
    store = dist.TCPStore(addr, port, parallel.world_size, True, COLLECTIVE_TIMEOUT, master_listen_fd=sock.fileno())
    _LISTENERS.append(sock)  # the store serves on this socket's descriptor: keep it open
    return store


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    while _LISTENERS:
        _LISTENERS.pop().close()
