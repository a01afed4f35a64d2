"""The second KV tier's stores: opaque objects by key, bounded in bytes, least recently used first out.

A key is 32 bytes (a SHA-256 the caller derives from what the object must match); a value is the
object's bytes, which the caller validates: a store only keeps bytes. `DiskStore` is a directory any
number of processes on one host share: an object is written to a private temporary file and
renamed into place (a reader never sees an object a dying process half wrote; one a power loss
tore fails the caller's checks), and the budget is
kept under an exclusive lock on the directory, so it holds whichever process writes (a running total
in `.bytes`; a scan evicts and corrects it when a write would pass the budget).
`RedisStore` keeps objects in Redis or Valkey, its byte budget and recency in two more keys, each
write and its evictions one atomic script. `TieredStore` reads the first store that has a key
(disk, then Redis) and writes every store.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, Protocol

KEY_BYTES = 32
SUFFIX = ".kv"
LOW_WATERMARK = 0.9  # a full directory is evicted down to this share of its budget: not a scan per write


class BadStoreEntry(ValueError):
    """An entry no valid object can be (too big, a link, a pipe): deleted, never read."""


class TierStore(Protocol):
    def put(self, key: bytes, value: bytes, age: float = 0.0) -> None:
        """Keep `value` under `key` (a key already kept: only its recency moves), evicting the least
        recently used objects until the store is within its budget; a value over the whole budget
        is not kept. `age`: seconds the use is dated back (a prompt's later blocks are older than
        its first, so a prefix loses its tail first: its head is what other prompts share)."""

    def get(self, key: bytes, age: float = 0.0, max_bytes: int | None = None) -> bytes | None:
        """The value, or None; a hit counts as a use (dated back `age` seconds). BadStoreEntry (and
        the entry deleted) for one over `max_bytes`, or on disk anything but a regular file."""

    def contains(self, key: bytes) -> bool: ...

    def delete(self, key: bytes) -> None:
        """Forget `key` (a bad object); absent keys are ignored."""

    def nbytes(self) -> int:
        """The bytes the store's objects take."""


def _check_key(key: bytes) -> str:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a tier key is {KEY_BYTES} bytes")
    return key.hex()


class DiskStore:
    """Objects as files `<root>/<2 hex>/<64 hex>.kv`; recency is a file's modification time."""

    def __init__(self, root: str | os.PathLike, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"a disk tier needs a positive byte budget, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(exist_ok=True)
        self._lock_path = self.root / ".lock"
        self._lock_path.touch(exist_ok=True)
        self._total_path = self.root / ".bytes"

    def _path(self, key: bytes) -> Path:
        name = _check_key(key)
        return self.root / name[:2] / f"{name}{SUFFIX}"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._lock_path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _objects(self) -> list[tuple[float, int, Path]]:
        """(modification time, size, path) of every object, whatever process wrote it."""
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(SUFFIX):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # evicted meanwhile by another process's delete
                        continue
                    found.append((st.st_mtime, st.st_size, Path(entry.path)))
        return found

    def put(self, key: bytes, value: bytes, age: float = 0.0) -> None:
        path = self._path(key)
        if len(value) > self.max_bytes:
            return
        if self._touch(path, age):
            return
        tmp = self.root / "tmp" / f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}"
        try:
            # no fsync (it cost more than the rest of a write): a process that dies mid-write leaves
            # only its temporary file, and an object torn by a power loss fails its signature check
            with open(tmp, "wb") as f:
                f.write(value)
            with self._locked():
                if path.exists():  # another process wrote it meanwhile
                    return
                total = self._read_total() + len(value)
                if total > self.max_bytes:  # evict by a scan, which also corrects the running total
                    objects = self._objects()
                    total = sum(size for _, size, _ in objects) + len(value)
                    for _, size, victim in sorted(objects):
                        if total <= self.max_bytes * LOW_WATERMARK:
                            break
                        victim.unlink(missing_ok=True)
                        total -= size
                path.parent.mkdir(exist_ok=True)
                os.replace(tmp, path)
                self._touch(path, age)
                self._write_total(total)
        finally:
            tmp.unlink(missing_ok=True)

    def _read_total(self) -> int:
        """The running total of object bytes (kept under the lock; a scan when it is unreadable)."""
        try:
            return int(self._total_path.read_text())
        except (FileNotFoundError, ValueError):
            return self.nbytes()

    def _write_total(self, total: int) -> None:
        tmp = self._total_path.with_suffix(f".{os.getpid()}")
        tmp.write_text(str(total))
        os.replace(tmp, self._total_path)

    def _touch(self, path: Path, age: float = 0.0) -> bool:
        stamp = time.time() - age
        try:
            os.utime(path, (stamp, stamp))
            return True
        except FileNotFoundError:
            return False

    def get(self, key: bytes, age: float = 0.0, max_bytes: int | None = None) -> bytes | None:
        path = self._path(key)
        try:  # never through a link, never blocking on a pipe
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._refuse(path, f"cannot be opened as a file: {e.strerror}")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (max_bytes is not None and st.st_size > max_bytes):
            os.close(fd)
            why = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"{st.st_size} bytes, over {max_bytes}"
            self._refuse(path, why)
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1 if max_bytes is not None else -1)
        if max_bytes is not None and len(data) > max_bytes:  # grew since the stat
            self._refuse(path, f"over {max_bytes} bytes")
        self._touch(path, age)
        return data

    def _refuse(self, path: Path, why: str) -> NoReturn:
        with self._locked():
            try:
                path.unlink()
            except OSError:  # gone already, or a directory someone put there: never read either way
                pass
            self._write_total(self.nbytes())
        raise BadStoreEntry(f"{path.name}: {why}")

    def contains(self, key: bytes) -> bool:
        return self._path(key).exists()

    def delete(self, key: bytes) -> None:
        path = self._path(key)
        with self._locked():
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                return
            self._write_total(max(0, self._read_total() - size))

    def nbytes(self) -> int:
        return sum(size for _, size, _ in self._objects())


