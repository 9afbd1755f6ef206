"""Load signals from an engine replica's Prometheus /metrics (the metrics contract
in DESIGN.md), parsed purely; the router's scrape loop does the I/O."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EngineSnapshot:
    running: int
    waiting: int
    kv_usage: float
    block_size: int | None
    num_blocks: int | None
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0


def parse_engine_metrics(text: str) -> EngineSnapshot | None:
    """The replica's load, or None when it exports no engine series (still loading
    its model: the engine's /metrics is up before the engine is)."""
    values: dict[str, float] = {}
    block_size = num_blocks = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pagefleet:cache_config_info":
                block_size = int(s.labels["block_size"])
                num_blocks = int(s.labels["num_blocks"])
            elif s.name.startswith("pagefleet:"):
                values[s.name.removeprefix("pagefleet:")] = s.value
    if "num_requests_running" not in values:
        return None
    return EngineSnapshot(running=int(values["num_requests_running"]),
                          waiting=int(values.get("num_requests_waiting", 0)),
                          kv_usage=float(values.get("kv_cache_usage_perc", 0.0)),
                          block_size=block_size, num_blocks=num_blocks,
                          prefix_cache_queries=values.get("prefix_cache_queries_total", 0.0),
                          prefix_cache_hits=values.get("prefix_cache_hits_total", 0.0))

