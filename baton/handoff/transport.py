"""How spans travel: as an HTTP body (application/octet-stream), parked on the decode worker under
a transfer id until the request that names it arrives. Parked spans are bounded in count, bytes
and age, so an abandoned handoff cannot pin memory."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict

SPAN_MEDIA_TYPE = "application/octet-stream"


class SpanStore:
    def __init__(self, max_spans: int = 64, max_bytes: int = 4 << 30, ttl_s: float = 120.0) -> None:
        self.max_spans, self.max_bytes, self.ttl_s = max_spans, max_bytes, ttl_s
        self._spans: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, blob: bytes) -> str:
        if len(blob) > self.max_bytes:
            raise ValueError(f"a KV span of {len(blob)} bytes exceeds the {self.max_bytes}-byte store")
        with self._lock:
            self._expire(time.monotonic())
            while self._spans and (len(self._spans) >= self.max_spans or self._bytes + len(blob) > self.max_bytes):
                _, (_, old) = self._spans.popitem(last=False)
                self._bytes -= len(old)
            transfer_id = uuid.uuid4().hex
            self._spans[transfer_id] = (time.monotonic(), blob)
            self._bytes += len(blob)
            return transfer_id

    def take(self, transfer_id: str) -> bytes | None:
        with self._lock:
            self._expire(time.monotonic())
            item = self._spans.pop(transfer_id, None)
            if item is None:
                return None
            self._bytes -= len(item[1])
            return item[1]

    def _expire(self, now: float) -> None:
        while self._spans:
            tid, (born, blob) = next(iter(self._spans.items()))
            if now - born < self.ttl_s:
                return
            del self._spans[tid]
            self._bytes -= len(blob)
