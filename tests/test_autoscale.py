"""The autoscaling policy as a pure function: single decisions from a table, then sequences of
decisions with an advancing clock (windows, step limits, flapping), then parameter validation."""

from __future__ import annotations

import math
import random

import pytest

from pagefleet.operator.autoscale import Decision, PodMetrics, Recommendation, ScalingParams, decide

P = ScalingParams()  # min 1, max 4, waiting target 2.0, KV target 0.8, tolerance 0.1, down window 300 s
NOW = 1000.0
TICK = 15.0  # the operator's timer period


def pods(n: int, waiting: float = 0.0, kv: float = 0.0, running: float = 0.0) -> list[PodMetrics]:
    return [PodMetrics(waiting=waiting, running=running, kv_usage=kv) for _ in range(n)]


def run(params: ScalingParams, current: int, load, *, start: float = 0.0, steps: int = 100,
        tick: float = TICK) -> tuple[list[int], list[Decision]]:
    """Apply each decision, as the operator would. `load(t, current)` returns the pods' metrics."""
    history: tuple[Recommendation, ...] = ()
    replicas, decisions = [current], []
    for i in range(steps):
        t = start + i * tick
        d = decide(params, current, load(t, current), history, t)
        history, current = d.history, d.replicas
        replicas.append(current)
        decisions.append(d)
    return replicas, decisions


def direction_changes(replicas: list[int]) -> int:
    moves = [b - a for a, b in zip(replicas, replicas[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:], strict=False) if (a > 0) != (b > 0))


# ---- single decisions ----------------------------------------------------------------------------

NO_DOWN_WINDOW = ScalingParams(scale_down_window_s=0)
WIDE = ScalingParams(max_replicas=10)

