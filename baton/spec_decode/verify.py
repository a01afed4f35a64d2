"""What one verification keeps: the tokens the target chose while they equal the drafts, plus the
first that does not; the KV and recurrent state of exactly the positions those tokens fill.

Row j of a request's verification chose the token after its first j drafts, with the noise of
that output position, as a decode there would have (the drafts were its inputs). So the tokens
kept are the ones decoding without drafts gives, greedy or seeded, and the rest are dropped:
rejected positions are simply not counted, blocks past the kept length go back to the pool,
and the recurrent state after the last kept row is committed from its snapshot.
"""

from __future__ import annotations

from baton.engine.output_processor import OutputProcessor
from baton.engine.scheduler import ScheduledRequest
from baton.kv.manager import KVManager
from baton.kv.state import StateStorage


def accept_drafts(
    s: ScheduledRequest,
    token_ids: list[int],
    logprobs: list,
    sampled_logprobs: list[float],
    output: OutputProcessor,
    kv: KVManager,
    states: StateStorage,
) -> int:
    """Append the verified tokens of `s` (one per row); returns how many drafts were accepted."""
    req, drafts = s.request, s.spec_token_ids
    for j, token in enumerate(token_ids):
        before = req.num_tokens
        output.append_token(req, token, logprobs[j], sampled_logprobs[j])
        if req.is_finished or req.num_tokens != before + 1 or j == len(drafts) or token != drafts[j]:
            break  # ended, its grammar forced tokens after it, or the next row's input was not it
    real = req.token_ids[s.start + 1 : s.start + 1 + len(drafts)]
    accepted = next((i for i, (a, b) in enumerate(zip(real, drafts)) if a != b), min(len(real), len(drafts)))
    req.num_computed_tokens = min(s.start + 1 + accepted, req.num_tokens - 1)
    rid = req.request_id
    if kv.spec.has_state:
        slot = kv.state_slots[rid]
        last = s.num_new_tokens - 1  # rows are 0..last; the slot holds the state after row `last`
        for num_tokens, cid in kv.plan_accepted_snapshots(
            rid, req.token_ids, s.start + 1, req.num_computed_tokens, req.cache_salt
        ):
            row = num_tokens - 1 - s.start
            if row < last:
                states.copy_checkpoint(states.scratch(slot, row), cid)
            else:
                states.save(slot, cid)
        row = req.num_computed_tokens - 1 - s.start
        if row < last and not req.is_finished:
            states.restore(slot, states.scratch(slot, row))
    kv.cache_blocks(rid, req.token_ids, req.num_computed_tokens, req.cache_salt)
    if not req.is_finished:
        kv.trim(rid, req.num_tokens)
    return accepted
