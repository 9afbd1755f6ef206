"""Sampler: greedy, seeded reproducibility, filters, distribution, penalties, min_tokens, logprobs.

Expected values are computed independently here (float64, plain Python) rather
than by re-running the sampler's own code.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagefleet.engine.sampler import Logprobs, Sampler, SamplerOutput, SamplingRow
from pagefleet.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0)


def make_row(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    **params: object,
) -> SamplingRow:
    p = SamplingParams(**params)
    if generator is None and p.seed is not None:
        generator = torch.Generator().manual_seed(p.seed)
    return SamplingRow(
        params=p,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=generator,
        eos_token_ids=eos,
    )


def softmax64(logits: Sequence[float], temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def draw_many(logits: torch.Tensor, n: int, seed: int = 0, **params: object) -> list[int]:
    """n independent samples from one logit vector, in a single batched call."""
    torch.manual_seed(seed)
    # One shared row object: the sampler must treat rows as read-only anyway.
    rows = [make_row(**params)] * n
    return Sampler()(logits.unsqueeze(0).expand(n, -1).contiguous(), rows).token_ids


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_is_argmax_and_skips_slow_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 300, generator=g).to(dtype)
    rows = [make_row(**GREEDY) for _ in range(16)]

    def slow(*_: object) -> SamplerOutput:
        raise AssertionError("all-greedy batch without extras must take the fast path")

    monkeypatch.setattr(Sampler, "_sample", slow)
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_slow_path_agrees_with_fast_path(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 300, generator=g).to(dtype)
    before = logits.clone()
    fast = Sampler()(logits, [make_row(**GREEDY) for _ in range(12)])
    # One row asking for logprobs pushes the whole batch onto the general path;
    # a random row in the batch exercises the mixed greedy/random split.
    slow_rows = [make_row(**GREEDY) for _ in range(12)]
    slow_rows[3] = make_row(temperature=0.0, logprobs=2)
    slow_rows[7] = make_row(temperature=1.0, seed=5)
    slow = Sampler()(logits, slow_rows)
    expected = logits.float().argmax(dim=-1).tolist()
    assert fast.token_ids == expected
    assert [t for i, t in enumerate(slow.token_ids) if i != 7] == [
        t for i, t in enumerate(expected) if i != 7
    ]
    assert torch.equal(logits, before), "the caller's logits must not be modified"


def test_empty_batch_and_shape_mismatch() -> None:
    assert Sampler()(torch.zeros(0, 10), []) == SamplerOutput(token_ids=[], logprobs=[])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [make_row()])


# ---------------------------------------------------------------- seeding


def _run_steps(batch_builder, steps: int, position: int, logits_seq: list[torch.Tensor]) -> list[int]:
    rows = batch_builder()
    sampler = Sampler()
    tokens = []
    for logits in logits_seq:
        batch = logits.unsqueeze(0).expand(len(rows), -1).contiguous()
        tokens.append(sampler(batch, rows).token_ids[position])
    return tokens


def test_seeded_rows_reproduce_across_calls_batches_and_positions() -> None:
    vocab = 1000
    g = torch.Generator().manual_seed(3)
    logits_seq = [torch.randn(vocab, generator=g) * 0.5 for _ in range(12)]

    def alone() -> list[SamplingRow]:
        return [make_row(seed=7)]

    def crowded() -> list[SamplingRow]:
        # Neighbours switch on batch-wide stages (temperature, top-k, top-p,
        # min-p, penalties, logprobs) that must leave the seeded row untouched.
        return [
            make_row(temperature=0.7, top_k=5),
            make_row(seed=8, top_p=0.5),
            make_row(**GREEDY),
            make_row(min_p=0.2, repetition_penalty=1.3, prompt=[1, 2, 3], logprobs=3),
            make_row(seed=7),
            make_row(temperature=1.3, presence_penalty=0.5, output=[4, 4]),
        ]

    torch.manual_seed(100)
    a = _run_steps(alone, 12, 0, logits_seq)
    torch.manual_seed(200)  # the global RNG must not matter to a seeded row
    b = _run_steps(crowded, 12, 4, logits_seq)
    c = _run_steps(alone, 12, 0, logits_seq)
    assert a == b == c
    other_seed = _run_steps(lambda: [make_row(seed=8)], 12, 0, logits_seq)
    assert other_seed != a
    assert len(set(a)) > 1, "a seeded row must still advance its generator between steps"


def test_seeded_row_uses_its_own_exponential_draw() -> None:
    """The documented contract: q = torch.empty(V).exponential_(generator=g)."""
    vocab = 500
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4))
    row = make_row(seed=11, temperature=0.8)
    out = Sampler()(torch.stack([torch.randn(vocab), logits, torch.randn(vocab)]),
                    [make_row(), row, make_row(seed=3)])
    q = torch.empty(vocab).exponential_(generator=torch.Generator().manual_seed(11))
    expected = int(((logits / 0.8).softmax(-1) / q).argmax())
    assert out.token_ids[1] == expected


# ---------------------------------------------------------------- filters

# Spread out enough that every token has > 1% probability at T=1, and distinct
# so the allowed sets have no ties at their boundaries.
FILTER_LOGITS = [0.13 * i for i in range(20)]
random.Random(5).shuffle(FILTER_LOGITS)


def allowed_top_k(logits: Sequence[float], k: int) -> set[int]:
    return set(sorted(range(len(logits)), key=lambda i: -logits[i])[:k])


def allowed_top_p(logits: Sequence[float], p: float, keep: set[int] | None = None) -> set[int]:
    keep = set(range(len(logits))) if keep is None else keep
    idx = sorted(keep, key=lambda i: -logits[i])
    probs = softmax64([logits[i] for i in idx])
    out, cum = set(), 0.0
    for i, pr in zip(idx, probs, strict=True):
        out.add(i)
        cum += pr
        if cum >= p:
            break
    return out


def allowed_min_p(logits: Sequence[float], min_p: float, keep: set[int] | None = None) -> set[int]:
    keep = set(range(len(logits))) if keep is None else keep
    top = max(logits[i] for i in keep)
    return {i for i in keep if math.exp(logits[i] - top) >= min_p}


def _mid_cum(logits: Sequence[float], n: int) -> float:
    """A top_p strictly between the mass of the top n-1 and top n tokens (far from any boundary)."""
    probs = np.sort(softmax64(logits))[::-1]
    cum = np.cumsum(probs)
    return float((cum[n - 2] + cum[n - 1]) / 2)


def _mid_ratio(logits: Sequence[float], n: int) -> float:
    """A min_p that keeps exactly the n most likely tokens."""
    ratios = sorted((math.exp(v - max(logits)) for v in logits), reverse=True)
    return (ratios[n - 1] + ratios[n]) / 2


def _filter_cases() -> list[tuple[dict, set[int]]]:
    lg = FILTER_LOGITS
    t = 1.5
    scaled = [v / t for v in lg]
    return [
        ({"top_k": 5}, allowed_top_k(lg, 5)),
        ({"top_p": _mid_cum(lg, 6)}, allowed_top_p(lg, _mid_cum(lg, 6))),
        ({"min_p": _mid_ratio(lg, 7)}, allowed_min_p(lg, _mid_ratio(lg, 7))),
        (
            {"temperature": t, "top_k": 9, "top_p": 0.7},
            allowed_top_p(scaled, 0.7, allowed_top_k(scaled, 9)),
        ),
        (
            {"top_k": 12, "top_p": 0.9, "min_p": 0.4},
            allowed_min_p(lg, 0.4, allowed_top_p(lg, 0.9, allowed_top_k(lg, 12))),
        ),
    ]


@pytest.mark.parametrize(("params", "allowed"), _filter_cases())
def test_filters_emit_exactly_the_allowed_set(params: dict, allowed: set[int]) -> None:
    assert 1 < len(allowed) < len(FILTER_LOGITS), "fixture should make the filter bite"
    tokens = draw_many(torch.tensor(FILTER_LOGITS), 3000, **params)
    assert set(tokens) <= allowed, f"emitted filtered-out tokens {set(tokens) - allowed}"
    assert set(tokens) == allowed, f"never emitted allowed tokens {allowed - set(tokens)}"


def test_filters_are_per_row_within_one_batch() -> None:
    """top-k only path: a row without top-k must not be cut at its neighbours' k."""
    logits = torch.tensor(FILTER_LOGITS)
    n = 1500
    settings = [{"top_k": 3}, {}, {"top_k": 7}, {"min_p": _mid_ratio(FILTER_LOGITS, 4)}]
    rows = [make_row(**s) for s in settings for _ in range(n)]
    torch.manual_seed(6)
    tokens = Sampler()(logits.expand(len(rows), -1).contiguous(), rows).token_ids
    groups = [set(tokens[i * n : (i + 1) * n]) for i in range(len(settings))]
    assert groups[0] == allowed_top_k(FILTER_LOGITS, 3)
    assert groups[1] == set(range(20))
    assert groups[2] == allowed_top_k(FILTER_LOGITS, 7)
    assert groups[3] == allowed_top_k(FILTER_LOGITS, 4)


