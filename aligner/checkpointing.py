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
"""
from __future__ import annotations

import errno
import hashlib
import heapq
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from aligner.config import OutputError, require_writable_dir
from aligner.runtime import run_lock, seeds
from aligner.runtime.distributed import device
from aligner.runtime.errors import DataError, UserError
from aligner.runtime.files import read_json

META_FILE = "aligner_meta.json"
MANIFEST_FILE = "aligner_manifest.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "aligner-megatron-v1"
CHECKSUM = "sha256"  # ~2 GB/s per core with SHA extensions, split over ranks; `sha256sum` checks a file by hand
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGING_SUFFIX = ".incomplete"
# How a full disk shows through torch's writers: a bare OSError, or its text inside a worker failure
# ("unexpected pos" is torch's zip writer noticing a short write).
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]", "unexpected pos")

# Checkpoints whose files this process has checked against their manifest (all ranks agree on it).
_verified: set[str] = set()


class CheckpointError(UserError, RuntimeError):
    """A checkpoint to load is missing, incomplete or damaged, or one cannot be saved."""


# ----------------------------------------------------------------------------- collectives
def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast(value: Any) -> Any:
    """Rank 0's value, on every rank."""
    if not dist.is_initialized() or _world() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _all_gather(value: Any) -> list:
    if not dist.is_initialized() or _world() == 1:
        return [value]
    gathered: list = [None] * _world()
    dist.all_gather_object(gathered, value)
    return gathered


def on_rank0(work: Callable[[], Any]) -> Any:
    """Run `work` on rank 0 only and return its result on every rank.

    An exception on rank 0 is raised on every rank (the original there, a CheckpointError with its
    message elsewhere), so no rank is left waiting in a collective for a rank that failed.
    """
    result, failure = None, None
    if _rank() == 0:
        try:
            result = work()
        except Exception as error:  # noqa: BLE001 - raised below on every rank, so none waits for rank 0
            failure = error
    outcome = _broadcast((result, None if failure is None else str(failure)))
    if failure is not None:
        raise failure
    if outcome[1] is not None:
        raise CheckpointError(outcome[1])
    return outcome[0]


# ----------------------------------------------------------------------------- meta
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


# ----------------------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, CHECKSUM).hexdigest()


def fingerprint(checkpoint_dir: str | os.PathLike) -> Optional[str]:
    """An id of a checkpoint's contents that survives moving it: the digest of its manifest (which lists
    every file's checksum); None for a checkpoint without a manifest."""
    path = Path(checkpoint_dir) / MANIFEST_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


