"""The CPU contention watch (aligner/runtime/cpu_pressure.py): which pressure file, the share it gives, the one
warning, the run loop saying it, and the kernel's own file rising when the CPUs are oversubscribed."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aligner.runtime import cpu_pressure
from aligner.runtime.cpu_pressure import CpuPressure, pressure_file, stalled_us
from aligner.training import loop as loop_module
from aligner.training.loop import Cadence, run_loop


def pressure_text(total_us: int) -> str:
    return (f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total_us}\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_some_line_total_is_read_and_a_file_without_it_is_refused():
    assert stalled_us(pressure_text(4295430722)) == 4295430722
    with pytest.raises(ValueError):
        stalled_us("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def test_the_runs_own_cgroup_file_is_preferred_then_the_systems_then_none(tmp_path):
    system = tmp_path / "proc_pressure_cpu"
    system.write_text(pressure_text(0))
    root = tmp_path / "cgroup"
    (root / "slurm" / "job_7").mkdir(parents=True)
    (root / "slurm" / "job_7" / "cpu.pressure").write_text(pressure_text(0))
    listing = tmp_path / "self_cgroup"

    listing.write_text("0::/slurm/job_7\n")
    assert pressure_file(listing, root, system) == root / "slurm" / "job_7" / "cpu.pressure"
    listing.write_text("0::/other\n")  # a group without the file (no cpu controller there)
    assert pressure_file(listing, root, system) == system
    listing.write_text("0::/\n")  # the root group: its file would be the system's anyway
    assert pressure_file(listing, root, system) == system
    listing.write_text("12:cpu,cpuacct:/docker/abc\n")  # cgroup v1 only
    assert pressure_file(listing, root, system) == system
    assert pressure_file(tmp_path / "missing", root, tmp_path / "no_psi") is None


def test_a_contended_window_warns_once_and_a_quiet_one_does_not(tmp_path):
    path = tmp_path / "cpu.pressure"
    clock = Clock()
    path.write_text(pressure_text(1_000_000))
    watch = CpuPressure(path, threads=2, clock=clock)

    clock.now += cpu_pressure.MIN_WINDOW_S / 2  # too short a window: nothing measured yet
    path.write_text(pressure_text(1_000_000 + 9_000_000))
    assert watch.share() is None and watch.check() is None

    clock.now += cpu_pressure.MIN_WINDOW_S  # 1.5 windows in all, 20 % of it stalled: quiet
    path.write_text(pressure_text(1_000_000 + int(0.2 * 1.5 * cpu_pressure.MIN_WINDOW_S * 1e6)))
    assert watch.check() is None

    clock.now += 40.0  # 30 of the next 40 s stalled: contended
    stalled = stalled_us(path.read_text()) + 30_000_000
    path.write_text(pressure_text(stalled))
    warning = watch.check()
    assert warning is not None and warning.startswith("the CPUs are contended: for 75% of the last 40 s")
    assert str(path) in warning and "2 thread(s)" in warning and "OMP_NUM_THREADS" in warning

    clock.now += 40.0
    path.write_text(pressure_text(stalled + 40_000_000))
    assert watch.check() is None  # once per run


def test_no_file_or_an_unreadable_one_measures_nothing(tmp_path):
    assert CpuPressure(None, threads=2).check() is None
    path = tmp_path / "cpu.pressure"
    path.write_text(pressure_text(0))
    clock = Clock()
    watch = CpuPressure(path, threads=2, clock=clock)
    path.write_text("garbage\n")
    clock.now += 2 * cpu_pressure.MIN_WINDOW_S
    assert watch.check() is None and watch.path is None


class Metrics:
    def log(self, step, metrics, prefix="train"):
        pass

    def advance(self, **shown):
        pass


class State:
    def __init__(self):
        self.step = 0
        self.metrics = Metrics()

    def count_step(self):
        self.step += 1

    def save(self):
        return Path("saved")

    def save_unless_saved(self):
        return Path("saved")

    def validate(self):
        return {}


def test_the_run_loop_says_once_that_the_cpus_are_contended(handlers, tmp_path, monkeypatch):
    path = tmp_path / "cpu.pressure"
    path.write_text(pressure_text(0))
    clock = Clock()
    monkeypatch.setattr(loop_module, "_cpu_pressure", lambda: CpuPressure(path, threads=2, clock=clock))
    state = State()

    def step():
        clock.now += 10.0
        path.write_text(pressure_text(stalled_us(path.read_text()) + 9_000_000))  # 90 % stalled
        return {"loss": 1.0, "lr": 0.1}

    class Collect(logging.Handler):  # the aligner logger does not propagate; its own handler may be any test's
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    collect = Collect()
    logger = loop_module.get_logger()
    logger.addHandler(collect)
    try:
        with run_loop(state, Cadence(save_at_end=False)) as loop:
            loop.run_until(6, step)
    finally:
        logger.removeHandler(collect)
    warnings = [message for message in collect.messages if "contended" in message]
    assert state.step == 6 and len(warnings) == 1 and "for 90% of the last 20 s" in warnings[0], warnings


@pytest.mark.skipif(not cpu_pressure.SYSTEM_PRESSURE.is_file(), reason="the kernel has no CPU pressure file (PSI)")
def test_the_kernels_pressure_rises_when_the_cpus_are_oversubscribed(monkeypatch):
    """Twice as many spinning processes as this process's CPUs, pinned to them, for about 2 s: the share
    with a task waiting must be over the warning's line (alone it measures a few per cent)."""
    monkeypatch.setattr(cpu_pressure, "MIN_WINDOW_S", 2.0)
    cpus = sorted(os.sched_getaffinity(0))
    watch = CpuPressure(pressure_file(), threads=1)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * len(cpus))]
    try:
        for spinner in spinners:
            os.sched_setaffinity(spinner.pid, cpus)
        time.sleep(2.5)
        share, window = watch.share()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert window >= 2.0 and share > cpu_pressure.CONTENDED_SHARE, (share, window, watch.path)
