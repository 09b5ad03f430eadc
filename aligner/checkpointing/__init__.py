"""Checkpoints on megatron-core `dist_checkpointing`: saved at one TP/PP layout, loadable at any.

A checkpoint is a directory:
    <dir>/                       dist_checkpointing files: "model" (+ "optimizer", "rng_state")
    <dir>/aligner_meta.json      model architecture, parallel layout at save time, trainer state, run id
    <dir>/tokenizer/             the tokenizer files, so a checkpoint is self-contained
    <dir>/aligner_manifest.json  size and sha256 of every other file; `load` checks them first
Training checkpoints live in `<save_dir>/step_<N>/`; a save is written to a temporary sibling
and renamed only when complete, so a crash never leaves a half-written `step_<N>`.

A training run has an id (`run_id` in the meta; a resumed run keeps the id of its checkpoint).
`start_run` locks the save_dir for the run (one live run per save_dir, `aligner.runtime.run_lock`) and
refuses a fresh run in a save_dir that already holds checkpoints; pruning deletes only checkpoints that
carry the run's own id, and a save never replaces another run's, so one run never deletes or adopts another's.

The parts: `base` (file names, CheckpointError, collectives), `manifest` (checksums, `verify`),
`disk_space` (free space, a full disk), `runs` (a run's save_dir: `start_run`, the step checkpoints,
pruning); this module saves and loads, and its names are the package's public ones.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from aligner.checkpointing.base import (
    _STAGING_SUFFIX,
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    TOKENIZER_DIR,
    CheckpointError,
    _all_gather,
    _barrier,
    _rank,
    _world,
    on_rank0,
)
from aligner.checkpointing.disk_space import (
    _causes,
    _disk_full_message,
    _free_bytes,
    _leave_disk_full_to_save,
    _state_bytes,
    checkpoint_bytes,
    estimated_checkpoint_bytes,
    is_disk_full,
)
from aligner.checkpointing.manifest import CHECKSUM, _verified, _verify_once, build_manifest, fingerprint, verify
from aligner.checkpointing.runs import (
    RunStart,
    _run_id_of,
    latest_checkpoint,
    latest_intact_checkpoint,
    remove_old_checkpoints,
    start_run,
    step_checkpoints,
    step_dir,
)
from aligner.runtime import seeds
from aligner.runtime.errors import DataError
from aligner.runtime.files import read_json

__all__ = [
    "CHECKSUM", "FORMAT", "MANIFEST_FILE", "META_FILE", "OPTIMIZER_STATE_FORMAT", "SAVED_KEY_ATTR", "TOKENIZER_DIR",
    "CheckpointError", "RunStart", "build_manifest", "checkpoint_bytes", "estimated_checkpoint_bytes", "fingerprint",
    "is_disk_full", "latest_checkpoint", "latest_intact_checkpoint", "load", "model_sharded_state_dict", "on_rank0",
    "read_meta", "remove_old_checkpoints", "save", "saved_key_predicate", "start_run", "step_checkpoints", "step_dir",
    "unwrap_chunks", "verify",
]


# How megatron's distributed optimizer (GPU) lays out its state in a checkpoint. Its 0.16.1 default,
# 'fully_sharded_model_space', writes flattened ShardedTensors that the same version's
# dist_checkpointing refuses at save (seen on an H100). 'fully_reshardable' stores each parameter's
# state at its full shape, so a checkpoint reloads at another TP/PP/DP layout as on CPU. Other
# optimizers ignore the key.
OPTIMIZER_STATE_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _has_stepped(optimizer) -> bool:
    """Whether the optimizer holds any state (torch's Adam makes it at the first step) on any rank: one answer
    for all, since every rank must save the same kind of checkpoint."""
    here = any(bool(part.optimizer.state) for part in getattr(optimizer, "chained_optimizers", [optimizer]))
    return any(_all_gather(here))


def _fill_unstepped_adam_state(optimizer, only) -> None:
    """Give every parameter of the `only`-typed (chained) parts that has no Adam state the state torch's Adam
    makes at its first step (step 0, zero moments)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, only):
            continue
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


