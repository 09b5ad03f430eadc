"""SIGTERM to the PPO launcher: the actor stops at a step boundary with its checkpoint and the critic's
at the same step, then the server stops; the launcher exits 143 and no process of the run is left."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from ..conftest import free_port_block
from ..functional.test_ppo_launch import _launch_command, _train_rows, models  # noqa: F401
from .test_stop_sft import Run

pytestmark = [pytest.mark.slow]


def _wait_for_the_first_step(run, log_dir, launcher_dir) -> None:
    deadline = time.monotonic() + 600
    while not any(row["step"] >= 1 for row in _train_rows(log_dir)):
        assert run.process.poll() is None, (launcher_dir / "stdout.txt").read_text()[-4000:]
        assert time.monotonic() < deadline, "the actor never logged a step"
        time.sleep(0.2)


def test_sigterm_to_the_launcher_stops_everything_with_a_checkpoint(models, tmp_path):  # noqa: F811
    log_dir = tmp_path / "ppo"
    command = _launch_command(models, log_dir, free_port_block(), max_steps=200)
    run = Run(command, tmp_path / "launcher")
    try:
        _wait_for_the_first_step(run, log_dir, tmp_path / "launcher")
        children = psutil.Process(run.process.pid).children()
        assert len(children) == 2  # the critic server and the actor
        os.kill(run.process.pid, signal.SIGTERM)
        code = run.wait(timeout_s=300)
        output = (tmp_path / "launcher" / "stdout.txt").read_text()
        assert not run.left_behind(), "processes of the PPO run are still running"
    finally:
        run.close()
    assert code == 143, output[-4000:]
    stopped_at = max(row["step"] for row in _train_rows(log_dir))
    actor_checkpoint = log_dir / "actor" / "checkpoints" / f"step_{stopped_at:08d}"
    assert (f"[actor] stopped at step {stopped_at} by SIGTERM; checkpoint {actor_checkpoint}; "
            "resume with the same command") in output, output[-4000:]
    assert (actor_checkpoint / "aligner_meta.json").is_file()
    # The actor had the critic save at the same step before the launcher stopped the server.
    assert (log_dir / "critic" / "checkpoints" / f"step_{stopped_at:08d}" / "aligner_meta.json").is_file()
    assert "Traceback" not in output, output[-4000:]


def test_sigkill_of_the_launcher_leaves_no_process(models, tmp_path):  # noqa: F811
    """The kernel sends SIGTERM to each child when the launcher dies (Linux): they stop on their own."""
    if not os.uname().sysname == "Linux":
        pytest.skip("parent-death signals are Linux only")
    log_dir = tmp_path / "ppo"
    run = Run(_launch_command(models, log_dir, free_port_block(), max_steps=200), tmp_path / "launcher")
    try:
        _wait_for_the_first_step(run, log_dir, tmp_path / "launcher")
        os.kill(run.process.pid, signal.SIGKILL)
        run.wait()
        assert not run.left_behind(timeout_s=120), "processes of the PPO run outlived the launcher"
    finally:
        run.close()
