"""Offline builders of tiny random-weight Hugging Face checkpoints.

The test-suite and the benchmarks use these as reference models: nothing is
downloaded, everything is built from text that ships with the interpreter.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import sysconfig
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

TOKENIZER_VOCAB_SIZE = 512

# Qwen2's pre-tokenization (NFC + this split + byte-level without its own regex).
# transformers 5 loads a "qwen2" checkpoint's tokenizer as Qwen2Tokenizer, which
# rebuilds exactly this pipeline around tokenizer.json's vocab and merges and
# ignores the file's own pipeline; using it for every arch makes AutoTokenizer
# agree with build_tokenizer whatever the model type.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Fixed list: the merges (hence token ids) depend on these files' contents, so
# they are the same for every run on the same interpreter version. Small,
# slow-changing modules keep the dependence on the version mild.
_STDLIB_CORPUS_FILES = ("colorsys.py", "bisect.py", "fnmatch.py", "string.py", "textwrap.py")

# Repeated so that some multi-byte characters get merged into single tokens while
# others (notably 4-byte emoji) stay split across tokens: the detokenizer tests
# need both.
_MULTILINGUAL_CORPUS = """\
Café crème, naïve façade, déjà vu, Über die Straße, señor, Ångström, Smørrebrød.
Привет, мир! Γειά σου Κόσμε. Merhaba dünya. Cześć, świecie. Dobrý den, světe.
日本語のテキストです。東京は大きな都市です。中文文本测试，你好世界。
한국어 텍스트입니다. 안녕하세요 세계. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया।
Emoji: 😀 😃 😄 😁 🎉 🎈 👍 👍🏽 ❤️ 🔥 🚀 🌍 👨‍👩‍👧 🇫🇷 🇯🇵 ✨ 🤖 🐍 🍕.
"""

_MODEL_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
}

# Why not N(0, 0.02) (HF's default initializer_range): at hidden_size 64 it makes the
# logits of a random model nearly flat (std ~0.16, median top-1/top-2 gap ~0.03
# with gaps down to 2e-4), so greedy argmax margins approach float rounding
# noise and token-for-token comparisons between two correct implementations get
# flaky; and the tied-embedding qwen2 model degenerates (the input embedding
# dominates the residual stream, so it echoes one token forever). Measured at
# hidden 64 on random prompts, init_std=0.2 gives logits a std of ~1.6, a median
# top-1/top-2 gap of ~0.35, and 47-56 distinct tokens in 64 greedy ones for all
# three archs (0.1 still left qwen2 at ~6 distinct). Weights are drawn from
# N(0, init_std / sqrt(hidden_size / 64)) so that wider models keep the same
# logit scale (the 125M benchmark config: logit std ~1.6, median gap ~0.25).
DEFAULT_INIT_STD = 0.2
# RMSNorm weights and biases are randomised too (not ones/zeros as in HF's
# init) so that a loader which drops them produces visibly different outputs.
_NORM_WEIGHT_JITTER = 0.1


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in _STDLIB_CORPUS_FILES:
        path = stdlib / name
        # Some distributions ship the stdlib as bytecode only; the embedded text
        # below is still enough to train a usable (if different) tokenizer.
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
    texts.extend([_MULTILINGUAL_CORPUS] * 16)
    return texts


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # Byte-level: every byte is in the base alphabet, so any text round-trips
    # (up to NFC) and there is no unknown token.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def _fast_tokenizer() -> PreTrainedTokenizerFast:
    # A fresh wrapper each call: callers may mutate theirs (add tokens, change
    # padding side) without affecting the cached training result.
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        # So that HF's all_special_ids agrees with the backend, which already
        # skips all three in decode(skip_special_tokens=True).
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def build_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Train (once per process) the tiny byte-level BPE tokenizer and save it to ``path``.

    Ids at or past ``len(tokenizer)`` (a model whose vocab_size is padded
    beyond the tokenizer) decode to nothing: the ``tokenizers`` backend skips
    ids it does not know instead of raising.
    """
    tokenizer = _fast_tokenizer()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    return tokenizer


def _normalize_rope_kwargs(config_cls: type[PretrainedConfig], kwargs: dict[str, Any]) -> None:
    """Accept both rope spellings on both transformers generations.

    transformers 5 keeps RoPE settings in ``rope_parameters`` (theta included) and
    converts the legacy ``rope_scaling``/``rope_theta`` kwargs itself; 4.x only
    knows the legacy pair, so translate the other way there.
    """
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        return
    rope = kwargs.pop("rope_parameters", None)
    if rope is None:
        return
    rope = dict(rope)
    if "rope_theta" in rope:
        kwargs.setdefault("rope_theta", rope.pop("rope_theta"))
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        kwargs.setdefault("rope_scaling", rope)