# ---------------------------------------------------------------- distribution

CHI_LOGITS = [1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5]
N_CHI = 20000


def _counts(tokens: list[int], vocab: int) -> np.ndarray:
    return np.bincount(np.asarray(tokens), minlength=vocab)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(temperature: float, seeded: bool) -> None:
    logits = torch.tensor(CHI_LOGITS)
    if seeded:
        # One generator shared by every row drives the per-row seeded draw path.
        gen = torch.Generator().manual_seed(9)
        rows = [make_row(temperature=temperature, generator=gen)] * N_CHI
        tokens = Sampler()(logits.expand(N_CHI, -1).contiguous(), rows).token_ids
    else:
        tokens = draw_many(logits, N_CHI, seed=9, temperature=temperature)
    expected = softmax64(CHI_LOGITS, temperature) * N_CHI
    assert expected.min() >= 5
    assert chisquare(_counts(tokens, 8), expected).pvalue > 1e-3


def test_chi_square_rejects_wrong_temperature() -> None:
    tokens = draw_many(torch.tensor(CHI_LOGITS), N_CHI, seed=9, temperature=1.0)
    wrong = softmax64(CHI_LOGITS, 2.0) * N_CHI
    assert chisquare(_counts(tokens, 8), wrong).pvalue < 1e-10


