"""How spans travel: as an HTTP body (application/octet-stream), parked on the decode worker under
a transfer id until the request that names it arrives.

Everything a decode worker holds of spans counts against one byte budget: uploads while their
bytes arrive, parked spans, and spans taken by requests until those requests end (their import
plans live that long at most). Uploads in flight are bounded in count too, and parked spans in
count and age, so neither a flood of uploads nor an abandoned handoff can pin memory. A span
that does not fit is refused (503): the router then prefills on the decode worker."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator

SPAN_MEDIA_TYPE = "application/octet-stream"


class SpanStoreFull(Exception):
    """No room for this span now (HTTP 503, retry later)."""


class HeldSpan:
    """A taken span's bytes, counted until `release()` (idempotent)."""

    def __init__(self, store: SpanStore, blob: bytes) -> None:
        self.blob = blob
        self._store, self._nbytes = store, len(blob)

    def release(self) -> None:
        if self._store is not None:
            self._store._unreserve(self._nbytes)
            self._store = None

    __del__ = release  # a request that never started still gives its bytes back


class SpanStore:
    def __init__(
        self, max_spans: int = 64, max_bytes: int = 4 << 30, max_uploads: int = 8, ttl_s: float = 120.0
    ) -> None:
        self.max_spans, self.max_bytes, self.max_uploads, self.ttl_s = max_spans, max_bytes, max_uploads, ttl_s
        self._spans: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0  # uploads in flight + parked + held
        self._uploads = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    async def receive(self, chunks: AsyncIterator[bytes]) -> str:
        """Park a span as its bytes arrive, each reserved before it is kept; its transfer id."""
        with self._lock:
            if self._uploads >= self.max_uploads:
                raise SpanStoreFull(f"{self.max_uploads} KV uploads are in flight")
            self._uploads += 1
        parts: list[bytes] = []
        reserved = 0
        try:
            async for chunk in chunks:
                self._reserve(len(chunk))
                reserved += len(chunk)
                parts.append(chunk)
        except BaseException:
            self._unreserve(reserved)
            raise
        finally:
            with self._lock:
                self._uploads -= 1
        blob = b"".join(parts)
        with self._lock:
            transfer_id = uuid.uuid4().hex
            self._spans[transfer_id] = (time.monotonic(), blob)
            while len(self._spans) > self.max_spans:
                self._drop_oldest()
            return transfer_id

    def take(self, transfer_id: str) -> HeldSpan | None:
        """The parked span, now held by its request (None: unknown or expired)."""
        with self._lock:
            self._expire(time.monotonic())
            item = self._spans.pop(transfer_id, None)
        return None if item is None else HeldSpan(self, item[1])

    def _reserve(self, n: int) -> None:
        with self._lock:
            self._expire(time.monotonic())
            while self._bytes + n > self.max_bytes and self._spans:
                self._drop_oldest()  # an older parked span gives way: its request prefills here
            if self._bytes + n > self.max_bytes:
                raise SpanStoreFull(f"the worker holds {self._bytes} of {self.max_bytes} KV span bytes")
            self._bytes += n

    def _unreserve(self, n: int) -> None:
        with self._lock:
            self._bytes -= n

    def _drop_oldest(self) -> None:
        _, (_, blob) = self._spans.popitem(last=False)
        self._bytes -= len(blob)

    def _expire(self, now: float) -> None:
        while self._spans:
            tid, (born, blob) = next(iter(self._spans.items()))
            if now - born < self.ttl_s:
                return
            del self._spans[tid]
            self._bytes -= len(blob)
