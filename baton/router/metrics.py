"""The router's /metrics: per worker, read from the worker set at scrape (a worker that leaves takes
its series with it)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baton.router.proxy import Router


class RouterCollector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        workers = list(self.router.workers)
        per_worker = [
            (CounterMetricFamily, "baton_router_requests", "Requests routed to the worker", lambda w: w.requests),
            (
                CounterMetricFamily,
                "baton_router_prefix_tokens_expected",
                "Prompt tokens the router expected the worker's prefix cache to hold (estimated from characters)",
                lambda w: w.prefix_tokens_expected,
            ),
            (
                CounterMetricFamily,
                "baton_router_prefix_tokens_hit",
                "Prompt tokens the worker reported served from its prefix cache (usage cached_tokens)",
                lambda w: w.prefix_tokens_hit,
            ),
            (
                CounterMetricFamily,
                "baton_router_prompt_tokens",
                "Prompt tokens the worker reported (usage prompt_tokens)",
                lambda w: w.prompt_tokens,
            ),
            (GaugeMetricFamily, "baton_router_worker_load", "Requests in flight on the worker", lambda w: w.in_flight),
            (GaugeMetricFamily, "baton_router_worker_up", "1 while the worker takes traffic", lambda w: w.up),
        ]
        for family, name, doc, value in per_worker:
            metric = family(name, doc, labels=["worker"])
            for w in workers:
                metric.add_metric([w.url], float(value(w)))
            yield metric
        yield CounterMetricFamily(
            "baton_router_failovers",
            "Requests a worker failed before any byte reached the client (then tried on another worker)",
            value=self.router.failovers,
        )
        prefill = self.router.prefill
        if prefill is not None:
            for name, doc, label, counts in (
                ("baton_router_prefills", "Requests by where their prompt was prefilled", "where", prefill.prefills),
                ("baton_router_handoff_failures", "Handoffs abandoned, by stage", "stage", prefill.handoff_failures),
            ):
                metric = CounterMetricFamily(name, doc, labels=[label])
                for key, n in counts.items():
                    metric.add_metric([key], n)
                yield metric
