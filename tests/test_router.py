"""The prefix-aware router: its index, its policies, and over HTTP with two real workers: sticky
conversations that hit the workers' prefix caches, workers joining and leaving, and failover."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import requests

from baton.http import APIError
from baton.router.policy import CacheAware, RoundRobin
from baton.router.prefix_index import PrefixIndex, chunk_hashes, request_text
from baton.router.proxy import Router
from baton.router.settings import RouterSettings
from baton.router.stream import is_preamble, usage_chunk
from baton.router.workers import Worker, WorkerSet, normalize_url
from tests.server_util import RouterProcess, ServerProcess, free_port

# ---- the index ------------------------------------------------------------------------------------


def _chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"messages": messages}


def test_request_text_of_a_longer_conversation_extends_the_shorter_one():
    first = request_text("chat", _chat("Be brief.", "Hi"))
    second = request_text("chat", _chat("Be brief.", "Hi", "Hello!", "Name a planet."))
    assert second.startswith(first) and len(second) > len(first)
    assert request_text("completions", {"prompt": [1, 2, 3, 4]}).startswith("[1,2,3")
    assert request_text("chat", {"messages": "not a list"}) == ""
    assert request_text("completions", {}) == ""


def test_chunk_hashes_are_chained_and_skip_a_partial_tail():
    hashes = chunk_hashes("abcd" * 5 + "xy", 4)
    assert len(hashes) == 5  # the 2-character tail is no chunk
    assert len(set(hashes)) == 5  # the same chunk text at another depth is another prefix
    assert chunk_hashes("abcdabcdzzzz", 4)[:2] == hashes[:2]
    assert chunk_hashes("zzzzabcd", 4)[1] != hashes[1]
    assert chunk_hashes("abcd" * 5, 4, limit=3) == hashes[:3]


def test_index_matches_leading_chunks_and_forgets_least_recent_tails_first():
    index = PrefixIndex(capacity=10)
    a, b, c = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    index.insert(a)
    assert index.match(a) == 4 and index.match(a[:2] + b[2:]) == 2 and index.match(b) == 0
    index.insert(b)
    index.insert(c)  # 12 chunks for 10 places: a's last two (its least recently used) go
    assert len(index) == 10
    assert (index.match(a), index.match(b), index.match(c)) == (2, 4, 4)
    index.insert(a[:2])  # a's head touched: now b's tail is the oldest
    index.insert([40, 41])
    assert (index.match(a), index.match(b), index.match(c)) == (2, 2, 4)
    index.insert(list(range(100, 125)))  # longer than the capacity: its head is what stays
    assert index.match(list(range(100, 125))) == 10 and len(index) == 10


# ---- the policies ---------------------------------------------------------------------------------


def _workers(n: int, settings: RouterSettings) -> WorkerSet:
    workers = WorkerSet(settings, [f"http://127.0.0.1:{9000 + i}" for i in range(n)])
    for w in workers:
        w.up = True
    return workers


def test_cache_aware_sends_each_tenant_where_its_prompt_is():
    settings = RouterSettings(chunk_chars=16)
    router = Router(_workers(2, settings), settings)
    w0, w1 = list(router.workers)
    tenants = {name: f"You answer for {name}. " + f"{name} sells umbrellas. " * 40 for name in ("Acme", "Globex")}

    def route(tenant: str, *turns: str, exclude: tuple[str, ...] = ()) -> Worker:
        text = request_text("chat", _chat(tenants[tenant], *turns))
        return router.choose(text, chunk_hashes(text, settings.chunk_chars), set(exclude))

    # nobody holds either prompt: Acme takes the first worker, Globex the one that holds nothing yet
    assert route("Acme", "Hi") is w0 and route("Globex", "Hi") is w1
    assert route("Globex", "Hi", "Hello.", "Prices?") is w1
    assert route("Acme", "Hi", "Hello.", "Hours?") is w0
    # the expected hit is the shared prefix, in chunks of 16 characters at 4 characters a token
    shared = len(request_text("chat", _chat(tenants["Acme"], "Hi"))) // 16 * 16 / 4
    assert w0.prefix_tokens_expected == pytest.approx(shared)
    assert route("Acme", "Hi", exclude=(w0.url,)) is w1  # a retry goes elsewhere


def test_load_weighs_against_prefix_as_the_setting_says():
    settings = RouterSettings(prefix_tokens_per_request=100, min_prefix_share=0.5)
    w0, w1 = _workers(2, settings)
    policy = CacheAware(settings.prefix_tokens_per_request, settings.min_prefix_share)
    # of a 500-token request, w0 holds 250 tokens: worth 2.5 requests in flight, so it wins at a
    # load of 2 (2.5 - 2 > 0 - 0) ...
    w0.in_flight, w1.in_flight = 2, 0
    assert policy.choose([w0, w1], [250, 0], 500) == 0
    # ... and loses at 3 (-0.5 < 0)
    w0.in_flight = 3
    assert policy.choose([w0, w1], [250, 0], 500) == 1
    assert policy.choose([w0, w1], [450, 300], 500) == 1  # 4.5 - 3 < 3.0 - 0
    assert policy.choose([w0, w1], [450, 200], 500) == 0  # w1's 200 is under half the request: 1.5 > 0
    # idle, and a prefix under the share: the one remembering less takes it, so prefixes spread
    w0.in_flight = 0
    w0.index.insert([1, 2, 3])
    assert policy.choose([w0, w1], [100, 0], 500) == 1
    assert policy.choose([w0, w1], [300, 0], 500) == 0


def test_round_robin_takes_workers_in_turn():
    settings = RouterSettings(policy="round_robin")
    workers = list(_workers(3, settings))
    policy = RoundRobin()
    assert [policy.choose(workers, [1e9, 0, 0], 1e9) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_settings_and_urls_refuse_nonsense():
    with pytest.raises(ValueError, match="policy"):
        RouterSettings(policy="random")
    with pytest.raises(ValueError):
        RouterSettings(prefix_tokens_per_request=0)
    for bad in (5, "", "ftp://h:1", "http://", "http://u:p@h:1", "http://h:99999", "http://h:1/?a=b", "http://h\n:1"):
        with pytest.raises(APIError) as e:
            normalize_url(bad)
        assert e.value.status == 400
    assert normalize_url("http://127.0.0.1:8001/") == "http://127.0.0.1:8001"
    with pytest.raises(ValueError, match="twice"):
        WorkerSet(RouterSettings(), ["http://h:1", "http://h:1/"])


def test_stream_helpers_know_the_preamble_and_the_usage_chunk():
    preamble = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    content = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}\n\n'
    assert is_preamble(preamble) and not is_preamble(content) and not is_preamble(b"data: [DONE]\n\n")
    assert usage_chunk(usage)["prompt_tokens"] == 9 and usage_chunk(content) is None


# ---- over HTTP: two workers and a router ----------------------------------------------------------

KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = "router-test-admin-key"  # the worker set is the admin's (tests/test_router_admin.py)
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
WORKER_ARGS = ("--model", "smollm2-135m", "--api-key", KEY, "--max-model-len", "512", "--num-kv-blocks", "64")
SYSTEMS = {
    "acme": "You are the support assistant of Acme Umbrellas. Answer in one short sentence. " * 8,
    "globex": "You are the help desk of Globex Shipping. Reply politely and briefly to customers. " * 8,
}


class KeyedRouter(RouterProcess):
    def __init__(self, *args: str) -> None:
        super().__init__("--api-key", KEY, "--admin-key", ADMIN, *args)

    def workers(self) -> dict[str, dict]:
        r = requests.get(f"{self.base_url}/v1/router/workers", headers=ADMIN_AUTH, timeout=10)
        assert r.status_code == 200, r.text
        return {w["url"]: w for w in r.json()["data"]}

    def metric(self, name: str, worker: str) -> float:
        text = requests.get(f"{self.base_url}/metrics", timeout=10).text
        prefix = f'{name}{{worker="{worker}"'
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(prefix)))


@pytest.fixture(scope="module")
def cluster():
    workers = [ServerProcess(*WORKER_ARGS, wait=False) for _ in range(2)]
    for w in workers:  # the two load at once
        w.wait_healthy()
    router = KeyedRouter(
        "--workers", *(w.base_url for w in workers), "--health-interval-s", "0.5", "--max-workers", "2"
    )
    yield router, {w.base_url: w for w in workers}
    router.proc.send_signal(signal.SIGTERM)
    router.proc.wait(timeout=30)
    for w in workers:
        if w.proc.poll() is None:
            w.terminate()


def _ask(router: KeyedRouter, tenant: str, turns: list[str], stream: bool = False, **extra) -> tuple[str, str, dict]:
    """(the worker that served it, the answer, the usage the client saw or {})."""
    before = {u: w["requests"] for u, w in router.workers().items()}
    body = {**_chat(SYSTEMS[tenant], *turns), "max_tokens": 8, "temperature": 0, "stream": stream, **extra}
    r = requests.post(f"{router.base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        text, usage = "", {}
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    else:
        text, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
    served = [u for u, w in router.workers().items() if w["requests"] > before.get(u, 0)]
    assert len(served) == 1
    return served[0], text, usage


def test_conversations_stay_on_the_worker_that_caches_them(cluster):
    router, _ = cluster
    acme, a1, usage = _ask(router, "acme", ["Do you sell red umbrellas?"])
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    globex, g1, _ = _ask(router, "globex", ["Where is my parcel?"])
    assert globex != acme  # a new prefix goes to the worker that holds none
    served, _, usage = _ask(router, "acme", ["Do you sell red umbrellas?", a1, "And blue ones?"])
    assert served == acme and usage["prompt_tokens_details"]["cached_tokens"] > 0
    hit_before = router.metric("baton_router_prefix_tokens_hit_total", globex)
    served, text, usage = _ask(router, "globex", ["Where is my parcel?", g1, "It is late."], stream=True)
    assert served == globex and text and usage == {}  # the usage the router asked for is not passed on
    assert router.metric("baton_router_prefix_tokens_hit_total", globex) > hit_before
    turns = ["Do you sell red umbrellas?", a1, "And blue ones?", "Yes.", "Thanks!"]
    served, _, usage = _ask(router, "acme", turns, stream=True, stream_options={"include_usage": True})
    assert served == acme and usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert router.metric("baton_router_requests_total", acme) == 3
    assert router.metric("baton_router_prefix_tokens_expected_total", acme) > 0
    assert router.metric("baton_router_worker_up", acme) == 1


def test_workers_join_and_leave_at_run_time(cluster):
    router, procs = cluster
    url = f"{router.base_url}/v1/router/workers"
    one, other = procs
    assert requests.get(url, timeout=10).status_code == 401  # the admin routes are behind the admin key
    assert requests.get(url, headers=AUTH, timeout=10).status_code == 401
    for data, status in (
        (b"{not json", 400),
        (b"[]", 400),
        (json.dumps({"url": 5}), 400),
        (json.dumps({"url": "file:///etc/passwd"}), 400),
        (json.dumps({"url": one}), 409),
        (json.dumps({"url": "http://127.0.0.1:1"}), 400),  # the limit of 2 comes first
    ):
        r = requests.post(url, data=data, headers=ADMIN_AUTH, timeout=10)
        assert r.status_code == status and r.json()["error"]["message"], (data, r.text)
    r = requests.delete(url, json={"url": other + "/"}, headers=ADMIN_AUTH, timeout=10)
    assert r.status_code == 200 and list(router.workers()) == [one]
    assert requests.delete(url, json={"url": other}, headers=ADMIN_AUTH, timeout=10).status_code == 404
    served, _, _ = _ask(router, "globex", ["Hello?"])
    assert served == one
    dead = f"http://127.0.0.1:{free_port()}"
    r = requests.post(url, json={"url": dead}, headers=ADMIN_AUTH, timeout=30)
    assert r.status_code == 400 and "not healthy" in r.json()["error"]["message"]
    r = requests.post(url, json={"url": other}, headers=ADMIN_AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["up"] is True
    assert set(router.workers()) == {one, other}


def test_a_killed_worker_is_marked_down_and_its_request_moves_on(cluster):
    router, procs = cluster
    acme, a1, _ = _ask(router, "acme", ["Do you sell red umbrellas?"])
    survivor = next(u for u in procs if u != acme)
    result: dict = {}

    def long_request() -> None:
        body = {**_chat(SYSTEMS["acme"], "Tell me a story."), "max_tokens": 120, "ignore_eos": True}
        r = requests.post(f"{router.base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
        result["status"], result["body"] = r.status_code, r.json()

    client = threading.Thread(target=long_request)
    client.start()
    deadline = time.time() + 30
    while router.workers()[acme]["load"] == 0 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    procs[acme].proc.kill()
    client.join(timeout=120)
    assert result["status"] == 200, result
    assert result["body"]["usage"]["completion_tokens"] == 120
    assert router.workers()[acme]["up"] is False
    assert router.metric("baton_router_worker_up", acme) == 0
    text = requests.get(f"{router.base_url}/metrics", timeout=10).text
    assert float(next(x.split()[-1] for x in text.splitlines() if x.startswith("baton_router_failovers_total"))) >= 1
    for stream in (False, True):
        served, text, _ = _ask(router, "acme", ["Do you sell red umbrellas?", a1, "Green?"], stream=stream)
        assert served == survivor and text
