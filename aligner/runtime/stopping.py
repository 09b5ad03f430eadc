"""Graceful stops on SIGTERM and SIGINT: stop at a step boundary, checkpoint, exit 128 + signal.

Every entry point calls `install()` (through `aligner.config.run_main`). A process is in one of two modes:

* immediate (the default: start-up, model building, anything outside a training loop): the first
  signal raises `Interrupted` (a KeyboardInterrupt) where the program is; entry points turn it into
  one line and exit 128 + the signal number, without a traceback.
* deferred (inside a training loop, `with stopping.deferred(grace_s) as stop:`): the signal is only
  recorded. At each step boundary the loop calls `stop.check(step, save)`, which agrees on the request
  over every rank of the job (an all_reduce MAX of the signal number: ranks may see the signal at
  different steps, e.g. when a scheduler signals one process) and, once any rank saw one, has every
  rank write the checkpoint through the loop's normal save path, print
  `stopped at step N ...; resume with the same command`, and raise `Stopped`.

The grace period (checkpoint.stop_grace_s) counts from the signal: past it the process exits
without the checkpoint (saying so), from a watchdog thread, whatever the main thread is doing. A
second signal while stopping exits at once. A signal that arrives within DUPLICATE_WINDOW_S of the
first counts as the same request: a terminal's Ctrl-C reaches torchrun and its workers, and torchrun
forwards it to the workers again.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from aligner.runtime import distributed, run_lock
from aligner.runtime.errors import ConfigError

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_WINDOW_S = 1.0


def signal_name(signal_number: int) -> str:
    try:
        return signal.Signals(signal_number).name
    except ValueError:
        return f"signal {signal_number}"


def exit_code(signal_number: int) -> int:
    """The shell's convention for a process ended by a signal."""
    return 128 + signal_number


class Interrupted(KeyboardInterrupt):
    """A signal arrived outside a training loop (or a follower was told to stop); `message`: the line
    the entry point ends with."""

    def __init__(self, signal_number: int, message: str = ""):
        super().__init__(message or f"interrupted by {signal_name(signal_number)}")
        self.signal_number = signal_number
        self.message = message or f"interrupted by {signal_name(signal_number)}; exiting"

    @property
    def exit_code(self) -> int:
        return exit_code(self.signal_number)


class Stopped(Interrupted):
    """A training loop stopped at a step boundary on request; `message` says where and what was saved."""

    def __init__(self, signal_number: int, message: str):
        super().__init__(signal_number, message)


@dataclass
class _State:
    installed: bool = False
    deferred: bool = False
    signal_number: int = 0  # the first signal of the current request; 0: none
    received_at: float = 0.0
    grace_s: float = float("inf")
    last_step: Optional[int] = None  # the last step boundary the loop reported (for messages)
    watchdog: Optional[threading.Timer] = None


_state = _State()


def _write_line(text: str) -> None:
    """One line on stderr, straight to the file descriptor (safe inside a signal handler)."""
    try:
        os.write(sys.stderr.fileno(), (text + "\n").encode())
    except (OSError, ValueError):
        pass


def _handler(signal_number: int, frame) -> None:
    now = time.monotonic()
    if _state.signal_number:
        if now - _state.received_at < DUPLICATE_WINDOW_S:
            return
        _write_line(f"{signal_name(signal_number)} again while stopping: exiting at once without a checkpoint")
        _exit_now(signal_number)
    _state.signal_number, _state.received_at = signal_number, now
    if not _state.deferred:
        raise Interrupted(signal_number)
    _start_watchdog()
    if _is_rank_zero():
        _write_line(f"{signal_name(signal_number)} received: stopping at the next step boundary with a checkpoint "
                    f"(within {_state.grace_s:g} s; {signal_name(signal_number)} again exits at once)")