def _prepare_distributed_optimizer_load(optimizer) -> None:
    """Bridge two gaps of megatron-core 0.16.1's distributed optimizer (GPU) on torch's Adam (no apex /
    transformer-engine), both seen on an H100 when a run resumes.

    - Laying out the state to load reads each parameter's Adam 'step' (`assert len(steps) == 1`), which
      torch creates only at the first step, and a resumed run has taken none: zero state is made here
      (loading overwrites all of it).
    - Loading the 'fully_reshardable' format copies every key of a parameter's optimizer state from the
      checkpoint, 'step' included, which that format does not store per parameter (`KeyError: 'step'`):
      the copy keeps the parameter's own step here (megatron sets it from the common state before).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _fill_unstepped_adam_state(optimizer, only=DistributedOptimizer)
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, DistributedOptimizer) or getattr(part, "_aligner_load_prepared", False):
            continue
        copy_states = part._set_main_param_and_optimizer_states

        def copy_states_keeping_step(model_param, tensors, part=part, copy_states=copy_states):
            group_index, group_order = part.model_param_group_index_map[model_param]
            main_param = part.optimizer.param_groups[group_index]["params"][group_order]
            step = part.optimizer.state[main_param].get("step")
            if "step" not in tensors and step is not None:
                tensors = {**tensors, "step": step}
            copy_states(model_param, tensors)

        part._set_main_param_and_optimizer_states = copy_states_keeping_step
        part._aligner_load_prepared = True


# A chunk that trains only part of its weights carries the predicate (chunk, state-dict key) -> saved under
# this attribute, set by what narrows it (`models.lora.apply_lora`: the adapters and the modules trained
# whole); checkpointing reads it from the chunks, so it imports nothing from the model layer.
SAVED_KEY_ATTR = "checkpoint_saved_key"


def saved_key_predicate(chunks: Sequence[torch.nn.Module]) -> Optional[Callable[[torch.nn.Module, str], bool]]:
    """The predicate of (unwrapped) chunks that save only part of their state (adapters); None: they save all."""
    return next((getattr(chunk, SAVED_KEY_ATTR) for chunk in chunks if hasattr(chunk, SAVED_KEY_ATTR)), None)


def model_sharded_state_dict(model_chunks: Sequence[torch.nn.Module]) -> dict:
    """Sharded state dict of the (possibly virtual-pipeline) model chunks, DDP wrappers unwrapped; of chunks
    with LoRA adapters, the adapters' entries only."""
    chunks = unwrap_chunks(model_chunks)
    states = [chunk.sharded_state_dict() for chunk in chunks]
    is_saved = saved_key_predicate(chunks)
    if is_saved is not None:  # LoRA training: the adapters (and any head trained whole) only; the base
        # stays in model.init_from
        states = [{key: value for key, value in state.items() if is_saved(chunk, key)}
                  for chunk, state in zip(chunks, states)]
    if len(chunks) == 1:
        return states[0]
    return {f"model{i}": state for i, state in enumerate(states)}


def unwrap_chunks(model_chunks: Sequence[torch.nn.Module]) -> list:
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model_chunks))