def test_bf16_logits_sample_from_the_same_distribution() -> None:
    logits = torch.tensor(CHI_LOGITS).to(torch.bfloat16)
    tokens = draw_many(logits, N_CHI, seed=10)
    expected = softmax64(logits.float().tolist()) * N_CHI
    assert chisquare(_counts(tokens, 8), expected).pvalue > 1e-3


# ---------------------------------------------------------------- penalties


def reference_penalties(logits: Sequence[float], row: SamplingRow) -> list[float]:
    """HF RepetitionPenaltyLogitsProcessor, then OpenAI presence/frequency on outputs."""
    p = row.params
    out = [float(v) for v in logits]
    for tok in set(row.prompt_token_ids) | set(row.output_token_ids):
        v = out[tok]
        out[tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for tok in set(row.output_token_ids):
        count = list(row.output_token_ids).count(tok)
        out[tok] -= p.presence_penalty + p.frequency_penalty * count
    return out


@pytest.mark.parametrize(
    ("logits", "row", "expected"),
    [
        # Positive logit in history is divided: 2.0 / 2 = 1.0 < 1.5.
        ([2.0, 1.5, 0.0], make_row(prompt=[0], repetition_penalty=2.0, **GREEDY), 1),
        # Negative logit in history is multiplied (dividing would make it win).
        ([-1.0, -1.5, -3.0], make_row(output=[0], repetition_penalty=2.0, **GREEDY), 1),
        # Repetition counts a token once however often it occurred: 4/2 = 2 > 1.5.
        ([4.0, 1.5, 0.0], make_row(prompt=[0, 0, 0], repetition_penalty=2.0, **GREEDY), 0),
        # Presence ignores prompt tokens...
        ([2.0, 1.9, 0.0], make_row(prompt=[0], presence_penalty=1.0, **GREEDY), 0),
        # ...and hits output tokens once.
        ([2.0, 1.9, 0.0], make_row(output=[0, 0], presence_penalty=0.5, **GREEDY), 1),
        # Frequency scales with the count: 2.0 - 3 * 0.2 = 1.4 < 1.5.
        ([2.0, 1.5, 0.0], make_row(output=[0, 0, 0], frequency_penalty=0.2, **GREEDY), 1),
        ([2.0, 1.5, 0.0], make_row(output=[0, 0], frequency_penalty=0.2, **GREEDY), 0),
        # Negative penalties encourage.
        ([1.0, 1.5, 0.0], make_row(output=[0], presence_penalty=-1.0, **GREEDY), 0),
    ],
)
def test_penalty_cases(logits: list[float], row: SamplingRow, expected: int) -> None:
    ref = reference_penalties(logits, row)
    assert int(np.argmax(ref)) == expected  # the fixture itself is right
    assert Sampler()(torch.tensor([logits]), [row]).token_ids == [expected]


def test_penalties_match_reference_on_random_batch() -> None:
    rng = random.Random(12)
    vocab, batch = 12, 300
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(12))
    rows = []
    for _ in range(batch):
        rows.append(
            make_row(
                prompt=[rng.randrange(vocab) for _ in range(rng.randrange(0, 6))],
                output=[rng.randrange(vocab) for _ in range(rng.randrange(0, 8))],
                repetition_penalty=rng.choice([1.0, 0.7, 1.5, 3.0]),
                presence_penalty=rng.choice([0.0, -1.0, 0.8, 2.0]),
                frequency_penalty=rng.choice([0.0, -0.5, 0.6]),
                **GREEDY,
            )
        )
    got = Sampler()(logits, rows).token_ids
    expected = [int(np.argmax(reference_penalties(logits[i].tolist(), r))) for i, r in enumerate(rows)]
    assert got == expected
    changed = sum(e != a for e, a in zip(expected, logits.argmax(-1).tolist(), strict=True))
    assert changed > batch // 5, "fixture too weak: penalties rarely change the argmax"


