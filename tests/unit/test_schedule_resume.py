"""aligner.training.schedule.resume_schedule: the resumed run's settings win, from the checkpoint's position.

The trainer, the RL actors and the critic server all resume their LR schedule through it; the
learning rates are checked against the schedule computed in float64 (tests/faults/test_errors_resume.py
checks the same end to end through the SFT and REINFORCE entry points).
"""
from __future__ import annotations

import pytest

from aligner.training import schedule
from aligner.training.setup import OptimConfig, build_scheduler

from ..faults.errors_sft import scheduled_lr


class ParamGroups:
    """What OptimizerParamScheduler needs of an optimizer: parameter groups as megatron builds them."""

    def __init__(self, optim: OptimConfig):
        self.param_groups = [{"max_lr": optim.lr, "min_lr": optim.final_lr, "lr": 0.0, "weight_decay": 0.0}
                             for _ in range(2)]


def _checkpoint_state(optim: OptimConfig, total: int, steps_done: int, record_settings: bool = True) -> dict:
    optimizer = ParamGroups(optim)
    scheduler = build_scheduler(optimizer, optim, total)
    scheduler.step(increment=steps_done)
    state = {"scheduler": scheduler.state_dict()}
    if record_settings:
        state[schedule.STATE_KEY] = schedule.schedule_settings(optim, {"train.max_steps": total})
    return state


def test_the_resumed_runs_settings_apply_from_the_checkpoints_step():
    old = OptimConfig(lr=1e-5, min_lr=1e-6, warmup_steps=2, decay_style="cosine")
    new = OptimConfig(lr=5e-3, min_lr=1e-4, warmup_steps=4, decay_style="linear")
    state = _checkpoint_state(old, total=100, steps_done=30)
    optimizer = ParamGroups(new)
    # as the optimizer state restores them
    optimizer.param_groups[0]["max_lr"] = optimizer.param_groups[1]["max_lr"] = old.lr
    scheduler = build_scheduler(optimizer, new, 200)
    changes = schedule.resume_schedule(scheduler, optimizer, state,
                                       schedule.schedule_settings(new, {"train.max_steps": 200}))
    assert changes == {"optim.lr": (1e-5, 5e-3), "optim.min_lr": (1e-6, 1e-4), "optim.warmup_steps": (2, 4),
                       "optim.decay_style": ("cosine", "linear"), "train.max_steps": (100, 200)}
    assert schedule.describe_changes(changes, 30) == (
        "resumed with changed settings: optim.lr 1e-05 -> 0.005, optim.min_lr 1e-06 -> 0.0001, "
        "optim.warmup_steps 2 -> 4, "
        "optim.decay_style cosine -> linear, train.max_steps 100 -> 200; the new values apply from step 31 on")
    assert scheduler.num_steps == 30
    for steps_done in (30, 31, 150, 199):
        scheduler.step(increment=steps_done - scheduler.num_steps)
        expected = scheduled_lr(steps_done, lr=5e-3, min_lr=1e-4, warmup=4, total=200, style="linear")
        assert all(group["lr"] == pytest.approx(expected, rel=1e-12) for group in optimizer.param_groups), steps_done


def test_unchanged_settings_resume_the_same_schedule_and_report_nothing():
    optim = OptimConfig(lr=1e-3, min_lr=1e-5, warmup_steps=3, decay_style="cosine")
    state = _checkpoint_state(optim, total=50, steps_done=7)
    optimizer = ParamGroups(optim)
    scheduler = build_scheduler(optimizer, optim, 50)
    changes = schedule.resume_schedule(scheduler, optimizer, state, schedule.schedule_settings(optim, {"k": 50}))
    assert changes == {} and schedule.describe_changes(changes, 7) is None  # no line is printed
    assert scheduler.num_steps == 7
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        scheduled_lr(7, lr=1e-3, min_lr=1e-5, warmup=3, total=50, style="cosine"), rel=1e-12)


def test_a_longer_schedule_from_other_settings_is_reported_and_old_checkpoints_are_read():
    """A checkpoint without recorded settings (written before they were): compared through its scheduler
    state; a schedule length that changed without a step-count setting (e.g. more PPO epochs) is named."""
    optim = OptimConfig(lr=1e-3, min_lr=1e-5, warmup_steps=0, decay_style="constant")
    state = _checkpoint_state(optim, total=40, steps_done=10, record_settings=False)
    optimizer = ParamGroups(optim)
    scheduler = build_scheduler(optimizer, optim, 80)
    changes = schedule.resume_schedule(scheduler, optimizer, state,
                                       schedule.schedule_settings(optim, {"ppo.epochs": 2}))
    assert changes == {"LR schedule length (optimizer steps)": (40, 80)}
    assert optimizer.param_groups[0]["lr"] == 1e-3
