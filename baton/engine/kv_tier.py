"""The engine's side of the second KV tier (stores: baton/kv/tier_store.py; objects:
baton/kv/tier_objects.py): write what the prefix cache publishes, look up what a new prompt's
prefix cache lacks, and put what a lookup found into the prefix cache when the request is admitted,
where `kv.prefix`'s rule decides how much of it resumes.

An object holds one block of a prompt: every paged group's rows of that block (an fp8 cache's
scales of it too, so the bits come back exactly); a state object holds the recurrent state (a
pooled indexer's open pool included) at a block boundary, copied from a published checkpoint.
Only the engine thread touches the KV manager and the caches: it copies published blocks out at
the end of a step and writes loaded ones in at admission. A writer thread encodes and stores,
a loader thread fetches and verifies; the engine loop never waits for either.

Writes go through at publish time (not at eviction): an object is in the tier once its block is
computed, so a second worker or a restarted one finds it at once, and an eviction (the moment
memory is short) costs nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch

from baton.config import EngineConfig
from baton.kv.manager import NULL_BLOCK, KVManager
from baton.kv.prefix import needed_start
from baton.kv.spec import STATE_DTYPE, KVSpec
from baton.kv.state import StateStorage
from baton.kv.storage import FP8, KVStorage
from baton.kv.tier_objects import (
    BadTierObject,
    TensorSpec,
    chunk_keys,
    decode_object,
    encode_object,
    namespace_digest,
    state_key,
)
from baton.kv.tier_store import DiskStore, RedisStore, TieredStore

logger = logging.getLogger(__name__)

_KNOWN_KEYS = 1 << 16  # keys written or read lately: not copied out again
_AGE_PER_BLOCK = 1e-3  # seconds a block's use is dated back per block before it: tails are evicted first


@dataclass
class TierStats:
    hit_tokens: int = 0  # prompt tokens the tier served
    miss_tokens: int = 0  # prompt tokens looked up past the prefix cache that it did not
    bytes_read: int = 0
    bytes_written: int = 0
    objects_written: int = 0
    load_seconds: float = 0.0
    bad_objects: int = 0  # failed a check: deleted, a miss
    writes_dropped: int = 0  # over the pending budget
    loads_cut: int = 0  # stopped short at the pending budget
    errors: int = 0  # a store that failed (I/O, connection): a miss or a lost write


@dataclass
class TierLoad:
    """What a lookup found: blocks `first`, `first + 1`, ... (each its tensors in block_specs'
    order) and the states at some positions."""

    first: int
    blocks: list[list[torch.Tensor]]
    states: dict[int, list[torch.Tensor]]
    nbytes: int


@dataclass
class _Tracked:
    token_ids: list[int]  # the request's own list: prompt, then its output as it grows
    num_prompt_tokens: int
    salt: bytes
    keys: list[bytes]  # tier keys of its whole blocks so far
    load: Future | None = None


def _lowest_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
    except (AttributeError, OSError):
        pass


def open_store(urls: list[str], max_bytes: int) -> TieredStore:
    stores: list[Any] = []
    for url in urls:
        if url.startswith("disk:"):
            stores.append(DiskStore(url.removeprefix("disk:"), max_bytes))
        else:
            stores.append(RedisStore(url.replace("valkey", "redis", 1), max_bytes))
    return TieredStore(stores)


def geometry(spec: KVSpec) -> dict:
    """What a tier object's tensors depend on besides the model and the KV dtype."""
    return {
        "block_size": spec.block_size,
        "groups": [
            [g.kind.name, g.kind.window, g.kind.pool, list(g.layer_ids), g.num_kv_heads, g.head_dim, g.v_head_dim]
            for g in spec.groups
        ],
        "state_groups": [[list(g.layer_ids), [list(s) for s in g.state_shapes]] for g in spec.state_groups],
    }


