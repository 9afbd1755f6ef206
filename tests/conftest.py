"""Session-wide reference models: tiny random-weight checkpoints built offline once per run."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from pagefleet.engine.testing import build_tokenizer, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return build_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Its own seed (same-shaped weights would otherwise equal tiny_llama's) and a
    # window shorter than most test prompts, so sliding-window masking is exercised.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=2, sliding_window=64)
