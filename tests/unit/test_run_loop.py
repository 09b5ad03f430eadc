"""The one run loop (aligner/training/loop.py): stop checks, step counting, metrics, validation and save
cadence, the save at the end, resume, and a failing step."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from aligner.runtime import stopping
from aligner.training.loop import Cadence, run_loop


class Metrics:
    def __init__(self, events: list):
        self.events = events

    def log(self, step: int, metrics: dict, prefix: str = "train") -> None:
        self.events.append(("log", prefix, step, dict(metrics)))

    def advance(self, **shown) -> None:
        self.events.append(("advance", shown))


class State:
    """A trainer as the loop sees it; records what the loop asked of it."""

    def __init__(self, step: int = 0, saved_at=None):
        self.step = step
        self.saved_at = saved_at
        self.events: list = []
        self.metrics = Metrics(self.events)

    def count_step(self) -> None:
        self.step += 1

    def save(self) -> Path:
        self.events.append(("save", self.step))
        self.saved_at = self.step
        return Path(f"step_{self.step:08d}")

    def save_unless_saved(self) -> Path:
        if self.saved_at != self.step:
            return self.save()
        return Path(f"step_{self.step:08d}")

    def validate(self) -> dict:
        self.events.append(("validate", self.step))
        return {"loss": -self.step}


def step_of(state: State, fail_at: int = 0, signal_at: int = 0):
    def step() -> dict:
        number = state.step + 1
        if number == fail_at:
            raise FloatingPointError(f"step {number}: the optimizer step failed")
        if number == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler ran (and only recorded the signal)
        state.events.append(("step", number))
        return {"loss": float(number), "lr": 0.1}
    return step


def kinds(state: State, *names: str) -> list:
    return [event for event in state.events if event[0] in names]


def test_steps_are_counted_logged_validated_and_saved_at_their_intervals(handlers):
    state = State()
    with run_loop(state, Cadence(val_check_interval=2, save_interval=2, save_at_end=True)) as loop:
        loop.run_until(5, step_of(state))
    assert state.step == 5
    assert kinds(state, "step") == [("step", n) for n in range(1, 6)]
    assert [event[2] for event in kinds(state, "log") if event[1] == "train"] == [1, 2, 3, 4, 5]
    # validation every 2 steps and after the last; saves every 2 steps before the last, then the end's
    assert [event for event in state.events if event[0] in ("validate", "save")] == [
        ("validate", 2), ("save", 2), ("validate", 4), ("save", 4), ("validate", 5), ("save", 5)]
    assert ("log", "validation", 4, {"loss": -4}) in state.events
    assert kinds(state, "advance")[0] == ("advance", {"loss": 1.0, "lr": 0.1})


def test_the_last_step_is_saved_once_and_not_at_all_without_save_at_end(handlers):
    state = State()
    with run_loop(state, Cadence(save_interval=2, save_at_end=True)) as loop:
        loop.run_until(4, step_of(state))
    assert kinds(state, "save") == [("save", 2), ("save", 4)]
    state = State()
    with run_loop(state, Cadence(save_interval=2, save_at_end=False)) as loop:
        loop.run_until(4, step_of(state))
    assert kinds(state, "save") == [("save", 2)]


def test_a_resumed_run_continues_at_its_step_and_a_finished_one_trains_and_saves_nothing(handlers):
    state = State(step=3, saved_at=3)
    with run_loop(state, Cadence(val_check_interval=0, save_interval=2, save_at_end=True)) as loop:
        loop.run_until(6, step_of(state))
    assert kinds(state, "step") == [("step", 4), ("step", 5), ("step", 6)]
    assert kinds(state, "save") == [("save", 4), ("save", 6)]
    finished = State(step=6, saved_at=6)
    with run_loop(finished, Cadence(save_interval=2, save_at_end=True)) as loop:
        loop.run_until(6, step_of(finished))
    assert finished.events == []


def test_a_stop_signal_saves_at_the_next_boundary_and_runs_no_further_step(handlers):
    state = State()
    with pytest.raises(stopping.Stopped) as raised:
        with run_loop(state, Cadence(save_interval=0, save_at_end=True)) as loop:
            loop.run_until(5, step_of(state, signal_at=2))
    assert kinds(state, "step") == [("step", 1), ("step", 2)]
    assert kinds(state, "save") == [("save", 2)]  # the stop's checkpoint; no save at the end after a stop
    assert raised.value.message == ("stopped at step 2 by SIGTERM; checkpoint step_00000002; "
                                    "resume with the same command")


def test_a_stop_at_a_boundary_that_cannot_be_resumed_saves_nothing(handlers):
    state = State()
    with pytest.raises(stopping.Stopped) as raised:
        with run_loop(state, Cadence(save_at_end=True)) as loop:
            for number in range(1, 4):
                loop.step(step_of(state, signal_at=1), extra={"iteration": 1}, resumable=number == 1,
                          unsaved_reason="mid-iteration")
    assert kinds(state, "step") == [("step", 1)] and kinds(state, "save") == []
    assert "stopped at step 1 by SIGTERM without a checkpoint (mid-iteration)" in raised.value.message
    assert kinds(state, "log")[0][3] == {"loss": 1.0, "lr": 0.1, "iteration": 1}  # extra joins the step's metrics


def test_a_failing_step_propagates_and_saves_nothing_extra(handlers):
    state = State()
    with pytest.raises(FloatingPointError, match="step 3"):
        with run_loop(state, Cadence(val_check_interval=1, save_interval=2, save_at_end=True)) as loop:
            loop.run_until(5, step_of(state, fail_at=3))
    assert state.step == 2
    assert kinds(state, "save") == [("save", 2)]  # the interval's; neither the failed step nor an end save
    assert kinds(state, "validate") == [("validate", 1), ("validate", 2)]