def _owners(sizes: Sequence[int], world: int) -> list[int]:
    """The rank that reads each file: largest first to the least-loaded rank (about total/world bytes each)."""
    loads = [(0, rank) for rank in range(world)]  # a heap of (bytes so far, rank)
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owner[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owner


def _listed_files(directory: Path) -> list[tuple[str, int]]:
    """(path relative to directory, size) of every file under it but the manifest, sorted."""
    files = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and relative != MANIFEST_FILE:
            files.append((relative, path.stat().st_size))
    return sorted(files)


def build_manifest(directory: str | os.PathLike) -> dict:
    """{"checksum": "sha256", "files": {relative path: {"size", "sha256"}}} of every file in directory.

    Collective when distributed: rank 0 lists the files, each rank hashes its share (split by size,
    so a checkpoint is read once in total), every rank returns the whole manifest.
    """
    root = Path(directory)
    files = _broadcast(_listed_files(root) if _rank() == 0 else None)
    owners = _owners([size for _, size in files], _world())
    mine: dict[str, str] = {}
    failure = None
    for (name, _), owner in zip(files, owners):
        if owner == _rank() and failure is None:
            try:
                mine[name] = _sha256(root / name)
            except OSError as error:  # reported on every rank below, so none waits in the gather
                failure = f"cannot read {root / name} to checksum it: {error}"
    shares = _all_gather((mine, failure))
    failures = [failed for _, failed in shares if failed is not None]
    if failures:
        raise OSError(failures[0])
    digests = {name: digest for share, _ in shares for name, digest in share.items()}
    return {"checksum": CHECKSUM, "files": {name: {"size": size, CHECKSUM: digests[name]} for name, size in files}}


def _file_problem(root: Path, name: str, expected: dict) -> Optional[str]:
    path = root / name
    if not path.is_file():
        return f"{name} is missing"
    try:
        size = path.stat().st_size
        if size < expected["size"]:
            return f"{name} is truncated to {size} of {expected['size']} bytes"
        if size > expected["size"]:
            return f"{name} has {size} bytes, {expected['size']} expected"
        if _sha256(path) != expected[CHECKSUM]:
            return f"{name} fails its {CHECKSUM} check (its bytes changed after the save)"
    except OSError as error:
        return f"{name} cannot be read ({error})"
    return None


def verify(checkpoint_dir: str | os.PathLike) -> Optional[str]:
    """None if every file of the checkpoint matches its manifest, else one line naming the damage.

    A checkpoint without a manifest (written before manifests existed) is not checked. Collective
    when distributed: each rank checks a share of the files (each file read once), all get the verdict.
    """
    root = Path(checkpoint_dir)

    def read_manifest():
        """The manifest's files, None without a manifest, or why it cannot be used."""
        path = root / MANIFEST_FILE
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
            files = sorted(manifest["files"].items())
            if manifest["checksum"] != CHECKSUM or not all(
                    isinstance(entry["size"], int) and isinstance(entry[CHECKSUM], str) for _, entry in files):
                raise ValueError(f"not a {CHECKSUM} manifest")
            return files
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return f"its {MANIFEST_FILE} is unreadable ({type(error).__name__}: {error})"

    files = _broadcast(read_manifest() if _rank() == 0 else None)
    if files is None:
        return None
    if isinstance(files, str):
        return f"{root} is damaged: {files}"
    owners = _owners([entry["size"] for _, entry in files], _world())
    mine = [(index, problem) for index, ((name, entry), owner) in enumerate(zip(files, owners))
            if owner == _rank() and (problem := _file_problem(root, name, entry)) is not None]
    problems = [problem for _, problem in sorted(found for share in _all_gather(mine) for found in share)]
    if not problems:
        return None
    others = len(problems) - 1
    more = f" (and {others} more damaged file{'s' if others > 1 else ''})" if others else ""
    return f"{root} is damaged: {problems[0]}{more}"


def _verify_once(checkpoint_dir: str | os.PathLike) -> None:
    key = str(Path(checkpoint_dir).resolve())
    if key in _verified:
        return
    problem = verify(checkpoint_dir)
    if problem is not None:
        raise CheckpointError(problem)
    _verified.add(key)


# ----------------------------------------------------------------------------- disk space
def _size(num_bytes: int) -> str:
    return f"{num_bytes:,} bytes ({num_bytes / 2**20:,.1f} MiB)"


def _mount_point(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def _free_bytes(path: Path) -> int:
    existing = Path(os.path.abspath(path))
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _disk_full_message(path: Path, needed: int) -> str:
    return (f"disk full while saving {path}: needs about {_size(needed)}, {_size(_free_bytes(path))} free on "
            f"{_mount_point(path)}")


def is_disk_full(error: BaseException) -> bool:
    """Whether an exception (or one it wraps, also inside torch's worker failures) is a full disk or quota."""
    return any((isinstance(cause, OSError) and cause.errno in _DISK_FULL_ERRNOS)
               or any(text in str(cause) for text in _DISK_FULL_TEXT) for cause in _causes(error))


def _causes(error: BaseException):
    """The exception and every one it wraps: causes, contexts, and torch's per-rank `failures`."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if isinstance(current, tuple):  # torch's CheckpointException.failures: rank -> (exception, traceback)
            current = current[0] if current else None
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        pending += [current.__cause__, current.__context__, *(failures.values() if isinstance(failures, dict) else ())]


def _not_a_disk_full_report(record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in _DISK_FULL_TEXT)


def _leave_disk_full_to_save() -> None:
    """Megatron's writer processes log a full disk themselves before `save` reports it in one line."""
    writer_logger = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if _not_a_disk_full_report not in writer_logger.filters:
        writer_logger.addFilter(_not_a_disk_full_report)


def _state_bytes(state: dict) -> tuple[int, int]:
    """(bytes of tensor data, about the bytes of files) a save of this sharded state writes, summed over
    ranks (collective). The tensor data is a floor; each stored tensor also gets a record header
    (~2 KiB measured with torch's writer), which matters only for tiny models."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    stored = [value.data for value in nested_values(state)
              if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(value.data, torch.Tensor)
              and is_main_replica(value.replica_id)]
    totals = [sum(tensor.numel() * tensor.element_size() for tensor in stored), len(stored)]
    if dist.is_initialized() and _world() > 1:
        reduced = torch.tensor(totals, dtype=torch.int64, device=device())
        dist.all_reduce(reduced)
        totals = [int(value) for value in reduced.tolist()]
    tensor_bytes, num_tensors = totals
    return tensor_bytes, tensor_bytes + 2048 * num_tensors


def estimated_checkpoint_bytes(num_params: int, params_dtype: torch.dtype) -> int:
    """Size of a training checkpoint before any exists, from the parameter count.

    Per parameter: the weight in params_dtype, Adam's two fp32 moments, and for 16-bit weights the
    fp32 main copy the mixed-precision optimizer keeps: 12 bytes (fp32) or 14 bytes (bf16/fp16).
    """
    weight = torch.empty((), dtype=params_dtype).element_size()
    main_copy = 0 if params_dtype == torch.float32 else 4
    return num_params * (weight + 4 + 4 + main_copy)


def checkpoint_bytes(checkpoint_dir: str | os.PathLike) -> int:
    return sum(path.stat().st_size for path in Path(checkpoint_dir).rglob("*") if path.is_file())


# ----------------------------------------------------------------------------- save / load
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


# ----------------------------------------------------------------------------- a run's save_dir
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


_RESUME_REMEDY = ("delete the damaged step_* directories to start over, or set checkpoint.resume=false with another "
                  "checkpoint.save_dir")


def latest_checkpoint(save_dir: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under save_dir (unchecked; a resume uses `latest_intact_checkpoint`)."""
    found = step_checkpoints(save_dir)
    return found[-1][1] if found else None


def latest_intact_checkpoint(save_dir: str | os.PathLike, log: Callable[[str], None], *, verb: str = "resuming from",
                             remedy: str = _RESUME_REMEDY) -> Optional[Path]:
    """The newest complete checkpoint under save_dir whose files match its manifest (collective).

    A damaged newer one is reported through `log` (its path and what is wrong) and skipped; None
    if save_dir holds no checkpoint; a CheckpointError (ending with `remedy`) if every one is damaged.
    verb: what the caller does with the checkpoint, for the lines on `log` (a resume; a start from a run dir).
    """
    found = _broadcast(step_checkpoints(save_dir) if _rank() == 0 else None)
    damaged = []
    for _, path in reversed(found):
        problem = verify(path)
        if problem is None:
            _verified.add(str(path.resolve()))
            if damaged:
                log(f"{verb} {path} instead: the newest intact checkpoint")
            return path
        log(f"warning: {problem}; not {verb} it")
        damaged.append(problem)
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {save_dir}: {'; '.join(damaged)}; {remedy}")
    return None


def step_dir(save_dir: str | os.PathLike, step: int) -> Path:
    return Path(save_dir) / f"step_{step:08d}"


def remove_old_checkpoints(save_dir: str | os.PathLike, keep_last: int, *, run_id: str, saved: Path) -> None:
    """After saving `saved`, keep it and the `keep_last - 1` newest older checkpoints of run `run_id`;
    delete this run's older ones (rank 0 deletes; keep_last <= 0 keeps all).

    Only checkpoints whose meta carries `run_id` are ever deleted. Newer ones of this run (left by
    an attempt that a resume fell back from past a damaged checkpoint) are kept: a later save of
    their step replaces them.
    """
    if keep_last <= 0 or _rank() != 0:
        return
    saved_step = int(_STEP_DIR.match(Path(saved).name).group(1))
    own = [path for step, path in step_checkpoints(save_dir) if step < saved_step and _run_id_of(path) == run_id]
    for path in own[:max(len(own) - (keep_last - 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


def _run_id_of(checkpoint_dir: Path) -> Optional[str]:
    try:
        return json.loads((checkpoint_dir / META_FILE).read_text()).get("run_id")
    except (OSError, ValueError):
        return None


@dataclass
class RunStart:
    """What `start_run` decided: the run's id and the checkpoint to resume from (None: a fresh start)."""

    run_id: str
    resume_checkpoint: Optional[Path]


def start_run(save_dir: str | os.PathLike, *, resume: bool, estimated_bytes: int,
              log: Callable[[str], None], lock_wait_s: float = 0.0) -> RunStart:
    """Start-up checks of a training run's checkpoint.save_dir, before the model is built (collective).

    - save_dir must be writable; it is locked for this run (rank 0 holds `run_lock`'s lock until the
      process ends): a save_dir another live run holds is refused, after waiting up to `lock_wait_s`
      seconds for that run to end;
    - resume=false into a save_dir that holds complete checkpoints is refused (nothing is deleted);
    - there must be free space for one more checkpoint (the newest existing checkpoint's size, else
      `estimated_bytes`);
    - partial saves an interrupted run left behind (step_*.incomplete) are removed (under the lock: no
      live run's);
    - with resume, the newest intact checkpoint is chosen (`latest_intact_checkpoint`) and its run id kept.
    """
    root = Path(save_dir)

    def check() -> None:
        existing = step_checkpoints(root)
        if existing and not resume:
            held = existing[0][1].name if len(existing) == 1 else f"{existing[0][1].name} to {existing[-1][1].name}"
            raise CheckpointError(
                f"checkpoint.save_dir={root} already holds {len(existing)} checkpoint(s) of an earlier run ({held}) "
                f"and checkpoint.resume=false would mix this run with them: set "
                f"checkpoint.resume=true to continue that run, choose another checkpoint.save_dir, or delete "
                f"those step_* directories to start over")
        for partial in root.glob(f"step_*{_STAGING_SUFFIX}"):
            shutil.rmtree(partial, ignore_errors=True)
            log(f"removed {partial}, a partial save left by an interrupted run")
        needed = checkpoint_bytes(existing[-1][1]) if existing else estimated_bytes
        free = _free_bytes(root)
        if free < needed:
            raise CheckpointError(
                f"checkpoint.save_dir={root}: too little free space for a checkpoint: needs about {_size(needed)}, "
                f"{_size(free)} free on {_mount_point(root)}")

    _lock_save_dir(root, lock_wait_s, log)
    try:
        on_rank0(check)
        resume_checkpoint = latest_intact_checkpoint(root, log) if resume else None
        run_id = on_rank0(lambda: (_run_id_of(resume_checkpoint) if resume_checkpoint else None) or uuid.uuid4().hex)
        on_rank0(lambda: run_lock.record_run_id(root, run_id))
    except BaseException:
        if _rank() == 0:
            run_lock.release(root)
        raise
    return RunStart(run_id, resume_checkpoint)


_LOCK_POLL_S = 1.0  # while checkpoint.lock_wait_s waits: every rank meets rank 0 this often (no long collective)


def _lock_save_dir(root: Path, wait_s: float, log: Callable[[str], None]) -> None:
    """Rank 0 locks save_dir for this process (`run_lock`), waiting up to `wait_s` seconds for a holder to end;
    every rank raises the same CheckpointError if it cannot."""
    deadline = time.monotonic() + wait_s

    def attempt() -> Optional[str]:
        """None: locked; else the holder, while there is time left to wait for it."""
        try:
            require_writable_dir(root, "checkpoint.save_dir")
        except OutputError as error:
            raise CheckpointError(str(error)) from None
        try:
            stale = run_lock.acquire(root)
        except run_lock.LockHeld as held:
            if time.monotonic() < deadline:
                return str(held.holder or "another process")
            raise CheckpointError(_lock_held_message(root, held, wait_s)) from None
        except OSError as error:
            raise CheckpointError(f"checkpoint.save_dir={root}: cannot lock {run_lock.lock_file(root)} ({error})") \
                from None
        if stale is not None and stale.silent_s is not None:
            log(f"took over {run_lock.lock_file(root)} from {stale}, whose heartbeat has been silent for "
                f"{stale.silent_s:.0f} s (a run on another host counts as ended after {run_lock.STALE_AFTER_S:g} s)")
        elif stale is not None:
            log(f"took over {run_lock.lock_file(root)} from {stale}, which ended without releasing it")
        return None

    waiting = False
    while (holder := on_rank0(attempt)) is not None:
        if not waiting:
            log(f"checkpoint.save_dir={root} is in use by {holder}: waiting up to checkpoint.lock_wait_s={wait_s:g} s "
                "for it to end")
            waiting = True
        time.sleep(_LOCK_POLL_S)


def _lock_held_message(root: Path, held: run_lock.LockHeld, wait_s: float) -> str:
    heartbeat = "" if held.holder is None or held.holder.silent_s is None else (
        f", whose heartbeat in {held.lock_file} was last seen {held.holder.silent_s:.0f} s ago (a run on another "
        f"host counts as ended after {run_lock.STALE_AFTER_S:g} s without one)")
    waited = f" (still after checkpoint.lock_wait_s={wait_s:g} s)" if wait_s > 0 else ""
    return (f"checkpoint.save_dir={root} is in use by {held.holder or 'another process'}{heartbeat}{waited}: one "
            f"run per save_dir; wait for that run to end (or stop it), set checkpoint.lock_wait_s to wait for it, or "
            f"choose another checkpoint.save_dir")
