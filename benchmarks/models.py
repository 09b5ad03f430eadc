"""`--model` for the real-model benchmarks: one spec, both sides' copies of the same weights.

A spec is an HF model directory, a .gguf file, an aligner checkpoint directory, or `smollm2`
(the pinned SmolLM2-135M-Instruct of `make real-model`). `resolve_model` turns it into an aligner
checkpoint (our side) and an HF directory (the peer's side) holding the same fp32 weights,
converting once into a cache keyed by the source's path, size and modification time.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from aligner.config import REPO_ROOT
from aligner.runtime.errors import ConfigError

BENCH_CACHE = REPO_ROOT / ".cache" / "bench"
PINNED_NAMES = ("smollm2",)


@dataclass(frozen=True)
class ResolvedModel:
    spec: str
    checkpoint_dir: Path  # aligner checkpoint (meta + dist checkpoint + tokenizer)
    hf_dir: Path  # the same weights as an HF directory, for transformers and the peer trainers


def _cache_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _is_checkpoint(path: Path) -> bool:
    from aligner import checkpointing

    return path.is_dir() and (path / checkpointing.META_FILE).is_file()


def resolve_model(spec: str, cache_dir: Path = BENCH_CACHE) -> ResolvedModel:
    """The aligner checkpoint and HF directory of `spec` (converted on first use, then cached)."""
    from aligner.hf.convert import export_hf, import_gguf, import_hf

    if spec in PINNED_NAMES:
        from aligner.hf.pinned import SMOLLM2_135M_INSTRUCT, fetch

        source = fetch(SMOLLM2_135M_INSTRUCT)
    else:
        source = Path(spec).expanduser()
        if not source.exists():
            raise ConfigError(f"--model {spec}: no such file or directory (an HF dir, a .gguf file, "
                              f"an aligner checkpoint or one of {PINNED_NAMES})")
    target = Path(cache_dir) / f"{source.name}-{_cache_key(source)}"
    checkpoint_dir, hf_dir = target / "checkpoint", target / "hf"
    if _is_checkpoint(source):
        checkpoint_dir = source
    elif not _is_checkpoint(checkpoint_dir):
        partial = target / "checkpoint.partial"
        _remove(partial)
        if source.is_file() and source.suffix == ".gguf":
            import_gguf(source, partial)
        elif source.is_dir() and (source / "config.json").is_file():
            import_hf(source, partial)
        else:
            raise ConfigError(f"--model {spec}: not an HF model directory (no config.json), a .gguf file "
                              "or an aligner checkpoint")
        os.replace(partial, checkpoint_dir)  # a killed conversion never leaves a half checkpoint behind
    if not (hf_dir / "config.json").is_file():
        partial = target / "hf.partial"
        _remove(partial)
        export_hf(checkpoint_dir, partial, dtype="float32")
        _remove(hf_dir)
        os.replace(partial, hf_dir)
    return ResolvedModel(spec=spec, checkpoint_dir=checkpoint_dir, hf_dir=hf_dir)


def _remove(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path)