# KEYS: the object, the recency sorted set, the byte counter; ARGV: the value, the budget, now.
# A new object is counted and stamped, then the oldest go until the total is within the budget.
_PUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
  return 0
end
local size = string.len(ARGV[1])
if size > tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
local total = redis.call('INCRBY', KEYS[3], size)
while total > tonumber(ARGV[2]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if oldest == nil then break end
  redis.call('ZREM', KEYS[2], oldest)
  total = redis.call('DECRBY', KEYS[3], redis.call('STRLEN', oldest))
  redis.call('DEL', oldest)
end
return 1
"""
# KEYS: the object, the recency sorted set, the byte counter; ARGV: the most bytes (-1: any), now.
# An object over the bound is deleted unread (-1).
_GET = """
local size = redis.call('STRLEN', KEYS[1])
if size == 0 then return false end
if tonumber(ARGV[1]) >= 0 and size > tonumber(ARGV[1]) then
  if redis.call('ZREM', KEYS[2], KEYS[1]) == 1 then redis.call('DECRBY', KEYS[3], size) end
  redis.call('DEL', KEYS[1])
  return -1
end
redis.call('ZADD', KEYS[2], 'XX', ARGV[2], KEYS[1])
return redis.call('GET', KEYS[1])
"""
_DELETE = """
if redis.call('ZREM', KEYS[2], KEYS[1]) == 1 then
  redis.call('DECRBY', KEYS[3], redis.call('STRLEN', KEYS[1]))
  redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisStore:
    """Objects in Redis or Valkey at `url` (redis://HOST:PORT[/DB]) under `namespace`."""

    def __init__(self, url: str, max_bytes: int, namespace: str = "baton:kv") -> None:
        import redis  # the client package; only a Redis tier needs it

        if max_bytes < 1:
            raise ValueError(f"a Redis tier needs a positive byte budget, got {max_bytes}")
        self.max_bytes = max_bytes
        self.namespace = namespace
        self._client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self._lru, self._total = f"{namespace}:lru", f"{namespace}:bytes"
        self._put = self._client.register_script(_PUT)
        self._delete = self._client.register_script(_DELETE)
        self._get = self._client.register_script(_GET)

    def _key(self, key: bytes) -> str:
        return f"{self.namespace}:obj:{_check_key(key)}"

    def put(self, key: bytes, value: bytes, age: float = 0.0) -> None:
        self._put(keys=[self._key(key), self._lru, self._total], args=[value, self.max_bytes, time.time() - age])

    def get(self, key: bytes, age: float = 0.0, max_bytes: int | None = None) -> bytes | None:
        value = self._get(keys=[self._key(key), self._lru, self._total], args=[max_bytes or -1, time.time() - age])
        if value == -1:
            raise BadStoreEntry(f"{key.hex()[:16]}: over {max_bytes} bytes")
        return value

    def contains(self, key: bytes) -> bool:
        return bool(self._client.exists(self._key(key)))

    def delete(self, key: bytes) -> None:
        self._delete(keys=[self._key(key), self._lru, self._total])

    def nbytes(self) -> int:
        return int(self._client.get(self._total) or 0)

    def close(self) -> None:
        self._client.close()


class TieredStore:
    """Stores in order (disk, then Redis): a read takes the first that has the key, a write goes to
    each."""

    def __init__(self, stores: list[TierStore]) -> None:
        if not stores:
            raise ValueError("a tiered store needs a store")
        self.stores = stores

    def put(self, key: bytes, value: bytes, age: float = 0.0) -> None:
        for store in self.stores:
            store.put(key, value, age)

    def get(self, key: bytes, age: float = 0.0, max_bytes: int | None = None) -> tuple[bytes, int] | None:
        """The value and the index of the first store that has it (`fill` copies it nearer once
        the caller has checked it: an unchecked value never displaces the nearer stores' objects)."""
        for i, store in enumerate(self.stores):
            value = store.get(key, age, max_bytes)
            if value is not None:
                return value, i
        return None

    def fill(self, key: bytes, value: bytes, age: float, found_in: int) -> None:
        for nearer in self.stores[:found_in]:
            nearer.put(key, value, age)

    def contains(self, key: bytes) -> bool:
        return any(store.contains(key) for store in self.stores)

    def delete(self, key: bytes) -> None:
        for store in self.stores:
            store.delete(key)

    def nbytes(self) -> int:
        return sum(store.nbytes() for store in self.stores)


def open_stores(urls: list[str], max_bytes: int) -> TieredStore:
    """The stores `--kv-tier` names (disk:PATH, redis://..., valkey://...), in order, each with
    `max_bytes`."""
    stores: list[TierStore] = []
    for url in urls:
        if url.startswith("disk:"):
            stores.append(DiskStore(url.removeprefix("disk:"), max_bytes))
        else:
            stores.append(RedisStore(url.replace("valkey", "redis", 1), max_bytes))
    return TieredStore(stores)
