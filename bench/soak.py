"""Soak: N minutes of mixed, partly hostile traffic against a PD deployment (a prefill worker, two
decode workers whose KV pools hold less than the offered load, a router), with the admin adding and
removing the second decode worker during traffic; then what it left behind.

Traffic, from several client threads at once: streams and non-streamed requests to the router
(PD handoffs) and to a decode worker directly, streams the client drops mid-way, non-streamed
requests whose client hangs up, bad requests (out-of-vocabulary ids, huge seeds, bad content
parts, too many sequences), seeded sampled requests, and unknown transfer ids. Every process has
the API key, the KV secret is its own, the worker set takes the admin key alone.

A watcher polls every process's /health twice a second: the longest time any of them answered
other than 200 is the longest stall seen (the workers also count their own stalls over
--stall-timeout-s 5 in baton_engine_stalls_total).

Prints requests sent by kind, the status codes seen, 5xx count, preemptions, worker churn, the
longest stall, leaked KV blocks and running requests on every worker once the traffic stops, and
each process's RSS at start (after warm-up) and at the end. Exit status 1 if any 5xx was seen,
anything leaked, or a stall passed 5 s.

    python -m bench.soak --minutes 20
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from baton.bench.procs import free_port, stop_processes, wait_healthy

KEY = secrets.token_hex(16)
KV_SECRET = secrets.token_hex(32)
ADMIN = secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
STALL_S = 5.0
WORDS = "the a river engine token block cache window state prefix model batch stream quiet long road".split()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Soak:
    def __init__(self, router: str, decode: str, vocab: int) -> None:
        self.router, self.decode, self.vocab = router, decode, vocab
        self.sent: collections.Counter = collections.Counter()
        self.statuses: collections.Counter = collections.Counter()
        self.server_errors: list[str] = []
        self.lock = threading.Lock()

    def record(self, kind: str, status: int | str, detail: str = "") -> None:
        with self.lock:
            self.sent[kind] += 1
            self.statuses[status] += 1
            if isinstance(status, int) and status >= 500:
                self.server_errors.append(f"{kind}: {status} {detail[:200]}")

    def one(self, rng: random.Random) -> None:
        kind = rng.choice(
            ["stream", "plain", "drop_stream", "hang_up", "bad", "seeded", "chat", "unknown_transfer", "direct"]
        )
        base = self.router if kind not in ("direct", "unknown_transfer") else self.decode
        body = {"prompt": prompt(rng, rng.randint(3, 300)), "max_tokens": rng.randint(1, 48), "temperature": 0}
        try:
            if kind == "stream" or kind == "drop_stream":
                with requests.post(
                    f"{base}/v1/completions", json={**body, "stream": True}, headers=AUTH, stream=True, timeout=300
                ) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if kind == "drop_stream" and i >= 2:
                            break
                    self.record(kind, r.status_code, r.text if r.status_code >= 500 else "")
            elif kind == "hang_up":
                self.hang_up(base, {**body, "max_tokens": 200, "ignore_eos": True}, rng.uniform(0.05, 1.5))
                self.record(kind, "hung up")
            elif kind == "bad":
                bad = rng.choice(
                    [
                        {**body, "stop_token_ids": [self.vocab + rng.randint(0, 10**6)], "min_tokens": 1},
                        {**body, "seed": 2**64 + rng.randint(0, 10**9)},
                        {**body, "logit_bias": {str(self.vocab + 3): 1}},
                        {**body, "prompt": [self.vocab, 1]},
                        {**body, "prompt": [body["prompt"]] * 500, "n": 16},
                        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                    ]
                )
                path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
                r = requests.post(f"{base}{path}", json=bad, headers=AUTH, timeout=60)
                self.record(kind, r.status_code, r.text)
            elif kind == "seeded":
                seeded = {**body, "temperature": 1.0, "seed": rng.randint(0, 2**64 - 1)}
                r = requests.post(f"{base}/v1/completions", json=seeded, headers=AUTH, timeout=300)
                self.record(kind, r.status_code, r.text)
            elif kind == "chat":
                chat = {"messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": body["max_tokens"]}
                r = requests.post(f"{base}/v1/chat/completions", json=chat, headers=AUTH, timeout=300)
                self.record(kind, r.status_code, r.text)
            else:
                extra = {"kv_transfer_id": secrets.token_hex(16)} if kind == "unknown_transfer" else {}
                r = requests.post(f"{base}/v1/completions", json={**body, **extra}, headers=AUTH, timeout=300)
                self.record(kind, r.status_code, r.text)
        except requests.RequestException as e:
            self.record(kind, type(e).__name__)

    def hang_up(self, base: str, body: dict, after_s: float) -> None:
        host, port = base.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head.encode() + payload)
            time.sleep(after_s)


class Watch:
    """Polls /health of every process; the longest stretch each answered anything but 200."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.longest = dict.fromkeys(urls, 0.0)
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        down_since: dict[str, float] = {}
        while not self.stop.wait(0.5):
            for name, url in self.urls.items():
                try:
                    ok = requests.get(f"{url}/health", timeout=2).status_code == 200
                except requests.RequestException:
                    ok = False
                now = time.time()
                if ok:
                    down_since.pop(name, None)
                    continue
                since = down_since.setdefault(name, now)
                self.longest[name] = max(self.longest[name], now - since)


