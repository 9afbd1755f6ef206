"""Property tests: random add/step/abort sequences never leak or double-free a
block, never exceed the token budget or the sequence cap, and end with every
block free. The model is replaced by a fake that "samples" token 7, so
hypothesis can explore thousands of schedules quickly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.engine.kv import BlockPool, KVCacheManager
from pagefleet.engine.kv.manager import cdiv
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import Scheduler


def check_pool(pool: BlockPool, kv: KVCacheManager | None = None) -> None:
    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks
    assert len({b.block_id for b in free}) == len(free), "a block is in the free queue twice"
    assert all(b.ref_cnt == 0 for b in free), "a referenced block is in the free queue"
    held = [b for b in pool.blocks if b.ref_cnt > 0]
    assert len(held) + len(free) == pool.num_blocks, "a block is neither free nor referenced"
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


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 90), st.integers(1, 12)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 1000), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=80), num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 4, 16]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 6))
def test_scheduler_invariants(ops, num_blocks, block_size, budget, max_seqs):
    kv = KVCacheManager(num_blocks, block_size)
    max_model_len = num_blocks * block_size
    sched = Scheduler(kv, max_seqs, budget, max_model_len)
    live: list[Request] = []
    counter = 0

    def step() -> None:
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_seqs
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        sampled = [c.request for c in out.chunks if c.samples]
        for c in out.chunks:
            assert c.request.status == RequestStatus.RUNNING
            assert len(kv.req_blocks[c.request.request_id]) * block_size >= (
                c.request.num_computed_tokens + c.num_new_tokens)
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
        check_pool(kv.pool, kv)

    for kind, a, b in ops:
        if kind == "add":
            prompt_len = min(a, max_model_len - 1)
            req = Request(str(counter), [1] * prompt_len, SamplingParams(max_tokens=b))
            counter += 1
            sched.add_request(req)
            live.append(req)
        elif kind == "step":
            step()
        elif live:
            victim = live.pop(a % len(live))
            sched.abort(victim.request_id)
            assert victim.status == RequestStatus.FINISHED_ABORTED
            check_pool(kv.pool, kv)

    # Drain: everything must finish (progress guaranteed) and give every block back.
    for _ in range(10_000):
        if not sched.num_unfinished:
            break
        step()
    assert not sched.num_unfinished, "scheduler stopped making progress"
    assert kv.num_free_blocks == num_blocks
    assert not any(kv.req_blocks.values())
