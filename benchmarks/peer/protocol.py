"""Two training processes taking turns step by step, so only one computes at a time and load hits both.

The driver starts each side as a worker process with a private pipe pair (fds named in $BENCH_CHANNEL,
so whatever the libraries print to stdout cannot garble it) and speaks a line protocol:

    worker -> "ready"                 (built, before its first step)
    driver -> "step [VARIANT]"        worker -> "done SECONDS TOKENS [NAME=VALUE ...]"   (one step, timed by
                                      the worker; NAME=VALUE: figures about that step: always its minor page
                                      faults and CPU seconds (user + system, all threads), then any the
                                      worker reports). VARIANT: which of the worker's variants runs the
                                      step (our trainer with some shortcuts switched off: the waterfall)
    driver -> "quit"                  worker -> "rss MEGABYTES"         (its peak resident set), then exits

A round steps every side once (every variant of a worker that has several); rounds alternate the order, so
neither always runs on a cache the other just warmed.
The ratio is the median over timed steps of (peer seconds / our seconds): pairs taken seconds apart see
the same machine load. Stdlib only: both venvs import it.
"""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

CHANNEL_ENV = "BENCH_CHANNEL"


class WorkerError(RuntimeError):
    """A worker exited or broke the protocol; the message carries its log's tail."""


