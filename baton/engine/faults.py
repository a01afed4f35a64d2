"""Fault points for the tests that prove a failed step or import leaves nothing behind.

`BATON_FAULTS="forward=49000,export=49001"` arms a stage: a step (or an import) raises
InjectedFault at that stage when one of its requests' prompts holds that token id, so a test
poisons exactly the requests it sends. Unset (always, in service) every point is a no-op."""

from __future__ import annotations

from collections.abc import Iterable

from baton.engine.request import Request

# where a step can fail: after the forward wrote KV and state, in sampling, while tokens join their
# requests, exporting a prefill's span, in speculation's bookkeeping; and an import once its blocks
# are allocated, or half written
STAGES = ("forward", "sample", "output", "export", "spec", "import_alloc", "import_write")


class InjectedFault(RuntimeError):
    pass


class Faults:
    def __init__(self, armed: dict[str, int]) -> None:
        unknown = sorted(set(armed) - set(STAGES))
        if unknown:
            raise ValueError(f"BATON_FAULTS names unknown stages {unknown}; known: {', '.join(STAGES)}")
        self.armed = armed

    def hit(self, stage: str, requests: Iterable[Request]) -> None:
        token = self.armed.get(stage)
        if token is not None and any(token in r.prompt_token_ids for r in requests):
            raise InjectedFault(f"fault injected at {stage}")
