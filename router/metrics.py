"""The router's own Prometheus metrics (`pagefleet:router_*`), labelled by pool.

Per-replica series are labelled with the replica URL; the set of replicas is
small (a pool's pods), so cardinality stays bounded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05)
_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pagefleet:router_requests", "Requests by the replica that answered and outcome "
            "(ok, client_error, upstream_error, midstream_error, no_replica, unknown_model).",
            ["pool", "replica", "outcome"], registry=r)
        self.retries = Counter("pagefleet:router_retries", "Attempts moved to another replica, by reason.",
                               ["pool", "reason"], registry=r)
        self.ejections = Counter("pagefleet:router_ejections", "Replicas taken out of rotation after failures.",
                                 ["pool", "replica"], registry=r)
        self.prefix_match = Histogram("pagefleet:router_prefix_match_fraction",
                                      "Fraction of the prompt's blocks the chosen replica was sent before.",
                                      ["pool"], buckets=_FRACTION_BUCKETS, registry=r)
        self.upstream_latency = Histogram("pagefleet:router_upstream_latency_seconds",
                                          "Time from forwarding a request to the replica's response headers.",
                                          ["pool"], buckets=_LATENCY_BUCKETS, registry=r)
        self.decision_time = Histogram("pagefleet:router_decision_seconds",
                                       "Time to pick a replica (tokenize, hash, score).", ["pool"],
                                       buckets=_DECISION_BUCKETS, registry=r)
        self.in_flight = Gauge("pagefleet:router_in_flight", "Requests this router has open to each replica.",
                               ["pool", "replica"], registry=r)
        self.replicas = Gauge("pagefleet:router_replicas", "Replicas by state (ready, ejected, not_ready).",
                              ["pool", "state"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
