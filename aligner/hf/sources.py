"""Where a model comes from: the one resolver of `model.init_from` and every other start (a DPO/RL
reference, a teacher, a critic, a reward model, chat's `init_from`).

A start names one of
- an aligner checkpoint directory (it holds `aligner_meta.json`): used as it is;
- a run directory (a training run's `checkpoint.save_dir`, holding `step_<N>` checkpoints): its newest
  intact checkpoint (`checkpointing.latest_intact_checkpoint`; a damaged newer one is reported and skipped);
- a Hugging Face model directory (`config.json` and weights) or a `.gguf` file: imported once, by the
  same functions as `python -m aligner.hf import` (`import_hf` / `import_gguf`, default options), into the
  import cache, keyed by a sha256 over the source's bytes; a later start from the same bytes loads the
  cached checkpoint, a changed source is imported again.

The import cache is `$ALIGNER_CACHE_DIR/imports/<sha256>` (default `$XDG_CACHE_HOME/aligner`, else
`~/.cache/aligner`). Runs that import the same source at once do not corrupt it: one imports (under a
file lock) while the others wait, and an import is written into `<sha256>.incomplete` and renamed into
place when complete, so a cached directory is always a whole one. Deleting the cache costs a re-import.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from filelock import FileLock

from aligner import checkpointing
from aligner.config import require_writable_dir
from aligner.hf import convert, gguf, layout, weights
from aligner.hf.convert import HF_SOURCE_FILE, import_gguf, import_hf, is_hf_model_dir
from aligner.hf.gguf import is_gguf_file
from aligner.runtime import distributed
from aligner.runtime.errors import ConfigError, UserError

CACHE_ENV = "ALIGNER_CACHE_DIR"  # the cache's root; its imports live under imports/
IMPORTS_DIR = "imports"
# The code an import runs; its bytes are part of every cache key, so a changed converter imports again.
CONVERTER_MODULES = (convert, gguf, layout, weights)

CHECKPOINT, RUN, HF_DIR, GGUF = "checkpoint", "run", "hf", "gguf"
EXPECTED = ("expected an aligner checkpoint, a run directory (its step_<N> checkpoints), a Hugging Face model "
            "directory (config.json + weights) or a .gguf file")


def source_kind(path: str | os.PathLike, key: str) -> str:
    """What a start names (CHECKPOINT, RUN, HF_DIR or GGUF), from the file system alone (cheap: run it
    before anything is built); a ConfigError naming `key` for anything else."""
    source = Path(path)
    if not source.exists():
        raise ConfigError(f"{key}={path} does not exist; {EXPECTED}")
    if source.is_file():
        if is_gguf_file(source):
            return GGUF
        raise ConfigError(f"{key}={path} is a file but not a .gguf file; {EXPECTED}")
    if (source / checkpointing.META_FILE).is_file():
        return CHECKPOINT
    if is_hf_model_dir(source):
        return HF_DIR
    if checkpointing.step_checkpoints(source):
        return RUN
    partial = sorted(child.name for child in source.glob("step_*"))
    if partial:
        raise ConfigError(f"{key}={path} holds no complete checkpoint (only {', '.join(partial)}, saves an "
                          f"interrupted run left); {EXPECTED}")
    raise ConfigError(f"{key}={path} is a directory of none of these kinds (no {checkpointing.META_FILE}, "
                      f"config.json or step_<N> checkpoint); {EXPECTED}")


def is_run_directory(path: str | os.PathLike) -> bool:
    """Whether `path` is a run directory (step_<N> checkpoints, no checkpoint or HF model of its own)."""
    try:
        return source_kind(path, "path") == RUN
    except ConfigError:
        return False


def cache_dir() -> Path:
    """The cache's root: $ALIGNER_CACHE_DIR, else $XDG_CACHE_HOME/aligner, else ~/.cache/aligner."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aligner"


def source_digest(path: str | os.PathLike, kind: str) -> str:
    """The cache key of an HF directory or a GGUF file: sha256 over the checkpoint format, the converter's
    code, the kind, and each file's name, size and bytes (an HF directory's top-level files but hidden ones;
    a GGUF file's bytes whatever its name)."""
    source = Path(path)
    digest = hashlib.sha256(f"{checkpointing.FORMAT}\n{kind}\n".encode())
    for module in CONVERTER_MODULES:
        digest.update(Path(module.__file__).read_bytes())
    if kind == GGUF:
        files = [(source, "")]
    else:
        files = [(file, file.name) for file in sorted(source.iterdir())
                 if file.is_file() and not file.name.startswith(".")]
    for file, name in files:
        with open(file, "rb") as handle:
            content = hashlib.file_digest(handle, "sha256").hexdigest()
        digest.update(f"{name}\0{file.stat().st_size}\0{content}\n".encode())
    return digest.hexdigest()


def resolve_model_source(path: str | os.PathLike, key: str, log: Callable[[str], None]) -> Path:
    """The aligner checkpoint a start names (see the module docstring), saying on `log` what was resolved.

    Every rank calls it (collective when distributed) before the model's parallel layout is set up: an
    import starts the process group at TP=1/PP=1 (`distributed.initialize`), which the caller's own
    `initialize` then replaces. Errors name `key`.
    """
    kind = source_kind(path, key)
    if kind == CHECKPOINT:
        return Path(path)
    if kind == RUN:
        latest = checkpointing.latest_intact_checkpoint(
            path, log, verb="starting from",
            remedy=f"delete the damaged step_* directories or set {key} to an intact checkpoint")
        log(f"{key}={path}: its latest intact checkpoint {latest.name}")
        return latest
    return _cached_import(Path(path), kind, key, log)


def _cached_import(source: Path, kind: str, key: str, log: Callable[[str], None]) -> Path:
    """The import cache's checkpoint of `source`, imported first unless the cache holds it."""
    distributed.initialize(distributed.ParallelConfig())  # every rank takes part in the import's save

    def find() -> tuple[str, bool]:
        digest = source_digest(source, kind)
        return digest, _is_cached(cache_dir() / IMPORTS_DIR / digest)

    digest, cached = checkpointing.on_rank0(find)  # rank 0 reads the source; every rank gets the answer
    imports = cache_dir() / IMPORTS_DIR
    target = imports / digest
    if not cached:
        lock = FileLock(str(imports / f"{digest}.lock"))  # rank 0 takes it: another run importing it waits

        def lock_and_look_again() -> bool:
            require_writable_dir(imports, f"the import cache ({CACHE_ENV}={cache_dir()})")
            lock.acquire()
            return _is_cached(target)  # another run may have imported it while this one waited

        try:
            if not checkpointing.on_rank0(lock_and_look_again):
                try:
                    if kind == GGUF:
                        import_gguf(source, target)
                    else:
                        import_hf(source, target)
                except UserError as error:
                    raise type(error)(f"{key}={source}: {error}") from error
                log(f"{key}={source}: imported into the cache at {target} (sha256 {digest[:16]})")
                return target
        finally:
            if lock.is_locked:
                lock.release()
    log(f"{key}={source}: its import cached at {target} (sha256 {digest[:16]}, the same bytes)")
    return target


def _is_cached(target: Path) -> bool:
    """A finished import: written into a staging directory and renamed into place, so whole if present."""
    return (target / checkpointing.META_FILE).is_file() and (target / HF_SOURCE_FILE).is_file()
