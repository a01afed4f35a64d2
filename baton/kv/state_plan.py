"""The KV manager's recurrent-state part (a mixin of `KVManager`, the only writer of state slots):
the slot each running request holds and where it starts from, and the state checkpoints its
forwards record (on the grid, at the prompt's last block boundary, past it only the latest, and
where another request diverges), publish under the block hash at their position, and release
with the cached blocks only they made resumable."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from baton.kv.pool import BlockPool
from baton.kv.prefix import PrefixHit
from baton.kv.spec import KVSpec
from baton.kv.state import Checkpoint, CheckpointPool


class StateCheckpointing:
    # the KV manager's own, which this part reads
    block_size: int
    pools: list[BlockPool]
    _hashes: dict[str, list[bytes]]
    _hits: dict[str, PrefixHit]
    _scheduled: dict[str, tuple]
    _block_hashes: Callable[[str, Sequence[int], bytes], list[bytes]]
    record_published: bool

    def _init_state(
        self, spec: KVSpec, num_state_slots: int, num_checkpoints: int, checkpoint_interval: int | None
    ) -> None:
        interval = checkpoint_interval or 0
        if spec.has_state and interval % spec.block_size:
            raise ValueError(
                f"state checkpoint interval {interval} is not a multiple of the block size {spec.block_size}"
            )
        self.checkpoint_interval = interval
        self.num_state_slots = num_state_slots
        self.free_slots: deque[int] = deque(range(num_state_slots))
        self.state_slots: dict[str, int] = {}
        self.checkpoints = CheckpointPool(num_checkpoints)
        self._block_uses: dict[bytes, int] = {}  # block hash -> published checkpoints it is a prefix of
        self._restores: dict[str, int | None] = {}  # request -> checkpoint its slot starts from (None: zeros)
        self.pending_snapshots: dict[str, list[tuple[int, int]]] = {}  # request -> (position, checkpoint id)
        self._checkpoint_at: dict[str, set[int]] = {}  # request -> positions to checkpoint besides the grid
        self._prompt_boundary: dict[str, int] = {}  # request -> last block boundary below its prompt's end
        self._rolling: dict[str, int] = {}  # request -> its latest checkpoint past the prompt
        # with a second KV tier: checkpoints published this step, (request, id, block hash, num_tokens)
        self.published_checkpoints: list[tuple[str, int, bytes, int]] = []

    def request_checkpoint(self, request_id: str, num_tokens: int) -> None:
        """Ask a running request to checkpoint its state at `num_tokens` when it passes there (a
        waiting request diverges from it there)."""
        if self.spec.has_state and num_tokens % self.block_size == 0:
            self._checkpoint_at.setdefault(request_id, set()).add(num_tokens)
            scheduled = self._scheduled.get(request_id)
            if scheduled is not None and scheduled[1] < num_tokens <= scheduled[2]:  # its forward this step
                self._plan_snapshots(request_id, *scheduled)

    def plan_accepted_snapshots(
        self, request_id: str, token_ids: Sequence[int], start: int, end: int, salt: bytes = b""
    ) -> list[tuple[int, int]]:
        """Checkpoints to take at the boundaries in (start, end] that accepted drafts crossed (the
        forward could not plan them: the tokens were not known). Returns (num_tokens, checkpoint id)
        for the caller to fill before `cache_blocks` publishes them."""
        if not (self.spec.has_state and self.checkpoints.num_checkpoints) or end <= start:
            return []
        before = set(self.pending_snapshots.get(request_id, []))
        self._plan_snapshots(request_id, token_ids, start, end, salt)
        return [p for p in self.pending_snapshots.get(request_id, []) if p not in before]

    def _take_slot(self, request_id: str, token_ids: Sequence[int], num_cached_tokens: int) -> None:
        self.state_slots[request_id] = self.free_slots.popleft()
        hit = self._hits.pop(request_id, PrefixHit())
        cid = None
        if num_cached_tokens:
            assert hit.num_tokens == num_cached_tokens and hit.checkpoint_id is not None, "hit without its checkpoint"
            cid = hit.checkpoint_id
            self.checkpoints.pin(cid)
        self._restores[request_id] = cid
        bs = self.block_size
        self._prompt_boundary[request_id] = (len(token_ids) - 1) // bs * bs
        if hit.kv_tokens > num_cached_tokens:  # a divergence point: the next request sharing it resumes here
            self.request_checkpoint(request_id, hit.kv_tokens)

    def pop_restore(self, request_id: str) -> tuple[int, int | None] | None:
        """(slot, checkpoint or None for zeros) to set a new slot from before its first forward;
        None when the slot already holds the request's state."""
        if request_id not in self._restores:
            return None
        cid = self._restores.pop(request_id)
        if cid is not None:
            self.checkpoints.unpin(cid)
        return self.state_slots[request_id], cid

    def _wants_checkpoint(self, request_id: str, num_tokens: int) -> bool:
        interval = self.checkpoint_interval
        return (
            (interval > 0 and num_tokens % interval == 0)
            or num_tokens >= self._prompt_boundary.get(request_id, 0)  # the prompt's last boundary, then rolling
            or num_tokens in self._checkpoint_at.get(request_id, ())
        )

    def _plan_snapshots(self, request_id: str, token_ids: Sequence[int], start: int, end: int, salt: bytes) -> None:
        """Reserve checkpoints for the block boundaries in (start, end] this request should record."""
        bs = self.block_size
        hashes = self._block_hashes(request_id, token_ids[:end], salt)
        planned = self.pending_snapshots.setdefault(request_id, [])
        for num_tokens in range((start // bs + 1) * bs, end + 1, bs):
            if not self._wants_checkpoint(request_id, num_tokens) or any(p == num_tokens for p, _ in planned):
                continue
            existing = self.checkpoints.lookup(hashes[num_tokens // bs - 1])
            if existing is not None:
                self.checkpoints.touch(existing)
                continue
            cid = self._reserve_checkpoint()
            if cid is None:
                break
            planned.append((num_tokens, cid))
        planned.sort()
        if not planned:
            del self.pending_snapshots[request_id]

    def _reserve_checkpoint(self) -> int | None:
        got = self.checkpoints.reserve()
        if got is None:
            return None
        cid, evicted = got
        if evicted is not None:
            if evicted.owner is not None and self._rolling.get(evicted.owner) == cid:
                del self._rolling[evicted.owner]  # a running request's latest: gone, not to be freed again
            self._release_prefix(evicted)
        return cid

    def _publish_checkpoint(self, request_id: str, cid: int, prefix_hashes: list[bytes], num_tokens: int) -> bool:
        within_prompt = num_tokens <= self._prompt_boundary.get(request_id, num_tokens)
        if not self.checkpoints.publish(cid, prefix_hashes[-1], num_tokens, tuple(prefix_hashes), within_prompt):
            return False
        for h in prefix_hashes:
            self._block_uses[h] = self._block_uses.get(h, 0) + 1
        if self.record_published:
            self.published_checkpoints.append((request_id, cid, prefix_hashes[-1], num_tokens))
        return True

    def _publish_snapshots(self, request_id: str, num_computed_tokens: int) -> None:
        self._scheduled.pop(request_id, None)
        planned = self.pending_snapshots.pop(request_id, [])
        hashes = self._hashes[request_id]
        for num_tokens, cid in planned:
            assert num_tokens <= num_computed_tokens, "a snapshot past what the forward computed"
            if not self._publish_checkpoint(request_id, cid, hashes[: num_tokens // self.block_size], num_tokens):
                continue
            boundary = self._prompt_boundary.get(request_id, 0)
            if num_tokens > boundary:  # past the prompt: keep only the latest
                previous = self._rolling.get(request_id)
                self._rolling[request_id] = cid
                self.checkpoints.entries[cid].owner = request_id
                at_boundary = self.checkpoints.lookup(hashes[boundary // self.block_size - 1]) if boundary else None
                if at_boundary is not None:  # the prompt's end ages with it: a next turn may resume at either
                    self.checkpoints.touch(at_boundary, used=False)
                if previous is not None and not self.checkpoints.entries[previous].pins:
                    self._release_prefix(self.checkpoints.free(previous))

    def _release_prefix(self, gone: Checkpoint) -> None:
        """A checkpoint is gone: cached blocks that no other checkpoint makes resumable are freed."""
        for h in gone.prefix_hashes:
            uses = self._block_uses.get(h, 0) - 1
            if uses > 0:
                self._block_uses[h] = uses
                continue
            self._block_uses.pop(h, None)
            for pool in self.pools:
                pool.drop_cached(h)
