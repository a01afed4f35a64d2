"""The second KV tier's stores (baton/kv/tier_store.py): a directory several processes share, and
Redis; bounded in bytes, least recently used out, never a half-written object."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import socket
import subprocess
import time

import pytest

from baton.kv.tier_store import BadStoreEntry, DiskStore, RedisStore, TieredStore


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_disk_store_keeps_gets_and_forgets(tmp_path):
    store = DiskStore(tmp_path / "tier", 1 << 20)
    assert store.get(key(1)) is None and not store.contains(key(1))
    store.put(key(1), b"abc")
    assert store.get(key(1)) == b"abc" and store.contains(key(1))
    store.put(key(1), b"xyz")  # a kept key keeps its bytes (the key names its content)
    assert store.get(key(1)) == b"abc"
    store.delete(key(1))
    store.delete(key(1))
    assert store.get(key(1)) is None and store.nbytes() == 0
    with pytest.raises(ValueError, match="32 bytes"):
        store.put(b"short", b"x")


def test_disk_store_evicts_the_least_recently_used_within_its_budget(tmp_path):
    store = DiskStore(tmp_path, 1000)
    for i in range(3):
        store.put(key(i), bytes(300))
        time.sleep(0.01)  # distinct modification times
    assert store.get(key(0)) is not None  # now the most recent
    time.sleep(0.01)
    store.put(key(3), bytes(300))  # 1,200 bytes: the oldest, key 1, goes
    assert [store.contains(key(i)) for i in range(4)] == [True, False, True, True]
    store.put(key(4), bytes(1001))  # bigger than the whole budget: not kept, nothing evicted
    assert not store.contains(key(4)) and store.nbytes() == 900
    for i in range(10, 40):  # 3x the budget written
        store.put(key(i), bytes(100))
    assert store.nbytes() <= 1000


def test_a_half_written_object_is_never_read(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    name = key(7).hex()
    (tmp_path / "tmp" / f"{name}.kv.123.dead").write_bytes(b"half")  # a writer that crashed
    assert store.get(key(7)) is None and not store.contains(key(7)) and store.nbytes() == 0
    store.put(key(7), b"whole")
    assert store.get(key(7)) == b"whole"


def _writer(root: str, first: int) -> None:
    store = DiskStore(root, 50_000)
    for i in range(first, first + 60):
        store.put(key(i), bytes(1000 + i))


def test_processes_sharing_a_directory_keep_its_budget(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), 100 * p)) for p in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = DiskStore(tmp_path, 50_000)
    assert 40_000 < store.nbytes() <= 50_000
    kept = [i for p in range(2) for i in range(100 * p, 100 * p + 60) if store.contains(key(i))]
    assert all(store.get(key(i)) == bytes(1000 + i) for i in kept)  # whole objects only
    assert not list((tmp_path / "tmp").iterdir())


@pytest.fixture(scope="module")
def redis_url():
    server = shutil.which("redis-server") or shutil.which("valkey-server")
    if server is None:
        pytest.skip("no redis-server or valkey-server installed (make install installs one)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_redis_store_keeps_its_budget_least_recently_used_out(redis_url):
    store = RedisStore(redis_url, 1000, namespace=f"t{time.monotonic_ns()}")
    for i in range(3):
        store.put(key(i), bytes(300))
        time.sleep(0.002)
    assert store.get(key(0)) == bytes(300)
    time.sleep(0.002)
    store.put(key(3), bytes(300))
    assert [store.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert store.nbytes() == 900
    store.delete(key(0))
    assert store.nbytes() == 600 and store.get(key(0)) is None
    for i in range(10, 40):
        store.put(key(i), bytes(100))
    assert store.nbytes() <= 1000
    store.close()


def test_tiered_store_reads_the_nearest_and_fills_it_once_checked(tmp_path, redis_url):
    disk, far = DiskStore(tmp_path, 1 << 20), RedisStore(redis_url, 1 << 20, namespace=f"t{time.monotonic_ns()}")
    both = TieredStore([disk, far])
    far.put(key(1), b"from redis")
    assert both.get(key(1)) == (b"from redis", 1) and disk.get(key(1)) is None  # unchecked: not copied
    both.fill(key(1), b"from redis", 0.0, 1)  # once the caller checked it
    assert both.get(key(1)) == (b"from redis", 0)
    both.put(key(2), b"both")
    assert disk.get(key(2)) == far.get(key(2)) == b"both"
    both.delete(key(2))
    assert not both.contains(key(2))
    far.close()


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_uses_dated_back_go_first_so_a_prefix_loses_its_tail_first(kind, tmp_path, request):
    store = DiskStore(tmp_path, 1000) if kind == "disk" else RedisStore(request.getfixturevalue("redis_url"), 1000, "t")
    for block in range(3):  # one prompt's blocks, written head first, each dated back by its index
        store.put(key(block), bytes(300), age=10.0 * block)
    store.put(key(9), bytes(300))  # over the budget: the prompt's last block goes, not its first
    assert [store.contains(key(i)) for i in (0, 1, 2, 9)] == [True, True, False, True]


def test_entries_no_object_can_be_are_deleted_unread(tmp_path, redis_url):
    store = DiskStore(tmp_path, 1 << 20)
    store.put(key(1), bytes(100))
    with pytest.raises(BadStoreEntry, match="over 50"):
        store.get(key(1), max_bytes=50)
    assert not store.contains(key(1)) and store.nbytes() == 0
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    for i, make in enumerate((lambda p: p.symlink_to(secret), os.mkfifo, os.mkdir), 2):
        path = store._path(key(i))
        path.parent.mkdir(exist_ok=True)
        make(path)
        with pytest.raises(BadStoreEntry):
            store.get(key(i), max_bytes=1 << 20)  # a pipe would block a plain open; a link would be followed
        assert not os.path.lexists(path) or os.path.isdir(path)
    assert secret.read_bytes() == b"not yours"
    far = RedisStore(redis_url, 1 << 20, namespace=f"big{time.monotonic_ns()}")
    far.put(key(1), bytes(100))
    with pytest.raises(BadStoreEntry):
        far.get(key(1), max_bytes=50)
    assert not far.contains(key(1)) and far.nbytes() == 0
    far.close()
