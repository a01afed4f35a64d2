"""The KV manager: the only writer of block tables. Prefix lookup, allocation, window freeing."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from baton.kv.pool import BlockPool
from baton.kv.spec import KVGroup, KVSpec

NULL_BLOCK = -1  # a block-table entry whose positions fell out of a sliding window


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    h = xxhash.xxh3_128()
    h.update(parent_hash or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    h.update(salt)
    return h.digest()


class KVManager:
    """Block tables per request and group, built on one `BlockPool` per group.

    Invariants: a block is referenced by a table iff its ref count says so; a sliding group's
    table holds real blocks only for positions still inside the window of the next query;
    a prefix hit of length L is taken only when every group can serve position L.
    """

    def __init__(self, spec: KVSpec, num_blocks: list[int], enable_prefix_caching: bool = True) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pools = [BlockPool(n) for n in num_blocks]
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[list[int]]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_published: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------------
    def num_free_blocks(self, group_id: int) -> int:
        return self.pools[group_id].num_free

    def num_used_blocks(self, group_id: int) -> int:
        return self.pools[group_id].num_used

    def all_free(self) -> bool:
        return all(p.num_free == p.num_blocks for p in self.pools)

    def max_request_blocks(self, num_tokens: int, chunk: int) -> list[int]:
        return [g.blocks_per_request(num_tokens, self.block_size, chunk) for g in self.spec.groups]

    def can_ever_fit(self, num_tokens: int, chunk: int) -> bool:
        """Whether one request of `num_tokens` fits in an otherwise empty pool."""
        need = self.max_request_blocks(num_tokens, chunk)
        return all(n <= p.num_blocks for n, p in zip(need, self.pools))

    def _window_start_block(self, group: KVGroup, next_pos: int) -> int:
        """First block a query at `next_pos` (or later) can still read."""
        if not group.kind.is_sliding:
            return 0
        return max(0, next_pos - group.kind.window + 1) // self.block_size

    def _block_hashes(self, request_id: str, token_ids: Sequence[int], salt: bytes) -> list[bytes]:
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(token_ids):
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], salt))
        return hashes

    def _lookup(self, group_id: int, i: int, hashes: list[bytes], token_ids: Sequence[int]) -> int | None:
        bs = self.block_size
        parent = hashes[i - 1] if i else None
        return self.pools[group_id].lookup(hashes[i], parent, tuple(token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int], salt: bytes = b"") -> int:
        """Longest L (a block multiple, < len(token_ids)) that every group can serve from cache."""
        if not self.enable_prefix_caching:
            return 0
        hashes = self._block_hashes(request_id, token_ids, salt)
        max_blocks = min(len(hashes), (len(token_ids) - 1) // self.block_size)
        full = [g for g in self.spec.groups if not g.kind.is_sliding]
        sliding = [g for g in self.spec.groups if g.kind.is_sliding]
        full_hit = 0
        while full_hit < max_blocks and all(
            self._lookup(g.group_id, full_hit, hashes, token_ids) is not None for g in full
        ):
            full_hit += 1
        for k in range(full_hit if full else max_blocks, 0, -1):
            end = k * self.block_size
            if all(
                self._lookup(g.group_id, i, hashes, token_ids) is not None
                for g in sliding
                for i in range(self._window_start_block(g, end), k)
            ):
                return end
        return 0

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
        if tables is None:
            tables = [[] for _ in self.spec.groups]
            self.block_tables[request_id] = tables
            for g in self.spec.groups:
                first = self._window_start_block(g, num_cached_tokens)
                for b in hit_blocks[g.group_id]:
                    self.pools[g.group_id].touch(b)
                tables[g.group_id] = [NULL_BLOCK] * first + hit_blocks[g.group_id]
        for g, (first_needed, num_new) in zip(self.spec.groups, plans):
            table = tables[g.group_id]
            self._drop_before(g.group_id, table, first_needed)
            table.extend([NULL_BLOCK] * (first_needed - len(table)))
            table.extend(self.pools[g.group_id].allocate(num_new))
        return True

    def blocks_for_import(self, num_tokens: int) -> list[int]:
        """Blocks per group that `allocate_for_import` takes for a prompt of num_tokens."""
        total = -(-num_tokens // self.block_size)
        return [total - self._window_start_block(g, num_tokens) for g in self.spec.groups]

    def allocate_for_import(self, request_id: str, num_tokens: int) -> bool:
        """Tables for positions [0, num_tokens) whose KV comes from elsewhere: sliding groups get
        blocks only for the window the next query reads. All-or-nothing, like allocate_slots."""
        need = self.blocks_for_import(num_tokens)
        if request_id in self.block_tables or any(n > p.num_free for n, p in zip(need, self.pools)):
            return False
        tables = []
        for g, n in zip(self.spec.groups, need):
            first = self._window_start_block(g, num_tokens)
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
            parent = hashes[i - 1] if i else None
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            for pool, table in zip(self.pools, tables):
                if table[i] != NULL_BLOCK:
                    pool.publish(table[i], hashes[i], parent, tokens)
        self._num_published[request_id] = max(done, num_computed_tokens // bs)

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
