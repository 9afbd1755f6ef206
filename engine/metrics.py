"""Prometheus metrics of one replica (the contract in DESIGN.md).

Names mirror vLLM's with a `pagefleet:` prefix, so existing dashboards, KEDA
recipes and endpoint pickers apply with a prefix change. Engine state (queue
lengths, KV usage, cache counters) is read at scrape time from the engine's
stats, so it can never drift from the truth; latencies are histograms observed
as requests stream.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagefleet.engine.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# `*_created` timestamps add a series per metric that no dashboard here uses.
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector(Collector):
    def __init__(self, get_engine: Callable[[], AsyncEngine | None], model_name: str) -> None:
        self.get_engine = get_engine
        self.model_name = model_name

    def collect(self):
        ae = self.get_engine()
        if ae is None:
            return
        s = ae.engine.stats()
        c = ae.counters
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(f"pagefleet:{name}", doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float):
            m = CounterMetricFamily(f"pagefleet:{name}", doc, labels=["model_name"])
            m.add_metric(label, value)
            return m

        yield gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled (incl. preempted).", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                    1.0 - s.num_free_blocks / s.num_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", c.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", c.generation_tokens)
        success = CounterMetricFamily("pagefleet:request_success", "Finished sequences by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted(c.requests_finished.items()):
            success.add_metric([self.model_name, reason], n)
        yield success
        info = GaugeMetricFamily("pagefleet:cache_config_info", "KV cache configuration.",
                                 labels=["model_name", "block_size", "num_blocks"])
        info.add_metric([self.model_name, str(s.block_size), str(s.num_blocks)], 1)
        yield info


class ServerMetrics:
    def __init__(self, get_engine: Callable[[], AsyncEngine | None], model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(get_engine, model_name))

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"pagefleet:{name}", doc, ["model_name"], registry=self.registry,
                             buckets=_LATENCY_BUCKETS).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from request arrival to its last token.")
        self.queue_time = hist("request_queue_time_seconds", "Time a request waited before first scheduled.")

    def render(self) -> bytes:
        return generate_latest(self.registry)
