"""Incremental detokenization against the tokenizer's own full decode.

The reference is always `tokenizer.decode` of the whole id sequence (and, for
stop strings, a plain search over that text): the detokenizer must agree with
it after every step without ever showing a half-decoded character.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagefleet.engine.detokenizer import IncrementalDetokenizer
from pagefleet.engine.sampling_params import SamplingParams

FFFD = "\ufffd"
TEXTS = [
    "Hello world, this is plain ASCII text.\n",
    "Café crème, naïve façade — Über die Straße. ",
    "日本語のテキストです。中文文本测试，你好世界。",
    "한국어 텍스트 and Привет, мир! Γειά σου.",
    "Emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 ✨🤖 done",
    "def f(x):\n    return {'k': x ** 2}  # ok\n",
]


@dataclass
class Run:
    detok: IncrementalDetokenizer
    stop: str | None = None
    deltas: list[str] = field(default_factory=list)


def stream(tokenizer: PreTrainedTokenizerFast, prompt: list[int], output: list[int], params: SamplingParams,
           rng: random.Random, check_step=None) -> Run:
    """Feed `output` in random chunks of 1-3 ids, collecting deltas; flush at the end."""
    run = Run(IncrementalDetokenizer(tokenizer, prompt, params))
    i = 0
    while i < len(output):
        n = rng.randint(1, 3)
        stop = run.detok.update(output[i:i + n])
        i = min(i + n, len(output))
        run.deltas.append(run.detok.get_delta())
        if check_step is not None:
            check_step(run, i)
        if stop is not None:
            run.stop = stop
            break
    if run.stop is None:
        run.stop = run.detok.flush()
        run.deltas.append(run.detok.get_delta())
    return run


def expected_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The first stop string completed when `text` is read left to right."""
    best = None
    for s in stops:
        idx = text.find(s)
        if idx != -1:
            cand = (idx + len(s), -len(s), s)
            best = cand if best is None or cand < best else best
    if best is None:
        return text, None
    end, neg_len, stop = best
    return text[: end if include else end + neg_len], stop


@pytest.fixture(scope="module")
def split_token_pool(tiny_tokenizer: PreTrainedTokenizerFast) -> list[int]:
    ids = sorted({i for t in TEXTS for i in tiny_tokenizer.encode(t)})
    partial = [i for i in ids if FFFD in tiny_tokenizer.decode([i])]
    assert len(partial) >= 10, "the pool must contain tokens that split multi-byte characters"
    return ids


def _random_case(rng: random.Random, tokenizer: PreTrainedTokenizerFast, pool: list[int]) -> list[int]:
    kind = rng.random()
    if kind < 0.4:  # valid text, possibly cut mid-character at either end
        ids = tokenizer.encode(rng.choice(TEXTS) + rng.choice(TEXTS))
        a = rng.randrange(0, 4)
        b = rng.randrange(max(a + 1, len(ids) - 4), len(ids) + 1)
        return ids[a:b]
    if kind < 0.8:  # tokens that split characters, shuffled: invalid UTF-8 is frequent
        return [rng.choice(pool) for _ in range(rng.randint(1, 30))]
    # anything, including special tokens and ids past the tokenizer (padded model vocab)
    return [rng.randrange(0, len(tokenizer) + 8) for _ in range(rng.randint(1, 30))]


def _random_prompt(rng: random.Random, tokenizer: PreTrainedTokenizerFast, pool: list[int]) -> list[int]:
    choice = rng.randrange(4)
    if choice == 0:
        return []
    if choice == 1:
        chat = [{"role": "user", "content": rng.choice(TEXTS)}]
        return tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    if choice == 2:  # ends inside a character
        return tokenizer.encode("x 😀")[:-1]
    return [rng.choice(pool) for _ in range(rng.randint(1, 10))]


@pytest.mark.parametrize("seed", range(4))
def test_random_streams_match_full_decode(seed: int, tiny_tokenizer: PreTrainedTokenizerFast,
                                          split_token_pool: list[int]) -> None:
    rng = random.Random(seed)
    tok = tiny_tokenizer
    saw_hold = False
    for _ in range(60):
        output = _random_case(rng, tok, split_token_pool)
        prompt = _random_prompt(rng, tok, split_token_pool)
        skip = rng.random() < 0.5
        final = tok.decode(output, skip_special_tokens=skip)

        def check(run: Run, i: int, final: str = final, output: list[int] = output, skip: bool = skip) -> None:
            nonlocal saw_hold
            text = run.detok.output_text
            assert final.startswith(text), (output, i)
            if FFFD not in final:
                assert FFFD not in text
            # Nothing held back beyond an incomplete trailing character.
            so_far = tok.decode(output[:i], skip_special_tokens=skip)
            if not so_far.endswith(FFFD):
                assert text == so_far
            else:
                saw_hold = True
            assert "".join(run.deltas) == text

        run = stream(tok, prompt, output, SamplingParams(skip_special_tokens=skip), rng, check)
        assert run.stop is None
        assert run.detok.output_text == final
        assert "".join(run.deltas) == final
    assert saw_hold


