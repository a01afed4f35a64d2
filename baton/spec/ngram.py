"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens: for the longest n in [n_min, n_max] whose last-n-token suffix occurred
    before, what followed its latest occurrence that k tokens follow (else its earliest, the one
    most tokens follow). [] when none did."""
    if k <= 0 or len(token_ids) <= n_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        # windows starting at i < len - n, each followed by at least one token
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= len(tokens)]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []
