"""Autoscaling policy for engine pools: a pure, clock-free function modelled on the
Kubernetes HorizontalPodAutoscaler. The operator and `pagefleet up` call `decide`
once per pool per tick, passing the clock (`now`) and the history it returned last time.

1. Bounds: a replica count outside [minReplicas, maxReplicas] goes straight to the
   nearest bound, metrics or not. A pool at 0 with minReplicas 0 stays at 0.
2. No metrics (no ready pod answered): hold at the current count.
3. Per metric, ratio = observed / target, where observed is waiting requests per replica
   or mean KV-cache usage, and pods that did not report count as idle
   (observed = sum / max(pods reporting, current)). A metric within 1 +- tolerance
   wants `current` replicas, otherwise ceil(current * ratio). The recommendation is the
   highest of these, so either metric can drive scale-up, and scale-down needs both.
   With fewer pods reporting than `current`, a lower recommendation becomes `current`:
   never scale down on partial data.
4. Stabilize: each recommendation holds until the next one. Scale up only to the lowest
   recommendation that held during the scale-up window. Scale down only to the highest
   one that held during the scale-down window. Time the history does not cover counts as
   `current` for scale-down, so a fresh pool or a restarted operator waits a full window
   before it shrinks.
5. Limit: add at most scaleUpStep and remove at most scaleDownStep per decision, then
   clamp to [max(minReplicas, 1), maxReplicas].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Float slack so that values computed exactly on a boundary (2.2 / 2.0 = 1.1000000000000001,
# 3 * (4 / 3) = 4.000000000000001) count as on it and do not add a replica.
_EPS = 1e-9


def _check(name: str, value: object, *, integer: bool = False, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None) -> None:
    # The messages use the YAML (camelCase) field names, because users read them in a status condition
    # or a CLI error, next to the spec they wrote.
    if integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    for bound, ok, word in ((ge, lambda b: value >= b, ">="), (gt, lambda b: value > b, ">"),
                            (le, lambda b: value <= b, "<="), (lt, lambda b: value < b, "<")):
        if bound is not None and not ok(bound):
            raise ValueError(f"{name} must be {word} {bound:g}, got {value!r}")


@dataclass(frozen=True)
class ScalingParams:
    min_replicas: int = 1
    max_replicas: int = 4
    target_waiting_per_replica: float = 2.0  # queue depth per replica we aim for
    target_kv_cache_usage: float = 0.8  # mean KV usage (0..1] we aim for
    tolerance: float = 0.1  # a metric within 1 +- tolerance of its target asks for no change
    scale_up_window_s: float = 0.0  # scale up only to the LOWEST recommendation that held in this window
    scale_down_window_s: float = 300.0  # scale down only to the HIGHEST recommendation that held in this window
    scale_up_step: int = 4  # max replicas added per decision
    scale_down_step: int = 1  # max replicas removed per decision

    def __post_init__(self) -> None:
        _check("minReplicas", self.min_replicas, integer=True, ge=0)
        _check("maxReplicas", self.max_replicas, integer=True, ge=1)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})")
        _check("targetWaitingPerReplica", self.target_waiting_per_replica, gt=0)
        _check("targetKVCacheUsage", self.target_kv_cache_usage, gt=0, le=1)
        # tolerance >= 1 would make the lower band reach 0: the pool could never shrink.
        _check("tolerance", self.tolerance, ge=0, lt=1)
        _check("scaleUpWindowSeconds", self.scale_up_window_s, ge=0)
        _check("scaleDownWindowSeconds", self.scale_down_window_s, ge=0)
        _check("scaleUpStep", self.scale_up_step, integer=True, ge=1)
        _check("scaleDownStep", self.scale_down_step, integer=True, ge=1)


@dataclass(frozen=True)
class PodMetrics:
    """One ready pod's scrape: `pagefleet:num_requests_waiting`, `_running`, `kv_cache_usage_perc`."""

    waiting: float
    running: float
    kv_usage: float


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    replicas: int  # what the Deployment should have now
    reason: str  # one human sentence for status and logs
    metrics: dict[str, float]  # the aggregated numbers used
    history: tuple[Recommendation, ...]  # pass back on the next call (pruned to the longest window)


