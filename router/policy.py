"""Routing decisions as pure functions: which replica serves a request, in what
order to try the others, and when a failing replica is taken out of rotation.

Nothing here does I/O or reads a clock; callers pass the state and `now`, so
every decision is reproducible in a table-driven test.

Load of a replica (in requests):

    queue(r) = max(in_flight(r), running(r) + waiting(r))
    load(r)  = queue(r) + kv_weight * kv_usage(r)

`in_flight` is this router's own count (exact and instant); `running`/`waiting`
are scraped from the replica's /metrics (stale by up to one interval, but they
include other routers' traffic). The max takes whichever is worse. KV usage
(0..1) breaks ties toward replicas far from preemption.

Prefix-aware score (policy `prefix`), in units of requests:

    mean     = mean load over the available replicas
    cap      = load_cap_ratio * mean + load_cap_slack
    affinity = match(r) if load(r) + 1 <= cap else 0
    worth    = prefix_weight + prefix_weight_per_load * mean
    score(r) = affinity * worth - load(r)

`match(r)` is the fraction of the prompt's full blocks, counted from the first,
whose hashes the router has sent to r before (its LRU index). A full match is
worth `worth` requests of queue: with the defaults (3, 0.5) a holder of the
prompt's prefix wins over an idle replica while it has fewer than 3 more
requests in flight on an idle pool, 5 at a mean load of 4, 53 at 100 (on big
batches, recomputing a prefix costs more than queueing behind a few more
decodes). The load cap is the hard guard: a replica whose load (with this
request) would exceed the cap gets no affinity at all, so a hot prefix spills
to the least-loaded replica (which then builds its own copy) instead of
melting one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Policy(StrEnum):
    PREFIX = "prefix"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"
    SESSION = "session"


@dataclass(frozen=True)
class ScoringParams:
    prefix_weight: float = 3.0
    prefix_weight_per_load: float = 0.5
    kv_weight: float = 1.0
    load_cap_ratio: float = 1.5
    load_cap_slack: float = 2.0

    def __post_init__(self) -> None:
        if min(self.prefix_weight, self.prefix_weight_per_load, self.kv_weight, self.load_cap_slack) < 0:
            raise ValueError("scoring: weights and slack must be >= 0")
        if self.load_cap_ratio < 1:
            raise ValueError("scoring: load_cap_ratio must be >= 1 (a cap below the mean would starve every replica)")


@dataclass(frozen=True)
class Candidate:
    """One available replica as the policy sees it."""
    name: str
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    match: float = 0.0  # prefix match fraction in [0, 1]


def load_of(c: Candidate, params: ScoringParams) -> float:
    return max(c.in_flight, c.running + c.waiting) + params.kv_weight * c.kv_usage


def prefix_scores(cands: Sequence[Candidate], params: ScoringParams) -> dict[str, float]:
    if not cands:
        return {}
    loads = {c.name: load_of(c, params) for c in cands}
    mean = sum(loads.values()) / len(loads)
    cap = params.load_cap_ratio * mean + params.load_cap_slack
    worth = params.prefix_weight + params.prefix_weight_per_load * mean
    scores = {}
    for c in cands:
        affinity = c.match if loads[c.name] + 1 <= cap else 0.0
        scores[c.name] = affinity * worth - loads[c.name]
    return scores


def _rotation(cands: Sequence[Candidate], turn: int) -> dict[str, int]:
    """Tie-break order that moves on every request, so idle replicas share sequential traffic."""
    n = len(cands)
    return {c.name: (i - turn) % n for i, c in enumerate(cands)}


def rank(policy: Policy, cands: Sequence[Candidate], params: ScoringParams, *, turn: int = 0,
         sticky: str | None = None) -> list[str]:
    """Replica names in the order to try them: the first is the choice, the rest are
    the failover order. `turn` is a counter the caller increments per request;
    `sticky` is the session's remembered replica (policy `session`)."""
    if not cands:
        return []
    rot = _rotation(cands, turn)
    if policy is Policy.ROUND_ROBIN:
        return sorted(rot, key=rot.__getitem__)
    loads = {c.name: load_of(c, params) for c in cands}
    by_load = sorted(rot, key=lambda n: (loads[n], rot[n]))
    if policy is Policy.LEAST_LOAD:
        return by_load
    if policy is Policy.SESSION:
        # A sticky replica that is no longer available simply is not a candidate:
        # the request falls back to least-load and the caller re-pins the session.
        if sticky in loads:
            return [sticky] + [n for n in by_load if n != sticky]
        return by_load
    assert policy is Policy.PREFIX
    scores = prefix_scores(cands, params)
    return sorted(rot, key=lambda n: (-scores[n], loads[n], rot[n]))


# ---- ejection ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EjectionParams:
    failures_to_eject: int = 3   # consecutive failures that take a replica out
    base_seconds: float = 2.0    # first ejection; doubles on each re-ejection
    max_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.failures_to_eject < 1 or self.base_seconds <= 0 or self.max_seconds < self.base_seconds:
            raise ValueError("ejection: need failures_to_eject >= 1 and 0 < base_seconds <= max_seconds")


@dataclass
class Health:
    """Outlier detection for one replica. After an ejection expires the replica is
    on probation: its next result decides (success clears the record, one more
    failure re-ejects it for twice as long)."""
    consecutive_failures: int = 0
    ejections: int = 0            # since the last success; drives the back-off
    ejected_until: float = 0.0

    def available(self, now: float) -> bool:
        return now >= self.ejected_until

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.ejections = 0

    def record_failure(self, now: float, params: EjectionParams) -> bool:
        """Count a failure; True when it ejects the replica (now)."""
        if not self.available(now):
            return False  # already out; late failures of requests sent before do not extend it
        self.consecutive_failures += 1
        if self.consecutive_failures < params.failures_to_eject and self.ejections == 0:
            return False
        self.ejected_until = now + min(params.base_seconds * 2 ** self.ejections, params.max_seconds)
        self.ejections += 1
        self.consecutive_failures = 0
        return True

    def retry_after(self, now: float) -> float:
        return max(self.ejected_until - now, 0.0)
