"""A stop of SPIN (aligner/runtime/stopping.py): at an iteration end it saves there and the run resumes
from it; in the middle of an iteration it exits without a checkpoint (SPIN resumes only at iteration ends)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from aligner.algorithms.spin import build_spin_run
from aligner.demo import arithmetic
from aligner.runtime import stopping

from ..conftest import write_jsonl
from .test_spin import _tiny_spin_config


def _signal_during_step(run, step: int) -> None:
    """SIGTERM arrives while the trainer runs step `step` (1-based)."""
    real_train_step = run.trainer.train_step

    def train_step(microbatches):
        if run.trainer.step + 1 == step:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        return real_train_step(microbatches)

    run.trainer.train_step = train_step


@pytest.mark.parametrize("signalled_step, stop_step, saved", [(2, 2, False), (3, 3, True)],
                         ids=["mid-iteration", "last-step-of-iteration"])
def test_spin_stops_at_the_next_boundary_and_saves_only_at_iteration_ends(
        tmp_path, arithmetic_tokenizer_dir, handlers, signalled_step, stop_step, saved):
    train = write_jsonl(tmp_path / "sft.jsonl", arithmetic.correct_sft_records(16, seed=2))
    cfg = _tiny_spin_config(tmp_path, arithmetic_tokenizer_dir, train, "run", "checkpoint.save_interval=0")
    run = build_spin_run(cfg)
    _signal_during_step(run, signalled_step)
    with pytest.raises(stopping.Stopped) as raised:
        run.fit()
    run.trainer.metrics.close()
    assert run.trainer.step == stop_step
    checkpoints = sorted(path.name for path in (tmp_path / "run" / "ckpt").glob("step_*"))
    if saved:
        assert checkpoints == ["step_00000003"]
        assert raised.value.message.startswith("stopped at step 3 by SIGTERM; checkpoint ")
        stopping.reset()
        resumed = build_spin_run(cfg)
        assert resumed.trainer.step == 3  # the next run starts the second iteration
        resumed.trainer.metrics.close()
    else:
        assert checkpoints == []
        assert raised.value.message == ("stopped at step 2 by SIGTERM without a checkpoint (SPIN resumes only at "
                                        "iteration ends: iteration 1 is repeated from the newest checkpoint); "
                                        "resume with the same command")
    assert raised.value.exit_code == 143
