"""The engine's side of the second KV tier (stores: kv/tier_store.py; objects: kv/tier_objects.py,
what they hold: kv/tier_layout.py): write through what the prefix cache publishes, look up what a
new prompt's prefix cache lacks, and at admission put what was found into the prefix cache, as far
as `kv.prefix`'s rule resumes. Only the engine thread touches the KV manager and the caches (it
copies published blocks out at the end of a step, writes loaded ones in at admission); a writer
thread encodes and stores, a loader thread fetches and verifies. The engine waits for neither,
beyond a 2 ms grace for fresh lookups (`before_schedule`). Writes go at publish time, not at
eviction: a block is in the tier once computed, so another worker or a restarted one finds it at
once, and an eviction (when memory is short) costs nothing."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, fields
from functools import partial

import torch

from baton.config import EngineConfig
from baton.kv.manager import NULL_BLOCK, KVManager
from baton.kv.prefix import needed_start
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.kv.tier_layout import TierLayout, geometry
from baton.kv.tier_objects import (
    BadTierObject,
    TensorSpec,
    chunk_keys,
    decode_object,
    encode_object,
    namespace_digest,
    state_key,
)
from baton.kv.tier_store import BadStoreEntry, open_stores

logger = logging.getLogger(__name__)

_KNOWN_KEYS = 1 << 16  # keys written or read lately: not copied out again
_BACKOFF_S = 30.0  # a failed store is not asked again for this long
_MAX_FRAME_BYTES = 1 << 20  # an object's header and framing, at most: a bigger file is not read
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


class KVTier:
    def __init__(
        self, config: EngineConfig, kv: KVManager, storage: KVStorage, states: StateStorage | None, fingerprint: dict
    ) -> None:
        tc = config.kv_tier
        self.secret = config.kv_tier_secret_bytes()
        self.store = open_stores(tc.kv_tier, tc.kv_tier_bytes)
        self.kv, self.storage, self.states = kv, storage, states
        self.block_size = kv.block_size
        self.namespace = namespace_digest(fingerprint, str(storage.dtype), geometry(kv.spec))
        self.layout = TierLayout(kv.spec, storage, states)
        self.block_specs, self.state_specs = self.layout.block_specs, self.layout.state_specs
        self.max_pending = tc.kv_tier_max_pending_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()  # the stats and the pending bytes: three threads count
        self._pending = 0
        self._down_until = 0.0  # monotonic time until which a failed store is skipped
        self._tracked: dict[str, _Tracked] = {}
        self._fresh: list[Future] = []  # lookups submitted since the last schedule
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="baton-kv-tier-load")
        # the writer runs at the lowest priority: it takes a core when the engine's threads leave one
        # (its encoding competes with the decode step's thread team otherwise)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="baton-kv-tier-write", initializer=_lowest_priority)
        kv.record_published = True

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
        # from where the cache ends, or where a sliding group's window before it begins (the cache
        # may have let those blocks go)
        sliding = [needed_start(g, hit.kv_tokens) // bs for g in self.kv.spec.groups if g.kind.is_sliding]
        first = min(max_blocks, hit.kv_tokens // bs, *sliding)
        lowest_state = hit.num_tokens // bs
        keys = list(self._keys(t, max_blocks)[:max_blocks])
        tokens = list(req.token_ids[: max_blocks * bs])
        t.load = req.tier_load = self._loader.submit(self._load, keys, tokens, first, lowest_state)
        self._fresh.append(t.load)

    def _load(self, keys: list[bytes], tokens: list[int], first: int, lowest_state: int) -> TierLoad:
        start = time.perf_counter()
        load = TierLoad(first, [], {}, 0)
        try:
            self._load_into(load, keys, tokens, lowest_state)
        except BaseException:
            self._release(load.nbytes)
            raise
        finally:
            self._count(load_seconds=time.perf_counter() - start)
        return load

    def _load_into(self, load: TierLoad, keys: list[bytes], tokens: list[int], lowest_state: int) -> None:
        """Blocks from `load.first` until one is missing (or the pending bytes are at their bound),
        then the latest state at or below their end."""
        for i in range(load.first, len(keys)):
            got = self._fetch("kv", keys[i], i, tokens, self.block_specs)
            if got is None:
                break
            if not self._reserve(got[1]):
                self._count(loads_cut=1)
                break
            load.blocks.append(got[0])
            load.nbytes += got[1]
        if self.state_specs:
            for k in range(load.first + len(load.blocks), lowest_state, -1):
                got = self._fetch("state", state_key(keys[k - 1]), k - 1, tokens, self.state_specs)
                if got is not None and self._reserve(got[1]):
                    load.states[k * self.block_size] = got[0]
                    load.nbytes += got[1]
                    break

    def _fetch(
        self, kind: str, key: bytes, block: int, tokens: list[int], specs: list[TensorSpec]
    ) -> tuple[list[torch.Tensor], int] | None:
        """An object's verified tensors and size, or None: absent, unreadable, or bad (then deleted).
        A store that failed is skipped for `_BACKOFF_S`: lookups then cost nothing, not a timeout each."""
        if time.monotonic() < self._down_until:
            return None
        bs = self.block_size
        nbytes = sum(s.nbytes for s in specs)
        try:
            found = self.store.get(key, block * _AGE_PER_BLOCK, nbytes + _MAX_FRAME_BYTES)
        except BadStoreEntry as e:  # deleted by the store
            self._count(bad_objects=1)
            logger.warning("kv tier object %s refused (%s): deleted, recomputed", key.hex()[:16], e)
            return None
        except Exception as e:
            self._store_failed("read", e)
            return None
        if found is None:
            return None
        blob, where = found
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
            except Exception as e:
                self._store_failed("delete", e)
            return None
        try:
            self.store.fill(key, blob, block * _AGE_PER_BLOCK, where)  # verified: now into the nearer stores
        except Exception as e:
            self._store_failed("write", e)
        return tensors, nbytes

    def _store_failed(self, what: str, e: Exception) -> None:
        self._count(errors=1)
        self._down_until = time.monotonic() + _BACKOFF_S
        why = f"{type(e).__name__}: {e}"
        logger.warning("kv tier %s failed (%s); the tier is skipped for %.0f s", what, why, _BACKOFF_S)

    def before_schedule(self, grace_s: float = 0.002) -> None:
        """Drop what a failed step published (never copied out), and give the lookups submitted
        since the last schedule `grace_s` to finish: a miss takes well under that, and its request
        is then admitted in this step rather than a step later (every new request would otherwise
        idle a step); a hit still loading waits in the queue as any lookup does."""
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

            def write_blocks(group_id: int, block_ids: list[int], indices: list[int]) -> None:
                for b, i in zip(block_ids, indices):
                    self.layout.write_block(group_id, b, load.blocks[i - load.first])

            def write_state(cid: int) -> None:
                self.layout.write_state(cid, load.states[num])

            if not self.kv.adopt_prefix(rid, tokens, salt, num, loaded.__contains__, write_blocks, write_state):
                num = local
        served = max(0, num - local)
        self._count(hit_tokens=served, miss_tokens=max(0, max_tokens - max(num, local)))
        t = self._tracked.get(rid)
        if t is not None and num > local:  # in the tier already: not written again
            keys = self._keys(t, num // bs)
            with self._lock:
                for key in keys[local // bs : num // bs]:
                    self._remember(key)
                if self.state_specs:
                    self._remember(state_key(keys[num // bs - 1]))

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
            copy = partial(self.layout.copy_block, block_ids)
            self._submit(self._keys(t, i + 1)[i], "kv", i, t, self.block_specs, copy)
        for rid, cid, block_hash, num_tokens in checkpoints:
            t = self._tracked.get(rid)
            entry = self.kv.checkpoints.entries[cid]
            if t is None or entry.block_hash != block_hash or num_tokens > t.num_prompt_tokens:
                continue  # not tracked, taken for another checkpoint since, or past the prompt
            k = num_tokens // bs
            key = state_key(self._keys(t, k)[k - 1])
            self._submit(key, "state", k - 1, t, self.state_specs, partial(self.layout.copy_state, cid))

    def _submit(self, key: bytes, kind: str, block: int, t: _Tracked, specs: list[TensorSpec], copy) -> None:
        """Copy an object's tensors out (`copy()`) and queue its write, unless the key was written or
        read lately, or the pending bytes are at their bound (then dropped and counted)."""
        with self._lock:
            if not self._remember(key):
                return
        nbytes = sum(s.nbytes for s in specs)
        if not self._reserve(nbytes):
            self._drop_write(key)
            return
        bs = self.block_size
        tensors = list(zip((s.name for s in specs), copy()))
        tokens = t.token_ids[block * bs : (block + 1) * bs]
        self._writer.submit(self._write, key, kind, block, tokens, tensors, nbytes)

    def _write(self, key, kind, block, tokens, tensors, nbytes) -> None:
        bs = self.block_size
        try:
            if time.monotonic() >= self._down_until:  # while the store is backed off: dropped below
                blob = encode_object(kind, key, block * bs, (block + 1) * bs, tokens, tensors, self.secret)
                self.store.put(key, blob, block * _AGE_PER_BLOCK)
                self._count(bytes_written=len(blob), objects_written=1)
                return
        except Exception as e:
            self._store_failed("write", e)
        finally:
            self._release(nbytes)
        self._drop_write(key)

    def _drop_write(self, key: bytes) -> None:
        """A write that did not happen: counted, and its key free to be written again."""
        self._count(writes_dropped=1)
        with self._lock:
            self._known.pop(key, None)

    def forget(self, request_id: str) -> None:
        """A request ended: its lookup is cancelled, or dropped when done."""
        t = self._tracked.pop(request_id, None)
        if t is not None and t.load is not None and not t.load.cancel():  # running or done: its bytes go back
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
