"""The tiny reference checkpoints: loadable offline by transformers, shaped as promised, deterministic."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from pagefleet.engine import testing

ARCHS = ["llama", "qwen2", "mistral"]
MULTILINGUAL = "def f(x):\n    return x  # Café naïve 日本語 中文 한국어 😀👍🏽 🇫🇷 Привет\t\n\n  end"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # A loader that tries the hub instead of the local directory fails loudly.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Tiny matmuls gain nothing from intra-op threads, and on a shared 2-core box
    # two spinning threads made these forward passes ~20x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _ckpt(request: pytest.FixtureRequest, arch: str) -> Path:
    return request.getfixturevalue(f"tiny_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("one_thread")
def test_checkpoint_loads_back(arch: str, request: pytest.FixtureRequest,
                               tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    path = _ckpt(request, arch)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (path / name).is_file(), name
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.max_position_embeddings) == (64, 2, 4, 2, 128, 2048)
    assert cfg.vocab_size >= len(tiny_tokenizer)
    assert cfg.eos_token_id == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert cfg.bos_token_id == tiny_tokenizer.bos_token_id
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id

    tensors = load_file(path / "model.safetensors")
    attn = model.model.layers[0].self_attn
    embed = model.model.embed_tokens.weight
    if arch == "qwen2":
        assert cfg.tie_word_embeddings
        assert "lm_head.weight" not in tensors
        assert model.lm_head.weight.data_ptr() == embed.data_ptr()
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
        assert attn.o_proj.bias is None
        assert attn.q_proj.bias.abs().min() > 0, "zero biases would not catch a loader that drops them"
    else:
        assert not cfg.tie_word_embeddings
        assert "lm_head.weight" in tensors
        assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
        assert attn.q_proj.bias is None
    if arch == "mistral":
        assert cfg.sliding_window == 64  # conftest's tiny_mistral exercises sliding-window attention
    # Non-trivial norm weights, for the same reason as the biases.
    assert not torch.allclose(model.model.norm.weight, torch.ones_like(model.model.norm.weight))

    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_loads_back_identically(arch: str, request: pytest.FixtureRequest,
                                          tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    # transformers picks the tokenizer class from the model type (Qwen2Tokenizer
    # rebuilds its own pipeline around the vocab): it must still agree with ours.
    tok = AutoTokenizer.from_pretrained(_ckpt(request, arch))
    assert len(tok) == len(tiny_tokenizer)
    ids = tiny_tokenizer.encode(MULTILINGUAL)
    assert tok.encode(MULTILINGUAL) == ids
    assert tok.decode(ids) == MULTILINGUAL
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert set(tok.all_special_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert tok.encode("a<|im_start|>b<|im_end|>c")[1:4:2] == specials[1:]
    assert tok.decode(specials + ids, skip_special_tokens=True) == MULTILINGUAL


def test_tokenizer_shape(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    assert 400 <= len(tiny_tokenizer) <= 512
    # Some characters must span several tokens (the detokenizer tests rely on it)
    # and some multi-byte characters must be single tokens.
    emoji_ids = tiny_tokenizer.encode("😀")
    assert len(emoji_ids) > 1
    assert any(tiny_tokenizer.decode(tiny_tokenizer.encode(c)) == c and len(tiny_tokenizer.encode(c)) == 1
               for c in "éи文本")
    # Ids beyond the tokenizer (a padded model vocab) decode to nothing instead of raising.
    assert tiny_tokenizer.decode([len(tiny_tokenizer), 31999, *emoji_ids]) == "😀"


def test_tokenizer_training_is_deterministic() -> None:
    retrained = testing._trained_tokenizer_json.__wrapped__()
    assert retrained == testing._trained_tokenizer_json()


def test_chat_template(request: pytest.FixtureRequest) -> None:
    tok = AutoTokenizer.from_pretrained(_ckpt(request, "llama"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 😀<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAgain?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages[:2], tokenize=False).endswith("Hi 😀<|im_end|>\n")
    ids = tok.encode(text)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = testing.make_tiny_checkpoint(tmp_path / "a", "qwen2", seed=3)
    b = testing.make_tiny_checkpoint(tmp_path / "b", "qwen2", seed=3)
    c = testing.make_tiny_checkpoint(tmp_path / "c", "qwen2", seed=4)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_building_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    testing.make_tiny_checkpoint(tmp_path / "m", "llama")
    assert torch.equal(torch.rand(3), expected)


def test_bf16_is_the_rounded_fp32_model(tiny_llama: Path, tmp_path: Path) -> None:
    path = testing.make_tiny_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    fp32 = load_file(tiny_llama / "model.safetensors")
    bf16 = load_file(path / "model.safetensors")
    assert fp32.keys() == bf16.keys()
    for name, t in bf16.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, fp32[name].to(torch.bfloat16)), name
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


def test_config_overrides(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    path = testing.make_tiny_checkpoint(
        tmp_path / "m", "llama", rope_parameters=rope, num_key_value_heads=1, vocab_size=1000,
        hidden_size=96, num_attention_heads=6, max_position_embeddings=4096,
    )
    assert AutoTokenizer.from_pretrained(path).model_max_length == 4096
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_parameters"] == rope
    assert (cfg["num_key_value_heads"], cfg["num_attention_heads"], cfg["vocab_size"]) == (1, 6, 1000)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (96 // 6, 96)  # MQA
    assert model.lm_head.weight.shape == (1000, 96)

    mistral = testing.make_tiny_checkpoint(tmp_path / "swa", "mistral", sliding_window=32)
    assert json.loads((mistral / "config.json").read_text())["sliding_window"] == 32

    with pytest.raises(ValueError, match="arch"):
        testing.make_tiny_checkpoint(tmp_path / "x", "gpt3")
    with pytest.raises(ValueError, match="vocab_size"):
        testing.make_tiny_checkpoint(tmp_path / "y", "llama", vocab_size=100)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("one_thread")
def test_logits_spread_and_generation_is_not_degenerate(arch: str, request: pytest.FixtureRequest) -> None:
    """Greedy margins well above float noise, and greedy text that moves around."""
    model = AutoModelForCausalLM.from_pretrained(_ckpt(request, arch)).eval()
    rng = random.Random(0)
    gaps: list[float] = []
    distinct: list[int] = []
    with torch.no_grad():
        for _ in range(3):
            ids = torch.tensor([[rng.randrange(3, 512) for _ in range(16)]])
            top2 = model(ids).logits[0].topk(2, dim=-1).values
            gaps += (top2[:, 0] - top2[:, 1]).tolist()
        for _ in range(2):
            ids = [rng.randrange(3, 512) for _ in range(8)]
            out: list[int] = []
            for _ in range(64):
                nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                out.append(nxt)
            distinct.append(len(set(out)))
    assert statistics.median(gaps) > 1e-2, gaps
    assert min(distinct) >= 8, distinct
