"""The config tree's KV sections that reach past one process: the PD handoff's (KVTransferConfig)
and the second KV tier's (KVTierConfig), and the rule their secrets follow."""

from __future__ import annotations

from dataclasses import dataclass, field

KV_ROLES = ("none", "prefill", "decode", "both")


@dataclass
class KVTransferConfig:
    kv_role: str = "none"
    """none: no internal routes; prefill: export KV spans on /v1/internal/prefill; decode: accept them
    on /v1/internal/kv; both."""
    kv_secret: str | None = None
    """Shared secret of a PD deployment (or BATON_KV_SECRET), required by every KV role and distinct
    from the API key: internal routes require it and every KV span carries an HMAC-SHA256 made with
    it. Without a role and a secret, spans are signed with a random per-process key, so only the
    process that exported a span can import it."""
    max_kv_span_bytes: int = 2 << 30
    """Largest KV span body accepted on /v1/internal/kv."""
    max_parked_kv_bytes: int = 4 << 30
    """KV span bytes a decode worker holds at once: uploads in flight, spans parked for their
    requests, and imports waiting for admission."""
    max_kv_uploads: int = 8
    """Uploads to /v1/internal/kv in flight at once; past it, 503."""
    kv_span_ttl_s: float = 120.0
    """A span expires this long after its export; a span is imported at most once before then."""

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.max_kv_span_bytes < 1 or self.max_parked_kv_bytes < 1 or self.max_kv_uploads < 1:
            raise ValueError("max_kv_span_bytes, max_parked_kv_bytes and max_kv_uploads must be positive")
        if not 0 < self.kv_span_ttl_s <= 3600:
            raise ValueError(f"kv_span_ttl_s must be in (0, 3600], got {self.kv_span_ttl_s}")


KV_TIER_SCHEMES = ("disk:", "redis://", "rediss://", "valkey://", "valkeys://")


@dataclass
class KVTierConfig:
    kv_tier: list[str] = field(default_factory=list)
    """A second KV tier, repeatable (read in the order given, written to each): disk:PATH, a
    directory any number of processes on one host share, or redis://HOST:PORT[/DB] (Redis or
    Valkey). Published prefix blocks and state checkpoints are written to it; a prompt it holds
    more of than the KV pool resumes from it."""
    kv_tier_bytes: int = 8 << 30
    """Each tier's byte budget; the least recently used objects go first."""
    kv_tier_secret: str | None = None
    """The key that signs and checks tier objects (or BATON_KV_TIER_SECRET), required with
    --kv-tier: every process sharing a tier uses the same one, and no other."""
    kv_tier_max_pending_bytes: int = 512 << 20
    """Bytes copied out and not yet written plus bytes loaded and not yet adopted: past it, writes
    are dropped and loads cut short (counted), never a step delayed."""

    def __post_init__(self) -> None:
        for entry in self.kv_tier:
            if not entry.startswith(KV_TIER_SCHEMES) or entry in KV_TIER_SCHEMES:
                raise ValueError(f"kv_tier entries are disk:PATH or redis://HOST:PORT, got {entry!r}")
        if self.kv_tier_bytes < 1 or self.kv_tier_max_pending_bytes < 1:
            raise ValueError("kv_tier_bytes and kv_tier_max_pending_bytes must be positive")


def check_kv_secret(secret: str | None, api_key: str | None, who: str) -> str:
    """A PD deployment's secret, refused when missing or when it is the API key (every tenant
    holds that one, and could then sign spans and call the internal routes)."""
    if not secret:
        raise ValueError(
            f"{who} needs the deployment's kv secret for the internal routes and KV spans: pass "
            "--kv-secret (or set BATON_KV_SECRET) on every worker and the router"
        )
    if api_key is not None and secret == api_key:
        raise ValueError(
            "the kv secret must differ from the API key: every client holds the API key, and could "
            "sign KV spans and call the internal routes with it"
        )
    return secret
