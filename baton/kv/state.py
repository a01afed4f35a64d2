"""Recurrent state: the tensors of running slots and checkpoints, and the checkpoint index.

A running request holds one slot: per recurrent layer, its state tensors (e.g. conv window and
delta-rule matrix) at the request's `num_computed_tokens`. A checkpoint is a copy of every
recurrent layer's state at one block boundary L of one token prefix, keyed by the chained block
hash of that prefix: a later request with the same prefix resumes at L from it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from baton.kv.spec import STATE_DTYPE, KVSpec
from baton.kv.storage import pool_zeros


class StateStorage:
    """Per state group and state tensor: running [layers, slots, *shape], checkpoints
    [layers, checkpoints, *shape]. Readers get per-layer views from `layer`."""

    def __init__(
        self,
        spec: KVSpec,
        num_slots: int,
        num_checkpoints: int,
        device: str = "cpu",
        drafts_per_slot: int = 0,
        layers: Collection[int] | None = None,
    ) -> None:
        """`drafts_per_slot`: speculative decoding's k; each slot then has k scratch snapshots after
        the checkpoints, the state after each verified draft, one of which is committed.
        `layers`: a pipeline stage's layers, the only ones given memory (default: all)."""
        self.spec = spec
        self.num_checkpoints = num_checkpoints
        self.drafts_per_slot = drafts_per_slot
        # tensor parallel: the driver's slot and checkpoint copies, replayed by the other ranks on
        # their own heads' state before the next forward (None: one rank, nothing to record)
        self.journal: list[list] | None = None
        # tensor parallel: per state group and tensor, the channels of the model's first state
        # dimension this rank holds (None: all of them)
        self.channels: list[list[torch.Tensor | None]] | None = None  # None: every rank holds it whole
        rows = num_checkpoints + num_slots * drafts_per_slot
        # on 4 KiB pages: a state is read whole, in order, and a checkpoint's first write then costs
        # 8 ms (19 MB of Qwen3.5-1.5B state, Zen 3) where zeroing huge pages took 50
        self.running: list[list[torch.Tensor]] = []
        self.checkpoints: list[list[torch.Tensor]] = []
        self._index: dict[int, tuple[int, int]] = {}  # layer -> (state group, index in its tensors)
        for g in spec.state_groups:
            held = [i for i in g.layer_ids if layers is None or i in layers]
            self._index.update({layer_id: (g.group_id, j) for j, layer_id in enumerate(held)})
            n = len(held)
            self.running.append(
                [pool_zeros((n, num_slots, *s), STATE_DTYPE, device, huge_pages=False) for s in g.state_shapes]
            )
            self.checkpoints.append(
                [pool_zeros((n, rows, *s), STATE_DTYPE, device, huge_pages=False) for s in g.state_shapes]
            )

    def scratch(self, slot: int, row: int) -> int:
        """The checkpoint index of a slot's snapshot after verify row `row` (0 <= row < k)."""
        assert 0 <= row < self.drafts_per_slot
        return self.num_checkpoints + slot * self.drafts_per_slot + row

    def copy_checkpoint(self, src: int, dst: int) -> None:
        self._record("copy_checkpoint", src, dst)
        for tensors in self.checkpoints:
            for t in tensors:
                t[:, dst].copy_(t[:, src])

    def layer(self, layer_id: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A layer's running state tensors [slots, *shape] and its checkpoint tensors [checkpoints, *shape]."""
        assert layer_id in self._index, f"layer {layer_id} has no recurrent state here"
        gid, idx = self._index[layer_id]
        return [t[idx] for t in self.running[gid]], [t[idx] for t in self.checkpoints[gid]]

    def _record(self, op: str, *args: int) -> None:
        if self.journal is not None:
            self.journal.append([op, *args])

    def replay(self, journal: list[list]) -> None:
        for op, *args in journal:
            if op not in ("reset", "restore", "save", "copy_checkpoint"):
                raise ValueError(f"unknown state operation {op!r}")
            getattr(self, op)(*(int(a) for a in args))

    def reset(self, slot: int) -> None:
        self._record("reset", slot)
        for tensors in self.running:
            for t in tensors:
                t[:, slot].zero_()

    def restore(self, slot: int, checkpoint: int) -> None:
        self._record("restore", slot, checkpoint)
        for run, ckpt in zip(self.running, self.checkpoints):
            for r, c in zip(run, ckpt):
                r[:, slot].copy_(c[:, checkpoint])

    def save(self, slot: int, checkpoint: int) -> None:
        self._record("save", slot, checkpoint)
        for run, ckpt in zip(self.running, self.checkpoints):
            for r, c in zip(run, ckpt):
                c[:, checkpoint].copy_(r[:, slot])

    def read_slot(self, slot: int) -> list[list[torch.Tensor]]:
        """Copies of a slot's state: per state group, per state tensor, [layers, *shape]."""
        return [[t[:, slot].clone() for t in tensors] for tensors in self.running]

    def write_state(self, slot: int, group_id: int, index: int, values: torch.Tensor) -> None:
        """One state tensor of a slot, [layers, *shape] with every channel of the model."""
        if self.channels is not None and self.channels[group_id][index] is not None:
            values = values[:, self.channels[group_id][index]]
        self.running[group_id][index][:, slot].copy_(values)

    def write_slot(self, slot: int, state: list[list[torch.Tensor]]) -> None:
        for tensors, values in zip(self.running, state):
            for t, v in zip(tensors, values):
                t[:, slot].copy_(v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.running + self.checkpoints for t in ts)


@dataclass
class Checkpoint:
    checkpoint_id: int
    block_hash: bytes | None = None  # hash of the prefix [0, num_tokens); None while reserved
    num_tokens: int = 0
    prefix_hashes: tuple[bytes, ...] = ()  # the block hashes it makes resumable
    pins: int = 0  # restores not yet applied
    owner: str | None = None  # a request's rolling end-of-sequence checkpoint
    uses: int = 0  # the times a request resumed from it or passed it after the one that took it


@dataclass
class CheckpointPool:
    """Vacant ids, reserved ids (being written by a forward pass), published ones in eviction order:
    least recently used first, except that one a later checkpoint on the same path supersedes goes
    to the front unless more than one request has used it: a chat's grid checkpoints and its
    previous turn's end once the next turn's end is kept, not a system prompt's that several
    conversations resume from."""

    num_checkpoints: int
    entries: list[Checkpoint] = field(init=False)
    vacant: deque[int] = field(init=False)
    lru: OrderedDict[int, None] = field(init=False)  # published and unpinned, oldest first
    hash_to_id: dict[bytes, int] = field(init=False)

    def __post_init__(self) -> None:
        self.entries = [Checkpoint(i) for i in range(self.num_checkpoints)]
        self.vacant = deque(range(self.num_checkpoints))
        self.lru = OrderedDict()
        self.hash_to_id = {}

    @property
    def num_used(self) -> int:
        return self.num_checkpoints - len(self.vacant)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.hash_to_id.get(block_hash)

    def reserve(self) -> tuple[int, Checkpoint | None] | None:
        """An id to write a checkpoint into and the published checkpoint evicted for it (if any);
        None when every checkpoint is reserved or pinned."""
        if self.vacant:
            return self.vacant.popleft(), None
        if not self.lru:
            return None
        cid, _ = self.lru.popitem(last=False)
        entry = self.entries[cid]
        evicted = Checkpoint(cid, entry.block_hash, entry.num_tokens, entry.prefix_hashes, owner=entry.owner)
        self._forget(entry)
        return cid, evicted

    def publish(
        self, cid: int, block_hash: bytes, num_tokens: int, prefix_hashes: tuple[bytes, ...], supersedes: bool = True
    ) -> bool:
        """Make a reserved id findable; False (and the id is freed) when that prefix already has one.
        `supersedes`: it puts the checkpoints before it on its path first in line for eviction (not
        a decode's rolling one: a chat's next turn may carry another reply than the one generated)."""
        if block_hash in self.hash_to_id:
            self.free(cid)
            return False
        entry = self.entries[cid]
        entry.block_hash, entry.num_tokens, entry.prefix_hashes = block_hash, num_tokens, prefix_hashes
        self.hash_to_id[block_hash] = cid
        self.lru[cid] = None
        for h in prefix_hashes[:-1] if supersedes else ():  # unless several requests used them
            ancestor = self.hash_to_id.get(h)
            if ancestor is not None and ancestor in self.lru and self.entries[ancestor].uses <= 1:
                self.lru.move_to_end(ancestor, last=False)
        return True

    def touch(self, cid: int, used: bool = True) -> None:
        """Most recently used: another request passed it (`used`), or it ages with a checkpoint
        taken after it on the same request (a prompt's end beside its decode's rolling one)."""
        self.entries[cid].uses += used
        if cid in self.lru:
            self.lru.move_to_end(cid)

    def pin(self, cid: int) -> None:
        """A request resumes from it (until unpinned)."""
        self.entries[cid].pins += 1
        self.entries[cid].uses += 1
        self.lru.pop(cid, None)

    def unpin(self, cid: int) -> None:
        entry = self.entries[cid]
        entry.pins -= 1
        if entry.pins == 0 and entry.block_hash is not None:
            self.lru[cid] = None

    def free(self, cid: int) -> Checkpoint:
        """Drop a reserved or published checkpoint; returns what it was."""
        entry = self.entries[cid]
        was = Checkpoint(cid, entry.block_hash, entry.num_tokens, entry.prefix_hashes, owner=entry.owner)
        self.lru.pop(cid, None)
        self._forget(entry)
        self.vacant.append(cid)
        return was

    def _forget(self, entry: Checkpoint) -> None:
        if entry.block_hash is not None and self.hash_to_id.get(entry.block_hash) == entry.checkpoint_id:
            del self.hash_to_id[entry.block_hash]
        entry.block_hash, entry.num_tokens, entry.prefix_hashes, entry.pins, entry.owner = None, 0, (), 0, None
        entry.uses = 0