def test_penalties_shape_the_sampled_distribution() -> None:
    base = [0.5, 1.0, 0.0, -0.5, 0.8, 0.2]
    params = dict(repetition_penalty=1.8, presence_penalty=0.4, frequency_penalty=0.3)
    template = make_row(prompt=[1, 3], output=[4, 4, 0, 3], **params)
    n = 10000  # per-row history tensors make big batches slower here; 10k is plenty for 6 tokens
    rows = [template] * n
    torch.manual_seed(13)
    tokens = Sampler()(torch.tensor(base).expand(n, -1).contiguous(), rows).token_ids
    expected = softmax64(reference_penalties(base, template)) * n
    counts = _counts(tokens, len(base))
    assert chisquare(counts, expected).pvalue > 1e-3
    assert chisquare(counts, softmax64(base) * n).pvalue < 1e-10


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 9.0, 0.0, 8.0]])
    kw = dict(min_tokens=3, stop_token_ids=[7, 1000], **GREEDY)  # 1000 is outside the vocabulary
    early = make_row(output=[2, 2], eos=(5,), **kw)
    done = make_row(output=[2, 2, 2], eos=(5,), **kw)
    assert Sampler()(logits, [early]).token_ids == [1]
    assert Sampler()(logits, [done]).token_ids == [5]
    assert Sampler()(logits.expand(2, -1), [early, done]).token_ids == [1, 5]


def test_min_tokens_blocks_random_sampling() -> None:
    logits = torch.tensor([3.0, 0.0, 0.5, 2.5, 0.2])
    tokens = draw_many(logits, 2000, min_tokens=1, stop_token_ids=[3], eos=(0,))
    assert set(tokens) == {1, 2, 4}


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_model_logprobs(dtype: torch.dtype) -> None:
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(14)).to(dtype)
    rows = [
        make_row(logprobs=5, **GREEDY),
        make_row(logprobs=0, seed=1, temperature=0.5, repetition_penalty=2.0, prompt=[1, 2, 3]),
        make_row(seed=2),
        make_row(logprobs=3, seed=3, top_k=4, presence_penalty=1.0, output=[7, 8]),
    ]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert isinstance(lp, Logprobs)
        # Raw distribution, not the penalized / tempered one actually sampled from.
        assert lp.token_logprob == pytest.approx(float(ref[i, out.token_ids[i]]), abs=1e-5)
        n = rows[i].params.logprobs
        assert len(lp.top) == n
        expected_ids = sorted(range(vocab), key=lambda t: -float(ref[i, t]))[:n]
        assert [t for t, _ in lp.top] == expected_ids
        for t, v in lp.top:
            assert v == pytest.approx(float(ref[i, t]), abs=1e-5)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
    assert out.logprobs[0].top[0] == (out.token_ids[0], pytest.approx(out.logprobs[0].token_logprob))


def test_logprobs_larger_than_vocab_are_capped() -> None:
    out = Sampler()(torch.tensor([[0.0, 1.0, 2.0]]), [make_row(logprobs=10, **GREEDY)])
    assert [t for t, _ in out.logprobs[0].top] == [2, 1, 0]