@dataclass(frozen=True)
class _Signal:
    label: str
    observed: float
    target: float
    ratio: float
    desired: int
    fmt: str
    unit: str

    def describe(self, tolerance: float) -> str:
        value = format(self.observed, self.fmt) + self.unit
        target = format(self.target, self.fmt)
        if self.ratio > 1 + tolerance + _EPS:
            return f"{self.label} {value} > target {target}"
        if self.ratio < 1 - tolerance - _EPS:
            return f"{self.label} {value} < target {target}"
        return f"{self.label} {value} within {tolerance:.0%} of target {target}"


def _reporting(pods: Sequence[PodMetrics] | None) -> list[PodMetrics]:
    # A pod with a NaN, infinite or negative value is a broken scrape, not a measurement. Counting it as
    # not reporting makes it partial data, and the policy never scales down on partial data.
    def ok(p: PodMetrics) -> bool:
        return all(math.isfinite(v) and v >= 0 for v in (p.waiting, p.running, p.kv_usage))

    return [p for p in pods or () if ok(p)]


def _signal(label: str, observed: float, target: float, current: int, tolerance: float, fmt: str,
            unit: str = "") -> _Signal:
    ratio = observed / target
    if abs(ratio - 1) <= tolerance + _EPS:
        desired = current  # HPA's tolerance applies per metric, so a metric inside its band never moves the pool
    else:
        desired = max(0, math.ceil(current * ratio - _EPS))
    return _Signal(label, observed, target, ratio, desired, fmt, unit)


def _prune(history: Sequence[Recommendation], now: float, keep_s: float) -> tuple[Recommendation, ...]:
    """Drop entries from the future (the clock went back) and entries older than `keep_s`. Keep the newest
    old entry, though: it was still in force when the window opened, and it shows the window is covered."""
    past = sorted((r for r in history if r.at <= now), key=lambda r: r.at)  # stable: same-`at` order is kept
    start = now - keep_s
    old = [i for i, r in enumerate(past) if r.at <= start]
    return tuple(past[old[-1]:] if old else past)


def _in_force(history: tuple[Recommendation, ...], now: float, window_s: float) -> tuple[list[int], bool]:
    """The recommendations that held at some time in [now - window_s, now], and whether the history covers
    all of that interval. With window 0 this is just the newest recommendation."""
    start = now - window_s
    values = [r.replicas for r in history if r.at > start]
    anchor = [r.replicas for r in history if r.at <= start]
    if anchor:
        values.append(anchor[-1])
    return values, bool(anchor)


def _metrics(current: int, reporting: list[PodMetrics]) -> dict[str, float]:
    n = len(reporting)
    out: dict[str, float] = {"replicas": float(current), "pods_reporting": float(n)}
    if n:
        # Missing pods count as idle (HPA does the same for scale-up). Pods that are not ready yet take no
        # traffic from the router, so the queue the ready ones hold will soon be shared by `current` replicas.
        denom = max(n, current)
        out["waiting_per_replica"] = sum(p.waiting for p in reporting) / denom
        out["running_per_replica"] = sum(p.running for p in reporting) / denom
        out["kv_usage_mean"] = sum(p.kv_usage for p in reporting) / denom
    return out


