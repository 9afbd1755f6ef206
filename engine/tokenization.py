"""Prompt -> token ids, exactly as the engine does it.

Public and pure (no torch): the router tokenizes with these same functions so
the block hashes it predicts are the ones the engine will compute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The model directory's Hugging Face tokenizer, or None when it ships none."""
    path = Path(model_dir).expanduser()
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def has_chat_template(tokenizer: Any | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat conversation. Template errors (e.g. an unsupported
    role order) are the client's input, so they surface as ValueError naming `messages`."""
    if not has_chat_template(tokenizer):
        raise ValueError("messages: this model has no chat template; use /v1/completions")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:
        raise ValueError(f"messages: chat template failed: {e}") from None


def encode_prompt(tokenizer: Any | None, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of a prompt. A rendered chat template already carries its special
    tokens, so only plain completion prompts get the tokenizer's BOS and friends."""
    if tokenizer is None:
        raise ValueError(("messages" if chat else "prompt") + ": this model has no tokenizer; pass token ids instead")
    return tokenizer.encode(text, add_special_tokens=not chat)
