"""A training run's save_dir: its step_<N> checkpoints (the newest, the newest intact one, pruning) and
the start of a run (`start_run`: the lock, the checks, resume or a fresh run id)."""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from aligner.checkpointing.base import (
    _STAGING_SUFFIX,
    _STEP_DIR,
    META_FILE,
    CheckpointError,
    _broadcast,
    _rank,
    on_rank0,
)
from aligner.checkpointing.disk_space import _free_bytes, _mount_point, _size, checkpoint_bytes
from aligner.checkpointing.manifest import _verified, verify
from aligner.config import OutputError, require_writable_dir
from aligner.runtime import run_lock


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
                f"{stale.silent_s:.0f} s (a run on another host counts as ended after {run_lock.stale_after_s():g} s)")
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
        f"host counts as ended after {run_lock.stale_after_s():g} s without one)")
    waited = f" (still after checkpoint.lock_wait_s={wait_s:g} s)" if wait_s > 0 else ""
    return (f"checkpoint.save_dir={root} is in use by {held.holder or 'another process'}{heartbeat}{waited}: one "
            f"run per save_dir; wait for that run to end (or stop it), set checkpoint.lock_wait_s to wait for it, or "
            f"choose another checkpoint.save_dir")