def read_meta(checkpoint_dir: str | os.PathLike) -> dict:
    path = Path(checkpoint_dir) / META_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint_dir} is not an aligner checkpoint (no {META_FILE}); expected a directory "
            f"written by aligner (a training step_<N> directory or an HF import)"
        )
    try:
        meta = read_json(path)
    except DataError as error:  # e.g. cut short by a full disk: `path:line: not valid JSON (...)`
        raise CheckpointError(str(error)) from None
    found = meta.get("format") if isinstance(meta, dict) else f"a JSON {type(meta).__name__}"
    if found != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {found!r}, expected {FORMAT!r}")
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
    run_id: Optional[str] = None,
) -> Path:
    """Save atomically to `checkpoint_dir` (collective: every rank calls it).

    The manifest is written last, over the final files, before the rename makes the checkpoint
    visible. A failed save removes its staging directory; a full disk (found before writing when
    the free space is already too small) is a CheckpointError saying so.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    final = Path(checkpoint_dir)
    staging = final.with_name(final.name + _STAGING_SUFFIX)
    _verified.discard(str(final.resolve()))
    _leave_disk_full_to_save()

    model_state = model_sharded_state_dict(model_chunks)
    state: dict[str, Any] = {"model": model_state}
    # An optimizer that has not stepped (a checkpoint at step 0, or after an iteration without a step) has no
    # state to save: megatron would save it without its step (it drops a step of 0) and fail to load it.
    # A resume then starts from a fresh optimizer, which is the same thing.
    optimizer_stepped = optimizer is not None and _has_stepped(optimizer)
    if optimizer_stepped:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, metadata=OPTIMIZER_STATE_FORMAT)
    if save_rng:
        state["rng_state"] = ShardedObject("rng_state", seeds.rng_state(), (_world(),), (_rank(),), replica_id=0)
    tensor_bytes, needed = _state_bytes(state)

    def prepare() -> None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        if _free_bytes(staging) < tensor_bytes:  # cannot fit: refuse before writing anything
            raise CheckpointError(_disk_full_message(final, needed))

    def write_meta() -> None:
        meta = {
            "format": FORMAT,
            "model": model_config,
            "parallel": _parallel_layout(),
            "trainer_state": trainer_state or {},
            "has_optimizer": optimizer is not None,
            "optimizer_stepped": optimizer_stepped,
            "has_rng_state": save_rng,
            **({"run_id": run_id} if run_id is not None else {}),
            **(extra_meta or {}),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if tokenizer_dir is not None:
            shutil.copytree(tokenizer_dir, staging / TOKENIZER_DIR)

    def publish(manifest: dict) -> None:
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if final.exists():
            # Replaced: this run's own newer checkpoint that a resume fell back from, or a damaged one whose meta
            # is unreadable. Another run's is never deleted: under the save_dir lock it can only be there if
            # something outside this run put it there, so this run's checkpoint is kept beside it.
            owner = _run_id_of(final)
            if run_id is not None and owner is not None and owner != run_id:
                kept = final.with_name(f"{final.name}.run_{run_id}")
                os.replace(staging, kept)
                raise CheckpointError(f"cannot save {final}: it holds a checkpoint of another run ({owner}), which "
                                      f"is not deleted; this run ({run_id}) saved its checkpoint as {kept}: is "
                                      "another process writing to this checkpoint.save_dir?")
            shutil.rmtree(final)
        os.replace(staging, final)

    try:
        on_rank0(prepare)
        dist_checkpointing.save(state, str(staging))
        _barrier()
        on_rank0(write_meta)
        manifest = build_manifest(staging)
        on_rank0(lambda: publish(manifest))
    except BaseException as error:  # also torch's CheckpointException, a BaseException, and interrupts
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, CheckpointError):
            raise
        if is_disk_full(error):
            raise CheckpointError(_disk_full_message(final, needed)) from error
        if isinstance(error, OSError):
            raise CheckpointError(f"cannot save {final}: {error}") from error
        raise
    return final


def load(
    checkpoint_dir: str | os.PathLike,
    model_chunks: Sequence[torch.nn.Module],
    *,
    optimizer=None,
    load_rng: bool = False,
    skip_prefixes: Sequence[str] = (),
    model_config: Optional[dict] = None,
) -> dict:
    """Load model (and optionally optimizer and RNG) state into the given layout; returns the meta.

    The files are checked against the checkpoint's manifest first (once per process and checkpoint).
    skip_prefixes: parameter names (per chunk) starting with these are not loaded and keep their
    current values, e.g. a reward head that an SFT checkpoint does not have.
    model_config: this model's architecture (a GPTConfig dict): when the checkpoint does not fit, the
    settings that differ from the checkpoint's are named.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    _verify_once(checkpoint_dir)  # first: a damaged meta file is named as damage
    meta = read_meta(checkpoint_dir)
    is_saved = saved_key_predicate(unwrap_chunks(model_chunks))
    adapters_here = is_saved is not None
    if "peft" in meta and not adapters_here:
        raise CheckpointError(f"{checkpoint_dir} holds LoRA adapters only (base model: {meta['peft']['base']}), not a "
                              "whole model; load it with its base (peft.scheme=lora, model.init_from=the base)")
    if adapters_here and "peft" not in meta:
        raise CheckpointError(f"{checkpoint_dir} is a whole model, not LoRA adapters; give it as model.init_from")
    model_state = model_sharded_state_dict(model_chunks)
    if skip_prefixes:
        model_state = _without_prefixes(model_state, tuple(skip_prefixes), len(model_chunks) > 1)
    request: dict[str, Any] = {"model": model_state}
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{checkpoint_dir} has no optimizer state; it cannot resume a training run")
    if optimizer is not None and meta.get("optimizer_stepped", True):  # (unstepped: a fresh optimizer is the same)
        _prepare_distributed_optimizer_load(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=True,
                                                            metadata=OPTIMIZER_STATE_FORMAT)
    same_layout = meta["parallel"] == _parallel_layout()
    load_rng = load_rng and meta.get("has_rng_state", False) and same_layout
    if load_rng:
        request["rng_state"] = ShardedObject("rng_state", None, (_world(),), (_rank(),), replica_id=0)
    try:
        loaded = dist_checkpointing.load(request, str(checkpoint_dir))
    except (Exception, _torch_checkpoint_exception()) as error:  # torch's CheckpointException is a BaseException
        damage = _read_failure(error)
        if damage is not None:  # a checkpoint without a manifest whose files are damaged
            raise CheckpointError(f"{checkpoint_dir} is damaged: {damage}") from error
        differences = _architecture_differences(meta.get("model"), model_config)
        if differences:
            raise CheckpointError(f"{checkpoint_dir} holds a model of another architecture than this run's "
                                  f"({differences}): give this run the settings the checkpoint was saved with, or "
                                  "another checkpoint") from error
        missing = sorted(set(re.findall(r"KeyError\('([^']+)'", repr(error))))[:5]
        detail = f"missing tensors {missing}" if missing else _load_failure_detail(error)
        raise CheckpointError(
            f"{checkpoint_dir}: cannot load it into this model ({detail}); is it the right kind of checkpoint "
            f"(policy vs reward model) and architecture?"
        ) from error

    chunks = unwrap_chunks(model_chunks)
    for i, chunk in enumerate(chunks):
        state = loaded["model"] if len(chunks) == 1 else loaded["model"][f"model{i}"]
        # A LoRA checkpoint holds the adapters only: the base weights stay as loaded from its base.
        result = chunk.load_state_dict(state, strict=not skip_prefixes and not adapters_here)
        if adapters_here:
            missing_saved = [key for key in result.missing_keys
                             if is_saved(chunk, key) and not key.startswith(tuple(skip_prefixes))]
            if result.unexpected_keys or missing_saved:
                raise CheckpointError(f"{checkpoint_dir}: its adapters do not match this run's peft settings "
                                      f"(missing {missing_saved[:3]}, unexpected {result.unexpected_keys[:3]})")
        elif skip_prefixes:
            missing = [key for key in result.missing_keys if not key.startswith(tuple(skip_prefixes))]
            if missing or result.unexpected_keys:
                raise CheckpointError(f"{checkpoint_dir}: missing {missing}, unexpected {result.unexpected_keys}")
    if "optimizer" in request:
        optimizer.load_state_dict(loaded["optimizer"])
    if load_rng:
        seeds.set_rng_state(loaded["rng_state"])
    meta["rng_restored"] = load_rng
    return meta


