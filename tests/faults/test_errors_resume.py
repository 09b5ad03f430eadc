"""Resuming with changed schedule settings, and after a crash left a partial metrics row.

A resumed run applies its own optim.lr / min_lr / warmup_steps / decay_style and step count from
the resume step on (aligner/training/schedule.py), says so in one line and in the resume marker
row of metrics.jsonl; the learning rates it logs are checked against the schedule computed in
float64 (errors_sft.scheduled_lr).
"""
from __future__ import annotations

import json
import shutil

import pytest

from aligner.training.metrics import METRICS_FILE, read_metrics

from .errors_sft import REINFORCE_SCRIPT, error_lines, run_sft, scheduled_lr, write_sft_inputs


def test_resume_after_a_crash_with_new_schedule_settings(tmp_path):
    root = tmp_path / "run"
    settings = write_sft_inputs(root)
    first = {"optim.lr": 1e-3, "optim.min_lr": 1e-5, "optim.warmup_steps": 1, "optim.decay_style": "cosine"}
    result = run_sft({**settings, **first, "trainer.max_steps": 4, "checkpoint.save_interval": 2})
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = root / "logs" / METRICS_FILE
    first_rows = read_metrics(metrics, "train")
    assert [row["step"] for row in first_rows] == [1, 2, 3, 4]
    for row in first_rows:
        assert row["lr"] == pytest.approx(scheduled_lr(row["step"] - 1, lr=1e-3, min_lr=1e-5, warmup=1, total=4,
                                                       style="cosine"), rel=1e-12, abs=1e-15)

    # A crash while step 4's metrics row was being written, before its checkpoint: half a row, no newline.
    text = metrics.read_text()
    last_row_start = text.rstrip("\n").rfind("\n") + 1
    metrics.write_text(text[: last_row_start + (len(text) - last_row_start) // 2])
    shutil.rmtree(root / "checkpoints" / "step_00000004")

    second = {"optim.lr": 5e-3, "optim.min_lr": 1e-4, "optim.warmup_steps": 3, "optim.decay_style": "linear"}
    result = run_sft({**settings, **second, "trainer.max_steps": 8})
    assert result.returncode == 0 and not error_lines(result), result.stderr[-4000:]
    assert "removed a partial last row" in result.stdout
    assert ("resumed with changed settings: optim.lr 0.001 -> 0.005, optim.min_lr 1e-05 -> 0.0001, optim.warmup_steps "
            "1 -> 3, optim.decay_style cosine -> linear, trainer.max_steps 4 -> 8; the new values apply from step 3 on"
            ) in result.stdout

    lines = metrics.read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line parses: the partial row was cut off
    marker = [row for row in rows if row["split"] == "resumed_from"]
    assert marker == [{"step": 2, "split": "resumed_from", "checkpoint": str(root / "checkpoints" / "step_00000002"),
                       "changed_settings": {"optim.lr": [1e-3, 5e-3], "optim.min_lr": [1e-5, 1e-4],
                                            "optim.warmup_steps": [1, 3], "optim.decay_style": ["cosine", "linear"],
                                            "trainer.max_steps": [4, 8]}}]
    history = read_metrics(metrics, "train", newest_attempt=True)
    assert [row["step"] for row in history] == list(range(1, 9))
    for row in history[2:]:  # steps 3..8 ran under the new schedule, from optimizer step 2 on
        expected = scheduled_lr(row["step"] - 1, lr=5e-3, min_lr=1e-4, warmup=3, total=8, style="linear")
        assert row["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15), row["step"]
    # Step 3's loss is computed before its update: the resumed run reproduces the first attempt's exactly.
    assert history[2]["loss"] == first_rows[2]["loss"]


@pytest.mark.slow
def test_actor_resume_applies_new_schedule_settings(tmp_path):
    """The PPO/REINFORCE actor (RLActor.resume_from): one optimizer step per step here, so the
    logged lr of step k is the schedule's value after k - 1 optimizer steps."""
    from aligner.demo import arithmetic

    inputs = write_sft_inputs(tmp_path / "sft")
    result = run_sft({**inputs, "trainer.max_steps": 0})  # the random-init policy, saved as step 0
    assert result.returncode == 0, result.stderr[-4000:]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in arithmetic.rl_prompts(32, seed=1)))
    actor = {
        "model.init_from": tmp_path / "sft" / "checkpoints" / "step_00000000", "data.prompts": prompts,
        "data.max_prompt_length": 8, "generation.max_new_tokens": 4, "generation.micro_batch_size": 8,
        "rollout.prompts_per_step": 4, "rollout.samples_per_prompt": 2, "trainer.global_batch_size": 8,
        "trainer.micro_batch_size": 8, "trainer.val_check_interval": 0, "reward.source": "function",
        "reward.function": "tests.faults.errors_sft:ones_reward", "kl.init_coef": 0.0,
        "logging.progress_bar": "false", "logging.tensorboard": "false", "logging.peak_tflops": 1.0,
        "checkpoint.save_dir": tmp_path / "actor" / "checkpoints", "logging.log_dir": tmp_path / "actor",
    }
    first = {"optim.lr": 1e-3, "optim.min_lr": 1e-5, "optim.warmup_steps": 0, "optim.decay_style": "cosine"}
    result = run_sft({**actor, **first, "trainer.max_steps": 2}, script=REINFORCE_SCRIPT)
    assert result.returncode == 0, result.stderr[-4000:]
    second = {"optim.lr": 4e-3, "optim.min_lr": 2e-4, "optim.warmup_steps": 1, "optim.decay_style": "linear"}
    result = run_sft({**actor, **second, "trainer.max_steps": 5}, script=REINFORCE_SCRIPT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("resumed with changed settings: optim.lr 0.001 -> 0.004, optim.min_lr 1e-05 -> 0.0002, optim.warmup_steps "
            "0 -> 1, optim.decay_style cosine -> linear, trainer.max_steps 2 -> 5; the new values apply from step 3 on"
            ) in result.stdout
    rows = read_metrics(tmp_path / "actor", "train", include_markers=True)
    assert [(row["split"], row["step"]) for row in rows] == [
        ("train", 1), ("train", 2), ("resumed_from", 2), ("train", 3), ("train", 4), ("train", 5)]
    assert rows[2]["changed_settings"]["trainer.max_steps"] == [2, 5]
    for row in rows[:2]:
        assert row["lr"] == pytest.approx(scheduled_lr(row["step"] - 1, lr=1e-3, min_lr=1e-5, warmup=0, total=2,
                                                       style="cosine"), rel=1e-12, abs=1e-15)
    for row in rows[3:]:
        assert row["lr"] == pytest.approx(scheduled_lr(row["step"] - 1, lr=4e-3, min_lr=2e-4, warmup=1, total=5,
                                                       style="linear"), rel=1e-12, abs=1e-15), row["step"]
