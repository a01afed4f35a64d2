"""Spans are imported at most once: the transfer ids a worker has taken, each remembered until its
span expires (an expired span is refused anyway, so nothing older needs remembering)."""

from __future__ import annotations

import heapq
import threading
import time

from baton.handoff.errors import InvalidKVImport

CLOCK_SKEW_S = 30.0  # hosts' clocks may differ by this much


class TransferLedger:
    def __init__(self, max_ttl_s: float, max_entries: int = 1 << 17) -> None:
        self.max_ttl_s = max_ttl_s
        self.max_entries = max_entries
        self._taken: set[str] = set()
        self._by_expiry: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def check_expiry(self, expires_at: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not expires_at > now - CLOCK_SKEW_S:
            raise InvalidKVImport("expires_at", f"a time after now ({now:.0f})", expires_at)
        if expires_at > now + self.max_ttl_s + CLOCK_SKEW_S:
            raise InvalidKVImport("expires_at", f"at most {self.max_ttl_s:.0f} s from now ({now:.0f})", expires_at)

    def claim(self, transfer_id: str, expires_at: float) -> None:
        """Take a transfer id for good (InvalidKVImport if it was taken before)."""
        with self._lock:
            now = time.time()
            while self._by_expiry and self._by_expiry[0][0] < now - CLOCK_SKEW_S:
                self._taken.discard(heapq.heappop(self._by_expiry)[1])
            if transfer_id in self._taken:
                raise InvalidKVImport("transfer_id", "a span not imported before", f"{transfer_id}, imported already")
            if len(self._taken) >= self.max_entries:
                raise InvalidKVImport("transfer_id", f"fewer than {self.max_entries} live spans", "the ledger is full")
            self._taken.add(transfer_id)
            heapq.heappush(self._by_expiry, (expires_at, transfer_id))
