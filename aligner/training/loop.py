"""The one run loop: stop signals, the step, metrics, validation and save cadence, the save at the end.

Every trainer (SFT, reward models, DPO, KTO, distillation, the RL actor, SPIN, rejection sampling)
runs its steps through a `RunLoop`; it supplies only the step (a function returning the step's
metrics) and a `LoopState`: its step counter and its checkpoint and validation hooks.

    with run_loop(state, cadence) as loop:    # signals are deferred to step boundaries inside
        loop.run_until(total, step)            # check, step, count, log, validate, save ... until total
    # on leaving: the save at the end (cadence.save_at_end) and the last stop check

A run made of iterations (SPIN, rejection sampling) calls `loop.step(...)` itself, marking the
boundaries it cannot resume from, and `loop.check()` at its iteration ends.

On a CPU the first rank of each machine also watches whether other work competes for the CPUs
(`cpu_pressure`) and says so once, since contended OpenMP threads slow a run several-fold.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol

import torch

from aligner.runtime import cpu_bridge, cpu_pressure, stopping
from aligner.runtime.distributed import rank_and_world_from_env
from aligner.training.metrics import MetricsLogger, get_logger


class LoopState(Protocol):
    """What the loop needs of a trainer: its step counter, metrics, checkpoints and validation."""

    step: int
    metrics: MetricsLogger

    def count_step(self) -> None:
        """The step just taken counts: advance the step counter (and whatever moves with it)."""

    def save(self) -> Path: ...

    def save_unless_saved(self) -> Path: ...

    def validate(self) -> dict[str, float]: ...


@dataclass
class Cadence:
    """When a loop validates and saves (steps; <= 0 disables an interval)."""

    val_check_interval: int = 0  # validate every N steps and after the last; 0: never (e.g. no validation data)
    save_interval: int = 0  # save every N steps before the last
    save_at_end: bool = True  # save when the loop ends (unless that step is saved already)
    stop_grace_s: float = 600.0  # checkpoint.stop_grace_s

    @classmethod
    def of(cls, checkpoint, val_check_interval: int = 0) -> Cadence:
        """From a `checkpoint:` section (save_interval, save_at_end, stop_grace_s) and the validation interval."""
        return cls(val_check_interval=val_check_interval, save_interval=checkpoint.save_interval,
                   save_at_end=checkpoint.save_at_end, stop_grace_s=checkpoint.stop_grace_s)


def loss_and_lr(metrics: dict) -> dict[str, float]:
    """The progress bar's postfix of a loss-over-batches step."""
    return {"loss": metrics["loss"], "lr": metrics["lr"]}


class RunLoop:
    """One run's loop over `state`, inside `run_loop` (signals deferred to step boundaries)."""

    def __init__(self, state: LoopState, cadence: Cadence, stop: stopping.StopCheck,
                 shown: Callable[[dict], dict] = loss_and_lr):
        self.state = state
        self.cadence = cadence
        self.shown = shown  # metrics -> the progress bar's postfix
        self._stop = stop
        self._pressure = _cpu_pressure()

    def check(self, resumable: bool = True, unsaved_reason: str = "") -> None:
        """A step boundary: on a stop signal, save (if this boundary can be resumed from) and raise `Stopped`."""
        save = self.state.save_unless_saved if resumable else None
        self._stop.check(self.state.step, save, unsaved_reason=unsaved_reason)

    def step(self, step: Callable[[], dict], *, total: Optional[int] = None, extra: Optional[dict] = None,
             resumable: bool = True, unsaved_reason: str = "") -> dict:
        """One step: the stop check before it (resumable=False: a boundary no checkpoint can be written at,
        `unsaved_reason` says why), the step, the counter, its metrics (with `extra`), then validation and
        the save at their intervals. total: the run's last step (validation runs after it; the save at
        the end, not the interval's, writes it); None: not known. Returns the step's metrics."""
        self.check(resumable, unsaved_reason)
        metrics = step()
        state = self.state
        state.count_step()
        state.metrics.log(state.step, {**metrics, **extra} if extra else metrics)
        state.metrics.advance(**self.shown(metrics))
        interval = self.cadence.val_check_interval
        if interval > 0 and (state.step % interval == 0 or state.step == total):
            state.metrics.log(state.step, state.validate(), prefix="validation")
        interval = self.cadence.save_interval
        if interval > 0 and state.step % interval == 0 and (total is None or state.step < total):
            state.save()
        warning = self._pressure.check() if self._pressure is not None else None
        if warning:
            get_logger().warning(warning)
        return metrics

    def run_until(self, total: int, step: Callable[[], dict]) -> None:
        """Steps until the state's counter reaches total."""
        while self.state.step < total:
            self.step(step, total=total)


def _cpu_pressure() -> Optional[cpu_pressure.CpuPressure]:
    """The CPU contention watch of a CPU run's first rank on its machine; None elsewhere (a GPU run's host
    threads are not its compute)."""
    if not cpu_bridge.is_applied() or rank_and_world_from_env()[1] != 0:
        return None
    return cpu_pressure.CpuPressure(cpu_pressure.pressure_file(), torch.get_num_threads())


@contextlib.contextmanager
def run_loop(state: LoopState, cadence: Cadence, shown: Callable[[dict], dict] = loss_and_lr) -> Iterator[RunLoop]:
    """The loop of one run: signals are deferred to its step boundaries; when the block ends without an
    error, the save at the end (cadence.save_at_end, unless that step is saved) and the last stop check."""
    with stopping.deferred(cadence.stop_grace_s) as stop:
        loop = RunLoop(state, cadence, stop, shown)
        yield loop
        if cadence.save_at_end:
            state.save_unless_saved()
        loop.check()
