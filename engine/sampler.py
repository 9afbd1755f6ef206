"""Token sampling: turns one step's logits into one token per sequence.

Order of operations follows vLLM v1:

1. logprobs are taken from the raw logits (the model's own distribution),
2. min_tokens blocking, 3. repetition / presence / frequency penalties,
4. greedy rows: argmax of the penalized logits,
5. random rows: temperature, top-k, top-p, min-p, softmax, exponential-race sample.

Everything is batched over rows; per-row settings become small tensors built
once per call, and a stage is skipped only when no row in the batch needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagefleet.engine.sampling_params import SamplingParams

__all__ = ["Logprobs", "Sampler", "SamplerOutput", "SamplingRow"]

_NEG_INF = float("-inf")

# Columns of the packed per-row parameter tensor. Packing them into one tensor
# means one host-to-device copy per step instead of one per setting.
_TEMP, _TOP_P, _TOP_K, _MIN_P, _REP, _PRES, _FREQ = range(7)


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Set iff params.seed is not None; owned by the request so that its draws do
    # not depend on whatever else shares the batch.
    generator: torch.Generator | None
    # While len(output_token_ids) < params.min_tokens these and
    # params.stop_token_ids are blocked.
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class Logprobs:
    token_logprob: float
    top: list[tuple[int, float]]  # descending; [] when params.logprobs == 0


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and not p.has_penalties
        and p.logprobs is None
        and len(row.output_token_ids) >= p.min_tokens
    )


def _blocked_ids(row: SamplingRow, vocab_size: int) -> list[int]:
    """Token ids min_tokens blocks for this row right now ([] once the row is long enough)."""
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return []
    # User-supplied stop ids may lie outside the model's vocabulary; such ids can
    # never be sampled, so there is nothing to block.
    return [t for t in {*row.eos_token_ids, *p.stop_token_ids} if 0 <= t < vocab_size]


def _pack_params(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, 7] float32 per-row settings, with "off" encoded as a value that makes the stage a no-op."""
    packed = []
    for r in rows:
        p = r.params
        top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
        # top_p == 1 maps to 2: the exclusive cumulative sum can creep past 1.0
        # in float32 and would otherwise drop tail tokens of an unfiltered row.
        top_p = p.top_p if p.top_p < 1.0 else 2.0
        packed.append(
            (
                p.temperature if not p.greedy else 1.0,
                top_p,
                float(top_k),
                p.min_p,
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
            )
        )
    return torch.tensor(packed, dtype=torch.float32, device=device)


