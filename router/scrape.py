"""Load signals from an engine replica's Prometheus /metrics (the metrics contract
in DESIGN.md), parsed purely; the router's scrape loop does the I/O."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSnapshot:
    running: int
    waiting: int
    kv_usage: float
    block_size: int | None
    num_blocks: int | None
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0


_WANTED = ("pagefleet:num_requests_running", "pagefleet:num_requests_waiting", "pagefleet:kv_cache_usage_perc",
           "pagefleet:prefix_cache_queries_total", "pagefleet:prefix_cache_hits_total")
_INFO = "pagefleet:cache_config_info"


def parse_engine_metrics(text: str) -> EngineSnapshot | None:
    """The replica's load, or None when it exports no engine series (still loading
    its model: the engine's /metrics is up before the engine is).

    Reads only the handful of series the router uses, line by line: a general
    exposition parser spent ~7 ms per scrape on the engine's histograms, on the
    same event loop that relays requests."""
    values: dict[str, float] = {}
    block_size = num_blocks = None
    for line in text.splitlines():
        if not line.startswith("pagefleet:") or line.startswith(("pagefleet:time_", "pagefleet:e2e_",
                                                                     "pagefleet:inter_", "pagefleet:request_")):
            continue
        name, _, rest = line.partition("{")
        if name == _INFO:
            labels = dict(kv.split("=", 1) for kv in rest.rpartition("}")[0].split(","))
            block_size = int(labels["block_size"].strip('"'))
            num_blocks = int(labels["num_blocks"].strip('"'))
        elif name in _WANTED:
            values[name.removeprefix("pagefleet:")] = float(rest.rpartition("} ")[2].split()[0])
    if "num_requests_running" not in values:
        return None
    return EngineSnapshot(running=int(values["num_requests_running"]),
                          waiting=int(values.get("num_requests_waiting", 0)),
                          kv_usage=float(values.get("kv_cache_usage_perc", 0.0)),
                          block_size=block_size, num_blocks=num_blocks,
                          prefix_cache_queries=values.get("prefix_cache_queries_total", 0.0),
                          prefix_cache_hits=values.get("prefix_cache_hits_total", 0.0))