# (id, params, current, pods, expected replicas, substrings of the reason)
DECIDE_TABLE = [
    ("up on queue", P, 1, pods(1, waiting=5.0, kv=0.3), 3,
     ["scale up 1 -> 3:", "waiting 5.0/replica > target 2.0"]),
    ("up on KV pressure", P, 2, pods(2, waiting=0.0, kv=0.95), 3,
     ["scale up 2 -> 3:", "KV cache usage 0.95 > target 0.80"]),
    # queue low but KV high: either metric can drive scale up
    ("KV outvotes idle queue", WIDE, 4, pods(4, waiting=0.0, kv=0.9), 5, ["scale up 4 -> 5:", "KV cache usage"]),
    ("within tolerance holds", P, 3, pods(3, waiting=2.1, kv=0.75), 3, ["holding at 3:", "within 10% of target"]),
    ("tolerance edge holds", P, 2, pods(2, waiting=2.2, kv=0.88), 2, ["holding at 2:"]),
    # KV is on target, so scale down is vetoed even though the queue is empty
    ("down needs both metrics", NO_DOWN_WINDOW, 4, pods(4, waiting=0.0, kv=0.8), 4, ["holding at 4:"]),
    ("up step limit", WIDE, 2, pods(2, waiting=20.0), 6,
     ["scale up 2 -> 6:", "recommendation 20", "step limit +4"]),
    ("up custom step", ScalingParams(max_replicas=10, scale_up_step=2), 2, pods(2, waiting=20.0), 4,
     ["step limit +2"]),
    ("up max clamp", P, 3, pods(3, waiting=6.0), 4, ["scale up 3 -> 4:", "maxReplicas 4"]),
    ("at max holds", P, 4, pods(4, waiting=9.0), 4, ["holding at 4:", "maxReplicas 4"]),
    ("down step limit", NO_DOWN_WINDOW, 4, pods(4, waiting=0.5, kv=0.1), 3,
     ["scale down 4 -> 3:", "waiting 0.5/replica < target 2.0", "step limit -1"]),
    ("down custom step", ScalingParams(scale_down_window_s=0, scale_down_step=3), 4, pods(4, waiting=0.5, kv=0.1),
     1, ["scale down 4 -> 1:"]),
    ("down min clamp", ScalingParams(min_replicas=2, scale_down_window_s=0, scale_down_step=3), 4, pods(4), 2,
     ["scale down 4 -> 2:", "minReplicas 2"]),
    ("never to zero on metrics", ScalingParams(min_replicas=0, scale_down_window_s=0), 1, pods(1), 1,
     ["holding at 1:", "floor of 1 replica"]),
    # ceil(current * ratio) may round back to current: no change without a window needed
    ("ceil rounds to current", NO_DOWN_WINDOW, 2, pods(2, waiting=1.7, kv=0.6), 2,
     ["holding at 2:", "(recommendation 2)"]),
    # bounds apply before anything else, with or without metrics, and without step limits
    ("below min, no metrics", ScalingParams(min_replicas=3), 1, None, 3, ["scale up 1 -> 3: below minReplicas 3"]),
    ("zero below min", P, 0, [], 1, ["scale up 0 -> 1: below minReplicas 1"]),
    ("above max with load", P, 7, pods(7, waiting=9.0), 4, ["scale down 7 -> 4: above maxReplicas 4"]),
    ("above max, no metrics", P, 9, None, 4, ["above maxReplicas 4"]),
    ("zero stays zero", ScalingParams(min_replicas=0), 0, None, 0, ["holding at 0:"]),
    ("zero stays zero with stray pods", ScalingParams(min_replicas=0), 0, pods(1, waiting=9.0), 0, ["holding at 0:"]),
    # missing metrics hold at current
    ("no metrics: None", P, 3, None, 3, ["holding at 3: no metrics"]),
    ("no metrics: empty", P, 3, [], 3, ["holding at 3: no metrics"]),
    ("no metrics: broken scrape", P, 3, [PodMetrics(math.nan, 0.0, 0.5)], 3, ["holding at 3: no metrics"]),
    # partial data: missing pods count as idle for scale up and veto scale down
    ("partial never scales down", NO_DOWN_WINDOW, 4, pods(2), 4,
     ["holding at 4:", "2/4 pods reporting, not scaling down on partial metrics"]),
    ("partial dampens KV up", P, 4, pods(2, kv=0.95), 4, ["holding at 4:"]),
    ("partial queue still scales up", WIDE, 2, pods(1, waiting=10.0), 5,
     ["scale up 2 -> 5:", "waiting 5.0/replica", "1/2 pods reporting, missing pods counted as idle"]),
    ("broken pod is partial", NO_DOWN_WINDOW, 2, [*pods(1), PodMetrics(0.0, 0.0, -1.0)], 2, ["1/2 pods reporting"]),
]


@pytest.mark.parametrize(("params", "current", "pod_metrics", "expected", "reason_parts"),
                         [row[1:] for row in DECIDE_TABLE], ids=[row[0] for row in DECIDE_TABLE])
def test_decide(params: ScalingParams, current: int, pod_metrics: list[PodMetrics] | None, expected: int,
                reason_parts: list[str]) -> None:
    d = decide(params, current, pod_metrics, (), NOW)
    assert d.replicas == expected, d.reason
    for part in reason_parts:
        assert part in d.reason
    assert "\n" not in d.reason


def test_decision_reports_the_numbers_it_used() -> None:
    d = decide(P, 2, [PodMetrics(9.0, 4.0, 0.5), PodMetrics(9.0, 2.0, 0.7)], (), NOW)
    assert d.reason == "scale up 2 -> 4: waiting 9.0/replica > target 2.0 (recommendation 9; maxReplicas 4)"
    assert d.metrics == pytest.approx({
        "replicas": 2, "pods_reporting": 2, "waiting_per_replica": 9.0, "running_per_replica": 3.0,
        "kv_usage_mean": 0.6, "waiting_ratio": 4.5, "kv_usage_ratio": 0.75, "recommendation": 9,
    })
    assert d.history == (Recommendation(NOW, 9),)


def test_partial_metrics_average_over_current_replicas() -> None:
    d = decide(WIDE, 4, pods(2, waiting=6.0, kv=0.9), (), NOW)
    assert d.metrics["pods_reporting"] == 2
    assert d.metrics["waiting_per_replica"] == 3.0  # 12 waiting shared by 4 replicas
    assert d.metrics["kv_usage_mean"] == pytest.approx(0.45)
    assert d.replicas == 6  # ceil(4 * 3.0 / 2.0)


