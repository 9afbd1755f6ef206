"""Routing decisions as pure functions: scores, rankings, ejection, the prefix
index, metric parsing and pool specs. Plus the router's hash prediction checked
against the blocks a real engine caches for the same request."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.router.policy import Candidate, EjectionParams, Health, Policy, ScoringParams, load_of, rank
from pagefleet.router.pool import Pool, parse_pool_spec
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scrape import EngineSnapshot, parse_engine_metrics

P = ScoringParams()  # a full match is worth 3 + 0.5 * mean requests; cap 1.5 * mean + 2


def C(name: str, in_flight: int = 0, running: int = 0, waiting: int = 0, kv: float = 0.0,
      match: float = 0.0) -> Candidate:
    return Candidate(name, in_flight, running, waiting, kv, match)


# ---- load and ranking ----------------------------------------------------------------------------


@pytest.mark.parametrize(("cand", "expected"), [
    (C("a"), 0.0),
    (C("a", in_flight=3), 3.0),                      # the router's own count
    (C("a", running=2, waiting=3), 5.0),             # scraped queue (includes other routers' traffic)
    (C("a", in_flight=4, running=1, waiting=1), 4.0),  # the worse of the two
    (C("a", in_flight=1, kv=0.5), 1.5),              # KV usage breaks ties
])
def test_load(cand: Candidate, expected: float) -> None:
    assert load_of(cand, P) == expected


# (policy, candidates, turn, sticky) -> expected first choice
RANK_TABLE = [
    # prefix match wins at equal load
    ("prefix match wins at equal load", Policy.PREFIX,
     [C("a", 1), C("b", 1, match=1.0), C("c", 1)], 0, None, "b"),
    ("longer match wins at equal load", Policy.PREFIX,
     [C("a", 1, match=0.3), C("b", 1, match=0.9), C("c", 1, match=0.5)], 0, None, "b"),
    ("affinity outweighs a moderate load difference", Policy.PREFIX,
     [C("a", 2, match=1.0), C("b", 0), C("c", 1)], 0, None, "a"),
    ("a big load difference outweighs affinity", Policy.PREFIX,  # worth 3 + 0.5 * 3 = 4.5 < 6
     [C("a", 7, match=1.0), C("b", 1), C("c", 1)], 0, None, "b"),
    ("scraped queue counts as load", Policy.PREFIX,
     [C("a", 0, running=4, waiting=4, match=1.0), C("b", 1), C("c", 0)], 0, None, "c"),
    ("no match anywhere: least load", Policy.PREFIX, [C("a", 3), C("b", 1), C("c", 2)], 0, None, "b"),
    ("spilled prefix: the less loaded holder wins", Policy.PREFIX,
     [C("a", 5, match=1.0), C("b", 2, match=1.0), C("c", 0)], 0, None, "b"),
    ("idle pool, no match: rotation spreads sequential traffic", Policy.PREFIX,
     [C("a"), C("b"), C("c")], 1, None, "b"),
    ("least-load", Policy.LEAST_LOAD, [C("a", 2), C("b", 1, match=1.0), C("c", 0)], 0, None, "c"),
    ("least-load ties rotate", Policy.LEAST_LOAD, [C("a", 1), C("b", 1), C("c", 1)], 2, None, "c"),
    ("round-robin ignores load", Policy.ROUND_ROBIN, [C("a", 9), C("b", 0), C("c", 0)], 3, None, "a"),
    ("round-robin next turn", Policy.ROUND_ROBIN, [C("a", 9), C("b", 0), C("c", 0)], 4, None, "b"),
    ("session stickiness beats load", Policy.SESSION, [C("a", 0), C("b", 5), C("c", 1)], 0, "b", "b"),
    ("session without a pin: least load", Policy.SESSION, [C("a", 2), C("b", 5), C("c", 1)], 0, None, "c"),
    ("session pinned to a gone replica falls back", Policy.SESSION, [C("a", 2), C("c", 1)], 0, "b", "c"),
]


@pytest.mark.parametrize(("policy", "cands", "turn", "sticky", "first"),
                         [row[1:] for row in RANK_TABLE], ids=[row[0] for row in RANK_TABLE])
def test_rank_first_choice(policy: Policy, cands: list[Candidate], turn: int, sticky: str | None,
                           first: str) -> None:
    order = rank(policy, cands, P, turn=turn, sticky=sticky)
    assert order[0] == first
    assert sorted(order) == sorted(c.name for c in cands)  # every replica is a failover option, once


# With a huge prefix weight only the cap stands between a prefix holder and overload.
STICKY = ScoringParams(prefix_weight=100.0)


@pytest.mark.parametrize(("loads", "first"), [
    ((5, 2, 1), "a"),   # mean 2.67, cap 6: 5 + 1 <= 6 keeps affinity
    ((6, 2, 1), "c"),   # mean 3, cap 6.5: 6 + 1 > 6.5, no affinity, least load wins
    ((1, 0, 0), "a"),   # idle pool: mean 0.33, cap 2.5, the slack keeps affinity at low load
])
def test_load_cap_overrides_affinity(loads: tuple[int, int, int], first: str) -> None:
    cands = [C("a", loads[0], match=1.0), C("b", loads[1]), C("c", loads[2])]
    assert rank(Policy.PREFIX, cands, STICKY)[0] == first


def test_rank_failover_order_is_by_score() -> None:
    cands = [C("a", 1, match=1.0), C("b", 0), C("c", 3)]
    assert rank(Policy.PREFIX, cands, P) == ["a", "b", "c"]
    assert rank(Policy.PREFIX, [], P) == []


def test_round_robin_cycles_evenly() -> None:
    cands = [C("a"), C("b"), C("c")]
    firsts = [rank(Policy.ROUND_ROBIN, cands, P, turn=t)[0] for t in range(9)]
    assert firsts == ["a", "b", "c"] * 3


def test_hot_prefix_spills_instead_of_melting_one_replica() -> None:
    """Simulate a single hot prefix with requests that never finish: the holder takes
    requests until the cap, then the rest spread; nobody ends far above the mean."""
    in_flight = {"a": 0, "b": 0, "c": 0, "d": 0}
    holders: set[str] = set()
    for t in range(40):
        cands = [C(n, in_flight[n], match=1.0 if n in holders else 0.0) for n in in_flight]
        choice = rank(Policy.PREFIX, cands, P, turn=t)[0]
        in_flight[choice] += 1
        holders.add(choice)
    mean = sum(in_flight.values()) / len(in_flight)
    assert max(in_flight.values()) <= P.load_cap_ratio * mean + P.load_cap_slack
    assert min(in_flight.values()) > 0


def test_scoring_params_validation() -> None:
    with pytest.raises(ValueError, match="load_cap_ratio"):
        ScoringParams(load_cap_ratio=0.5)
    with pytest.raises(ValueError, match=">= 0"):
        ScoringParams(prefix_weight=-1)


# ---- ejection and recovery ----------------------------------------------------------------------


def test_ejection_after_consecutive_failures_and_recovery() -> None:
    ep = EjectionParams(failures_to_eject=3, base_seconds=2.0, max_seconds=5.0)
    h = Health()
    assert not h.record_failure(0.0, ep)
    assert not h.record_failure(0.1, ep)
    h.record_success()  # a success in between resets the count
    assert not h.record_failure(0.2, ep) and not h.record_failure(0.3, ep)
    assert h.available(0.3)
    assert h.record_failure(0.4, ep)  # third in a row: ejected for 2 s
    assert not h.available(0.5) and h.retry_after(0.5) == pytest.approx(1.9)
    assert not h.record_failure(1.0, ep)  # late failures of earlier requests do not extend it
    assert h.available(2.4)
    # probation: one failure re-ejects for twice as long, capped at max_seconds
    assert h.record_failure(2.5, ep) and h.retry_after(2.5) == pytest.approx(4.0)
    assert h.record_failure(6.5, ep) and h.retry_after(6.5) == pytest.approx(5.0)
    # recovery: a success clears the record; it takes 3 failures again
    h.record_success()
    assert not h.record_failure(20.0, ep) and not h.record_failure(20.1, ep) and h.available(20.1)


def test_ejection_params_validation() -> None:
    with pytest.raises(ValueError):
        EjectionParams(failures_to_eject=0)
    with pytest.raises(ValueError):
        EjectionParams(base_seconds=10, max_seconds=5)


# ---- prefix index -------------------------------------------------------------------------------


def test_prefix_index_matches_leading_blocks_only() -> None:
    idx = PrefixIndex(capacity=10)
    idx.add([1, 2, 3])
    assert idx.match([1, 2, 3, 4]) == 3
    assert idx.match([1, 9, 3]) == 1
    assert idx.match([]) == 0


def test_prefix_index_is_bounded_lru_evicting_tails_first() -> None:
    idx = PrefixIndex(capacity=4)
    idx.add([1, 2, 3])
    idx.add([1, 5, 6])       # shares the root block: 1 is refreshed
    assert len(idx) == 4     # 1, 5, 6 and one of the first chain's blocks
    assert idx.match([1, 5, 6]) == 3
    assert idx.match([1, 2]) == 2 and idx.match([1, 2, 3]) == 2  # the old chain lost its tail first
    idx.resize(2)
    assert len(idx) == 2 and idx.match([1]) == 1


# ---- metrics parsing ------------------------------------------------------------------------------

ENGINE_METRICS = """\
# HELP pagefleet:num_requests_running Sequences in the running batch.
# TYPE pagefleet:num_requests_running gauge
pagefleet:num_requests_running{model_name="m"} 3.0
# TYPE pagefleet:num_requests_waiting gauge
pagefleet:num_requests_waiting{model_name="m"} 2.0
# TYPE pagefleet:kv_cache_usage_perc gauge
pagefleet:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE pagefleet:prefix_cache_queries counter
pagefleet:prefix_cache_queries_total{model_name="m"} 200.0
# TYPE pagefleet:prefix_cache_hits counter
pagefleet:prefix_cache_hits_total{model_name="m"} 96.0
# TYPE pagefleet:cache_config_info gauge
pagefleet:cache_config_info{block_size="16",model_name="m",num_blocks="100"} 1.0
# TYPE pagefleet:time_to_first_token_seconds histogram
pagefleet:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
"""


def test_parse_engine_metrics() -> None:
    assert parse_engine_metrics(ENGINE_METRICS) == EngineSnapshot(
        running=3, waiting=2, kv_usage=0.25, block_size=16, num_blocks=100, prefix_cache_queries=200.0,
        prefix_cache_hits=96.0)
    # a replica still loading exports only its latency histograms: not ready
    assert parse_engine_metrics("# TYPE x gauge\nx 1\n") is None


# ---- pool specs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "expected"), [
    ("main=tiny:http://a:1,http://b:2", ("main", "tiny", ["http://a:1", "http://b:2"])),
    ("q=qwen:0.5b:https://h", ("q", "qwen:0.5b", ["https://h"])),
    ("k8s=my-model", ("k8s", "my-model", [])),
])
def test_parse_pool_spec(spec: str, expected: tuple) -> None:
    assert parse_pool_spec(spec) == expected


@pytest.mark.parametrize("spec", ["main", "=m:http://a", "main=", "main=:http://a", "m=x:http://a,ftp://b"])
def test_parse_pool_spec_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="--pool"):
        parse_pool_spec(spec)


# ---- pool decisions ---------------------------------------------------------------------------------


def _snap(**kw) -> EngineSnapshot:
    return EngineSnapshot(**{"running": 0, "waiting": 0, "kv_usage": 0.0, "block_size": 4, "num_blocks": 64, **kw})


def test_pool_membership_readiness_and_routing_memory() -> None:
    pool = Pool("main", "tiny", policy=Policy.PREFIX)
    pool.set_urls(["http://a", "http://b/"])
    assert pool.plan({"prompt": [1, 2, 3]}, False, None, 0.0).order == []  # nothing scraped yet: not ready
    pool.observe("http://a", _snap())
    pool.observe("http://b", _snap())
    assert pool.block_size == 4
    body = {"model": "tiny", "prompt": list(range(1, 18))}  # 4 full blocks
    first = pool.plan(body, False, None, 0.0)
    assert len(first.hashes) == 4 and first.match_of(first.order[0]) == 0.0
    pool.routed(first.order[0], first, None)
    again = pool.plan(body, False, None, 0.0)
    assert again.order[0] is first.order[0] and again.match_of(again.order[0]) == 1.0
    salted = pool.plan({**body, "cache_salt": "tenant-b"}, False, None, 0.0)
    assert salted.hashes != first.hashes and max(salted.matches.values()) == 0.0  # salts never share blocks
    # a replica that left keeps no state; one that stayed keeps its index
    pool.set_urls(["http://b"])
    assert list(pool.replicas) == ["http://b"]


def test_pool_session_pins_and_repins_after_failover() -> None:
    pool = Pool("main", "tiny", policy=Policy.SESSION, ejection=EjectionParams(failures_to_eject=1))
    pool.set_urls(["http://a", "http://b", "http://c"])
    for u in pool.replicas:
        pool.observe(u, _snap())
    plan = pool.plan({"prompt": "x"}, False, "s1", 0.0)
    home = plan.order[0]
    pool.routed(home, plan, "s1")
    for t in range(5):  # sticky whatever the rotation
        assert pool.plan({"prompt": "x"}, False, "s1", float(t)).order[0] is home
    home.health.record_failure(10.0, pool.ejection)  # ejected: the session falls back and re-pins
    plan = pool.plan({"prompt": "x"}, False, "s1", 10.5)
    assert plan.order[0] is not home and home not in plan.order
    pool.routed(plan.order[0], plan, "s1")
    assert pool.plan({"prompt": "x"}, False, "s1", 100.0).order[0] is plan.order[0]


def test_pool_unparseable_request_routes_without_prefix_hashes() -> None:
    pool = Pool("main", "tiny")
    pool.set_urls(["http://a"])
    pool.observe("http://a", _snap())
    for body, chat in [({"prompt": "text but no tokenizer"}, False), ({}, False), ({"messages": "nope"}, True)]:
        plan = pool.plan(body, chat, None, 0.0)
        assert [r.url for r in plan.order] == ["http://a"] and plan.hashes == []


# ---- the router predicts the engine's block hashes ------------------------------------------------------


def test_router_hashes_are_the_engines(tiny_llama: Path) -> None:
    """Completion and chat prompts: the blocks the engine caches after serving a request are
    exactly the blocks the router predicts, computed from the tokenizer and hash function alone."""
    from pagefleet.engine import SamplingParams
    from pagefleet.engine.config import EngineConfig
    from pagefleet.engine.llm_engine import LLMEngine
    from pagefleet.engine.tokenization import encode_prompt, load_tokenizer, render_chat

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB",
                                    max_model_len=512, served_model_name="tiny", block_size=8))
    pool = Pool("main", "tiny", tokenizer=load_tokenizer(tiny_llama))
    pool.set_urls(["http://a"])
    pool.observe("http://a", _snap(block_size=8))
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "You are a terse assistant. " * 6},
                {"role": "user", "content": "Name three prime numbers."}]
    chat_ids = encode_prompt(tok, render_chat(tok, messages), chat=True)
    cases = [
        ({"prompt": "The quick brown fox jumps over the lazy dog. " * 5}, False, None),
        ({"prompt": "The quick brown fox jumps over the lazy dog. " * 5, "cache_salt": "t1"}, False, "t1"),
        ({"messages": messages}, True, None),
    ]
    for i, (body, chat, salt) in enumerate(cases):
        predicted = pool.routing_hashes(body, chat)
        assert len(predicted) >= 4
        prompt = chat_ids if chat else body["prompt"]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1), cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        cached = set(engine.core.kv.pool.cached)
        assert set(predicted) <= cached, f"case {i}: the engine did not cache the predicted blocks"
    assert pool.routing_hashes(cases[0][0], False) != pool.routing_hashes(cases[1][0], False)


def test_burst_sharing_a_prefix_lands_together_until_the_cap() -> None:
    """Requests of a burst are recorded as routed when sent, not when answered: the
    second request of a burst already sees the first one's prefix (and its load)."""
    pool = Pool("main", "tiny")
    pool.set_urls(["http://a", "http://b", "http://c", "http://d"])
    for u in pool.replicas:
        pool.observe(u, _snap())
    body = {"prompt": list(range(1, 65))}  # 16 full blocks, nothing cached yet
    chosen = []
    for _ in range(5):
        plan = pool.plan(body, False, None, 0.0)
        r = plan.order[0]
        pool.routed(r, plan, None)
        r.in_flight += 1  # still running: the burst arrives before anything finishes
        chosen.append(r.url)
    # the 2nd joins the 1st (load 1 + 1 <= cap 1.5 * 0.25 + 2); the 3rd would not fit under
    # the cap (2 + 1 > 1.5 * 0.5 + 2), so it spills, and the 4th follows the prefix's new copy
    assert chosen[1] == chosen[0]
    assert chosen[2] != chosen[0]
    assert chosen[3] == chosen[2]
