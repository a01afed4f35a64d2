"""The KV manager: the only writer of block tables and state slots. Prefix lookup, allocation,
window freeing; its state slots and checkpoints are state_plan.py's part of it."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import xxhash

from baton.kv.pool import BlockPool
from baton.kv.prefix import PrefixHit, needed_start, resumable_prefix
from baton.kv.spec import KVGroup, KVSpec
from baton.kv.state_plan import StateCheckpointing

NULL_BLOCK = -1  # a block-table entry whose positions fell out of a sliding window


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    h = xxhash.xxh3_128()
    h.update(parent_hash or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    h.update(salt)
    return h.digest()


class KVManager(StateCheckpointing):
    """Block tables per request and group, built on one `BlockPool` per group; one recurrent-state
    slot per running request and a pool of state checkpoints when the model has recurrent layers.

    Invariants: a block is referenced by a table iff its ref count says so; a sliding group's
    table holds real blocks only for positions still inside the window of the next query;
    a prefix hit of length L is taken only when every group can serve position L
    (`kv.prefix.resumable_prefix`), recurrent layers from a checkpoint taken exactly at L.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: list[int],
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        num_checkpoints: int = 0,
        checkpoint_interval: int | None = None,
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pools = [BlockPool(n) for n in num_blocks]
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[list[int]]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_published: dict[str, int] = {}
        self._hits: dict[str, PrefixHit] = {}
        self._init_state(spec, num_state_slots, num_checkpoints if enable_prefix_caching else 0, checkpoint_interval)
        self._scheduled: dict[str, tuple] = {}  # request -> (token_ids, start, end, salt) of this step
        # with a second KV tier: what each step published, (request, block index, block id per group),
        # for the tier to copy out before the blocks can be reused
        self.record_published = False
        self.published_blocks: list[tuple[str, int, tuple[int, ...]]] = []

    # ---- queries -------------------------------------------------------------------------------
    def num_free_blocks(self, group_id: int) -> int:
        return self.pools[group_id].num_free

    def num_used_blocks(self, group_id: int) -> int:
        return self.pools[group_id].num_used

    def all_free(self) -> bool:
        return (
            all(p.num_free == p.num_blocks for p in self.pools)
            and len(self.free_slots) == self.num_state_slots
            and not any(c.pins for c in self.checkpoints.entries)
            and not self.pending_snapshots
        )

    def max_request_blocks(self, num_tokens: int, chunk: int) -> list[int]:
        return [g.blocks_per_request(num_tokens, self.block_size, chunk) for g in self.spec.groups]

    def can_ever_fit(self, num_tokens: int, chunk: int) -> bool:
        """Whether one request of `num_tokens` fits in an otherwise empty pool."""
        need = self.max_request_blocks(num_tokens, chunk)
        return all(n <= p.num_blocks for n, p in zip(need, self.pools))

    def _window_start_block(self, group: KVGroup, next_pos: int) -> int:
        """First block a query at `next_pos` (or later) can still read."""
        return needed_start(group, next_pos) // self.block_size

    def _block_hashes(self, request_id: str, token_ids: Sequence[int], salt: bytes) -> list[bytes]:
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(token_ids):
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], salt))
        return hashes

    def _block_identity(self, i: int, hashes: list[bytes], token_ids: Sequence[int]) -> tuple:
        """Block i's (hash, parent hash, tokens): what a pool publishes it under and checks on lookup."""
        bs = self.block_size
        return hashes[i], hashes[i - 1] if i else None, tuple(token_ids[i * bs : (i + 1) * bs])

    def _lookup(self, group_id: int, i: int, hashes: list[bytes], token_ids: Sequence[int]) -> int | None:
        return self.pools[group_id].lookup(*self._block_identity(i, hashes, token_ids))

    def find_cached_prefix(
        self,
        request_id: str,
        token_ids: Sequence[int],
        salt: bytes = b"",
        tier_block: Callable[[int], bool] | None = None,
        tier_state: Callable[[int], bool] | None = None,
    ) -> PrefixHit:
        """The longest L (a block multiple, < len(token_ids)) that every group can serve from cache;
        `allocate_slots` takes it with `num_cached_tokens=hit.num_tokens`. With `tier_block` and
        `tier_state` (block indices and state positions a second KV tier brought), the L the cache
        and that tier could serve together, which `adopt_prefix` then makes the cache's (nothing is
        recorded for allocation)."""
        if not self.enable_prefix_caching:
            return PrefixHit()
        bs = self.block_size
        hashes = self._block_hashes(request_id, token_ids, salt)
        max_blocks = min(len(hashes), (len(token_ids) - 1) // bs)

        def has_block(g: KVGroup, i: int) -> bool:
            cached = self._lookup(g.group_id, i, hashes, token_ids) is not None
            return cached or (tier_block is not None and tier_block(i))

        contiguous = {}
        for g in self.spec.groups:
            if not g.kind.is_sliding:
                n = 0
                while n < max_blocks and has_block(g, n):
                    n += 1
                contiguous[g.group_id] = n

        def has_positions(g: KVGroup, lo: int, hi: int) -> bool:
            if not g.kind.is_sliding:
                return hi // bs <= contiguous[g.group_id]
            return all(has_block(g, i) for i in range(lo // bs, hi // bs))

        def has_state(num_tokens: int) -> bool:
            local = self.checkpoints.lookup(hashes[num_tokens // bs - 1]) is not None
            return local or (tier_state is not None and tier_state(num_tokens))

        candidates = [k * bs for k in range(1, max_blocks + 1)]
        kv_tokens = resumable_prefix(self.spec, candidates, has_positions, lambda _: True)
        if not self.spec.has_state:
            hit = PrefixHit(kv_tokens, kv_tokens)
        else:
            num = resumable_prefix(self.spec, [c for c in candidates if c <= kv_tokens], has_positions, has_state)
            hit = PrefixHit(num, kv_tokens, self.checkpoints.lookup(hashes[num // bs - 1]) if num else None)
        if tier_block is None and tier_state is None:
            self._hits[request_id] = hit
        return hit

    def shared_prefix(self, a: str, a_tokens: Sequence[int], b: str, b_tokens: Sequence[int], salts: tuple) -> int:
        """Tokens (a block multiple) two requests' prompts share, as their block hashes say."""
        ha = self._block_hashes(a, a_tokens, salts[0])
        hb = self._block_hashes(b, b_tokens, salts[1])
        n = 0
        while n < min(len(ha), len(hb)) and ha[n] == hb[n]:
            n += 1
        return n * self.block_size

    # ---- writes --------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        num_cached_tokens: int = 0,
        salt: bytes = b"",
    ) -> bool:
        """Make room for positions [num_computed_tokens, +num_new_tokens) in every group.

        A first call may take a prefix hit of `num_cached_tokens` (from `find_cached_prefix`).
        All-or-nothing: returns False, changing nothing, when any group lacks free blocks.
        """
        bs = self.block_size
        tables = self.block_tables.get(request_id)
        end = num_computed_tokens + num_cached_tokens + num_new_tokens
        start = num_computed_tokens + num_cached_tokens
        hit_blocks: list[list[int]] = [[] for _ in self.spec.groups]
        if tables is None and num_cached_tokens:
            hashes = self._block_hashes(request_id, token_ids, salt)
            for g in self.spec.groups:
                first = self._window_start_block(g, num_cached_tokens)
                ids = [self._lookup(g.group_id, i, hashes, token_ids) for i in range(first, num_cached_tokens // bs)]
                assert all(b is not None for b in ids), "prefix hit vanished before allocation"
                hit_blocks[g.group_id] = ids  # type: ignore[assignment]
        plans = []
        for g, pool in zip(self.spec.groups, self.pools):
            table = tables[g.group_id] if tables is not None else []
            have = len(table) if tables is not None else num_cached_tokens // bs
            first_needed = self._window_start_block(g, start)
            num_new = max(0, -(-end // bs) - max(have, first_needed))
            reclaimed = sum(1 for b in hit_blocks[g.group_id] if pool.is_free(b))
            if num_new + reclaimed > pool.num_free:
                return False
            plans.append((first_needed, num_new))
        if tables is None and self.spec.has_state and not self.free_slots:
            return False
        if tables is None:
            tables = [[] for _ in self.spec.groups]
            self.block_tables[request_id] = tables
            if self.spec.has_state:
                self._take_slot(request_id, token_ids, num_cached_tokens)
            for g in self.spec.groups:
                first = self._window_start_block(g, num_cached_tokens)
                for b in hit_blocks[g.group_id]:
                    self.pools[g.group_id].touch(b)
                tables[g.group_id] = [NULL_BLOCK] * first + hit_blocks[g.group_id]
            self._num_published[request_id] = num_cached_tokens // bs  # found by lookup: published
        for g, (first_needed, num_new) in zip(self.spec.groups, plans):
            table = tables[g.group_id]
            self._drop_before(g.group_id, table, first_needed)
            table.extend([NULL_BLOCK] * (first_needed - len(table)))
            table.extend(self.pools[g.group_id].allocate(num_new))
        if self.spec.has_state and self.checkpoints.num_checkpoints:
            known = min(end, len(token_ids))  # positions past the tokens hold drafts: no boundary there yet
            self._scheduled[request_id] = (token_ids, start, known, salt)
            self._plan_snapshots(request_id, token_ids, start, known, salt)
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Return the blocks past position num_tokens - 1 (they held rejected drafts)."""
        tables = self.block_tables.get(request_id)
        if tables is None:
            return
        keep = -(-num_tokens // self.block_size)
        for pool, table in zip(self.pools, tables):
            tail = [b for b in reversed(table[keep:]) if b != NULL_BLOCK]
            del table[keep:]
            if tail:
                pool.free(tail)

    def blocks_for_import(self, num_imported: int, num_tokens: int) -> list[int]:
        """Blocks per group that `allocate_for_import` takes."""
        total = -(-num_tokens // self.block_size)
        return [total - self._window_start_block(g, num_imported) for g in self.spec.groups]

    def allocate_for_import(self, request_id: str, num_imported: int, num_tokens: int) -> bool:
        """Tables for positions [0, num_tokens) of which [0, num_imported) come from elsewhere:
        sliding groups get blocks only for the window the next query reads. All-or-nothing, like
        allocate_slots; called by the scheduler when it admits an imported request."""
        need = self.blocks_for_import(num_imported, num_tokens)
        if request_id in self.block_tables or any(n > p.num_free for n, p in zip(need, self.pools)):
            return False
        if self.spec.has_state:  # the span brings the state at num_imported: no restore
            if not self.free_slots:
                return False
            self.state_slots[request_id] = self.free_slots.popleft()
            self._prompt_boundary[request_id] = (num_imported - 1) // self.block_size * self.block_size
        tables = []
        for g, n in zip(self.spec.groups, need):
            first = self._window_start_block(g, num_imported)
            tables.append([NULL_BLOCK] * first + self.pools[g.group_id].allocate(n))
        self.block_tables[request_id] = tables
        return True

    def cache_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, salt: bytes = b""
    ) -> None:
        """Publish the full blocks whose KV the last forward pass wrote."""
        if not self.enable_prefix_caching or request_id not in self.block_tables:
            return
        hashes = self._block_hashes(request_id, token_ids[:num_computed_tokens], salt)
        done = self._num_published.get(request_id, 0)
        bs = self.block_size
        tables = self.block_tables[request_id]
        for i in range(done, num_computed_tokens // bs):
            identity = self._block_identity(i, hashes, token_ids)
            for pool, table in zip(self.pools, tables):
                if table[i] != NULL_BLOCK:
                    pool.publish(table[i], *identity)
            if self.record_published:
                self.published_blocks.append((request_id, i, tuple(table[i] for table in tables)))
        self._num_published[request_id] = max(done, num_computed_tokens // bs)
        self._publish_snapshots(request_id, num_computed_tokens)

    def adopt_prefix(
        self,
        request_id: str,
        token_ids: Sequence[int],
        salt: bytes,
        num_tokens: int,
        available: Callable[[int], bool],
        write_blocks: Callable[[int, list[int], list[int]], None],
        write_state: Callable[[int], None],
    ) -> bool:
        """Make a prefix of `num_tokens` that a second KV tier completes the cache's own, for a prefix
        lookup to find: per group, the blocks a query at num_tokens reads that the cache lacks get
        new blocks, which `write_blocks(group, block_ids, indices)` fills, published under the
        request's block hashes; with recurrent layers, a checkpoint at num_tokens unless the pool
        has one, which `write_state(checkpoint id)` fills. The cache's own blocks are held meanwhile
        (neither the new blocks nor the checkpoint's eviction can take them), and all go back tail
        first (a prefix loses its tail before its head). All or nothing: False, changing nothing,
        when a needed block is neither cached nor `available(index)`, a pool lacks room, or every
        checkpoint is in use."""
        bs = self.block_size
        hashes = self._block_hashes(request_id, token_ids, salt)
        plans = []
        for g, pool in zip(self.spec.groups, self.pools):
            held, missing = [], []
            for i in range(needed_start(g, num_tokens) // bs, num_tokens // bs):
                b = self._lookup(g.group_id, i, hashes, token_ids)
                if b is not None:
                    held.append((i, b))
                elif available(i):
                    missing.append(i)
                else:
                    return False
            if len(missing) > pool.num_free - sum(1 for _, b in held if pool.is_free(b)):
                return False
            plans.append((held, missing))
        for pool, (held, _) in zip(self.pools, plans):
            for _, b in held:
                pool.touch(b)
        cid = None
        if self.spec.has_state and self.checkpoints.lookup(hashes[num_tokens // bs - 1]) is None:
            cid = self._reserve_checkpoint()
            if cid is None:
                for pool, (held, _) in zip(self.pools, plans):
                    pool.free([b for _, b in reversed(held)])
                return False
        for g, pool, (held, missing) in zip(self.spec.groups, self.pools, plans):
            new = pool.allocate(len(missing))
            if missing:
                write_blocks(g.group_id, new, missing)
            for b, i in zip(new, missing):
                pool.publish(b, *self._block_identity(i, hashes, token_ids))
            pool.free([b for _, b in sorted(held + list(zip(missing, new)), reverse=True)])
        if cid is not None:
            write_state(cid)
            self._publish_checkpoint(request_id, cid, hashes[: num_tokens // bs], num_tokens)
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release sliding-group blocks no later query can read."""
        tables = self.block_tables.get(request_id)
        if tables is None:
            return
        for g in self.spec.groups:
            if g.kind.is_sliding:
                self._drop_before(g.group_id, tables[g.group_id], self._window_start_block(g, num_computed_tokens))

    def free(self, request_id: str) -> None:
        tables = self.block_tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_published.pop(request_id, None)
        self._hits.pop(request_id, None)
        self._checkpoint_at.pop(request_id, None)
        self._prompt_boundary.pop(request_id, None)
        self._scheduled.pop(request_id, None)
        rolling = self._rolling.pop(request_id, None)
        if rolling is not None:  # stays cached: the next turn of a chat resumes there
            self.checkpoints.entries[rolling].owner = None
        for _, cid in self.pending_snapshots.pop(request_id, []):
            self.checkpoints.free(cid)
        if request_id in self._restores:
            self.pop_restore(request_id)
        slot = self.state_slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        if tables is None:
            return
        for pool, table in zip(self.pools, tables):
            pool.free([b for b in reversed(table) if b != NULL_BLOCK])

    def _drop_before(self, group_id: int, table: list[int], first_needed: int) -> None:
        stale = [b for b in table[:first_needed] if b != NULL_BLOCK]
        if stale:
            self.pools[group_id].free(list(reversed(stale)))
            for i in range(min(first_needed, len(table))):
                table[i] = NULL_BLOCK