def test_missing_metrics_keep_history_unchanged() -> None:
    history = (Recommendation(NOW - 500, 1), Recommendation(NOW - 10, 2))
    for missing in (None, []):
        d = decide(P, 2, missing, history, NOW)
        assert (d.replicas, d.history) == (2, history)


def test_negative_current_is_rejected() -> None:
    with pytest.raises(ValueError, match="current"):
        decide(P, -1, None, (), NOW)


# ---- sequences: windows, step limits, flapping ---------------------------------------------------


def test_scale_down_waits_for_the_window_then_steps() -> None:
    # Idle from the first call: with no history, the time before it counts as "wanted current".
    replicas, decisions = run(P, 4, lambda t, n: pods(n), steps=30)
    times = [i * TICK for i in range(30)]
    first_drop = next(i for i, d in enumerate(decisions) if d.replicas < 4)
    assert times[first_drop] == P.scale_down_window_s
    assert all("scale-down window 300s" in d.reason for d in decisions[:first_drop])
    assert all(a - b <= P.scale_down_step for a, b in zip(replicas, replicas[1:], strict=False))
    assert replicas[-1] == 1  # min_replicas, one step per decision
    assert replicas[first_drop + 1:first_drop + 4] == [3, 2, 1]


def test_scale_down_window_counts_from_the_last_high_recommendation() -> None:
    # Busy (on target) until t=150, idle afterwards; one busy blip at t=300.
    def load(t: float, n: int) -> list[PodMetrics]:
        busy = t < 150 or t == 300
        return pods(n, waiting=2.0 if busy else 0.0, kv=0.8 if busy else 0.1)

    replicas, decisions = run(P, 3, load, steps=60)
    first_drop = next(i for i, d in enumerate(decisions) if d.replicas < 3)
    # The blip's recommendation stands until the next tick, and the window must clear that tick too.
    assert first_drop * TICK == 300 + TICK + P.scale_down_window_s
    assert "highest recommendation 3" in decisions[first_drop - 1].reason
    assert direction_changes(replicas) == 0


def test_scale_up_window_ignores_short_spikes() -> None:
    params = ScalingParams(scale_up_window_s=60)

    def spike(until: float):
        return lambda t, n: pods(n, waiting=8.0 if 150 <= t < until else 2.0, kv=0.5)

    short, _ = run(params, 2, spike(150 + 60), steps=30)  # 60 s of spike: not sustained for the whole window
    assert set(short) == {2}
    long, decisions = run(params, 2, spike(150 + 120), steps=30)
    first_up = next(i for i, d in enumerate(decisions) if d.replicas > 2)
    assert first_up * TICK == 150 + 60
    assert max(long) == 4


def test_scale_up_is_immediate_by_default() -> None:
    replicas, _ = run(P, 1, lambda t, n: pods(n, waiting=3.0 * 2 / n), steps=3)  # 6 queued requests in total
    assert replicas == [1, 3, 3, 3]


def test_partial_metrics_never_scale_down_over_time() -> None:
    replicas, decisions = run(NO_DOWN_WINDOW, 4, lambda t, n: pods(n - 1), steps=50)
    assert set(replicas) == {4}
    assert all("not scaling down on partial metrics" in d.reason for d in decisions)


def test_history_is_pruned_to_the_longest_window() -> None:
    _, decisions = run(P, 2, lambda t, n: pods(n, waiting=2.0, kv=0.8), steps=200)
    history = decisions[-1].history
    now = 199 * TICK
    # Everything inside the window, plus the one entry that was in force when the window opened.
    assert len(history) == P.scale_down_window_s / TICK + 1
    assert [r.at for r in history] == sorted(r.at for r in history)
    assert history[0].at == now - P.scale_down_window_s and history[-1].at == now
    # With both windows at zero only the newest recommendation matters.
    _, decisions = run(ScalingParams(scale_down_window_s=0), 2, lambda t, n: pods(n), steps=5)
    assert len(decisions[-1].history) == 1