def churn(router: str, worker: str, deadline: float, period_s: float, log: list[str]) -> None:
    """The admin adds `worker` to the router's set, later removes it, and again, until the deadline."""
    joined = False
    while time.time() + period_s < deadline:
        time.sleep(period_s)
        method = requests.delete if joined else requests.post
        r = method(f"{router}/v1/router/workers", json={"url": worker}, headers=ADMIN_AUTH, timeout=30)
        log.append(f"{'remove' if joined else 'add'} {r.status_code}")
        joined = not joined if r.status_code == 200 else joined


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-kv-blocks", type=int, default=20, help="blocks of 64 tokens per decode worker")
    ap.add_argument("--churn-s", type=float, default=30.0, help="seconds between the admin's joins and leaves")
    args = ap.parse_args()
    env = {**os.environ, "BATON_KV_SECRET": KV_SECRET, "BATON_API_KEY": KEY, "BATON_LOG_LEVEL": "WARNING"}
    serve = [sys.executable, "-m", "baton.cli", "serve", "--model", args.model, "--stall-timeout-s", str(STALL_S)]
    decode = ["--kv-role", "decode", "--block-size", "64", "--num-kv-blocks", str(args.decode_kv_blocks)]
    decode += ["--max-model-len", "1024"]
    ports = {name: free_port() for name in ("prefill", "decode", "decode2", "router")}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    procs = {
        "prefill": subprocess.Popen([*serve, "--kv-role", "prefill", "--port", str(ports["prefill"])], **quiet),
        "decode": subprocess.Popen([*serve, *decode, "--port", str(ports["decode"])], **quiet),
        "decode2": subprocess.Popen([*serve, *decode, "--port", str(ports["decode2"])], **quiet),
    }
    workers = ("prefill", "decode", "decode2")
    try:
        for name in workers:
            wait_healthy(url[name], procs[name], 600)
        router_cmd = [sys.executable, "-m", "baton.cli", "router", "--port", str(ports["router"])]
        router_cmd += ["--prefill", url["prefill"], "--decode", url["decode"], "--admin-key", ADMIN]
        procs["router"] = subprocess.Popen(router_cmd, **quiet)
        wait_healthy(url["router"], procs["router"], 60)
        vocab = 49152 if args.model == "smollm2-135m" else 262144
        soak = Soak(url["router"], url["decode"], vocab)
        warm = random.Random(args.seed)
        for _ in range(10):  # warm-up: first-use allocations are not a leak
            soak.one(warm)
        rss_start = {k: rss_mib(p.pid) for k, p in procs.items()}
        watch = Watch(url)
        deadline = time.time() + args.minutes * 60
        start = time.time()
        churned: list[str] = []

        def client(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i + 1)
            while time.time() < deadline:
                soak.one(rng)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        threads.append(
            threading.Thread(target=churn, args=(url["router"], url["decode2"], deadline, args.churn_s, churned))
        )
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.time() - start
        watch.stop.set()
        time.sleep(3)  # let aborts of the last hang-ups land
        leaked = {k: metric(url[k], "baton_kv_blocks_used") for k in workers}
        running = {
            k: metric(url[k], "baton_num_requests_running") + metric(url[k], "baton_num_requests_waiting")
            for k in workers
        }
        stalls = {k: metric(url[k], "baton_engine_stalls_total") for k in workers}
        preemptions = {k: metric(url[k], "baton_preemptions_total") for k in workers}
        remote = {k: metric(url[k], 'baton_prefills_total{where="remote"') for k in ("decode", "decode2")}
        rss_end = {k: rss_mib(p.pid) for k, p in procs.items()}
        print(f"soak: {args.model}, {elapsed / 60:.1f} min, {args.clients} clients, PD: 1 prefill + 2 decode workers")
        print(f"decode KV pools: {args.decode_kv_blocks} blocks x 64 tokens; preemptions {preemptions}")
        print(f"requests sent: {sum(soak.sent.values())}  by kind: {dict(sorted(soak.sent.items()))}")
        print(f"outcomes: {dict(sorted(soak.statuses.items(), key=str))}")
        print(f"5xx: {len(soak.server_errors)}")
        for line in soak.server_errors[:10]:
            print(f"  {line}")
        kinds = ", ".join(sorted(set(churned)))
        print(f"admin churn of decode2 every {args.churn_s:.0f} s: {len(churned)} changes ({kinds})")
        print(f"imported prompts: {remote}")
        longest = max(watch.longest.values())
        print(f"longest /health outage: {longest:.1f} s {watch.longest}; engine stalls over {STALL_S:.0f} s: {stalls}")
        print(f"leaked KV blocks after: {leaked}   requests left after: {running}")
        for k in procs:
            growth = (rss_end[k] - rss_start[k]) / rss_start[k] * 100
            print(f"RSS {k:8s} start {rss_start[k]:8.1f} MiB  end {rss_end[k]:8.1f} MiB  ({growth:+.1f} %)")
        failed = soak.server_errors or any(leaked.values()) or any(running.values())
        failed = failed or any(stalls.values()) or longest > STALL_S
        sys.exit(1 if failed else 0)
    finally:
        stop_processes(procs.values())


if __name__ == "__main__":
    main()