def _apply_min_tokens(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab_size = x.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        ids = _blocked_ids(r, vocab_size)
        row_idx.extend([i] * len(ids))
        tok_idx.extend(ids)
    if tok_idx:
        dev = x.device
        x[torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev)] = _NEG_INF


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow], params: torch.Tensor) -> None:
    """Penalize x in place.

    Works on the (row, token) pairs that occurred rather than on dense [B, V]
    masks: histories are far shorter than the vocabulary, so this stays cheap
    for 150k-token vocabularies.
    """
    vocab_size = x.shape[1]
    dev = x.device
    flat = x.view(-1)

    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        toks: list[int] = []
        lens: list[int] = []
        for i in rep_rows:
            r = rows[i]
            toks.extend(r.prompt_token_ids)
            toks.extend(r.output_token_ids)
            lens.append(len(r.prompt_token_ids) + len(r.output_token_ids))
        if toks:
            row_t = torch.repeat_interleave(
                torch.tensor(rep_rows, device=dev), torch.tensor(lens, device=dev)
            )
            # Deduplicated so each token is penalized once however often it
            # occurred, as in HF's RepetitionPenaltyLogitsProcessor.
            keys = torch.unique(row_t * vocab_size + torch.tensor(toks, dtype=torch.long, device=dev))
            vals = flat[keys]
            penalty = params[keys // vocab_size, _REP]
            flat[keys] = torch.where(vals > 0, vals / penalty, vals * penalty)

    pf_rows = [
        i
        for i, r in enumerate(rows)
        if (r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0) and r.output_token_ids
    ]
    if pf_rows:
        toks = []
        lens = []
        for i in pf_rows:
            out = rows[i].output_token_ids
            toks.extend(out)
            lens.append(len(out))
        row_t = torch.repeat_interleave(torch.tensor(pf_rows, device=dev), torch.tensor(lens, device=dev))
        keys, counts = torch.unique(
            row_t * vocab_size + torch.tensor(toks, dtype=torch.long, device=dev), return_counts=True
        )
        owner = keys // vocab_size
        # keys are unique, so a plain indexed subtract is deterministic (no atomics).
        flat[keys] -= params[owner, _PRES] + params[owner, _FREQ] * counts.to(torch.float32)


def _apply_top_k_top_p(x: torch.Tensor, rows: Sequence[SamplingRow], params: torch.Tensor) -> None:
    vocab_size = x.shape[1]
    use_top_k = any(0 < r.params.top_k < vocab_size for r in rows)
    use_top_p = any(r.params.top_p < 1.0 for r in rows)
    if not (use_top_k or use_top_p):
        return
    k = params[:, _TOP_K].to(torch.long).unsqueeze(1)
    if not use_top_p:
        # topk over the largest k is much cheaper than a full-vocabulary sort.
        max_k = max(r.params.top_k for r in rows if 0 < r.params.top_k < vocab_size)
        kth = x.topk(max_k, dim=-1).values.gather(1, (k.clamp(max=max_k) - 1))
        # Rows without top-k (k == V) must not be cut at some other row's max_k.
        kth.masked_fill_(k >= vocab_size, _NEG_INF)
        # Comparing against the k-th value (not keeping exactly k positions)
        # keeps ties, so the result does not depend on sort stability.
        x.masked_fill_(x < kth, _NEG_INF)
        return
    x_sorted, order = x.sort(dim=-1, descending=True)
    if use_top_k:
        kth = x_sorted.gather(1, k - 1)
        x_sorted.masked_fill_(x_sorted < kth, _NEG_INF)
    probs = x_sorted.softmax(dim=-1)
    # Mass strictly before each position: a token is kept iff the tokens above
    # it have not yet reached top_p, which yields the smallest prefix whose
    # cumulative probability is >= top_p and always keeps the top token.
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    x_sorted.masked_fill_(mass_before >= params[:, _TOP_P].unsqueeze(1), _NEG_INF)
    x.scatter_(1, order, x_sorted)


def _apply_min_p(x: torch.Tensor, rows: Sequence[SamplingRow], params: torch.Tensor) -> None:
    if not any(r.params.min_p > 0.0 for r in rows):
        return
    # prob_i < min_p * prob_max  <=>  logit_i < logit_max + log(min_p): no
    # softmax needed, and min_p == 0 gives log 0 = -inf, which keeps everything.
    threshold = x.amax(dim=-1, keepdim=True) + params[:, _MIN_P].log().unsqueeze(1)
    x.masked_fill_(x < threshold, _NEG_INF)


def _sample_random(x: torch.Tensor, rows: Sequence[SamplingRow], params: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of x (modified in place); params holds these rows only."""
    if any(r.params.temperature != 1.0 for r in rows):
        x.div_(params[:, _TEMP].unsqueeze(1))
    _apply_top_k_top_p(x, rows, params)
    _apply_min_p(x, rows, params)
    probs = x.softmax(dim=-1)
    # Exponential race: argmax_i p_i / q_i with q_i ~ Exp(1) picks i with
    # probability p_i. Unlike torch.multinomial it needs no cumulative sum or
    # host sync, and each row's randomness is just its own q row.
    q = torch.empty_like(probs)
    seeded = [j for j, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        q.exponential_()
    for j in seeded:
        # Exactly torch.empty(V).exponential_(generator=g): a seeded request's
        # stream depends only on its own generator, not on batch position.
        q[j].exponential_(generator=rows[j].generator)
    return probs.div_(q).argmax(dim=-1)


def _logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
) -> list[Logprobs | None]:
    out: list[Logprobs | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return out
    if len(want) == len(rows):
        raw, sampled = logits, tokens
    else:
        idx = torch.tensor(want, device=logits.device)
        raw, sampled = logits[idx], tokens[idx]
    lp = torch.log_softmax(raw.to(torch.float32), dim=-1)
    token_lp = lp.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    max_n = min(max(rows[i].params.logprobs or 0 for i in want), lp.shape[1])
    top_ids: list[list[int]] = [[] for _ in want]
    top_lps: list[list[float]] = [[] for _ in want]
    if max_n > 0:
        vals, ids = lp.topk(max_n, dim=-1)
        top_ids, top_lps = ids.tolist(), vals.tolist()
    for j, i in enumerate(want):
        n = rows[i].params.logprobs or 0
        top = list(zip(top_ids[j][:n], top_lps[j][:n], strict=True))
        out[i] = Logprobs(token_logprob=token_lp[j], top=top)
    return out


class Sampler:
    """Stateless; per-request state (history, generator) arrives in each SamplingRow."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        if all(_is_plain_greedy(r) for r in rows):
            # Casting bf16 -> float32 is exact, so argmax on the raw dtype is the
            # same answer without the copy.
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * len(rows))
        return self._sample(logits, rows)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        batch, vocab_size = logits.shape
        dev = logits.device
        # Private float32 copy: every stage below works in place, and the caller's
        # raw logits must survive for logprobs.
        x = logits.to(torch.float32, copy=True)
        params = _pack_params(rows, vocab_size, dev)

        _apply_min_tokens(x, rows)
        if any(r.params.has_penalties for r in rows):
            _apply_penalties(x, rows, params)

        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_idx:
            tokens = x.argmax(dim=-1)
        elif len(random_idx) == batch:
            tokens = _sample_random(x, rows, params)
        else:
            tokens = x.argmax(dim=-1)
            idx = torch.tensor(random_idx, device=dev)
            tokens[idx] = _sample_random(x[idx], [rows[i] for i in random_idx], params[idx])

        return SamplerOutput(token_ids=tokens.tolist(), logprobs=_logprobs(logits, rows, tokens))

