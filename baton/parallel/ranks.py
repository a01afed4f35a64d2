"""The driver's side of a tensor-parallel engine: start the other ranks of this host, join the
process group, send each step's metadata, and notice a rank that dies.

The driver (rank 0) runs the one scheduler and the one KV manager; the other ranks hold their
heads' weights, KV and state, and run what the driver sends (`baton/parallel/worker.py`)."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from baton.config import EngineConfig
from baton.handoff.transfer import GroupReader, read_group
from baton.kv.memory import CacheMemory
from baton.kv.spec import KVSpec
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.parallel import messages
from baton.parallel.comm import TPGroup, destroy_process_group, init_process_group, listen
from baton.parallel.pipeline import Stage
from baton.parallel.shard import group_heads

logger = logging.getLogger(__name__)


def reduce_state(tp: TPGroup, states: StateStorage, spec: KVSpec, slot: int) -> list[list[torch.Tensor]]:
    """A slot's state tensors as the whole model's, [layers, *shape], on rank 0 (zeros elsewhere)."""
    out = []
    for g, tensors in zip(spec.state_groups, states.running):
        out.append([])
        for j, t in enumerate(tensors):
            full = torch.zeros((t.shape[0], *g.state_shapes[j]), dtype=t.dtype)
            channels = states.channels[g.group_id][j]
            if channels is not None:
                full[:, channels] = t[:, slot]
            elif tp.rank == 0:  # replicated: one rank's copy, not the sum of all
                full.copy_(t[:, slot])
            tp.reduce_to_first(full)
            out[-1].append(full)
    return out


class RanksLost(RuntimeError):
    """A rank of this engine died: the engine cannot run another step."""


def spawn_ranks(config: EngineConfig, ranks: range) -> list[subprocess.Popen]:
    """One process per rank, handed the config through a pipe (a command line is world-readable)."""
    procs = []
    for rank in ranks:
        proc = subprocess.Popen(
            [sys.executable, "-m", "baton.parallel.worker", "--rank", str(rank)], stdin=subprocess.PIPE
        )
        assert proc.stdin is not None
        proc.stdin.write(config.to_json().encode())
        proc.stdin.close()
        procs.append(proc)
    return procs


class Ranks:
    def __init__(self, config: EngineConfig, procs: list[subprocess.Popen], tp: TPGroup) -> None:
        self.config = config
        self.procs = procs
        self.tp = tp
        self.stage: Stage | None = None  # pipeline parallel: the driver's (first) stage, once the model is cut
        self.lost: str | None = None  # why, once a rank died
        self.on_lost: list[Callable[[str], None]] = []
        self._stopping = threading.Event()
        atexit.register(self.stop)
        threading.Thread(target=self._watch, name="baton-ranks", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig) -> Ranks:
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError("only node 0 runs the engine; start other nodes with `baton serve --node-rank N`")
        listener = listen(parallel)
        # a free port unless one was given: the other ranks learn it from their copy of the config
        parallel = dataclasses.replace(parallel, master_port=listener.getsockname()[1])
        config = dataclasses.replace(config, parallel=parallel)
        try:
            procs = spawn_ranks(config, range(1, parallel.ranks_per_node))
        except BaseException:
            listener.close()
            raise
        try:
            tp = init_process_group(parallel, 0, listener)
        except BaseException:
            listener.close()
            for p in procs:
                p.kill()
            raise
        logger.info(
            "%d ranks (tensor parallel %d x pipeline parallel %d), %d on this host, backend %s",
            parallel.world_size,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            parallel.ranks_per_node,
            torch.distributed.get_backend(),
        )
        return cls(config, procs, tp)

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    self.lose(f"rank {rank} exited with code {code}")
                    return

    def lose(self, why: str) -> None:
        """The ranks are out of step for good: no collective may be started again."""
        if self.lost is not None:
            return
        self.lost = why
        logger.error("%s: this engine's ranks cannot step any more", why)
        for callback in self.on_lost:
            callback(why)

    def send(self, message: dict) -> None:
        if self.lost is not None:
            raise RanksLost(self.lost)
        try:
            start = time.perf_counter()
            nbytes = messages.broadcast(message)
            self.tp.stats.add("broadcast", time.perf_counter() - start, nbytes * (self.config.parallel.world_size - 1))
        except RuntimeError as e:  # a peer's socket closed under the collective
            self.lose(f"a collective failed ({e})")
            raise RanksLost(str(self.lost)) from e

    def build_caches(self, memory: CacheMemory, kv_dtype: torch.dtype) -> None:
        """The pools' sizes, decided here, for every rank's own KV and state tensors."""
        memory.states.journal = []
        self.send(
            {
                "op": "caches",
                "num_blocks": [p.num_blocks for p in memory.kv.pools],
                "num_state_slots": memory.kv.num_state_slots,
                "num_checkpoints": memory.states.num_checkpoints,
                "drafts_per_slot": memory.states.drafts_per_slot,
                "kv_dtype": str(kv_dtype).removeprefix("torch."),
                "kv_layout": memory.storage.layout,
            }
        )

    def kv_reader(self, storage: KVStorage, block_size: int, shares: list[range], num_kv_heads: int) -> GroupReader:
        """Export: a group's K/V at some slots with every rank's heads, gathered here."""
        local = read_group(storage, block_size)

        def read(group_id: int, slots: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
            self.send({"op": "read_kv", "group": group_id, "slots": slots})
            heads = group_heads(storage.spec.groups[group_id], shares, num_kv_heads)
            gather = lambda t: self.tp.gather_heads(t, *heads)  # noqa: E731  (scales: [.., heads, 1])
            return [(kind, gather(t), None if s is None else gather(s)) for kind, t, s in local(group_id, slots)]

        return read

    def state_reader(self, states: StateStorage, spec: KVSpec) -> Callable[[int], list[list[torch.Tensor]]]:
        """Export: a slot's state with every rank's channels, summed here (each rank adds its own
        channels into zeros: exact)."""

        def read(slot: int) -> list[list[torch.Tensor]]:
            self.send({"op": "read_state", "slot": slot})
            return reduce_state(self.tp, states, spec, slot)

        return read

    def write_kv(self, written: list, states: list) -> None:
        """Import: the other ranks write their heads and state channels of what the driver wrote."""
        self.send({"op": "write_kv", "groups": [list(w) for w in written], "states": states})

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.lost is None:
            try:
                messages.broadcast({"op": "stop"})
            except RuntimeError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        destroy_process_group()
