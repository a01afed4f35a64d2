"""The engine's side of the KV handoff: sign and check spans, validate an import against this
worker, write it, export a finished prefill. With tensor parallelism a span carries every KV head:
validated against the whole model's heads and state, read from every rank on export, and written
as each rank's share on import."""

from __future__ import annotations

import os
import time

from baton.config import EngineConfig
from baton.engine.faults import Faults
from baton.engine.request import Request
from baton.handoff import wire
from baton.handoff.replay import TransferLedger
from baton.handoff.span import model_fingerprint
from baton.handoff.transfer import apply_import, export_span
from baton.handoff.validate import ImportPlan, plan_import
from baton.kv.memory import CacheMemory
from baton.kv.spec import KVSpec
from baton.models.loader import LoadedModel
from baton.parallel.ranks import Ranks
from baton.parallel.shard import split_caches

_PROCESS_KV_SECRET = os.urandom(32)


class KVHandoff:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, memory: CacheMemory, ranks: Ranks | None) -> None:
        mc = loaded.config
        self.kv, self.storage, self.states = memory.kv, memory.storage, memory.states
        self.ranks = ranks
        self.fingerprint = model_fingerprint(mc, loaded.source.header(), loaded.weights_content_sha256)
        # spans are signed and checked with this key: without a configured secret, a random one
        # per process, so only this process can import what it exported
        self.secret = config.kv_secret_bytes() or _PROCESS_KV_SECRET
        self.span_ttl_s = config.kv_transfer.kv_span_ttl_s
        self.ledger = TransferLedger(self.span_ttl_s)  # transfer ids imported here: each at most once
        self.vocab_size = mc.vocab_size
        self.heads_spec: KVSpec | None = None
        self.read = self.read_state = None
        if ranks is not None:
            split = split_caches(loaded.model, mc, self.storage, self.states, ranks.tp, config.cache.block_size)
            self.heads_spec = split.whole_spec
            self.read = ranks.kv_reader(self.storage, config.cache.block_size, split.shares, mc.num_kv_heads)
            self.read_state = ranks.state_reader(self.states, self.heads_spec)

    def plan(self, blob: bytes, expected_tokens: list[int] | None) -> ImportPlan:
        """Every check of a KV span against this worker (InvalidKVImport); writes nothing and reads
        no state the engine thread changes, so it runs on any thread (the server's verify thread)."""
        return plan_import(
            blob,
            secret=self.secret,
            fingerprint=self.fingerprint,
            kv=self.kv,
            kv_dtype=self.storage.dtype,
            vocab_size=self.vocab_size,
            expected_tokens=expected_tokens,
            ledger=self.ledger,
            heads_spec=self.heads_spec,
        )

    def apply(self, req: Request, plan: ImportPlan, faults: Faults) -> None:
        """Write an admitted import (its blocks and slot are allocated), on every rank."""
        written = apply_import(self.kv, self.storage, self.states, req.request_id, plan)
        faults.hit("import_write", [req])
        if self.ranks is not None:
            slot = self.kv.state_slots.get(req.request_id)
            self.ranks.write_kv(written, [[gid, j, slot, t] for gid, j, t in plan.states])

    def export(self, request_id: str, prompt_token_ids: list[int], first_token: int, fmt: str) -> bytes:
        span = export_span(
            self.kv,
            self.storage,
            self.fingerprint,
            request_id,
            prompt_token_ids,
            first_token,
            fmt,
            self.states,
            self.read,
            self.read_state,
        )
        span.expires_at = time.time() + self.span_ttl_s
        return wire.encode(span, self.secret)
