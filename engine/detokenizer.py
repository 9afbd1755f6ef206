"""Incremental detokenization with stop strings, safe for multi-byte characters.

Decoding the whole output again after every token is quadratic in its length.
Instead, as in vLLM, each step decodes a short window of ids twice: from
`prefix_offset` to `read_offset` (text already emitted, kept as context so that
decoders which drop a leading space or merge byte tokens behave as they do in
the full decode) and from `prefix_offset` to the end. The difference is the new
text.

A byte-level BPE (or SentencePiece byte fallback) can split one character over
several tokens; decoding such a prefix ends in U+FFFD. New text that ends in
U+FFFD is therefore held back (and `read_offset` not advanced) until a later
token completes the character, or until `flush()` at the end of the sequence,
which emits it as the full decode would. Only a run of tokens that each leave
the text mid-character (e.g. a stream of lone UTF-8 lead bytes) widens the
window; any token that completes a character shrinks it back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagefleet.engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as context ahead of the first output token: enough for
# leading-space handling, few enough to keep the first window short.
INITIAL_CONTEXT_TOKENS = 5


def _make_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        # The Rust tokenizer directly: HF's fast decode is this call plus input
        # conversion and an optional clean-up pass, and the clean-up (which
        # rewrites text across token boundaries) must stay off for incremental
        # decoding to agree with itself anyway.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text as they arrive.

    `output_text` is the text the output ids add after the prompt, truncated at
    the first stop string, minus any held-back incomplete character until
    `flush()`. For byte-level BPE that is exactly ``tokenizer.decode(output_ids)``;
    SentencePiece-style decoders, which drop the leading space of a standalone
    decode, keep it here because the last prompt tokens are decoded as context.

    The caller calls `flush()` when the sequence ends for any reason other than
    a stop string returned by `update()` (EOS, stop token, length, abort).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._decode = _make_decode(tokenizer, params.skip_special_tokens)
        self.stop: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # A stop string may start this many chars before the new text, and a
        # stop truncation (without include_stop_str_in_output) may cut this many
        # chars of text that was already there; streaming holds them back.
        self._stop_lookback = max(self._max_stop_len - 1, 0)
        self._delta_holdback = 0 if self.include_stop_str_in_output else self._stop_lookback

        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        # A prompt that ends inside a character would make the first output
        # bytes complete (or corrupt) prompt text; decode the output on its own
        # then, as tokenizer.decode(output_ids) does.
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text_len = len(self._decode(context)) if context else 0

        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._sent = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated ids; return the stop string they completed, if any.

        On a stop, `output_text` is truncated at it (keeping the stop string only
        with include_stop_str_in_output) and the detokenizer is finished: later
        ids are ignored, since the text can no longer change.
        """
        for token_id in new_token_ids:
            if self.finished:
                break
            stop = self._add(token_id)
            if stop is not None:
                return stop
        return None

    def _add(self, token_id: int) -> str | None:
        # One id at a time, so that a batch (e.g. accepted speculative tokens)
        # yields exactly the text and stop of feeding its ids one by one.
        self._ids.append(token_id)
        text = self._decode(self._ids[self.prefix_offset:])
        if text.endswith(REPLACEMENT_CHAR):
            return None
        new_text = text[self._prefix_text_len:]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self._prefix_text_len = len(self._decode(self._ids[self.prefix_offset:self.read_offset]))
        return self._append(new_text)

    def flush(self) -> str | None:
        """End of sequence: emit held-back text (an incomplete character becomes
        U+FFFD, as in the full decode), release the stream's stop-string holdback,
        and return the stop string the flushed text completed, if any."""
        if self.finished:
            return None
        stop = None
        if self.read_offset < len(self._ids):
            new_text = self._decode(self._ids[self.prefix_offset:])[self._prefix_text_len:]
            self.prefix_offset = self.read_offset = len(self._ids)
            self._prefix_text_len = 0
            stop = self._append(new_text)
        self.finished = True
        return stop

    def _append(self, new_text: str) -> str | None:
        if not new_text:
            return None
        start = len(self.output_text)
        self.output_text += new_text
        if not self.stop:
            return None
        search_from = max(start - self._stop_lookback, 0)
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stop:
            idx = self.output_text.find(s, search_from)
            if idx != -1:
                # The stop completed first in text order wins, so the result
                # does not depend on how tokens were grouped into updates.
                cand = (idx + len(s), -len(s), s)
                if best is None or cand < best:
                    best = cand
        if best is None:
            return None
        end, neg_len, stop = best
        self.output_text = self.output_text[: end if self.include_stop_str_in_output else end + neg_len]
        self.stop_reason = stop
        self.finished = True
        return stop

    def get_delta(self) -> str:
        """Text added to `output_text` since the last call, for streaming.

        While unfinished, the last len(longest stop)-1 chars are held back
        (unless include_stop_str_in_output), because a stop string completed by
        a later token would truncate them; so the concatenated deltas never
        need to be retracted and, once finished, equal `output_text`.
        """
        limit = len(self.output_text)
        if not self.finished:
            limit -= self._delta_holdback
        if limit <= self._sent:
            return ""
        delta = self.output_text[self._sent:limit]
        self._sent = limit
        return delta
