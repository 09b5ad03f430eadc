"""Asynchronous RL's generation worker under the signals a user or a scheduler sends, through the entry point:
SIGTERM to the trainer and its worker together (as Ctrl-C or Slurm deliver it) stops the run at a step boundary
with a checkpoint that keeps the rollouts generated ahead, exit 143, no process left; SIGKILL of the trainer takes
the worker with it."""
from __future__ import annotations

import json
import os
import signal
import sys

import psutil
import pytest

from ..conftest import REPO_ROOT
from ..unit.test_async_rl import (
    CORRECTED,
    actor_overrides,
    tiny,  # noqa: F401 (the module fixture)
)
from .test_stop_sft import Run

pytestmark = [pytest.mark.slow]
ENTRY = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_reinforce_actor.py"


def _start(tiny, run_dir) -> Run:  # noqa: F811
    command = [sys.executable, str(ENTRY), *actor_overrides(tiny, run_dir / "logs", run_dir / "ckpt"),
               "trainer.max_steps=500", "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=1",
               *CORRECTED]
    return Run(command, run_dir)


def _worker(run: Run) -> psutil.Process:
    commands = {child: " ".join(child.cmdline()) for child in psutil.Process(run.process.pid).children(recursive=True)}
    workers = [child for child, command in commands.items()
               if "multiprocessing" in command and "resource_tracker" not in command]
    assert len(workers) == 1, list(commands.values())
    return workers[0]


def test_sigterm_to_trainer_and_worker_stops_at_a_step_with_the_rollouts_ahead(tiny, tmp_path):  # noqa: F811
    run = _start(tiny, tmp_path / "run")
    try:
        run.wait_for_step(2)
        worker = _worker(run)
        for process in (run.process.pid, worker.pid):  # the process group's signal, as a terminal or Slurm sends it
            os.kill(process, signal.SIGTERM)
        code = run.wait(timeout_s=120)
        assert not run.left_behind(), "processes of the run are still running"
        stderr = run.stderr()
    finally:
        run.close()
    assert code == 143, stderr[-3000:]
    checkpoints = sorted((tmp_path / "run" / "ckpt").glob("step_*"))
    assert checkpoints, stderr[-3000:]
    meta = json.loads((checkpoints[-1] / "aligner_meta.json").read_text())
    step = meta["trainer_state"]["step"]
    # The rollouts of the next step, generated one version back, travel with the checkpoint.
    assert [entry[0] for entry in meta["trainer_state"]["asynchronous"]["ready_by_replica"][0]] == [step]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_sigkill_of_the_trainer_takes_the_worker_with_it(tiny, tmp_path):  # noqa: F811
    run = _start(tiny, tmp_path / "run")
    try:
        run.wait_for_step(1)
        worker = _worker(run)
        os.kill(run.process.pid, signal.SIGKILL)
        run.wait(timeout_s=30)
        assert not run.left_behind(), "processes of the run are still running"
        assert worker in run.descendants
    finally:
        run.close()