def _read_failure(error: BaseException) -> Optional[str]:
    """The file-level cause (a missing or short file) inside a dist_checkpointing load error, if any."""
    for cause in _causes(error):
        if isinstance(cause, (EOFError, OSError)):
            return f"{type(cause).__name__}: {cause}".splitlines()[0][:500]
    return None


def _architecture_differences(saved: Optional[dict], wanted: Optional[dict]) -> str:
    """'key: A in the checkpoint, B here' for each architecture setting that differs ('' if none or unknown)."""
    if not saved or not wanted:
        return ""
    return "; ".join(f"{key}: {saved[key]} in the checkpoint, {wanted[key]} here"
                     for key in sorted(set(saved) & set(wanted)) if saved[key] != wanted[key])


# megatron's words for a tensor whose shape differs between the checkpoint and the model
_SHAPE_MISMATCH = re.compile(r"shape mismatch for loaded \((.+?)\) and expected \((.+?)\) tensor for key (\S+)")


def _load_failure_detail(error: BaseException) -> str:
    """What a dist_checkpointing load failure says, from the exceptions it wraps (torch's
    CheckpointException itself reads only 'CheckpointException ranks:dict_keys([0])')."""
    wrapper = _torch_checkpoint_exception()
    messages = [str(cause) for cause in _causes(error) if str(cause) and not isinstance(cause, wrapper)]
    for message in messages:
        if (shape := _SHAPE_MISMATCH.search(message)) is not None:
            loaded, expected = ([int(size) for size in re.findall(r"\d+", text)] for text in shape.groups()[:2])
            return f"{shape.group(3)} has shape {loaded} in the checkpoint, {expected} in this model"
    return (messages[0] if messages else str(error)).splitlines()[0][:500]


def _torch_checkpoint_exception() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _without_prefixes(state: dict, prefixes: tuple, per_chunk: bool) -> dict:
    if per_chunk:
        return {name: _without_prefixes(chunk_state, prefixes, False) for name, chunk_state in state.items()}
    return {key: value for key, value in state.items() if not key.startswith(prefixes)}
