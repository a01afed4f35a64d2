"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens: for the longest n in [n_min, n_max] whose last-n-token suffix occurred
    before, what followed its latest occurrence that k tokens follow (else its earliest, the one
    most tokens follow). [] when none did."""
    if k <= 0 or len(token_ids) <= n_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # occurrences end at i (< len - 1): candidates are the earlier places of the last token, then
    # narrowed one token further back at a time; `ends` holds those matching n tokens
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    matches: dict[int, np.ndarray] = {1: ends}
    for n in range(2, min(n_max, len(tokens) - 1) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[-n]]
        if not ends.size:
            break
        matches[n] = ends
    for n in sorted(matches, reverse=True):
        ends = matches[n]
        if n < n_min or not ends.size:
            continue
        full = ends[ends + 1 + k <= len(tokens)]
        start = int(full[-1] if full.size else ends[0]) + 1
        return tokens[start : start + k].tolist()
    return []
