"""The second KV tier wired into the engine (baton/engine/kv_tier.py): a restarted engine, or another
one, resumes a prompt from a disk or Redis tier with a cold engine's tokens; hybrids resume at a
state checkpoint the tier holds; every bad object is a counted miss; budgets hold; nothing leaks."""

from __future__ import annotations

import random
import shutil
import time

import pytest
import requests
import torch

from baton import LLM, SamplingParams
from baton.handoff.wire import frame, read_header
from baton.kv.tier_objects import MAGIC, chunk_keys, state_key
from baton.kv.tier_store import DiskStore
from tests.server_util import ServerProcess
from tests.test_glm5_flash import flash  # noqa: F401 (fixtures)
from tests.test_kimi_linear import kimi  # noqa: F401
from tests.test_kv_tier_store import redis_url  # noqa: F401
from tests.test_random_models import make_model
from tests.test_recurrent_hybrid import qwen3_next  # noqa: F401

SECRET = "tier-secret"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LLAMA = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, max_position_embeddings=2048)


def _ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]


def _tier_llm(model: str, tier: list[str], **kw) -> LLM:
    args = dict(progress=False, kv_tier=tier, kv_tier_secret=SECRET, block_size=16)
    return LLM(model, **{**args, **kw})


def _run(llm: LLM, ids: list[int], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": ids}], params)[0]


def _close(llm: LLM) -> None:
    llm.engine.tier.flush()
    llm.engine.shutdown()


def _object(llm: LLM, root, ids: list[int], block: int, state: bool = False):
    """The file of a prompt's block object (or of the state at that block's end)."""
    key = chunk_keys(llm.engine.tier.namespace, ids, llm.engine.kv.block_size)[block]
    return DiskStore(root, 1)._path(state_key(key) if state else key)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **LLAMA)[1]


@pytest.mark.parametrize(
    "kv_dtype,length",
    [("fp8", 1000)]
    + [pytest.param(d, 1000, marks=pytest.mark.slow) for d in ("float32", "bfloat16")]
    + [pytest.param(d, 7900, marks=pytest.mark.slow) for d in ("float32", "bfloat16", "fp8")],
)
def test_a_restarted_engine_resumes_from_the_disk_tier_with_a_cold_engines_tokens(tmp_path, kv_dtype, length):
    """(bench/kv_tier.py times the 7,900-token case's TTFT cold and after the restart.)"""
    ids = _ids(length, 0, 40000)
    cold = LLM("smollm2-135m", progress=False, kv_cache_dtype=kv_dtype)
    expected = _run(cold, ids).outputs[0].token_ids
    del cold
    first = _tier_llm("smollm2-135m", [f"disk:{tmp_path}"], kv_cache_dtype=kv_dtype)
    assert _run(first, ids).outputs[0].token_ids == expected
    _close(first)
    written = first.engine.tier.metrics()
    assert written["objects_written"] == length // 16 and written["hit_tokens"] == 0  # the prompt's blocks
    restarted = _tier_llm("smollm2-135m", [f"disk:{tmp_path}"], kv_cache_dtype=kv_dtype)
    out = _run(restarted, ids)
    stats = restarted.engine.tier.metrics()
    assert out.num_cached_tokens == (len(ids) - 1) // 16 * 16 == stats["hit_tokens"]
    assert out.outputs[0].token_ids == expected
    assert stats["bad_objects"] == 0 and stats["bytes_read"] > 0 and stats["objects_written"] == 0
    assert restarted.engine.kv.all_free()


@pytest.mark.parametrize("family", ["qwen3_next", "kimi", "flash"])
def test_hybrids_resume_at_the_tiers_checkpoint_and_a_lost_checkpoint_only_shortens_the_hit(family, request, tmp_path):
    _, path = request.getfixturevalue(family)
    kw = dict(kv_cache_memory_bytes=64 << 20, state_checkpoint_interval=64)
    ids = _ids(300, 1)
    cold = LLM(str(path), progress=False, block_size=16, **kw)
    expected = _run(cold, ids).outputs[0].token_ids
    first = _tier_llm(str(path), [f"disk:{tmp_path}"], **kw)
    _run(first, ids)
    _close(first)
    resumed = _tier_llm(str(path), [f"disk:{tmp_path}"], **kw)
    out = _run(resumed, ids)
    assert out.num_cached_tokens == 288 and out.outputs[0].token_ids == expected  # the prompt's last boundary
    # the blocks are there, the checkpoint at 288 is not: the hit falls back to the one at 256
    _object(resumed, tmp_path, ids, 288 // 16 - 1, state=True).unlink()
    again = _tier_llm(str(path), [f"disk:{tmp_path}"], **kw)
    out = _run(again, ids)
    assert out.num_cached_tokens == 256 and out.outputs[0].token_ids == expected
    assert again.engine.tier.metrics()["bad_objects"] == 0


def _flip(data: bytes, llm, secret: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :]


def _truncate(data: bytes, llm, secret: bytes) -> bytes:
    return data[: len(data) // 2]


def _other_secret(data: bytes, llm, secret: bytes) -> bytes:
    header, body = read_header(data, secret, MAGIC)
    return frame(header, bytes(body), b"another secret", MAGIC)


def _lying_header(data: bytes, llm, secret: bytes) -> bytes:
    header, body = read_header(data, secret, MAGIC)
    shape = header["tensors"][0]["shape"]
    header["tensors"][0]["shape"] = [shape[0], shape[1] // 2, shape[2] * 2, shape[3]]  # same bytes, other shape
    return frame(header, bytes(body), secret, MAGIC)


def _oversized(data: bytes, llm, secret: bytes) -> bytes:
    return data + bytes(2 << 20)  # past what the object can be: deleted unread


HOSTILE = {
    "flipped byte": _flip,
    "truncated": _truncate,
    "other secret": _other_secret,
    "lying header": _lying_header,
    "oversized": _oversized,
}


def test_bad_objects_are_counted_deleted_misses_with_a_cold_engines_tokens(llama, tmp_path):
    prompts = {name: _ids(200, 10 + i) for i, name in enumerate(HOSTILE)}
    writer = _tier_llm(str(llama), [f"disk:{tmp_path}"])
    expected = {name: _run(writer, ids).outputs[0].token_ids for name, ids in prompts.items()}
    _close(writer)
    reader = _tier_llm(str(llama), [f"disk:{tmp_path}"])
    for n, (name, corrupt) in enumerate(HOSTILE.items(), 1):
        bad = _object(reader, tmp_path, prompts[name], 5)
        original = bad.read_bytes()
        bad.write_bytes(corrupt(original, reader, SECRET.encode()))
        out = _run(reader, prompts[name])
        assert out.num_cached_tokens == 5 * 16, name  # blocks 0-4 verified, block 5 refused
        assert out.outputs[0].token_ids == expected[name], name
        assert reader.engine.tier.metrics()["bad_objects"] == n, name
        reader.engine.tier.flush()  # deleted, then written again from the recomputed block: the same bytes
        assert bad.read_bytes() == original, name
    assert reader.engine.kv.all_free()


def test_an_object_of_a_model_one_weight_apart_is_a_counted_miss(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(llama, other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in weights if k.endswith("mlp.up_proj.weight"))
    weights[name][0, 0] += 1.0
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    ids = _ids(200, 3)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    mine = _tier_llm(str(llama), [f"disk:{ours}"])
    expected = _run(mine, ids).outputs[0].token_ids
    _close(mine)
    foreign = _tier_llm(str(other), [f"disk:{theirs}"])
    _run(foreign, ids)
    foreign.engine.tier.flush()
    assert foreign.engine.tier.namespace != mine.engine.tier.namespace  # their keys are not ours
    for block in range(len(ids) // 16):  # their objects put where ours would be
        shutil.copy(_object(foreign, theirs, ids, block), _object(mine, ours, ids, block))
    _close(foreign)
    reader = _tier_llm(str(llama), [f"disk:{ours}"])
    out = _run(reader, ids)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == expected
    assert reader.engine.tier.metrics()["bad_objects"] == 1


def test_the_directory_stays_within_its_budget_and_nothing_leaks(llama, tmp_path):
    budget = 400_000
    llm = _tier_llm(str(llama), [f"disk:{tmp_path}"], kv_tier_bytes=budget, num_kv_blocks=40, max_num_seqs=4)
    prompts = [_ids(300, 100 + i) for i in range(12)]  # ~1.2 MB of objects: 3x the budget
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)  # 40 blocks for 4 x 19: preemption
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.tier.flush()
    stats = llm.engine.tier.metrics()
    assert stats["bytes_written"] >= 3 * budget and DiskStore(tmp_path, budget).nbytes() <= budget
    # aborted while its lookup runs, while running, and a miss: all their blocks come back
    engine = llm.engine
    for i, ids in enumerate([prompts[-1], _ids(300, 999), prompts[0]]):
        rid = engine.add_request({"prompt_token_ids": ids}, params)
        for _ in range(i):
            engine.step()
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    llm.engine.tier.flush()
    assert engine.kv.all_free() and engine.tier._pending == 0


def test_the_tier_needs_its_secret_and_refuses_bad_settings(llama):
    with pytest.raises(ValueError, match="kv-tier-secret"):
        LLM(str(llama), progress=False, kv_tier=["disk:/tmp/x"])
    with pytest.raises(ValueError, match="kv_tier entries"):
        LLM(str(llama), progress=False, kv_tier=["/tmp/x"], kv_tier_secret=SECRET)
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(str(llama), progress=False, kv_tier=["disk:/tmp/x"], kv_tier_secret=SECRET, enable_prefix_caching=False)


def _completion(server: ServerProcess, prompt: str) -> dict:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    r = requests.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _written(server: ServerProcess, response: dict) -> None:
    """Wait for a server's asynchronous writes of the prompt it answered."""
    blocks = response["usage"]["prompt_tokens"] // 16
    for _ in range(200):
        if server.metric("baton_kv_tier_objects_written_total") >= blocks:
            return
        time.sleep(0.05)
    raise AssertionError("the tier writes did not finish")


PROMPT = " ".join(f"item {i} of the list is {i * 7 % 13}." for i in range(120))


@pytest.mark.slow  # four servers one after another: 53 s of the default suite
def test_two_servers_share_a_disk_tier_and_two_with_their_own_disks_share_redis(tmp_path, redis_url):  # noqa: F811
    env = {"BATON_KV_TIER_SECRET": SECRET}
    disk = ["--kv-tier", f"disk:{tmp_path / 'shared'}"]
    first, second = (ServerProcess(*disk, env=env, wait=False) for _ in range(2))
    try:
        first.wait_healthy()
        second.wait_healthy()
        a = _completion(first, PROMPT)
        _written(first, a)
        b = _completion(second, PROMPT)
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.9 * b["usage"]["prompt_tokens"]
        assert second.metric("baton_kv_tier_hit_tokens_total") > 0
    finally:
        first.terminate()
        second.terminate()
    servers = [
        ServerProcess("--kv-tier", f"disk:{tmp_path / d}", "--kv-tier", redis_url, env=env, wait=False)
        for d in ("one", "two")
    ]
    try:
        for s in servers:
            s.wait_healthy()
        a = _completion(servers[0], PROMPT + " again")
        _written(servers[0], a)
        b = _completion(servers[1], PROMPT + " again")
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.9 * b["usage"]["prompt_tokens"]
        assert servers[1].metric("baton_kv_tier_hit_tokens_total") > 0
        assert any((tmp_path / "two").glob("*/*.kv"))  # read from Redis, kept on its own disk too
    finally:
        for s in servers:
            s.terminate()


def test_tier_keys_are_the_same_in_every_process():
    ns = bytes(32)
    keys = chunk_keys(ns, list(range(64)), 16, b"salt")
    assert keys == chunk_keys(ns, list(range(32)), 16, b"salt") + chunk_keys(
        ns, list(range(32, 64)), 16, b"salt", keys[1]
    )
    assert (
        keys[0].hex()
        == __import__("hashlib")
        .sha256(
            ns + (4).to_bytes(4, "little") + b"salt" + bytes(32) + torch.arange(16, dtype=torch.int32).numpy().tobytes()
        )
        .hexdigest()
    )


def test_an_unreachable_store_costs_one_error_then_is_skipped(llama):
    from baton.bench.procs import free_port

    ids = [_ids(100, 40 + i) for i in range(4)]
    cold = LLM(str(llama), progress=False, block_size=16)
    expected = [o.outputs[0].token_ids for o in cold.generate([{"prompt_token_ids": p} for p in ids], GREEDY)]
    llm = _tier_llm(str(llama), [f"redis://127.0.0.1:{free_port()}/0"])  # nothing listens there
    for p, want in zip(ids, expected):
        assert _run(llm, p).outputs[0].token_ids == want
    llm.engine.tier.flush()
    stats = llm.engine.tier.metrics()
    assert stats["errors"] == 1 and stats["writes_dropped"] > 0 and llm.engine.kv.all_free()