def test_emoji_split_across_tokens_is_held_back(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("a😀b")
    assert len(ids) >= 4
    d = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams())
    seen = []
    for i in ids:
        d.update([i])
        seen.append(d.output_text)
        assert FFFD not in d.output_text and FFFD not in d.get_delta()
    assert seen[0] == "a" and seen[-2] == "a😀" and seen[-1] == "a😀b"
    assert all(s == "a" for s in seen[1:-2])


def test_flush_emits_an_incomplete_tail_like_decode(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("ok😀")[:-1]
    d = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams())
    assert d.update(ids) is None
    assert d.output_text == "ok"  # the clean part of a batch is not held back with its tail
    assert d.flush() is None
    assert d.output_text == tiny_tokenizer.decode(ids) == "ok" + FFFD
    assert d.flush() is None and d.update([5]) is None  # finished: later calls change nothing
    assert d.output_text == "ok" + FFFD


def test_prompt_ending_mid_character(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("x😀y")
    cut = len(ids) - 2  # the emoji's last byte token starts the output
    d = IncrementalDetokenizer(tiny_tokenizer, ids[:cut], SamplingParams())
    d.update(ids[cut:])
    d.flush()
    assert d.output_text == tiny_tokenizer.decode(ids[cut:])


def test_leading_space_is_kept(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tiny_tokenizer.encode("Hello")
    out = tiny_tokenizer.encode(" world")
    d = IncrementalDetokenizer(tiny_tokenizer, prompt, SamplingParams())
    for i in out:
        d.update([i])
    assert d.output_text == " world"


def test_special_tokens(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tiny_tokenizer.encode("hi") + [end]
    for skip, expected in ((True, "hi"), (False, "hi<|im_end|>")):
        d = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(skip_special_tokens=skip))
        d.update(ids)
        assert d.output_text == expected
    d = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(skip_special_tokens=False, stop=["<|im_end|>"]))
    assert d.update(ids) == "<|im_end|>" and d.output_text == "hi"


def test_decode_window_is_bounded(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("".join(TEXTS) * 4)
    assert len(ids) > 500
    d = IncrementalDetokenizer(tiny_tokenizer, ids[:20], SamplingParams(stop=["never appears"]))
    inner = d._decode
    lengths: list[int] = []

    def spy(window: list[int]) -> str:
        lengths.append(len(window))
        return inner(window)

    d._decode = spy
    for i in ids[20:]:
        d.update([i])
    d.flush()
    assert d.output_text == tiny_tokenizer.decode(ids[20:])
    assert max(lengths) <= 8, max(lengths)  # an emoji is at most 4 byte tokens, plus the prefix window
    assert sum(lengths) <= 6 * len(ids)


# ---- stop strings ------------------------------------------------------------------------


def _boundaries(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> set[int]:
    """Char offsets in decode(ids) at which a token ends (where the text so far is clean)."""
    out = set()
    for i in range(1, len(ids)):
        prefix = tokenizer.decode(ids[:i])
        if not prefix.endswith(FFFD):
            out.add(len(prefix))
    return out


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(include: bool, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    text = "The answer is forty-two. Then more text follows."
    ids = tiny_tokenizer.encode(text)
    stop = "two. Th"
    start = text.index(stop)
    assert any(start < b < start + len(stop) for b in _boundaries(tiny_tokenizer, ids)), "must span tokens"
    for chunk in (1, 2, len(ids)):
        d = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(stop=[stop], include_stop_str_in_output=include))
        got = None
        deltas = []
        for i in range(0, len(ids), chunk):
            got = d.update(ids[i:i + chunk])
            deltas.append(d.get_delta())
            if got is not None:
                break
        assert got == stop
        assert d.output_text == (text[: start + len(stop)] if include else text[:start])
        assert "".join(deltas) == d.output_text
        assert d.update(ids[:1]) is None and d.output_text == "".join(deltas)


@pytest.mark.parametrize("include", [False, True])
def test_multiple_stops_first_completed_wins(include: bool, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("abc bcd xyz bc")
    cases = [
        # " bc" completes at char 6, "c bcd" only at 7 although it starts earlier.
        (["xyz", "c bcd", " bc"], " bc", "abc bc" if include else "abc"),
        # Both complete at char 7: the longer one (which started earlier) wins.
        (["bcd", "c bcd", "xyz"], "c bcd", "abc bcd" if include else "ab"),
        (["xyz", "nope"], "xyz", "abc bcd xyz" if include else "abc bcd "),
    ]
    for stops, want_stop, want_text in cases:
        for chunk in (1, len(ids)):
            params = SamplingParams(stop=stops, include_stop_str_in_output=include)
            d = IncrementalDetokenizer(tiny_tokenizer, [], params)
            got = [d.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
            assert [g for g in got if g is not None] == [want_stop]
            assert d.output_text == want_text


def test_stop_on_emoji(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("ab😀cd")
    for include, expected in ((False, "ab"), (True, "ab😀")):
        d = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(stop=["😀"], include_stop_str_in_output=include))
        deltas = []
        stop = None
        for i in ids:
            stop = stop or d.update([i])
            deltas.append(d.get_delta())
            assert FFFD not in d.output_text
        assert stop == "😀" and d.output_text == expected and "".join(deltas) == expected


def test_streaming_never_shows_a_stop_prefix(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    text = "xxENxEN yEND tail"
    ids = tiny_tokenizer.encode(text)
    d = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(stop=["END"]))
    streamed = ""
    for i in ids:
        if d.update([i]) is not None:
            break
        streamed += d.get_delta()
        assert "xxENxEN y".startswith(streamed)
    streamed += d.get_delta()
    assert streamed == d.output_text == "xxENxEN y"


def test_no_stop_found_then_flush_releases_holdback(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("abcdef")
    d = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(stop=["zzzz"]))
    d.update(ids)
    assert d.output_text == "abcdef" and d.get_delta() == "abc"  # last 3 chars could start "zzzz"
    assert d.flush() is None and d.get_delta() == "def"


@pytest.mark.parametrize("seed", range(3))
def test_random_stops_match_reference(seed: int, tiny_tokenizer: PreTrainedTokenizerFast,
                                      split_token_pool: list[int]) -> None:
    rng = random.Random(100 + seed)
    tok = tiny_tokenizer
    hits = 0
    for _ in range(60):
        output = _random_case(rng, tok, split_token_pool)
        skip = rng.random() < 0.5
        final = tok.decode(output, skip_special_tokens=skip)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8 and len(final) > 1:
                a = rng.randrange(len(final))
                s = final[a:a + rng.randint(1, 6)]
                if FFFD not in s:  # a stop string is real text
                    stops.append(s)
            else:
                stops.append("never in the text")
        if not stops:
            continue
        include = rng.random() < 0.5
        params = SamplingParams(stop=stops, include_stop_str_in_output=include, skip_special_tokens=skip)
        want_text, want_stop = expected_stop(final, stops, include)

        def check(run: Run, i: int, want_text: str = want_text) -> None:
            # Streamed text is never retracted.
            assert want_text.startswith("".join(run.deltas)), i

        run = stream(tok, [], output, params, rng, check)
        assert (run.detok.output_text, run.stop) == (want_text, want_stop), (output, stops, include)
        assert "".join(run.deltas) == want_text
        hits += want_stop is not None
    assert hits > 30  # most cases do stop


# ---- a SentencePiece-style tokenizer (Metaspace + byte fallback), as in Llama 2 / Mistral --------


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = ["Hello world and more words here, the quick brown fox jumps over the lazy dog."] * 4
    trainer_tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    vocab = trainer_tok.get_vocab()
    for b in range(256):  # byte fallback for everything the vocab lacks (all non-ASCII here)
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
              for m in json.loads(trainer_tok.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def test_metaspace_leading_space_and_byte_fallback(metaspace_tokenizer: PreTrainedTokenizerFast) -> None:
    tok = metaspace_tokenizer
    ids = tok.encode("Hello world 😀 and 中 more")
    emoji_bytes = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "😀".encode()]
    assert any(ids[i:i + 4] == emoji_bytes for i in range(len(ids))), "emoji must fall back to 4 byte tokens"
    prompt, output = ids[:1], ids[1:]
    assert tok.decode(prompt) == "Hello"
    # What the user sees: the output continues the prompt, so its leading space
    # stays (a standalone decode of the output would strip it).
    expected = tok.decode(ids)[len("Hello"):]
    assert expected.startswith(" world")
    d = IncrementalDetokenizer(tok, prompt, SamplingParams())
    for i in output:
        d.update([i])
        assert expected.startswith(d.output_text)
        assert FFFD not in d.output_text  # byte fallback shows one U+FFFD per pending byte
    d.flush()
    assert d.output_text == expected