class KVTier:
    def __init__(
        self, config: EngineConfig, kv: KVManager, storage: KVStorage, states: StateStorage | None, fingerprint: dict
    ) -> None:
        tc = config.kv_tier
        self.secret = config.kv_tier_secret_bytes()
        self.store = open_store(tc.kv_tier, tc.kv_tier_bytes)
        self.kv, self.storage, self.states = kv, storage, states
        self.block_size = kv.block_size
        self.namespace = namespace_digest(fingerprint, str(storage.dtype), geometry(kv.spec))
        self.block_specs = self._block_specs()
        self.state_specs = [
            TensorSpec(f"s{g}.{j}", (t.shape[0], *t.shape[2:]), STATE_DTYPE)
            for g, tensors in enumerate(states.checkpoints if states is not None and kv.spec.has_state else [])
            for j, t in enumerate(tensors)
        ]
        self.max_pending = tc.kv_tier_max_pending_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()  # the stats and the pending bytes: three threads count
        self._pending = 0
        self._tracked: dict[str, _Tracked] = {}
        self._fresh: list[Future] = []  # lookups submitted since the last schedule
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="baton-kv-tier-load")
        # the writer runs at the lowest priority: it takes a core when the engine's threads leave one
        # (its encoding competes with the decode step's thread team otherwise)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="baton-kv-tier-write", initializer=_lowest_priority)
        # the sliding groups' windows, in blocks: a lookup starts that far before the cached prefix
        windows = [g.kind.window for g in kv.spec.groups if g.kind.is_sliding]
        self._window_blocks = max((-(-(w - 1) // self.block_size) + 1 for w in windows), default=0)
        kv.record_published = True

    def _block_specs(self) -> list[TensorSpec]:
        out = []
        for g in self.kv.spec.groups:
            k, v = self.storage.group_view(g.group_id)
            rows = g.rows_per_block(self.block_size)
            for name, t, scale in (("k", k, self.storage.k_scale), ("v", v, self.storage.v_scale)):
                if t.shape[-1] == 0:  # MLA latents and pooled keys: K alone
                    continue
                out.append(TensorSpec(f"g{g.group_id}.{name}", (t.shape[0], rows, *t.shape[2:]), t.dtype))
                if self.storage.dtype == FP8:
                    s = scale[g.group_id]
                    out.append(TensorSpec(f"g{g.group_id}.{name}_scale", (s.shape[0], s.shape[2]), s.dtype))
        return out

    def _block_views(self, group_id: int, block_id: int) -> list[torch.Tensor]:
        """A block's rows of one group (and fp8 scales) in block_specs' order, as views."""
        g = self.kv.spec.groups[group_id]
        rows = g.rows_per_block(self.block_size)
        k, v = self.storage.group_view(group_id)
        out = []
        for t, scale in ((k, self.storage.k_scale), (v, self.storage.v_scale)):
            if t.shape[-1] == 0:
                continue
            out.append(t[:, block_id * rows : (block_id + 1) * rows])
            if self.storage.dtype == FP8:
                out.append(scale[group_id][:, block_id])
        return out

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + d)

    def _reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._pending + nbytes > self.max_pending:
                return False
            self._pending += nbytes
            return True

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._pending -= nbytes

    def _keys(self, t: _Tracked, num_blocks: int) -> list[bytes]:
        """The tier keys of the first `num_blocks` whole blocks of a tracked request."""
        bs = self.block_size
        if len(t.keys) < num_blocks:
            parent = t.keys[-1] if t.keys else None
            start = len(t.keys) * bs
            t.keys.extend(chunk_keys(self.namespace, t.token_ids[start : num_blocks * bs], bs, t.salt, parent))
        return t.keys

    # ---- lookups ---------------------------------------------------------------------------------
    def track(self, req) -> None:
        """A new prompt: written through as it is computed, and looked up (on the loader thread)
        past what the prefix cache holds; the request waits for the lookup before admission."""
        t = _Tracked(req.token_ids, req.num_prompt_tokens, req.cache_salt, [])
        self._tracked[req.request_id] = t
        bs = self.block_size
        max_blocks = (len(req.token_ids) - 1) // bs
        hit = self.kv.find_cached_prefix(req.request_id, req.token_ids, req.cache_salt)
        if hit.num_tokens >= max_blocks * bs:
            return
        first = min(max_blocks, max(0, hit.kv_tokens // bs - self._window_blocks))
        lowest_state = hit.num_tokens // bs
        keys = list(self._keys(t, max_blocks)[:max_blocks])
        tokens = list(req.token_ids[: max_blocks * bs])
        t.load = req.tier_load = self._loader.submit(self._load, keys, tokens, first, lowest_state)
        self._fresh.append(t.load)

    def _load(self, keys: list[bytes], tokens: list[int], first: int, lowest_state: int) -> TierLoad:
        start = time.perf_counter()
        bs = self.block_size
        load = TierLoad(first, [], {}, 0)
        for i in range(first, len(keys)):
            got = self._fetch("kv", keys[i], i, tokens, self.block_specs)
            if got is None:
                break
            if not self._reserve(got[1]):
                self._count(loads_cut=1)
                break
            load.blocks.append(got[0])
            load.nbytes += got[1]
        if self.state_specs:
            for k in range(first + len(load.blocks), lowest_state, -1):  # the longest first
                got = self._fetch("state", state_key(keys[k - 1]), k - 1, tokens, self.state_specs)
                if got is not None and self._reserve(got[1]):
                    load.states[k * bs] = got[0]
                    load.nbytes += got[1]
                    break
        self._count(load_seconds=time.perf_counter() - start)
        return load

    def _fetch(
        self, kind: str, key: bytes, block: int, tokens: list[int], specs: list[TensorSpec]
    ) -> tuple[list[torch.Tensor], int] | None:
        """An object's verified tensors and size, or None: absent, unreadable, or bad (then deleted)."""
        bs = self.block_size
        try:
            blob = self.store.get(key, block * _AGE_PER_BLOCK)
        except Exception as e:
            self._count(errors=1)
            logger.warning("kv tier read failed: %s", e)
            return None
        if blob is None:
            return None
        self._count(bytes_read=len(blob))
        try:
            tensors = decode_object(
                blob, self.secret, kind, key, block * bs, (block + 1) * bs, tokens[block * bs : (block + 1) * bs], specs
            )
        except BadTierObject as e:
            self._count(bad_objects=1)
            logger.warning("kv tier object %s failed a check (%s): deleted, recomputed", key.hex()[:16], e)
            try:
                self.store.delete(key)
            except Exception:
                self._count(errors=1)
            return None
        return tensors, sum(s.nbytes for s in specs)

    def before_schedule(self, grace_s: float = 0.002) -> None:
        """Drop what a failed step published (never copied out), and give the lookups submitted
        since the last schedule `grace_s` to finish: a miss takes well under that, and its request
        is then admitted in this step rather than the next (a step's delay for every new request
        cost ~4 % of c8 throughput); a hit still loading waits in the queue as any lookup does."""
        self.kv.published_blocks.clear()
        self.kv.published_checkpoints.clear()
        fresh, self._fresh = self._fresh, []
        if fresh:
            wait(fresh, grace_s)

    def wait(self, timeout: float) -> None:
        """Block until some lookup is done (the engine has nothing else to run)."""
        pending = [t.load for t in self._tracked.values() if t.load is not None and not t.load.done()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    # ---- adoption (the scheduler, on admission) -------------------------------------------------------
    def adopt(self, req) -> None:
        """Put what the lookup of `req` found into the prefix cache, as far as the resumable-prefix
        rule takes it with what the cache holds now; the scheduler's lookup then finds it."""
        future, req.tier_load = req.tier_load, None
        t = self._tracked.get(req.request_id)
        if t is not None:
            t.load = None
        try:
            load: TierLoad = future.result()
        except Exception:
            logger.exception("kv tier lookup of request %s failed", req.request_id)
            self._count(errors=1)
            return
        try:
            self._adopt(req, load)
        finally:
            self._release(load.nbytes)

    def _adopt(self, req, load: TierLoad) -> None:
        rid, tokens, salt = req.request_id, req.token_ids, req.cache_salt
        bs = self.block_size
        loaded = range(load.first, load.first + len(load.blocks))
        max_tokens = (len(tokens) - 1) // bs * bs
        local = self.kv.find_cached_prefix(rid, tokens, salt).num_tokens
        num = self.kv.find_cached_prefix(rid, tokens, salt, loaded.__contains__, load.states.__contains__).num_tokens
        if num > local:
            write_state = lambda cid: self._write_state(cid, load.states[num])  # noqa: E731
            if self.kv.spec.has_state and not self.kv.adopt_checkpoint(rid, tokens, salt, num, write_state):
                num = local
            needed = [range(needed_start(g, num) // bs, num // bs) for g in self.kv.spec.groups]

            def write(group_id: int, block_ids: list[int], indices: list[int]) -> None:
                for b, i in zip(block_ids, indices):
                    self._write_block(group_id, b, load.blocks[i - load.first])

            if num > local and not self.kv.adopt_blocks(rid, tokens, salt, needed, loaded.__contains__, write):
                num = local
        served = max(0, num - local)
        self._count(hit_tokens=served, miss_tokens=max(0, max_tokens - max(num, local)))
        t = self._tracked.get(rid)
        if t is not None and num > local:  # in the tier already: not written again
            keys = self._keys(t, num // bs)
            with self._lock:
                for key in keys[local // bs : num // bs]:
                    self._remember(key)
                self._remember(state_key(keys[num // bs - 1]))

    def _write_block(self, group_id: int, block_id: int, tensors: list[torch.Tensor]) -> None:
        names = [s.name for s in self.block_specs]
        prefix = f"g{group_id}."
        mine = [t for s, t in zip(names, tensors) if s.startswith(prefix)]
        for view, values in zip(self._block_views(group_id, block_id), mine):
            view.copy_(values)

    def _write_state(self, cid: int, tensors: list[torch.Tensor]) -> None:
        it = iter(tensors)
        for group in self.states.checkpoints:
            for t in group:
                t[:, cid].copy_(next(it))

    # ---- writes (end of each step) ----------------------------------------------------------------
    def _remember(self, key: bytes) -> bool:
        """Whether `key` is new here (then it is remembered); caller holds the lock."""
        if key in self._known:
            self._known.move_to_end(key)
            return False
        self._known[key] = None
        if len(self._known) > _KNOWN_KEYS:
            self._known.popitem(last=False)
        return True

    def after_step(self) -> None:
        """Copy out what this step published (the blocks are not reused before the next schedule)
        and hand it to the writer: a prompt's blocks and checkpoints, not those of its output (as
        LMCache by default: writes then cost nothing while a batch decodes, and the next turn of a
        chat writes the previous answer's blocks with its own prompt)."""
        blocks, self.kv.published_blocks = self.kv.published_blocks, []
        checkpoints, self.kv.published_checkpoints = self.kv.published_checkpoints, []
        bs = self.block_size
        for rid, i, block_ids in blocks:
            t = self._tracked.get(rid)
            if t is None or NULL_BLOCK in block_ids or (i + 1) * bs > t.num_prompt_tokens:
                continue
            copy = partial(self._copy_block, block_ids)
            self._submit(self._keys(t, i + 1)[i], "kv", i, t, self.block_specs, copy)
        for rid, cid, block_hash, num_tokens in checkpoints:
            t = self._tracked.get(rid)
            entry = self.kv.checkpoints.entries[cid]
            if t is None or entry.block_hash != block_hash or num_tokens > t.num_prompt_tokens:
                continue  # not tracked, taken for another checkpoint since, or past the prompt
            k = num_tokens // bs
            key = state_key(self._keys(t, k)[k - 1])
            self._submit(key, "state", k - 1, t, self.state_specs, partial(self._copy_state, cid))

    def _copy_state(self, cid: int) -> list[torch.Tensor]:
        return [x[:, cid].clone() for group in self.states.checkpoints for x in group]

    def _copy_block(self, block_ids: tuple[int, ...]) -> list[torch.Tensor]:
        return [
            v.clone(memory_format=torch.contiguous_format)
            for g, b in enumerate(block_ids)
            for v in self._block_views(g, b)
        ]

    def _submit(self, key: bytes, kind: str, block: int, t: _Tracked, specs: list[TensorSpec], copy) -> None:
        """Copy an object's tensors out (`copy()`) and queue its write, unless the key was written or
        read lately, or the pending bytes are at their bound (then dropped and counted)."""
        with self._lock:
            if not self._remember(key):
                return
        nbytes = sum(s.nbytes for s in specs)
        if not self._reserve(nbytes):
            self._count(writes_dropped=1)
            with self._lock:
                self._known.pop(key, None)
            return
        bs = self.block_size
        tensors = list(zip((s.name for s in specs), copy()))
        tokens = t.token_ids[block * bs : (block + 1) * bs]
        self._writer.submit(self._write, key, kind, block, tokens, tensors, nbytes)

    def _write(self, key, kind, block, tokens, tensors, nbytes) -> None:
        bs = self.block_size
        try:
            blob = encode_object(kind, key, block * bs, (block + 1) * bs, tokens, tensors, self.secret)
            self.store.put(key, blob, block * _AGE_PER_BLOCK)
            self._count(bytes_written=len(blob), objects_written=1)
        except Exception as e:
            self._count(errors=1)
            logger.warning("kv tier write failed: %s", e)
            with self._lock:
                self._known.pop(key, None)
        finally:
            self._release(nbytes)

    def forget(self, request_id: str) -> None:
        """A request ended: its lookup, if still running, is dropped when done."""
        t = self._tracked.pop(request_id, None)
        if t is not None and t.load is not None:
            t.load.add_done_callback(self._drop_load)

    def _drop_load(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._release(future.result().nbytes)

    def flush(self) -> None:
        """Wait for the writes handed over so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the writes (a restart finds them), drop the lookups."""
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=True)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self.stats, f.name) for f in fields(self.stats)}
