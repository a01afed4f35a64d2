"""The router as a hostile tenant and a broken worker meet it: the worker set is the admin's alone and
only on allowed hosts, nothing a tenant sends reaches a host outside them, the KV secret and the
admin key are secrets of their own, and a worker that hangs, floods or redirects is a failed worker
(the request moves on while nothing has reached the client). Workers here are small fakes in this
process, each recording what it received."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tests.server_util import RouterProcess, free_port

KEY, ADMIN = "tenant-key", "operator-admin-key"
AUTH, ADMIN_AUTH = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}
ANSWER = {"object": "text_completion", "choices": [{"index": 0, "text": "fake", "finish_reason": "length"}]}


class FakeWorker:
    """An HTTP server on `host` that answers /health and the completion routes as `behaviour` says:
    ok, unhealthy, hang (never answers), huge (an endless body), redirect (307 to `location`),
    stall (a stream that stops after its first token)."""

    def __init__(self, behaviour: str = "ok", host: str = "127.0.0.1", location: str = "") -> None:
        self.received: list[tuple[str, str, dict, bytes]] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                worker.received.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}, b""))
                self._answer(500 if behaviour == "unhealthy" else 200, b"")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                worker.received.append(("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                stream = json.loads(body or b"{}").get("stream") is True
                if behaviour == "hang":
                    time.sleep(30)
                elif behaviour == "redirect":
                    self.send_response(307)
                    self.send_header("Location", location + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif behaviour == "huge":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
                    self.end_headers()
                    for _ in range(4096):
                        self.wfile.write(b"x" * 65536)
                elif stream:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    chunk = {"choices": [{"index": 0, "text": "fake", "finish_reason": None}]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                    if behaviour == "stall":
                        time.sleep(30)
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self._answer(200, json.dumps(ANSWER).encode())

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posts(self) -> list[tuple[str, dict, bytes]]:
        return [(path, headers, body) for method, path, headers, body in self.received if method == "POST"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    made: list[FakeWorker] = []

    def make(*args, **kwargs) -> FakeWorker:
        made.append(FakeWorker(*args, **kwargs))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _routes(router: RouterProcess, headers: dict, url: str) -> list[int]:
    base = f"{router.base_url}/v1/router/workers"
    return [
        requests.get(base, headers=headers, timeout=10).status_code,
        requests.post(base, json={"url": url}, headers=headers, timeout=10).status_code,
        requests.delete(base, json={"url": url}, headers=headers, timeout=10).status_code,
    ]


def _complete(router: RouterProcess, **body) -> requests.Response:
    return requests.post(f"{router.base_url}/v1/completions", json={"prompt": "Hi", **body}, headers=AUTH, timeout=60)


def test_the_worker_set_is_the_admins_alone_and_only_on_allowed_hosts(fakes):
    outside = fakes(host="127.0.0.2")  # loopback too, but not an allowed worker host here
    first, second, sick = fakes(), fakes(), fakes("unhealthy")
    router = RouterProcess(
        "--workers", first.url, "--api-key", KEY, "--admin-key", ADMIN, "--allowed-worker-hosts", "127.0.0.1"
    )
    try:
        for headers in ({}, AUTH, {"Authorization": "Bearer wrong"}):
            assert _routes(router, headers, second.url) == [401, 401, 401]
        assert _complete(router).status_code == 200  # a tenant's own requests are fine
        r = requests.post(f"{router.base_url}/v1/completions", json={"prompt": "Hi"}, headers=ADMIN_AUTH, timeout=10)
        assert r.status_code == 401  # and the admin key is not a client key
        base = f"{router.base_url}/v1/router/workers"
        r = requests.post(base, json={"url": outside.url}, headers=ADMIN_AUTH, timeout=10)
        assert r.status_code == 403 and "allowed worker host" in r.json()["error"]["message"]
        refusals = set()
        for url in (f"http://127.0.0.1:{free_port()}", sick.url):  # closed port, or /health 500: one answer
            r = requests.post(base, json={"url": url}, headers=ADMIN_AUTH, timeout=30)
            assert r.status_code == 400
            refusals.add(r.json()["error"]["message"])
        assert refusals == {"the worker is not reachable or not healthy"}
        assert requests.post(base, json={"url": second.url}, headers=ADMIN_AUTH, timeout=30).status_code == 200
        assert requests.delete(base, json={"url": first.url}, headers=ADMIN_AUTH, timeout=10).status_code == 200
        assert [w["url"] for w in requests.get(base, headers=ADMIN_AUTH, timeout=10).json()["data"]] == [second.url]
        served = len(second.posts())
        assert _complete(router).json()["choices"][0]["text"] == "fake"
        assert len(second.posts()) == served + 1 and second.posts()[-1][1]["authorization"] == f"Bearer {KEY}"
        # what a tenant might try, to steer a request elsewhere: none of it reaches the outside host
        for body in (
            {"kv_transfer_id": "0" * 32, "model": outside.url},
            {"prompt": outside.url, "user": outside.url, "stream": True},
        ):
            requests.post(f"{router.base_url}/v1/completions", json=body, headers=AUTH, timeout=30)
        requests.post(f"{router.base_url}/v1/router/workers", json={"url": outside.url}, headers=AUTH, timeout=10)
        assert outside.received == []
    finally:
        router.stop()


def test_without_an_admin_key_the_worker_routes_do_not_exist(fakes):
    worker = fakes()
    router = RouterProcess("--workers", worker.url, "--api-key", KEY)
    try:
        assert _routes(router, AUTH, worker.url) == [404, 404, 404]
    finally:
        router.stop()


def _refused(*args: str, env: dict | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    return proc.stderr


def test_the_kv_secret_and_the_admin_key_are_secrets_of_their_own():
    import os

    plain = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    w = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert "kv secret" in _refused("router", *w, "--api-key", KEY, env=plain)
    assert "differ from the API key" in _refused("router", *w, "--api-key", KEY, "--kv-secret", KEY, env=plain)
    assert "admin key must differ" in _refused("router", "--api-key", KEY, "--admin-key", KEY, env=plain)
    start = time.monotonic()
    assert "kv secret" in _refused("serve", "--kv-role", "decode", "--api-key", KEY, env=plain)
    assert "differ from the API key" in _refused(
        "serve", "--kv-role", "prefill", "--api-key", KEY, env={**plain, "BATON_KV_SECRET": KEY}
    )
    assert time.monotonic() - start < 60  # refused before a model is loaded


def test_a_worker_that_hangs_floods_or_redirects_is_a_failed_worker(fakes):
    outside = fakes(host="127.0.0.2")
    good = fakes()
    bad = [fakes("hang"), fakes("huge"), fakes("redirect", location=outside.url)]
    router = RouterProcess(
        "--workers",
        *(w.url for w in [*bad, good]),
        "--api-key",
        KEY,
        "--policy",
        "round_robin",
        "--first-byte-timeout-s",
        "2",
        "--max-response-bytes",
        "1000000",
        "--health-interval-s",
        "60",
    )
    try:
        start = time.monotonic()
        r = _complete(router)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fake"
        assert time.monotonic() - start < 20
        assert all(w.posts() for w in bad) and len(good.posts()) == 1  # each bad one tried once, then the good one
        text = requests.get(f"{router.base_url}/metrics", timeout=10).text
        failovers = next(x for x in text.splitlines() if x.startswith("baton_router_failovers_total"))
        assert float(failovers.split()[-1]) >= 2
        assert outside.received == []  # the redirect was not followed
    finally:
        router.stop()


def test_a_stream_silent_past_the_idle_timeout_ends_with_an_error(fakes):
    stalling = fakes("stall")
    router = RouterProcess("--workers", stalling.url, "--api-key", KEY, "--idle-timeout-s", "1")
    try:
        start = time.monotonic()
        r = requests.post(
            f"{router.base_url}/v1/completions", json={"prompt": "Hi", "stream": True}, headers=AUTH, timeout=30
        )
        events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
        assert time.monotonic() - start < 15
        assert b'"text": "fake"' in events[0] and b"failed mid-stream" in events[-1]
    finally:
        router.stop()


def test_the_router_reads_a_request_as_the_workers_do(fakes):
    worker = fakes()
    router = RouterProcess("--workers", worker.url, "--api-key", KEY)
    try:
        r = _complete(router, stream="no")  # the workers' model reads "no" as false: a JSON answer
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        assert r.json()["choices"][0]["text"] == "fake"
        r = _complete(router, stream="perhaps", n=1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        r = _complete(router, n=10_000)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert len(worker.posts()) == 1  # refused requests never left the router
    finally:
        router.stop()
