"""Disk space: what a checkpoint needs, what is free, and a full disk recognised inside torch's and
megatron's write errors."""
from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from aligner.checkpointing.base import _world
from aligner.runtime.distributed import device

# How a full disk shows through torch's writers: a bare OSError, or its text inside a worker failure
# ("unexpected pos" is torch's zip writer noticing a short write).
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]", "unexpected pos")


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
