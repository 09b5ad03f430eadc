"""What every part of a checkpoint shares: the names of its files, its error, and the collectives (each
also runs without torch.distributed, as one rank)."""
from __future__ import annotations

import re
from typing import Any, Callable

import torch.distributed as dist

from aligner.runtime.errors import UserError

META_FILE = "aligner_meta.json"
MANIFEST_FILE = "aligner_manifest.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "aligner-megatron-v1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGING_SUFFIX = ".incomplete"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint to load is missing, incomplete or damaged, or one cannot be saved."""


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
