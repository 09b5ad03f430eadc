"""Whether other work competes for the CPUs a CPU run computes on, from the kernel's pressure stall information.

On a CPU a run's intra-op threads are torch's OpenMP team (libgomp), whose idle workers spin before they
sleep. When a second job's threads share the cores, each team's spinning workers take time slices the
other team's working threads need, and both jobs slow far beyond a fair share (measured in
docs/concepts/performance.md, "One job per set of cores"). Nothing in the run itself shows why its steps
got slow, so the run loop asks `CpuPressure` after each step and warns once.

The measure is the kernel's CPU pressure (PSI, Linux 4.20+): the share of wall time during which at least
one task was runnable but waited for a CPU (the "some" line's `total`, microseconds). The run's own
cgroup's `cpu.pressure` (cgroup v2: a container, a Slurm job) is read where it exists, since it counts only
the tasks that share the run's CPU budget; else the whole system's `/proc/pressure/cpu`. Without either
(an older kernel, PSI off) nothing is measured and nothing is said.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

SYSTEM_PRESSURE = Path("/proc/pressure/cpu")
CGROUP_ROOT = Path("/sys/fs/cgroup")

CONTENDED_SHARE = 0.5  # warn above this share of wall time with a task waiting for a CPU
MIN_WINDOW_S = 20.0  # shares are taken over at least this long (steps shorter than it accumulate)


def pressure_file(cgroup_list: Path = Path("/proc/self/cgroup"), cgroup_root: Path = CGROUP_ROOT,
                  system: Path = SYSTEM_PRESSURE) -> Optional[Path]:
    """The CPU pressure file for this process: its cgroup v2 group's `cpu.pressure` where there is one,
    else the system's; None where neither exists."""
    try:
        for line in cgroup_list.read_text().splitlines():
            hierarchy, _, path = line.split(":", 2)
            if hierarchy == "0":  # the unified (v2) hierarchy
                candidate = cgroup_root / path.lstrip("/") / "cpu.pressure"
                if path.strip("/") and candidate.is_file():
                    return candidate
    except (OSError, ValueError):
        pass
    return system if system.is_file() else None


def stalled_us(text: str) -> int:
    """The `some` line's total (microseconds with at least one task waiting for a CPU) of a pressure file's text."""
    for line in text.splitlines():
        kind, _, fields = line.partition(" ")
        if kind == "some":
            values = dict(field.split("=", 1) for field in fields.split())
            return int(values["total"])
    raise ValueError(f"no 'some' line in {text!r}")


class CpuPressure:
    """The share of wall time with a task waiting for a CPU since the last window, taken every
    MIN_WINDOW_S or more; `check()` returns a one-line warning the first time a window is contended."""

    def __init__(self, path: Optional[Path], threads: int, clock: Callable[[], float] = time.monotonic):
        self.path, self.threads, self.clock = path, threads, clock
        self.warned = False
        self._start = self._read()

    def _read(self) -> Optional[tuple[float, int]]:
        if self.path is None:
            return None
        try:
            return self.clock(), stalled_us(self.path.read_text())
        except (OSError, ValueError):
            self.path = None  # unreadable once: measure nothing more rather than fail the run
            return None

    def share(self, min_window_s: Optional[float] = None) -> Optional[tuple[float, float]]:
        """(the share, the window's seconds) since the last window once min_window_s (default MIN_WINDOW_S)
        has passed, else None; the next window starts now."""
        if self._start is None:
            return None
        started, stalled = self._start
        if self.clock() - started < (MIN_WINDOW_S if min_window_s is None else min_window_s):
            return None
        now = self._read()
        if now is None:
            return None
        self._start = now
        window = now[0] - started
        return min(1.0, (now[1] - stalled) / 1e6 / window), window

    def check(self) -> Optional[str]:
        """A warning (once per run) when the last window's share was over CONTENDED_SHARE, else None."""
        if self.warned:
            return None
        measured = self.share()
        if measured is None or measured[0] <= CONTENDED_SHARE:
            return None
        self.warned = True
        share, window = measured
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return (f"the CPUs are contended: for {share:.0%} of the last {window:.0f} s a task waited for a CPU "
                f"({self.path}); other work is competing with this run's {self.threads} thread(s) on {cpus} "
                f"CPU(s), and OpenMP's spinning threads slow every job sharing them several-fold: run one job "
                f"at a time, or give each job fewer threads (OMP_NUM_THREADS) so that their sum fits the CPUs")
