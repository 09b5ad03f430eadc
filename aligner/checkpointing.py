"""Checkpoints on megatron-core `dist_checkpointing`: saved at one TP/PP layout, loadable at any.

A checkpoint is a directory:
    <dir>/                     dist_checkpointing files: "model" (+ "optimizer", "rng_state")
    <dir>/aligner_meta.json    model architecture, parallel layout at save time, trainer state
    <dir>/tokenizer/           the tokenizer files, so a checkpoint is self-contained
Training checkpoints live in `<save_dir>/step_<N>/`; a save is written to a temporary sibling
and renamed only when complete, so a crash never leaves a half-written `step_<N>`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

META_FILE = "aligner_meta.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "aligner-megatron-v1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    pass


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def model_sharded_state_dict(model_chunks: Sequence[torch.nn.Module]) -> dict:
    """Sharded state dict of the (possibly virtual-pipeline) model chunks, DDP wrappers unwrapped."""
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(list(model_chunks))
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def read_meta(checkpoint_dir: str | os.PathLike) -> dict:
    path = Path(checkpoint_dir) / META_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint_dir} is not an aligner checkpoint (no {META_FILE}); expected a directory "
            f"written by aligner (a training step_<N> directory or an HF import)"
        )
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _parallel_layout() -> dict:
    from megatron.core import parallel_state as ps

    layout = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "world_size": _world(),
    }
    expert_parallel = ps.get_expert_model_parallel_world_size()
    if expert_parallel > 1:  # only then: layouts of checkpoints without MoE compare as before
        layout["expert_model_parallel_size"] = expert_parallel
    return layout


def save(
    checkpoint_dir: str | os.PathLike,
    model_chunks: Sequence[torch.nn.Module],
    *,
    model_config: dict,
    extra_meta: Optional[dict] = None,
    optimizer=None,
    trainer_state: Optional[dict] = None,
    tokenizer_dir: Optional[str | os.PathLike] = None,
    save_rng: bool = False,
) -> Path:
    """Save atomically to `checkpoint_dir` (collective: every rank calls it)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from aligner.runtime import seeds

    final = Path(checkpoint_dir)
    staging = final.with_name(final.name + ".incomplete")
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()

    model_state = model_sharded_state_dict(model_chunks)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state)
    if save_rng:
        state["rng_state"] = ShardedObject("rng_state", seeds.rng_state(), (_world(),), (_rank(),), replica_id=0)
    dist_checkpointing.save(state, str(staging))
    _barrier()

    if _rank() == 0:
        meta = {
            "format": FORMAT,
            "model": model_config,
            "parallel": _parallel_layout(),
            "trainer_state": trainer_state or {},
            "has_optimizer": optimizer is not None,
            "has_rng_state": save_rng,
            **(extra_meta or {}),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if tokenizer_dir is not None:
            shutil.copytree(tokenizer_dir, staging / TOKENIZER_DIR)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    _barrier()
    return final


def load(
    checkpoint_dir: str | os.PathLike,
    model_chunks: Sequence[torch.nn.Module],
    *,
    optimizer=None,
    load_rng: bool = False,
    skip_prefixes: Sequence[str] = (),
) -> dict:
    """Load model (and optionally optimizer and RNG) state into the given layout; returns the meta.

    skip_prefixes: parameter names (per chunk) starting with these are not loaded and keep their
    current values, e.g. a reward head that an SFT checkpoint does not have.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    meta = read_meta(checkpoint_dir)
    model_state = model_sharded_state_dict(model_chunks)
    if skip_prefixes:
        model_state = _without_prefixes(model_state, tuple(skip_prefixes), len(model_chunks) > 1)
    request: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        if not meta.get("has_optimizer"):
            raise CheckpointError(f"{checkpoint_dir} has no optimizer state; it cannot resume a training run")
        request["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=True)
    same_layout = meta["parallel"] == _parallel_layout()
    load_rng = load_rng and meta.get("has_rng_state", False) and same_layout
    if load_rng:
        request["rng_state"] = ShardedObject("rng_state", None, (_world(),), (_rank(),), replica_id=0)
    try:
        loaded = dist_checkpointing.load(request, str(checkpoint_dir))
    except (Exception, _torch_checkpoint_exception()) as error:  # torch's CheckpointException is a BaseException
        missing = sorted(set(re.findall(r"KeyError\('([^']+)'", repr(error))))[:5]
        detail = f"missing tensors {missing}" if missing else str(error).splitlines()[0][:500]
        raise CheckpointError(
            f"{checkpoint_dir}: cannot load it into this model ({detail}); is it the right kind of checkpoint "
            f"(policy vs reward model) and architecture?"
        ) from error

    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(list(model_chunks))
    for i, chunk in enumerate(chunks):
        state = loaded["model"] if len(chunks) == 1 else loaded["model"][f"model{i}"]
        result = chunk.load_state_dict(state, strict=not skip_prefixes)
        if skip_prefixes:
            missing = [key for key in result.missing_keys if not key.startswith(tuple(skip_prefixes))]
            if missing or result.unexpected_keys:
                raise CheckpointError(f"{checkpoint_dir}: missing {missing}, unexpected {result.unexpected_keys}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if load_rng:
        from aligner.runtime import seeds

        seeds.set_rng_state(loaded["rng_state"])
    meta["rng_restored"] = load_rng
    return meta


def _torch_checkpoint_exception() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _without_prefixes(state: dict, prefixes: tuple, per_chunk: bool) -> dict:
    if per_chunk:
        return {name: _without_prefixes(chunk_state, prefixes, False) for name, chunk_state in state.items()}
    return {key: value for key, value in state.items() if not key.startswith(prefixes)}


def step_checkpoints(save_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete training checkpoints under save_dir, oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(save_dir: str | os.PathLike) -> Optional[Path]:
    found = step_checkpoints(save_dir)
    return found[-1][1] if found else None


def step_dir(save_dir: str | os.PathLike, step: int) -> Path:
    return Path(save_dir) / f"step_{step:08d}"


def remove_old_checkpoints(save_dir: str | os.PathLike, keep_last: int) -> None:
    """Keep the newest `keep_last` training checkpoints (rank 0 deletes; <= 0 keeps all)."""
    if keep_last <= 0 or _rank() != 0:
        return
    for _, path in step_checkpoints(save_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
