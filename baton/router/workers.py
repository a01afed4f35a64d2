"""The router's worker set: workers join and leave at run time, a background task checks each one's
/health, and a worker that fails is marked down (out of routing, its prefix index forgotten) until
a check finds it healthy again. A worker's load is the count of requests the router has in flight
on it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp

from baton.http import APIError
from baton.router.allowed_hosts import AllowedHosts
from baton.router.prefix_index import PrefixIndex
from baton.router.settings import RouterSettings

logger = logging.getLogger(__name__)

MAX_URL_CHARS = 2048


def normalize_url(url: object) -> str:
    """A worker's base URL as the router keys it (no trailing slash); 400 for anything else."""
    if not isinstance(url, str) or not url:
        raise APIError(400, "'url' must be a non-empty string", param="url")
    if len(url) > MAX_URL_CHARS:
        raise APIError(400, f"'url' is longer than {MAX_URL_CHARS} characters", param="url")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise APIError(400, "'url' must not contain spaces or control characters", param="url")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as e:
        raise APIError(400, f"'url' is not a URL: {e}", param="url") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise APIError(400, "'url' must be http:// or https:// with a host, e.g. http://127.0.0.1:8001", param="url")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise APIError(400, "'url' must not carry credentials, a query or a fragment", param="url")
    return url.rstrip("/")


class Lease:
    """One request in flight on a worker; released once, however the request ends."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        worker.in_flight += 1
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.worker.in_flight -= 1


class Worker:
    def __init__(self, url: str, index_capacity: int) -> None:
        self.url = url
        self.index = PrefixIndex(index_capacity)
        self.up = False
        self.in_flight = 0
        self.failed_checks = 0
        # set when the worker is marked down: requests waiting on it give up and go elsewhere
        self.gone = asyncio.Event()
        self.requests = 0
        self.prefix_tokens_expected = 0.0
        self.prefix_tokens_hit = 0
        self.prompt_tokens = 0

    def stats(self) -> dict:
        return {
            "url": self.url,
            "up": self.up,
            "load": self.in_flight,
            "requests": self.requests,
            "prefix_tokens_expected": round(self.prefix_tokens_expected),
            "prefix_tokens_hit": self.prefix_tokens_hit,
            "prompt_tokens": self.prompt_tokens,
            "indexed_chunks": len(self.index),
        }


class WorkerSet:
    def __init__(
        self, settings: RouterSettings, urls: Sequence[str] = (), allowed_hosts: AllowedHosts | None = None
    ) -> None:
        self.settings = settings
        self.allowed_hosts = allowed_hosts or AllowedHosts.default(urls)  # a worker given at start is allowed
        self._workers: dict[str, Worker] = {}
        for url in urls:
            try:
                url = normalize_url(url)
            except APIError as e:
                raise ValueError(f"worker {url!r}: {e.message}") from None
            if url in self._workers:
                raise ValueError(f"worker {url} given twice")
            self._workers[url] = Worker(url, settings.index_capacity_chunks)
        if len(self._workers) > settings.max_workers:
            raise ValueError(f"{len(self._workers)} workers given, --max-workers is {settings.max_workers}")
        self.session: aiohttp.ClientSession | None = None
        self._checker: asyncio.Task | None = None

    def __iter__(self):
        return iter(list(self._workers.values()))

    def up(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.up]

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Check every worker once (those given at start take traffic only once healthy), then keep checking."""
        self.session = session
        await self.check_all()
        for w in self:
            if not w.up:
                logger.warning("worker %s is not healthy yet; it takes traffic once /health answers 200", w.url)
        self._checker = asyncio.create_task(self._check_forever())

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()

    async def add(self, url: object) -> Worker:
        """Join a worker on an allowed host once its /health answered 200. Nothing is sent to a host
        that is not allowed, and a failed probe says nothing of what it found (the admin's logs do)."""
        url = normalize_url(url)
        if not self.allowed_hosts.allows(urlsplit(url).hostname or ""):
            raise APIError(403, "the worker's host is not an allowed worker host (--allowed-worker-hosts)", param="url")
        if url in self._workers:
            raise APIError(409, f"worker {url} is already in the set", param="url")
        if len(self._workers) >= self.settings.max_workers:
            raise APIError(400, f"the router holds at most {self.settings.max_workers} workers (--max-workers)")
        problem = await self._probe(url)
        if problem is not None:
            logger.warning("worker %s was not added: %s", url, problem)
            raise APIError(400, "the worker is not reachable or not healthy", param="url")
        if url in self._workers:  # added by a concurrent call while this one probed
            raise APIError(409, f"worker {url} is already in the set", param="url")
        worker = Worker(url, self.settings.index_capacity_chunks)
        worker.up = True
        self._workers[url] = worker
        logger.info("worker %s joined", url)
        return worker

    def remove(self, url: object) -> str:
        """Out of the set at once; its requests in flight finish where they are."""
        url = normalize_url(url)
        if self._workers.pop(url, None) is None:
            raise APIError(404, f"worker {url} is not in the set", param="url")
        logger.info("worker %s left", url)
        return url

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.up:
            logger.warning("worker %s marked down: %s", worker.url, reason)
        worker.up = False
        worker.index.clear()  # a worker that comes back may have restarted with an empty cache
        worker.gone.set()

    def _mark_up(self, worker: Worker) -> None:
        if not worker.up:
            logger.info("worker %s is up", worker.url)
            worker.gone = asyncio.Event()
        worker.up = True

    async def _probe(self, url: str) -> str | None:
        """None if GET /health answers 200, else what went wrong."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
            async with self.session.get(f"{url}/health", timeout=timeout, allow_redirects=False) as r:
                return None if r.status == 200 else f"/health answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return f"{type(e).__name__}: {e}"[:200]

    async def check(self, worker: Worker) -> None:
        problem = await self._probe(worker.url)
        if problem is None:
            worker.failed_checks = 0
            self._mark_up(worker)
            return
        worker.failed_checks += 1
        if worker.up and worker.failed_checks >= self.settings.health_failures:
            self.mark_down(worker, problem)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self))

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self.check_all()
