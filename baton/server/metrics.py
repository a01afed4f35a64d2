"""Prometheus metrics: request outcomes and latencies observed by the server, engine state read at scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baton.engine.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class EngineCollector:
    """Reads the engine's own counters when scraped, so nothing is counted twice."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.async_engine = engine
        self.engine = engine.engine

    def collect(self):
        e = self.engine
        a = self.async_engine
        prefills = CounterMetricFamily("baton_prefills", "Prompts prefilled, by where", labels=["where"])
        prefills.add_metric(["remote"], e.prefills["remote"])
        prefills.add_metric(["local"], e.prefills["local"])
        yield prefills
        yield CounterMetricFamily(
            "baton_kv_imports_rejected",
            "KV spans refused (validation, replay, a first token the request forbids, an unknown or "
            "expired transfer id, a write that failed), the prompt then prefilled locally",
            value=a.rejected_imports + a.refused_first_tokens + e.num_kv_imports_failed,
        )
        s = e.scheduler
        yield GaugeMetricFamily("baton_num_requests_running", "Requests in the running batch", value=len(s.running))
        yield GaugeMetricFamily("baton_num_requests_waiting", "Requests waiting to be scheduled", value=len(s.waiting))
        used = GaugeMetricFamily("baton_kv_blocks_used", "KV blocks referenced by requests", labels=["group"])
        total = GaugeMetricFamily("baton_kv_blocks_total", "KV blocks in the pool", labels=["group"])
        for g in e.kv_spec.groups:
            label = f"{g.group_id}:{g.kind.name}"
            used.add_metric([label], e.kv.num_used_blocks(g.group_id))
            total.add_metric([label], e.kv.pools[g.group_id].num_blocks)
        yield used
        yield total
        yield CounterMetricFamily(
            "baton_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=s.prefix_queried_tokens,
        )
        yield CounterMetricFamily(
            "baton_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", value=s.prefix_hit_tokens
        )
        hits = CounterMetricFamily(
            "baton_prefix_cache_group_hit_tokens", "Tokens each KV or state group served from cache", labels=["group"]
        )
        for label, served in s.group_hit_tokens.items():
            hits.add_metric([label], served)
        yield hits
        yield CounterMetricFamily(
            "baton_prefix_cache_no_checkpoint_tokens",
            "Prompt tokens the KV cache held but no state checkpoint could resume",
            value=s.prefix_lost_tokens,
        )
        if e.kv_spec.has_state:
            ckpts = e.kv.checkpoints
            yield GaugeMetricFamily("baton_state_checkpoints_used", "State checkpoints held", value=ckpts.num_used)
            yield GaugeMetricFamily(
                "baton_state_checkpoints_total", "State checkpoint pool", value=ckpts.num_checkpoints
            )
            yield GaugeMetricFamily(
                "baton_state_slots_used", "Running requests' state slots", value=len(e.kv.state_slots)
            )
            yield GaugeMetricFamily("baton_state_slots_total", "State slots", value=e.kv.num_state_slots)
        yield CounterMetricFamily("baton_preemptions", "Requests preempted for KV memory", value=s.num_preemptions)
        if e.tier is not None:
            yield from tier_metrics(e.tier.metrics())
        so = e.structured
        yield CounterMetricFamily(
            "baton_grammars_compiled", "Distinct output constraints compiled", value=so.num_compiled
        )
        yield CounterMetricFamily(
            "baton_grammar_compile_seconds", "Time compiling output constraints", value=so.compile_seconds
        )
        yield CounterMetricFamily("baton_grammar_mask_steps", "Steps that computed token masks", value=so.mask_steps)
        yield CounterMetricFamily(
            "baton_grammar_mask_seconds",
            "Time computing token masks (beside the model's forward)",
            value=so.mask_seconds,
        )
        if e.spec is not None:
            yield from _spec_metrics(e.spec)
        yield CounterMetricFamily(
            "baton_engine_step_failures",
            "Engine steps that raised (their requests failed; the engine went on)",
            value=a.step_failures,
        )
        yield GaugeMetricFamily(
            "baton_engine_alive", "1 while the engine loop runs, 0 once it stopped or died", value=int(a.running)
        )
        yield CounterMetricFamily(
            "baton_engine_stalls",
            "Times the engine made no progress for --stall-timeout-s with work pending (/health said 503)",
            value=a.stalls,
        )


def _spec_metrics(spec):
    """vLLM's names: vllm:spec_decode_num_drafts and so on."""
    yield CounterMetricFamily(
        "baton_spec_decode_num_drafts", "Verifications with at least one draft", value=spec.num_drafts
    )
    yield CounterMetricFamily(
        "baton_spec_decode_num_draft_tokens", "Draft tokens verified", value=spec.num_draft_tokens
    )
    yield CounterMetricFamily(
        "baton_spec_decode_num_accepted_tokens", "Draft tokens accepted", value=spec.num_accepted_tokens
    )
    per_position = CounterMetricFamily(
        "baton_spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the draft",
        labels=["position"],
    )
    for i, n in enumerate(spec.accepted_per_position):
        per_position.add_metric([str(i)], n)
    yield per_position


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        r = self.registry
        self.requests = Counter("baton_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("baton_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("baton_generation_tokens", "Generated tokens", registry=r)
        self.rejected = Counter("baton_requests_rejected", "Requests refused before admission", ["reason"], registry=r)
        self.ttft = Histogram(
            "baton_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "baton_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "baton_e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r
        )

    def observe(self, outcome: str, prompt_tokens: int, output_tokens: int, ttft: float | None, e2e: float) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            if output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (output_tokens - 1))
        self.e2e.observe(e2e)


TIER_METRICS = {
    "hit_tokens": "Prompt tokens served from the second KV tier",
    "miss_tokens": "Prompt tokens looked up in the second KV tier past the prefix cache and not found",
    "bytes_read": "Bytes read from the second KV tier",
    "bytes_written": "Bytes written to the second KV tier",
    "objects_written": "Objects written to the second KV tier",
    "load_seconds": "Seconds spent loading and verifying second-tier objects (off the engine thread)",
    "bad_objects": "Second-tier objects that failed a check: deleted, recomputed",
    "writes_dropped": "Second-tier writes dropped over the pending-bytes budget",
    "loads_cut": "Second-tier loads cut short at the pending-bytes budget",
    "errors": "Second-tier store operations that failed (I/O, connection)",
}


def tier_metrics(stats: dict[str, float]):
    for name, doc in TIER_METRICS.items():
        yield CounterMetricFamily(f"baton_kv_tier_{name}", doc, value=stats[name])
