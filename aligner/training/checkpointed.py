"""The checkpoint lifecycle of a trainer, written once: save (and prune), save_unless_saved, resume_from.

`Trainer`, `RLActor` and `Critic` mix in `Checkpointed` and say only what differs: what goes into
their checkpoints (`checkpoint_fields`, `state_dict`), how their state comes back (`load_state_dict`),
and what else a save does (`after_save`: the RL actor's EMA and critic checkpoints).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ContextManager, Optional

from aligner import checkpointing
from aligner.training import schedule


class Checkpointed:
    """save / save_unless_saved / resume_from over `checkpoint.save_dir/step_<N>`.

    A class using it has `step`, `chunks`, `optimizer`, `save_dir`, `keep_last`, `run_id` and `metrics`
    (a MetricsLogger, or None: no messages) and defines `state_dict()` and `load_state_dict(state)`
    (-> the schedule settings that changed, `aligner.training.schedule.resume_schedule`).
    """

    saved_at: Optional[object] = None  # `position()` of the newest checkpoint this run wrote or resumed from

    # -- what differs between trainers
    def position(self) -> object:
        """What a checkpoint of the current state is known by (the RL actor's also counts critic warm-up rounds)."""
        return self.step

    def saved_state(self, step: int) -> dict:
        """The trainer state a checkpoint at `step` carries (the critic adds the step its caller named)."""
        return self.state_dict()

    def checkpoint_fields(self) -> dict:
        """checkpointing.save's keyword arguments besides the directory, chunks, optimizer, trainer state and run id."""
        raise NotImplementedError

    def load_fields(self) -> dict:
        """checkpointing.load's keyword arguments besides the directory, chunks and optimizer."""
        return {"load_rng": True, "model_config": self.checkpoint_fields()["model_config"]}

    def optimizer_state_ready(self) -> ContextManager:
        """Around a save or load: the optimizer state where checkpointing reads and writes it."""
        return contextlib.nullcontext()

    def before_save(self, step: int) -> str:
        """What must be saved before this trainer's checkpoint of `step` exists (a checkpoint then implies it);
        returns a note for the saved-message."""
        return ""

    def after_save(self, path: Path) -> str:
        """Whatever else a save writes (before old checkpoints are pruned); returns a note for the saved-message."""
        return ""

    def check_trainer_state(self, checkpoint_dir: Path, state: dict) -> None:
        """Raise if checkpoint_dir's trainer state is not this trainer's (before any of it is applied)."""

    def resume_note(self, meta: dict) -> str:
        """What the resumed-message adds after the step."""
        return ""

    # -- the lifecycle
    def save(self, step: Optional[int] = None) -> Path:
        """save_dir/step_<step> (default: the current step); then this run's older checkpoints are pruned
        to keep_last."""
        step = self.step if step is None else step
        note = self.before_save(step)
        with self.optimizer_state_ready():
            path = checkpointing.save(checkpointing.step_dir(self.save_dir, step), self.chunks,
                                      optimizer=self.optimizer, trainer_state=self.saved_state(step),
                                      run_id=self.run_id, **self.checkpoint_fields())
        note += self.after_save(path)
        checkpointing.remove_old_checkpoints(self.save_dir, self.keep_last, run_id=self.run_id, saved=path)
        self.saved_at = self.position()
        if self.metrics is not None:
            self.metrics.write(f"saved checkpoint {path}{note}")
        return path

    def save_unless_saved(self) -> Path:
        """The checkpoint of the current state: saved now unless this run already wrote (or resumed from) it."""
        if self.saved_at == self.position():
            return checkpointing.step_dir(self.save_dir, self.step)
        return self.save()

    def resume_from(self, checkpoint_dir: Path) -> None:
        """Weights, optimizer, trainer state (and RNG) from checkpoint_dir; says so, and which schedule
        settings changed."""
        with self.optimizer_state_ready():
            meta = checkpointing.load(checkpoint_dir, self.chunks, optimizer=self.optimizer, **self.load_fields())
        state = meta.get("trainer_state", {})
        self.check_trainer_state(checkpoint_dir, state)
        changes = self.load_state_dict(state)
        self.saved_at = self.position()
        self.report_resume(checkpoint_dir, meta, changes)

    def report_resume(self, checkpoint_dir: Path, meta: dict, changes: dict) -> None:
        if self.metrics.progress is not None:
            self.metrics.progress.update(self.step)
        self.metrics.log_resume(self.step, checkpoint_dir, changes)
        self.metrics.write(f"resumed from {checkpoint_dir} at step {self.step}{self.resume_note(meta)}")
        if changes:
            self.metrics.write(schedule.describe_changes(changes, self.step))
