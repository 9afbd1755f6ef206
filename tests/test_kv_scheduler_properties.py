"""Property tests: random add/step/abort sequences never leak or double-free a
block, never exceed the token budget or the sequence cap, and end with every
block free. The model is replaced by a fake that "samples" token 7, so
hypothesis can explore thousands of schedules quickly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.engine.kv import BlockPool, KVCacheManager, block_hashes
from pagefleet.engine.kv.manager import cdiv
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import Scheduler


def check_pool(pool: BlockPool, kv: KVCacheManager | None = None,
               content: dict[int, list[int | None]] | None = None) -> None:
    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks
    assert len({b.block_id for b in free}) == len(free), "a block is in the free queue twice"
    assert all(b.ref_cnt == 0 for b in free), "a referenced block is in the free queue"
    held = [b for b in pool.blocks if b.ref_cnt > 0]
    assert len(held) + len(free) == pool.num_blocks, "a block is neither free nor referenced"
    for h, block in pool.cached.items():
        assert block.block_hash == h, "hash map entry points at a block with another hash"
        if content is not None:
            assert tuple(content[block.block_id]) == block.token_ids, "cached block holds other tokens"
    if kv is not None:
        table_refs: dict[int, int] = {}
        for blocks in kv.req_blocks.values():
            for b in blocks:
                table_refs[b.block_id] = table_refs.get(b.block_id, 0) + 1
        assert table_refs == {b.block_id: b.ref_cnt for b in held}, "ref counts != block-table references"


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=60))
def test_block_pool_alloc_free(ops):
    pool = BlockPool(16)
    owned: list[list] = []
    for alloc, n in ops:
        if alloc and n <= pool.num_free_blocks:
            owned.append(pool.allocate(n))
        elif owned:
            pool.free(owned.pop(n % len(owned)))
        check_pool(pool)
    for blocks in owned:
        pool.free(blocks)
    check_pool(pool)
    assert pool.num_free_blocks == pool.num_blocks


def test_double_free_is_caught():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    try:
        pool.free(blocks)
    except AssertionError:
        return
    raise AssertionError("double free was not detected")


# (kind, a, b, c): add = (prompt length, max_tokens, shared-prefix id), step, abort = (which)
op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 90), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 1000), st.just(0), st.just(0)),
    st.tuples(st.just("evict"), st.just(0), st.just(0), st.just(0)),
)
# A few fixed "system prompts": requests built from them share leading blocks.
PREFIXES = [[(7 * k + i) % 50 + 1 for i in range(64)] for k in range(4)]


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=80), num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 4, 16]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 6), caching=st.booleans())
def test_scheduler_invariants(ops, num_blocks, block_size, budget, max_seqs, caching):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    max_model_len = num_blocks * block_size
    sched = Scheduler(kv, max_seqs, budget, max_model_len)
    live: list[Request] = []
    counter = 0
    # What each block's KV would hold: written by the (fake) forward pass at the
    # slots the scheduled tokens map to. Cached blocks must hold their tokens.
    content: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}

    def step() -> None:
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_seqs
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        sampled = [c.request for c in out.chunks if c.samples]
        for c in out.chunks:
            req = c.request
            assert req.status == RequestStatus.RUNNING
            blocks = kv.req_blocks[req.request_id]
            assert len(blocks) * block_size >= req.num_computed_tokens + c.num_new_tokens
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + c.num_new_tokens):
                content[blocks[pos // block_size].block_id][pos % block_size] = req.all_token_ids[pos]
            # Blocks reused from the cache hold exactly this request's tokens.
            for i in range(req.num_computed_tokens // block_size):
                want = req.all_token_ids[i * block_size:(i + 1) * block_size]
                assert content[blocks[i].block_id] == want, "reused block holds other tokens"
        sched.update_after_step(out)
        for req in sampled:
            req.append_output_token(7)
            if req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= max_model_len:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
                live.remove(req)
        for req in sched.running:  # running requests hold blocks for what they computed
            assert len(kv.req_blocks[req.request_id]) >= cdiv(req.num_computed_tokens, block_size)
        for req in sched.waiting:
            assert req.request_id not in kv.req_blocks or not kv.req_blocks[req.request_id]
        check_pool(kv.pool, kv, content)

    for kind, a, b, c in ops:
        if kind == "add":
            prompt_len = min(a, max_model_len - 1)
            prompt = (PREFIXES[c] + [counter % 50 + 100] * prompt_len)[:prompt_len]
            req = Request(str(counter), prompt, SamplingParams(max_tokens=b))
            counter += 1
            sched.add_request(req)
            live.append(req)
        elif kind == "step":
            step()
        elif kind == "evict":
            kv.reset_prefix_cache()
            check_pool(kv.pool, kv, content)
        elif live:
            victim = live.pop(a % len(live))
            sched.abort(victim.request_id)
            assert victim.status == RequestStatus.FINISHED_ABORTED
            check_pool(kv.pool, kv, content)

    # Drain: everything must finish (progress guaranteed) and give every block back.
    for _ in range(10_000):
        if not sched.num_unfinished:
            break
        step()
    assert not sched.num_unfinished, "scheduler stopped making progress"
    assert kv.num_free_blocks == num_blocks
    assert not any(kv.req_blocks.values())
    assert kv.prefix_stats.hits <= kv.prefix_stats.queries
    if not caching:
        assert not kv.pool.cached


def test_block_hashes_contract():
    """Pure, chained, deterministic (pinned values: the router relies on them), and
    namespaced by extra keys."""
    tokens = list(range(40))
    h = block_hashes(tokens, 16, ("m", None, None))
    assert len(h) == 2  # the trailing 8 tokens form no full block
    assert h == block_hashes(tokens[:32], 16, ("m", None, None))
    assert block_hashes(tokens, 16, ("m", None, "salt"))[0] != h[0]
    assert block_hashes(tokens, 16, ("other-model", None, None))[0] != h[0]
    changed = list(tokens)
    changed[3] = 99
    h2 = block_hashes(changed, 16, ("m", None, None))
    assert h2[0] != h[0] and h2[1] != h[1], "a change in block 0 must change every later hash"
    assert h == [69682499472193535168250524725859122831, 137064979171085598291739673333037234026]


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300), st.integers(1, 6))
def test_decode_buckets_partition_sorted_lengths(lengths, max_groups):
    from pagefleet.engine.attention import bucket_by_length

    lengths.sort()
    groups = bucket_by_length(lengths, max_groups=max_groups)
    assert 1 <= len(groups) <= max_groups
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(groups, groups[1:], strict=False))
    for start, end in groups[1:]:  # every group but the catch-all first one keeps padding below 30%
        assert lengths[start] >= 0.7 * lengths[end - 1]
