"""A demo's stages as a dependency graph, run several at a time (`make demo --jobs`).

The toy demo's models are small (about a million parameters): a training step's matrix products are too small
for a second thread to halve them, so on 2 cores two stages side by side, one thread each, finish sooner than
the same stages one after the other on two threads each. `StageGraph` is handed the chosen stages once and runs
each when the stages it depends on have finished, at most `jobs` at a time, longest chains first (the order it
is given). Each stage's commands (`run`) get `threads` threads and write to the stage's log file, which is
printed whole when the stage ends, so the console reads stage by stage. With one job the commands write to the
console as they run, on the caller's threads.

A failed stage stops the others: their running commands are terminated, no stage starts after it, and the run
ends with the failed stage's name and its log.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

STOP_GRACE_S = 30.0  # a terminated command's time to exit before it is killed

_stage = threading.local()  # log: the running stage's log file (None: the console); threads: its commands' threads
_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()
_stopping = threading.Event()


class StageStopped(Exception):
    """A stage's command was terminated because another stage failed."""


def child_env() -> dict:
    """The environment of a stage's commands: this process's, warnings off, the stage's thread count."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    threads = getattr(_stage, "threads", None)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def _output() -> TextIO:
    return getattr(_stage, "log", None) or sys.stdout


def spawn(command: Sequence, cwd: Path, stdout=None) -> subprocess.Popen:
    """Start a command of the running stage (a server it talks to); stopped with the others if a stage fails."""
    stdout = stdout or getattr(_stage, "log", None)  # None: the console
    with _children_lock:
        if _stopping.is_set():
            raise StageStopped("another stage failed")
        process = subprocess.Popen([str(part) for part in command], cwd=cwd, env=child_env(), stdout=stdout,
                                   stderr=None if stdout is None else subprocess.STDOUT)
        _children.add(process)
    return process


def release(process: subprocess.Popen) -> None:
    with _children_lock:
        _children.discard(process)


def run(label: str, command: Sequence, cwd: Path) -> None:
    """Run one command of a stage to its end; SystemExit naming `label` if it fails."""
    out = _output()
    print(f"\n=== {label}: {' '.join(map(str, command))}", file=out, flush=True)
    start = time.perf_counter()
    process = spawn(command, cwd)
    try:
        code = process.wait()
    finally:
        release(process)
    if _stopping.is_set() and code != 0:
        raise StageStopped(f"{label}: stopped (exit code {code}) because another stage failed")
    if code != 0:
        raise SystemExit(f"demo stage '{label}' failed with exit code {code}")
    print(f"=== {label} done in {time.perf_counter() - start:.0f} s", file=out, flush=True)


def _stop_children() -> None:
    with _children_lock:
        _stopping.set()
        children = list(_children)
    for process in children:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in children:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class StageGraph:
    """stages: the chosen stages, name -> callable, in the order to prefer among stages ready at once; depends:
    name -> the stages it reads the output of (those not chosen are taken as done: their artefacts are on disk);
    jobs: stages at a time; threads: each command's threads when jobs > 1; log_dir: the stages' log files."""

    def __init__(self, stages: dict[str, Callable[[], None]], depends: dict[str, Sequence[str]], *, jobs: int,
                 threads: int, log_dir: Path):
        if jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {jobs}")
        self.stages = stages
        self.depends = {name: [dep for dep in depends.get(name, ()) if dep in stages] for name in stages}
        self.jobs, self.threads, self.log_dir = jobs, threads, log_dir
        self.timings: dict[str, float] = {}
        pending, done = list(stages), set()
        while pending:
            name = self._next_ready(pending, done)
            if name is None:
                raise ValueError(f"stages {', '.join(pending)} wait on each other")
            pending.remove(name)
            done.add(name)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def run(self) -> dict[str, float]:
        """Run every stage; returns each one's seconds. Raises the first failure (SystemExit naming its log)."""
        try:
            return self._run()
        finally:  # every stage has ended: commands started later (a next graph, a plain `run`) may run again
            _stopping.clear()

    def _run(self) -> dict[str, float]:
        pending, done = list(self.stages), set()
        if self.jobs == 1:
            while pending:
                name = self._next_ready(pending, done)
                pending.remove(name)
                start = time.perf_counter()
                self.stages[name]()
                self.timings[name] = time.perf_counter() - start
                done.add(name)
            return self.timings
        self.log_dir.mkdir(parents=True, exist_ok=True)
        running: dict[Future, str] = {}
        failure: Optional[BaseException] = None
        failed = ""
        with ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="stage") as pool:
            try:
                while (pending and failure is None) or running:
                    while failure is None and len(running) < self.jobs:
                        ready = self._next_ready(pending, done)
                        if ready is None:
                            break
                        pending.remove(ready)
                        print(f"=== stage {ready} started, {self.threads} thread(s) (log: {self.log_path(ready)})",
                              flush=True)
                        running[pool.submit(self._run_stage, ready)] = ready
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in finished:
                        name = running.pop(future)
                        self._print_log(name)
                        error = future.exception()
                        if error is None:
                            done.add(name)
                            print(f"=== stage {name} done in {self.timings[name]:.0f} s", flush=True)
                        elif failure is None and not isinstance(error, StageStopped):
                            failure, failed = error, name
                            print(f"=== stage {name} failed; stopping the stages still running", flush=True)
                            _stop_children()
            except BaseException:  # KeyboardInterrupt: stop the running stages' commands before leaving
                _stop_children()
                raise
        if failure is not None:
            message = failure.code if isinstance(failure, SystemExit) else f"{type(failure).__name__}: {failure}"
            raise SystemExit(f"{message} (its log: {self.log_path(failed)})")
        return self.timings

    def _next_ready(self, pending: list[str], done: set[str]) -> Optional[str]:
        return next((name for name in pending if set(self.depends[name]) <= done), None)

    def _run_stage(self, name: str) -> None:
        start = time.perf_counter()
        with open(self.log_path(name), "w") as log:
            _stage.log, _stage.threads = log, self.threads
            try:
                self.stages[name]()
            finally:
                _stage.log, _stage.threads = None, None
        self.timings[name] = time.perf_counter() - start

    def _print_log(self, name: str) -> None:
        path = self.log_path(name)
        if path.exists():
            sys.stdout.write(path.read_text())
            sys.stdout.flush()