# ----------------------------------------------------------------------------- the worker's end
class WorkerChannel:
    """The worker's end of the pipes named in $BENCH_CHANNEL ("READ_FD,WRITE_FD")."""

    def __init__(self) -> None:
        read_fd, write_fd = (int(fd) for fd in os.environ[CHANNEL_ENV].split(","))
        self.reader = os.fdopen(read_fd, "r")
        self.writer = os.fdopen(write_fd, "w")
        self.started = 0.0
        self.usage = resource.getrusage(resource.RUSAGE_SELF)

    def send(self, *words) -> None:
        self.writer.write(" ".join(str(word) for word in words) + "\n")
        self.writer.flush()

    def command(self) -> str:
        line = self.reader.readline()
        return line.strip() or "quit"  # the driver gone: stop

    @staticmethod
    def is_step(command: str) -> bool:
        return command.split()[0] == "step"

    def ready_then_wait(self) -> str:
        """Announce readiness, wait for the first command; the first step's clock starts on "step"."""
        self.send("ready")
        return self.wait()

    def wait(self) -> str:
        command = self.command()
        self.usage = resource.getrusage(resource.RUSAGE_SELF)
        self.started = time.perf_counter()
        return command

    def step_done(self, tokens: float, figures: Optional[dict[str, float]] = None) -> None:
        seconds = time.perf_counter() - self.started
        usage = resource.getrusage(resource.RUSAGE_SELF)
        counted = {"minor_faults": usage.ru_minflt - self.usage.ru_minflt,
                   "cpu_seconds": usage.ru_utime + usage.ru_stime - self.usage.ru_utime - self.usage.ru_stime,
                   **(figures or {})}
        self.send("done", f"{seconds:.6f}", f"{tokens:.0f}",
                  *(f"{name}={value:.6g}" for name, value in counted.items()))

    def finish(self) -> None:
        """After the last step: wait for "quit", report the peak RSS (ru_maxrss is in KiB on Linux)."""
        while self.command() != "quit":
            pass
        self.send("rss", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")


def serve_steps(step: Callable[..., Union[float, tuple[float, dict[str, float]]]]) -> None:
    """The whole worker loop for a trainer that can be stepped from outside: `step()` (`step(variant)` for
    "step VARIANT") returns its tokens, or (tokens, {name: value}) with figures about the step (e.g. where its
    time went)."""
    channel = WorkerChannel()
    command = channel.ready_then_wait()
    while WorkerChannel.is_step(command):
        result = step(*command.split()[1:])
        tokens, figures = result if isinstance(result, tuple) else (result, None)
        channel.step_done(tokens, figures)
        command = channel.wait()
    channel.send("rss", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")


# ----------------------------------------------------------------------------- the driver's end
@dataclass
class Worker:
    name: str
    command: Sequence[str]
    log: Path
    env: dict = field(default_factory=dict)
    variants: tuple[str, ...] = ()  # several: each round steps each of them ("step VARIANT"); none: "step"
    process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        to_worker_read, to_worker_write = os.pipe()
        from_worker_read, from_worker_write = os.pipe()
        env = {**os.environ, **self.env, CHANNEL_ENV: f"{to_worker_read},{from_worker_write}"}
        self._log = open(self.log, "w")
        self.process = subprocess.Popen(list(self.command), env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, pass_fds=(to_worker_read, from_worker_write))
        os.close(to_worker_read)
        os.close(from_worker_write)
        self.writer = os.fdopen(to_worker_write, "w")
        self.reader = os.fdopen(from_worker_read, "r")

    def send(self, command: str) -> None:
        try:
            self.writer.write(command + "\n")
            self.writer.flush()
        except BrokenPipeError:
            raise self._failed(f"exited before {command!r}") from None

    def expect(self, word: str) -> list[str]:
        line = self.reader.readline().split()
        if not line or line[0] != word:
            raise self._failed(f"sent {line!r}, expected {word!r}")
        return line[1:]

    def _failed(self, what: str) -> WorkerError:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._log.flush()
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        return WorkerError(f"{self.name} worker {what} (exit {self.process.returncode}); {self.log}:\n{tail}")

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process is not None:
            self._log.close()


@dataclass
class SideResult:
    name: str  # the worker's name, or "NAME:VARIANT"
    seconds: list[float]  # every step, warm-up included
    tokens: list[float]
    peak_rss_mb: float
    figures: list[dict[str, float]] = field(default_factory=list)  # per step: what the worker reported besides


def run_interleaved(workers: Sequence[Worker], total_steps: int,
                    progress: Optional[Callable[[str], None]] = None) -> list[SideResult]:
    """Start the workers (they build concurrently), then step them in rounds, `total_steps` rounds: each round
    steps every worker once, or once per variant where it has several, the order reversed every other round;
    `progress` is told each round's times. One result per worker (per variant), in that order."""
    slots = [(worker, variant) for worker in workers for variant in (worker.variants or (None,))]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.expect("ready")
        seconds = [[] for _ in slots]
        tokens = [[] for _ in slots]
        figures = [[] for _ in slots]
        names = [worker.name if variant is None else f"{worker.name}:{variant}" for worker, variant in slots]
        for step in range(total_steps):
            for index in in_turn(range(len(slots)), step):
                worker, variant = slots[index]
                worker.send("step" if variant is None else f"step {variant}")
                elapsed, counted, *named = worker.expect("done")
                seconds[index].append(float(elapsed))
                tokens[index].append(float(counted))
                figures[index].append({name: float(value) for name, value in (word.split("=", 1) for word in named)})
            if progress is not None:
                progress(f"step {step + 1}/{total_steps}: " + ", ".join(
                    f"{name} {seconds[index][-1]:.2f} s" for index, name in enumerate(names)))
        peak_rss = {}
        for worker in workers:
            worker.send("quit")
            (rss,) = worker.expect("rss")
            worker.process.wait(timeout=120)
            peak_rss[worker.name] = float(rss)
        return [SideResult(names[index], seconds[index], tokens[index], peak_rss[worker.name], figures[index])
                for index, (worker, _) in enumerate(slots)]
    finally:
        for worker in workers:
            worker.close()


def in_turn(sides: Iterable, repeat: int) -> list:
    """The sides in the order repeat number `repeat` runs them: as given, then reversed every other repeat, so a
    burst of load, or a first-in-line cost, hits every side alike (every benchmark's rounds use this order)."""
    sides = list(sides)
    return sides[::-1] if repeat % 2 else sides


def step_ratio(peer_seconds: Sequence[float], our_seconds: Sequence[float], warmup_steps: int) -> float:
    """Median over the timed steps of peer time / our time (> 1: we are faster)."""
    pairs = list(zip(peer_seconds, our_seconds))[warmup_steps:]
    if not pairs:
        raise ValueError("no timed steps after the warm-up")
    return statistics.median(peer / ours for peer, ours in pairs)
