"""Engine configuration and the small parsers that feed it."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # Kubernetes quantity spellings


def parse_bytes(value: int | str) -> int:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (use e.g. '512MiB', '2GiB' or bytes)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return n


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def keep_freed_memory_in_process() -> bool:
    """Stop glibc from returning large freed blocks to the OS (Linux only).

    Each engine step allocates tensors of tens of MB (activations, gathered KV).
    glibc serves those with mmap and unmaps them on free, so every step pays the
    page faults of touching fresh memory again: measured here, that tripled the
    time of a KV gather. Keeping freed memory in the heap makes reuse free. The
    process's resident size then stays at its peak, which suits a server."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are only faster than fp32 on CPUs with native bf16 (AVX512-BF16 / AMX);
    elsewhere torch emulates them and they run several times slower."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    ckpt = _DTYPES.get(str(checkpoint_dtype or "").replace("torch.", ""), torch.bfloat16)
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


@dataclass
class EngineConfig:
    model: str
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str = "2GiB"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context length, capped by the KV budget
    num_threads: int | None = None  # default: torch's own choice (physical cores)
    enable_prefix_caching: bool = True
    served_model_name: str | None = None  # prefix-cache namespace; default: the model path
    seed: int = 0
    quantization: str = "none"  # weight-only: none | int8 (engine/quant.py)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        self.kv_cache_bytes = parse_bytes(self.kv_cache_memory)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