def _build_config(
    arch: str, vocab_size: int, tokenizer: PreTrainedTokenizerFast, **overrides: Any
) -> PretrainedConfig:
    if arch not in _MODEL_CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_MODEL_CONFIGS)}, got {arch!r}")
    config_cls = _MODEL_CONFIGS[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        kwargs["tie_word_embeddings"] = False
    elif arch == "qwen2":
        kwargs["tie_word_embeddings"] = True
        kwargs["use_sliding_window"] = False
    elif arch == "mistral":
        kwargs["tie_word_embeddings"] = False
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    _normalize_rope_kwargs(config_cls, kwargs)
    return config_cls(**kwargs)


@torch.no_grad()
def _init_weights(model: torch.nn.Module, *, seed: int, std: float) -> None:
    # Own init instead of HF's _init_weights: its scheme differs between
    # transformers versions. A private generator leaves the caller's global RNG
    # alone, and drawing in name order keeps the bytes independent of module
    # registration order.
    params = dict(model.named_parameters())  # tied weights appear once
    saved = set(model.state_dict())
    missing = saved - set(dict(model.named_parameters(remove_duplicate=False)))
    # Persistent buffers would be left uninitialised by the meta-device build.
    assert not missing, f"checkpoint tensors that are not parameters: {sorted(missing)}"
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(params):
        p = params[name]
        # Always float32 here, so that a bf16/fp16 checkpoint is the rounding of
        # the float32 one with the same seed.
        assert p.dtype == torch.float32, (name, p.dtype)
        if p.ndim == 1 and "norm" in name:
            p.normal_(1.0, _NORM_WEIGHT_JITTER, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_std: float = DEFAULT_INIT_STD,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight ``arch`` checkpoint (config, safetensors, tokenizer) to ``path``.

    ``config_overrides`` go straight into the transformers config (e.g.
    ``rope_parameters``/``rope_scaling``, ``num_key_value_heads=1``,
    ``vocab_size=32000``). Weights come from a private generator seeded with
    ``seed`` (the global torch RNG is left alone; see DEFAULT_INIT_STD for the
    scale), so the same arguments always produce identical files.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _fast_tokenizer()
    # Round up to a multiple of 64, as real checkpoints pad their embeddings.
    vocab_size = config_overrides.pop("vocab_size", -(-len(tokenizer) // 64) * 64)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = _build_config(arch, vocab_size, tokenizer, **config_overrides)
    std = init_std / math.sqrt(config.hidden_size / 64)
    # Only informative (HF would init with it); recorded so the config tells the truth.
    config.initializer_range = std
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(path)

    # Built on the meta device: HF's own init would take most of the build time
    # for the 125M benchmark model, and _init_weights overwrites every weight.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    _init_weights(model, seed=seed, std=std)
    model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)

    generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generation_config.save_pretrained(path)
    return path



# ---- GGUF ---------------------------------------------------------------------------------------------

# HF parameter name (per layer, after "model.layers.{i}.") -> GGUF tensor name (llama.cpp's convention)
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(hf_dir: str | Path, out: str | Path, q8_0: bool = False) -> Path:
    """Write a Qwen2 HF checkpoint (e.g. ``make_tiny_checkpoint(..., "qwen2")``) as a
    GGUF file the way llama.cpp's converter lays it out: hyperparameters, the
    byte-level BPE tokenizer (tokens, merges, special ids, chat template) and the
    tensors, float32, or Q8_0 for the 2-D weights when ``q8_0`` (to exercise
    dequantization). For tests of GGUF loading; only Qwen2 (no Q/K permutation)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg["model_type"] != "qwen2":
        raise ValueError("write_tiny_gguf: only qwen2 checkpoints")
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    ids = {**vocab, **added}
    tokens = [""] * cfg["vocab_size"]
    types = [gguf.TokenType.UNUSED] * cfg["vocab_size"]
    for text, i in ids.items():
        if i < len(tokens):
            tokens[i] = text
            types[i] = gguf.TokenType.CONTROL if text in added else gguf.TokenType.NORMAL
    for i, t in enumerate(tokens):
        if not t:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(eos if isinstance(eos, int) else eos[0])
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    w.add_add_bos_token(False)
    template = tok_cfg.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)

    tensors = load_file(str(hf_dir / "model.safetensors"))
    for name, t in tensors.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        t = np.ascontiguousarray(t.astype(np.float32))
        if q8_0 and t.ndim == 2 and t.shape[1] % 32 == 0:
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
