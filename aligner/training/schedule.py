"""Resuming the LR schedule under the settings of the resumed run.

A resumed run applies its own `optim.lr`, `optim.min_lr`, `optim.warmup_steps`, `optim.decay_style`
and step count from the resume step on: users change them on purpose (a longer run, a lower rate).
The checkpoint contributes only the position in the schedule (optimizer steps done). Each setting
that differs from the checkpoint's is reported in one line, and in the metrics' resume marker row.

Megatron's `OptimizerParamScheduler.load_state_dict` would instead take every value from the
checkpoint, and the optimizer state restores the old `max_lr`/`min_lr` into the parameter groups,
where they win over the scheduler's: both are undone here.
"""
from __future__ import annotations

from typing import Any, Optional

STATE_KEY = "schedule_settings"  # where a trainer's state_dict records the settings its schedule was built from


def schedule_settings(optim, length: dict[str, int]) -> dict[str, Any]:
    """The settings an LR schedule is built from, by config key. optim: the `optim:` section;
    length: the settings that set the run's length, e.g. {"trainer.max_steps": 100}."""
    return {"optim.lr": optim.lr, "optim.min_lr": optim.final_lr, "optim.warmup_steps": optim.warmup_steps,
            "optim.decay_style": optim.decay_style, **length}


def _settings_of_scheduler_state(state: dict) -> dict[str, Any]:
    """What a checkpoint from before `schedule_settings` were recorded says about them."""
    settings = {"optim.lr": state["max_lr"], "optim.warmup_steps": state["lr_warmup_steps"],
                "optim.decay_style": state["lr_decay_style"]}
    if state["lr_decay_style"] != "constant":  # a constant schedule stores lr as its min_lr
        settings["optim.min_lr"] = state["min_lr"]
    return settings


def resume_schedule(scheduler, optimizer, saved_state: dict, settings: dict[str, Any]) -> dict[str, tuple]:
    """Put `scheduler` (built from the current config) at the checkpoint's position in its schedule.

    saved_state: the trainer state of the checkpoint (`scheduler` and, if recorded, STATE_KEY);
    settings: the current `schedule_settings`. Call after the optimizer state is loaded. Returns
    {key: (checkpoint value, current value)} for every setting that changed.
    """
    saved_scheduler = saved_state["scheduler"]
    saved_settings = saved_state.get(STATE_KEY) or _settings_of_scheduler_state(saved_scheduler)
    changes = {key: (saved_settings[key], value) for key, value in settings.items()
               if key in saved_settings and saved_settings[key] != value}
    if saved_scheduler["lr_decay_steps"] != scheduler.lr_decay_steps and not any(
            not key.startswith("optim.") for key in changes):
        # e.g. more PPO epochs or another max_epochs: the same step count spans more optimizer steps
        changes["LR schedule length (optimizer steps)"] = (saved_scheduler["lr_decay_steps"], scheduler.lr_decay_steps)
    for group in optimizer.param_groups:  # the optimizer state brought the checkpoint's values back
        group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
    scheduler.load_state_dict(saved_scheduler)  # now only the step count comes from the checkpoint
    return changes


def describe_changes(changes: dict[str, tuple], resume_step: int) -> Optional[str]:
    """One line for the log, or None when nothing changed."""
    if not changes:
        return None
    listed = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items())
    return f"resumed with changed settings: {listed}; the new values apply from step {resume_step + 1} on"
