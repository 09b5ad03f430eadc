"""metrics.jsonl: resume marker rows, a partial last row from a crash, readers, write failures."""
from __future__ import annotations

import json
import os

import pytest

from aligner.config import OutputError
from aligner.data.jsonl import DataError
from aligner.training.metrics import METRICS_FILE, LoggingConfig, MetricsLogger, read_metrics


def _logger(log_dir) -> MetricsLogger:
    return MetricsLogger(LoggingConfig(log_dir=str(log_dir), tensorboard=False, progress_bar=False), "test", 10)


def _row(step, split="train", **values) -> str:
    return json.dumps({"step": step, "split": split, **values}) + "\n"


def test_a_resume_writes_a_marker_row_and_readers_see_each_step_once(tmp_path):
    metrics = _logger(tmp_path)
    for step in (1, 2, 3):
        metrics.log(step, {"loss": float(step)})
    metrics.log(3, {"loss": 30.0}, prefix="validation")
    metrics.close()
    # Crashed after step 3, resumed from the step-2 checkpoint with a new learning rate.
    metrics = _logger(tmp_path)
    metrics.log_resume(2, tmp_path / "ckpt" / "step_00000002", {"optim.lr": (1e-5, 5e-3)})
    for step in (3, 4):
        metrics.log(step, {"loss": step + 0.5})
    metrics.close()

    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert json.loads(lines[4]) == {"step": 2, "split": "resumed_from",
                                    "checkpoint": str(tmp_path / "ckpt" / "step_00000002"),
                                    "changed_settings": {"optim.lr": [1e-5, 5e-3]}}
    as_written = read_metrics(tmp_path, "train")
    assert [(row["step"], row["loss"]) for row in as_written] == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 3.5), (4, 4.5)]
    history = read_metrics(tmp_path, "train", newest_attempt=True)
    assert [(row["step"], row["loss"]) for row in history] == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]
    # step 3's validation belonged to the attempt that was re-run
    assert read_metrics(tmp_path, "validation", newest_attempt=True) == []
    everything = read_metrics(tmp_path / METRICS_FILE, newest_attempt=True, include_markers=True)
    assert [(row["split"], row["step"]) for row in everything] == [
        ("train", 1), ("train", 2), ("resumed_from", 2), ("train", 3), ("train", 4)]


def test_a_partial_last_row_is_skipped_by_readers_and_cut_off_before_appending(tmp_path):
    path = tmp_path / METRICS_FILE
    partial = _row(3)[:17]  # a write cut short by a crash: no newline, not valid JSON
    path.write_text(_row(1, loss=1.0) + _row(2, loss=2.0) + partial)
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]

    metrics = _logger(tmp_path)
    metrics.log_resume(2, "ckpt")
    metrics.log(3, {"loss": 3.0})
    metrics.close()
    text = path.read_text()
    assert text.endswith("\n")
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 2, 3]  # every line parses
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_complete_last_row_without_its_newline_is_kept(tmp_path):
    (tmp_path / METRICS_FILE).write_text(_row(1) + _row(2).rstrip("\n"))
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]


def test_a_damaged_row_inside_the_file_is_an_error_naming_the_line(tmp_path):
    (tmp_path / METRICS_FILE).write_text(_row(1) + '{"step": 2, "spl\n' + _row(3))
    with pytest.raises(DataError, match=rf"{tmp_path / METRICS_FILE}:2: not valid JSON"):
        read_metrics(tmp_path)


def test_an_unwritable_log_dir_is_refused_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OutputError, match=rf"^logging.log_dir={blocker / 'logs'} is not writable \(Not a directory\)$"):
        _logger(blocker / "logs")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to make writes fail with ENOSPC")
def test_a_full_disk_ends_the_run_with_one_line_naming_the_file(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full file system does."""
    os.symlink("/dev/full", tmp_path / METRICS_FILE)
    metrics = _logger(tmp_path)
    with pytest.raises(OutputError) as raised:
        metrics.log(1, {"loss": 1.0})
    assert str(raised.value) == (f"{tmp_path / METRICS_FILE}: cannot write metrics (No space left on device); the run "
                                 "stops, since every later metric would be lost")
    metrics.close()  # after the failure, closing raises nothing more