def decide(params: ScalingParams, current: int, pods: Sequence[PodMetrics] | None,
           history: tuple[Recommendation, ...], now: float) -> Decision:
    """The replica count a pool should have now. See the module docstring for the algorithm.

    `current`: the Deployment's replica count. `pods`: metrics of the ready pods that answered (None or
    empty: metrics missing). `history`: `Decision.history` from the previous call for this pool (empty on
    the first call). `now`: seconds on any monotonic clock, the same clock on every call.
    """
    if isinstance(current, bool) or not isinstance(current, int) or current < 0:
        raise ValueError(f"current must be a non-negative integer, got {current!r}")
    history = tuple(history)
    reporting = _reporting(pods)
    metrics = _metrics(current, reporting)
    lo, hi = params.min_replicas, params.max_replicas
    keep_s = max(params.scale_up_window_s, params.scale_down_window_s)

    # Bounds win over everything, including missing metrics: the user changed min/max and expects it now.
    # As in HPA, no step limit or window applies to this.
    if current < lo:
        return Decision(lo, f"scale up {current} -> {lo}: below minReplicas {lo}", metrics,
                        _prune(history, now, keep_s))
    if current > hi:
        return Decision(hi, f"scale down {current} -> {hi}: above maxReplicas {hi}", metrics,
                        _prune(history, now, keep_s))
    if current == 0:
        # Only reachable with minReplicas 0. A pool at zero has no pods to report load. Waking it needs the
        # router to see requests for it, which this policy does not do, so it stays at zero.
        return Decision(0, "holding at 0: scaled to zero (scale-from-zero is not automatic)", metrics, history)
    if not reporting:
        return Decision(current, f"holding at {current}: no metrics", metrics, history)

    n = len(reporting)
    tol = params.tolerance
    signals = [
        _signal("waiting", metrics["waiting_per_replica"], params.target_waiting_per_replica, current, tol, ".1f",
                "/replica"),
        _signal("KV cache usage", metrics["kv_usage_mean"], params.target_kv_cache_usage, current, tol, ".2f"),
    ]
    rec = max(s.desired for s in signals)
    partial = n < current
    partial_hold = partial and rec < current
    if partial_hold:
        # The missing pods may be the busy ones (a pod that is stuck serving a long prefill can time out its
        # scrape). Shrinking on what the others report could remove capacity that is needed, so hold.
        rec = current
    metrics["waiting_ratio"] = signals[0].ratio
    metrics["kv_usage_ratio"] = signals[1].ratio
    metrics["recommendation"] = float(rec)

    hist = _prune((*history, Recommendation(now, rec)), now, keep_s)
    up_values, _ = _in_force(hist, now, params.scale_up_window_s)
    down_values, covered = _in_force(hist, now, params.scale_down_window_s)
    # The newest recommendation is in both windows, so min(up) <= rec <= max(down), and only one branch can fire.
    up_target = max(current, min(up_values))
    down_target = min(current, max(down_values))
    down_note = f"scale-down window {params.scale_down_window_s:g}s: highest recommendation {max(down_values)}"
    if not covered:
        # No record of the start of the window (first call, or operator restart). Count that time as
        # "wanted current". Otherwise a restart would shrink the pool at once. HPA seeds its history the same way.
        down_target = current
        down_note = f"scale-down window {params.scale_down_window_s:g}s: less history than the window"

    # Each limit is a bound on the target. The reason names only the ones the result actually hit.
    notes: list[str] = []
    target = current
    if rec > current:
        bounds = [(up_target, f"scale-up window {params.scale_up_window_s:g}s: lowest recommendation "
                              f"{min(up_values)}"),
                  (current + params.scale_up_step, f"step limit +{params.scale_up_step}"),
                  (hi, f"maxReplicas {hi}")]
        target = min(b for b, _ in bounds)
        notes = [note for b, note in bounds if b == target and b < rec]
    elif rec < current:
        # Never to zero on metrics: at zero nothing reports load, and scaling up from zero is not automatic.
        floor = max(lo, 1)
        floor_note = f"minReplicas {lo}" if lo >= 1 else "floor of 1 replica (no automatic scale-from-zero)"
        bounds = [(down_target, down_note),
                  (current - params.scale_down_step, f"step limit -{params.scale_down_step}"),
                  (floor, floor_note)]
        target = max(b for b, _ in bounds)
        notes = [note for b, note in bounds if b == target and b > rec]
    # A hold with a metric off target (ceil() landed back on `current`) also shows the number, or it reads as a bug.
    off_target = any(abs(s.ratio - 1) > tol + _EPS for s in signals)
    if target != rec or (target == current and off_target and not partial_hold):
        notes.insert(0, f"recommendation {rec}")
    if partial:
        notes.append(f"{n}/{current} pods reporting" + (", not scaling down on partial metrics" if partial_hold
                                                        else ", missing pods counted as idle"))

    if target > current:
        head = f"scale up {current} -> {target}"
        why = " and ".join(s.describe(tol) for s in signals if s.desired > current)
    elif target < current:
        head = f"scale down {current} -> {target}"
        why = " and ".join(s.describe(tol) for s in signals)
    else:
        head = f"holding at {current}"
        why = " and ".join(s.describe(tol) for s in signals)
    reason = f"{head}: {why}" + (f" ({'; '.join(notes)})" if notes else "")
    return Decision(target, reason, metrics, hist)


_POD_SERIES = {"pagefleet:num_requests_waiting": "waiting", "pagefleet:num_requests_running": "running",
               "pagefleet:kv_cache_usage_perc": "kv_usage"}


def parse_pod_metrics(text: str) -> PodMetrics | None:
    """The policy's input from one engine's Prometheus /metrics (the metrics contract in
    DESIGN.md); None when the engine does not export them (still loading)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, brace, rest = line.partition("{")
        if brace and name in _POD_SERIES:
            values[_POD_SERIES[name]] = float(rest.rpartition("} ")[2].split()[0])
    return PodMetrics(**values) if len(values) == len(_POD_SERIES) else None