def test_entries_from_the_future_are_dropped() -> None:
    history = (Recommendation(NOW + 60, 4),)  # the clock went backwards
    d = decide(P, 2, pods(2, waiting=2.0, kv=0.8), history, NOW)
    assert d.history == (Recommendation(NOW, 2),)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_flapping_on_noise_around_target(seed: int) -> None:
    rng = random.Random(seed)

    # Closed loop: a fixed total demand with +-30% noise, shared by the current replicas.
    def load(t: float, n: int) -> list[PodMetrics]:
        queue = 3 * P.target_waiting_per_replica * rng.uniform(0.7, 1.3)
        kv = min(1.0, 3 * P.target_kv_cache_usage * rng.uniform(0.7, 1.3) / n)
        return pods(n, waiting=queue / n, kv=kv)

    replicas, _ = run(P, 3, load, steps=100)
    assert direction_changes(replicas) <= 1
    assert 3 <= replicas[-1] <= 4


@pytest.mark.parametrize("seed", [0, 1])
def test_no_flapping_on_per_pod_noise(seed: int) -> None:
    rng = random.Random(seed)

    # Open loop: each pod's load jitters around the target independently of the replica count.
    def load(t: float, n: int) -> list[PodMetrics]:
        return [PodMetrics(2.0 * rng.uniform(0.6, 1.4), 4.0, 0.8 * rng.uniform(0.8, 1.2)) for _ in range(n)]

    replicas, _ = run(WIDE, 3, load, steps=100)
    assert direction_changes(replicas) <= 1


def test_no_flapping_on_alternating_load() -> None:
    # Half the ticks far above target, half far below: one scale up, then the down window never clears.
    replicas, _ = run(P, 2, lambda t, n: pods(n, waiting=3.0 if int(t / TICK) % 2 else 1.0, kv=0.5), steps=100)
    assert direction_changes(replicas) <= 1
    assert replicas == sorted(replicas)


# ---- parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"min_replicas": -1}, "minReplicas"),
    ({"min_replicas": 1.5}, "minReplicas"),
    ({"max_replicas": 0, "min_replicas": 0}, "maxReplicas"),
    ({"min_replicas": 5, "max_replicas": 4}, "minReplicas"),
    ({"target_waiting_per_replica": 0}, "targetWaitingPerReplica"),
    ({"target_waiting_per_replica": math.nan}, "targetWaitingPerReplica"),
    ({"target_kv_cache_usage": 0}, "targetKVCacheUsage"),
    ({"target_kv_cache_usage": 1.2}, "targetKVCacheUsage"),
    ({"tolerance": -0.1}, "tolerance"),
    ({"tolerance": 1.0}, "tolerance"),
    ({"scale_up_window_s": -1}, "scaleUpWindowSeconds"),
    ({"scale_down_window_s": -5}, "scaleDownWindowSeconds"),
    ({"scale_down_window_s": math.inf}, "scaleDownWindowSeconds"),
    ({"scale_up_step": 0}, "scaleUpStep"),
    ({"scale_down_step": 0}, "scaleDownStep"),
    ({"scale_down_step": True}, "scaleDownStep"),
])
def test_invalid_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ScalingParams(**kwargs)


def test_valid_edge_params() -> None:
    ScalingParams(min_replicas=0, max_replicas=1, target_kv_cache_usage=1.0, tolerance=0.0,
                  scale_up_window_s=0, scale_down_window_s=0, scale_up_step=1, scale_down_step=1)


def test_parse_pod_metrics_reads_the_engine_exposition() -> None:
    from pagefleet.operator.autoscale import parse_pod_metrics

    text = (
        "# HELP pagefleet:num_requests_running Sequences in the running batch.\n"
        "# TYPE pagefleet:num_requests_running gauge\n"
        'pagefleet:num_requests_running{model_name="m"} 3.0\n'
        'pagefleet:num_requests_waiting{model_name="m"} 5.0\n'
        'pagefleet:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'pagefleet:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0\n'
    )
    assert parse_pod_metrics(text) == PodMetrics(waiting=5.0, running=3.0, kv_usage=0.25)
    assert parse_pod_metrics("# an engine still loading exports no gauges\n") is None
