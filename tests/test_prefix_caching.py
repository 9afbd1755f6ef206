"""Prefix caching: same outputs as without it, exact hit accounting, tenant salts,
eviction order, and reuse after preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.kv import KVCacheManager
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.request import Request

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _llm(model_dir, caching: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "32MiB")
    return LLM(model=str(model_dir), dtype="float32", enable_prefix_caching=caching, **kw)


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def _shared_prefix_batch(vocab: int, n: int = 12, prefix_len: int = 100, seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("regime", [
    dict(),
    dict(max_num_batched_tokens=24),  # chunked prefill
    dict(kv_tokens=260, max_num_batched_tokens=256),  # preemption-heavy
    dict(block_size=1),
])
def test_caching_does_not_change_greedy_output(tiny_llama, regime):
    regime = dict(regime)
    cfg = ModelConfig.from_dir(tiny_llama)
    if "kv_tokens" in regime:
        regime["kv_cache_memory"] = regime.pop("kv_tokens") * cfg.kv_bytes_per_token(torch.float32)
    prompts = _shared_prefix_batch(cfg.vocab_size)
    off = _llm(tiny_llama, False, **regime)
    on = _llm(tiny_llama, True, **regime)
    # Twice through the same engine: the second round reuses blocks from the first.
    expected = _tokens(off.generate(prompts, GREEDY))
    assert _tokens(on.generate(prompts, GREEDY)) == expected
    assert _tokens(on.generate(prompts, GREEDY)) == expected
    stats = on.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks
    assert off.stats().prefix_cache_hits == 0
    if "kv_cache_memory" in regime and regime["kv_cache_memory"] != "32MiB":
        assert stats.num_preemptions > 0


def test_multi_turn_conversation_reuses_previous_turns(tiny_qwen2):
    """Turn N's prompt = turn N-1's prompt + answer + new message, so each turn
    hits the blocks of everything before it, generated tokens included."""
    cfg = ModelConfig.from_dir(tiny_qwen2)
    rng = random.Random(3)
    on, off = _llm(tiny_qwen2, True), _llm(tiny_qwen2, False)
    history = [rng.randrange(cfg.vocab_size) for _ in range(40)]
    for _turn in range(4):
        out_on = on.generate([history], GREEDY)[0]
        out_off = off.generate([history], GREEDY)[0]
        assert out_on.outputs[0].token_ids == out_off.outputs[0].token_ids
        if _turn:
            # Everything but the last (partial) block of the previous prompt+answer is reused.
            assert out_on.num_cached_tokens >= (len(history) - 12 - 8) // 16 * 16 - 16
        history = history + out_on.outputs[0].token_ids + [rng.randrange(cfg.vocab_size) for _ in range(9)]


def test_n_greater_than_one_with_seed(tiny_llama):
    """n sequences of one request share the prompt's blocks; seeded sampling is unchanged."""
    cfg = ModelConfig.from_dir(tiny_llama)
    prompt = _shared_prefix_batch(cfg.vocab_size, n=1, prefix_len=70)[0]
    params = SamplingParams(n=3, max_tokens=10, temperature=0.8, seed=11)
    on, off = _llm(tiny_llama, True), _llm(tiny_llama, False)
    assert _tokens(on.generate([prompt], params)) == _tokens(off.generate([prompt], params))
    assert on.stats().prefix_cache_hits > 0  # sequences 2 and 3 reused sequence 1's prompt blocks


def test_hit_accounting_is_exact(tiny_llama):
    llm = _llm(tiny_llama, True, block_size=16)
    shared = list(range(10, 58))  # exactly 3 full blocks
    llm.generate([shared + [1, 2, 3, 4, 5]], GREEDY)
    before = llm.stats()
    out = llm.generate([shared + [7, 8]], GREEDY)[0]
    after = llm.stats()
    assert out.num_cached_tokens == 48
    assert after.prefix_cache_hits - before.prefix_cache_hits == 48
    assert after.prefix_cache_queries - before.prefix_cache_queries == 50
    # The whole prompt cached: the last token is still recomputed, so its block is not a hit.
    out = llm.generate([shared], GREEDY)[0]
    assert out.num_cached_tokens == 32


def test_cache_salt_isolates_tenants(tiny_llama):
    llm = _llm(tiny_llama, True)
    prompt = list(range(20, 84))
    a = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY)[0]
    b = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], GREEDY)[0]
    unsalted = llm.generate([prompt], GREEDY)[0]
    a2 = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY)[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == 48
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == a2.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], GREEDY)


def test_eviction_takes_lru_and_tail_blocks_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    old = Request("old", [1, 2, 3, 4, 5, 6], SamplingParams())
    new = Request("new", [9, 8, 7, 6], SamplingParams())
    for req in (old, new):
        assert kv.allocate_slots(req, req.num_tokens)
    kv.free("old")  # freed first: least recently used
    kv.free("new")
    assert len(kv.pool.cached) == 5
    filler = Request("filler", [0] * 4, SamplingParams())
    assert kv.allocate_slots(filler, 2)  # the one never-cached block goes first (nothing evicted)
    assert len(kv.pool.cached) == 6  # the five freed ones + filler's own full block
    assert kv.allocate_slots(filler, 4)  # evicts one block: old's tail
    remaining = {b.token_ids for b in kv.pool.cached.values()}
    assert (5, 6) not in remaining and {(1, 2), (3, 4), (9, 8), (7, 6)} <= remaining
    # A hit re-references a free cached block and takes it out of the free queue.
    again = Request("again", [1, 2, 3, 4, 5], SamplingParams())
    hits = kv.find_cached_prefix(again)
    assert [b.token_ids for b in hits] == [(1, 2), (3, 4)]
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(again, again.num_tokens, hits)
    assert kv.num_free_blocks == free_before - 3  # 2 revived hits + 1 new block
    assert all(b.ref_cnt == 1 for b in hits)


def test_hash_collision_is_a_miss():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = Request("a", [1, 2, 3], SamplingParams())
    assert kv.allocate_slots(a, 3)
    kv.free("a")
    b = Request("b", [5, 6, 7], SamplingParams())
    b.update_block_hashes(2)
    b.block_hashes[0] = a.block_hashes[0]  # forge a collision: same hash, other tokens
    assert kv.find_cached_prefix(b) == []


def test_preempted_request_resumes_through_cache(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    rng = random.Random(5)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(120)] for _ in range(6)]
    budget = 300 * cfg.kv_bytes_per_token(torch.float32)
    on = _llm(tiny_llama, True, kv_cache_memory=budget)
    off = _llm(tiny_llama, False, kv_cache_memory=budget)
    params = SamplingParams(max_tokens=40, temperature=0)
    assert _tokens(on.generate(prompts, params)) == _tokens(off.generate(prompts, params))
    s = on.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
    assert s.num_computed_tokens < off.stats().num_computed_tokens  # recompute was (partly) skipped
