"""Phase-less continuous-batching scheduler (vLLM v1 style).

Every request has `num_computed_tokens` catching up to `num_tokens` (prompt +
output). Each step fills one token budget: running requests first (a decode
costs one token, an unfinished prefill continues its chunk), then waiting
requests in FCFS order, each cut to what is left of the budget (chunked
prefill). When the KV pool runs dry, the newest running request is preempted:
its blocks are freed and it goes back to the front of the queue to be
recomputed later, which gives identical output because its tokens are kept.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagefleet.engine.kv import KVCacheManager
from pagefleet.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's tokens, so its last position's
        logits produce the next token. Earlier prefill chunks sample nothing."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    peak_num_running: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # ---- admission / removal -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        assert request.num_tokens <= self.max_model_len
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks at once."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, f"running request {req.request_id} has nothing to compute"
            while not self.kv.allocate_slots(req, req.num_computed_tokens + num_new):
                victim = self.running.pop()  # newest request loses its blocks
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, num_new))
                budget -= num_new
                i += 1

        # New work only when nothing had to be preempted: a preemption means
        # memory is already too tight for the running set.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            assert req.num_computed_tokens == 0
            hits = self.kv.find_cached_prefix(req)
            num_cached = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, num_cached + num_new, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            self.kv.record_admission(req.num_tokens, num_cached)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, num_new))
            budget -= num_new

        assert out.num_batched_tokens <= self.max_num_batched_tokens
        self.stats.num_steps += 1
        self.stats.peak_num_running = max(self.stats.peak_num_running, len(self.running))
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts once the model ran the step. Called before
        sampled tokens are appended, so `ScheduledChunk.samples` is still valid."""
        for chunk in out.chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