def install() -> None:
    """Handle SIGTERM and SIGINT in this process (main thread only; idempotent)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signal_number in HANDLED_SIGNALS:
        signal.signal(signal_number, _handler)
    _state.installed = True


def requested() -> int:
    """The signal this process received (0: none)."""
    return _state.signal_number


def reset() -> None:
    """Forget a request (tests; a process that handled a stop and goes on)."""
    if _state.watchdog is not None:
        _state.watchdog.cancel()
    _state.signal_number, _state.received_at, _state.watchdog, _state.last_step = 0, 0.0, None, None


def abandoned(reason: str) -> Interrupted:
    """The stop of a wait that would not reach the next step boundary in time (a reward call that does
    not return): exit now, without a checkpoint of the step; `reason` says what was waited for."""
    where = f" after step {_state.last_step}" if _state.last_step is not None else ""
    return Interrupted(_state.signal_number, f"stopped{where} by {signal_name(_state.signal_number)} without a "
                       f"checkpoint: {reason}; resume with the same command (from the previous checkpoint)")


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) in ("", "0")


def _start_watchdog() -> None:
    if _state.watchdog is not None or _state.grace_s == float("inf"):
        return
    remaining = max(_state.grace_s - (time.monotonic() - _state.received_at), 0.0)
    _state.watchdog = threading.Timer(remaining, _grace_expired, args=(_state.signal_number,))
    _state.watchdog.daemon = True
    _state.watchdog.start()


def _grace_expired(signal_number: int) -> None:
    where = f" after step {_state.last_step}" if _state.last_step is not None else ""
    _write_line(f"stopped{where} by {signal_name(signal_number)} without a checkpoint: checkpoint.stop_grace_s="
                f"{_state.grace_s:g} s passed; resume with the same command (from the previous checkpoint)")
    _exit_now(signal_number)


def _exit_now(signal_number: int) -> None:
    """Exit at once (no atexit handlers), but release the save_dir lock cleanly first: a record left behind
    would hold off a resume on another host until its heartbeat counts as silent (aligner/runtime/run_lock.py)."""
    run_lock.release_all()
    os._exit(exit_code(signal_number))


class StopCheck:
    """The step-boundary check of one training loop (see the module docstring)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self._group = None
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            # A gloo group of its own: a CPU all_reduce whatever the model's backend (no device sync).
            self._group = dist.new_group(backend="gloo")

    def agreed(self) -> int:
        """The signal any rank received (0: none); collective over the job when it has several ranks."""
        if self._group is None:
            return _state.signal_number
        import torch
        import torch.distributed as dist

        value = torch.tensor([_state.signal_number], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group)
        return int(value.item())

    def check(self, step: int, save: Optional[Callable[[], Optional[Path]]], *, unsaved_reason: str = "") -> None:
        """At a step boundary: raise `Stopped` after saving (`save()` -> the checkpoint's path) if any
        rank received a signal. save=None: this boundary cannot be resumed from; `unsaved_reason` says why."""
        _state.last_step = step
        signal_number = self.agreed()
        if not signal_number:
            return
        if not _state.signal_number:  # learnt from another rank: this rank's grace starts now
            _state.signal_number, _state.received_at = signal_number, time.monotonic()
        name = signal_name(signal_number)
        if save is None:
            message = (f"stopped at step {step} by {name} without a checkpoint ({unsaved_reason}); "
                       "resume with the same command")
        elif time.monotonic() - _state.received_at >= self.grace_s:
            message = (f"stopped at step {step} by {name} without a checkpoint: "
                       f"checkpoint.stop_grace_s={self.grace_s:g} s had passed at the step boundary; "
                       "resume with the same command (from the previous checkpoint)")
        else:
            _start_watchdog()
            path = save()
            if _state.watchdog is not None:
                _state.watchdog.cancel()
            message = f"stopped at step {step} by {name}; checkpoint {path}; resume with the same command"
        raise Stopped(signal_number, message)


@contextlib.contextmanager
def deferred(grace_s: float) -> Iterator[StopCheck]:
    """Signals are recorded, not raised, inside; the loop calls `check` at each step boundary.

    Collective when the job has several ranks (a gloo group is made on entry). A request that
    arrived before entry is acted on at the first check.
    """
    if grace_s <= 0:
        raise ConfigError(f"checkpoint.stop_grace_s must be > 0, got {grace_s}")
    check = StopCheck(grace_s)
    previous = (_state.deferred, _state.grace_s)
    _state.deferred, _state.grace_s = True, grace_s
    try:
        yield check
    finally:
        _state.deferred, _state.grace_s = previous
    # A signal after the loop's last check (rare: loops check once more after their final save).
    if _state.signal_number:
        raise Interrupted(_state.signal_number)


def exit_on_stop(stop: KeyboardInterrupt) -> None:
    """An entry point's end after a stop: one line on stderr (rank 0), SystemExit(128 + signal).

    After `Stopped` every rank stopped at the same step, so the process group is torn down as after
    a success; after `Interrupted` the peers may be anywhere, so that teardown is skipped.
    """
    signal_number = getattr(stop, "signal_number", signal.SIGINT)
    if not isinstance(stop, Stopped):
        distributed.exiting_on_error()
    if _is_rank_zero():
        _write_line(stop.message if isinstance(stop, Interrupted)
                    else f"interrupted by {signal_name(signal_number)}; exiting")
    raise SystemExit(exit_code(signal_number)) from None
