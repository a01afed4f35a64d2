"""Block pool of one KV group: vacant blocks, cached free blocks in LRU order, reference counts."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Free blocks are vacant (no hash) or cached (hash kept until reuse, evicted LRU first)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.vacant: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.vacant) + len(self.cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with {self.num_free} free blocks")
        out = []
        for _ in range(n):
            if self.vacant:
                block_id = self.vacant.popleft()
            else:
                block_id, _ = self.cached_free.popitem(last=False)
                self._forget(self.blocks[block_id])
            self.blocks[block_id].ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_id: int) -> None:
        """Take a reference to a cached block found by `lookup`."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.cached_free[block_id]
        block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each; callers pass tail blocks first so they are evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block_id}"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.vacant.append(block_id)
                else:
                    self.cached_free[block_id] = None

    def lookup(self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly these tokens after this parent, verified, or None."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block_id

    def publish(self, block_id: int, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.hash_to_block:
            return  # already published, or an identical block is cached
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.hash_to_block[block_hash] = block_id

    def drop_cached(self, block_hash: bytes) -> None:
        """Forget a cached block no request holds (nothing can resume through it any more)."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].ref_cnt:
            return
        del self.cached_free[block_id]
        self._forget(self.blocks[block_id])
        self.vacant.append(block_id)

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block.block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None
