"""The one rule for how much of a prefix can be resumed. Prefix caching, the KV importer and any
offload tier ask it, each describing what it holds; nothing else decides a resume point."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from baton.kv.spec import KVGroup, KVSpec


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int = 0  # the resumable prefix: every group can serve it
    kv_tokens: int = 0  # what the paged groups alone could serve (past num_tokens: no state checkpoint)
    checkpoint_id: int | None = None  # the state checkpoint at num_tokens


def needed_start(group: KVGroup, num_tokens: int) -> int:
    """First position a query at `num_tokens` (or later) reads in this group: 0 for full and MLA
    groups, the start of the window for sliding ones."""
    if not group.kind.is_sliding:
        return 0
    return max(0, num_tokens - group.kind.window + 1)


def resumable_prefix(
    spec: KVSpec,
    candidates: Iterable[int],
    has_positions: Callable[[KVGroup, int, int], bool],
    has_state: Callable[[int], bool],
) -> int:
    """The longest L among `candidates` at which every group can supply what a query at L needs:
    full and MLA groups every position before L, sliding groups the window before L
    (`has_positions(group, lo, L)`), recurrent layers their state exactly at L (`has_state(L)`).
    0 when none can: resuming at 0 needs nothing."""
    for num_tokens in sorted(candidates, reverse=True):
        if num_tokens <= 0:
            break
        if spec.has_state and not has_state(num_tokens):
            continue
        if all(has_positions(g, needed_start(g, num_tokens), num_tokens) for g in spec.groups):
            return num_tokens
    return 0
