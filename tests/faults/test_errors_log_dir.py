"""log_dir faults through the real SFT entry point: unwritable at start-up, full during training.

Guarantees tested here: an unwritable log_dir is refused before the model is built, with one line
naming `logging.log_dir` and the path; a full log_dir ends the run at the metrics write that failed
with one line naming metrics.jsonl (exit 2, no traceback); a row cut short by the full disk is
removed when the run is resumed, so every line of metrics.jsonl parses again.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess

import pytest

from aligner.training.metrics import METRICS_FILE, read_metrics

from .conftest import tmpfs
from .errors_sft import error_lines, run_sft, write_sft_inputs


def _assert_one_error(result: subprocess.CompletedProcess, expected: str) -> None:
    lines = error_lines(result)
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    assert lines[0].startswith(expected), lines[0]


def test_read_only_log_dir_is_refused_before_the_model_is_built(tmp_path):
    settings = write_sft_inputs(tmp_path / "inputs")
    with tmpfs(tmp_path / "read_only", "ro,size=1m") as log_dir:
        result = run_sft({**settings, "logging.log_dir": log_dir / "logs", "trainer.max_steps": 2})
    _assert_one_error(result, f"error: logging.log_dir={log_dir / 'logs'} is not writable (Read-only file system)")
    assert not (tmp_path / "inputs" / "checkpoints").exists()  # nothing was built or saved


def test_log_dir_that_is_a_file_is_refused(tmp_path):
    settings = write_sft_inputs(tmp_path / "inputs")
    (tmp_path / "a_file").write_text("")
    result = run_sft({**settings, "logging.log_dir": tmp_path / "a_file", "trainer.max_steps": 2})
    _assert_one_error(result, f"error: logging.log_dir={tmp_path / 'a_file'} is not writable")
    assert not (tmp_path / "inputs" / "checkpoints").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to make writes fail with ENOSPC")
def test_metrics_write_failing_with_enospc_ends_the_run_with_one_line(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does (works without root)."""
    settings = write_sft_inputs(tmp_path / "inputs")
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    os.symlink("/dev/full", log_dir / METRICS_FILE)
    result = run_sft({**settings, "logging.log_dir": log_dir, "trainer.max_steps": 3})
    _assert_one_error(result, f"error: {log_dir / METRICS_FILE}: cannot write metrics (No space left on device); "
                              "the run stops")


@pytest.mark.parametrize("tensorboard", [False, True])
def test_full_log_dir_stops_the_run_and_the_resume_drops_the_partial_row(tmp_path, tensorboard):
    settings = write_sft_inputs(tmp_path / "inputs")
    with tmpfs(tmp_path / "small", "size=64k") as mount:
        log_dir = mount / "logs"
        log_dir.mkdir()
        # Fill the file system, then free one 4 kB page (room for about a dozen metrics rows), or
        # four with TensorBoard's event file beside them.
        filler = mount / "filler"
        with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as handle:
            while True:
                handle.write(b"\0" * 4096)
        os.truncate(filler, (filler.stat().st_size // 4096 - (4 if tensorboard else 1)) * 4096)
        run = {**settings, "logging.log_dir": log_dir, "trainer.max_steps": 40, "checkpoint.save_interval": 2,
               "logging.tensorboard": str(tensorboard).lower()}
        result = run_sft(run)
        # With TensorBoard on, its event file may be the write that fails first (its writer thread's
        # traceback is not shown either).
        failed = f"{log_dir / 'tensorboard'}|{log_dir / METRICS_FILE}" if tensorboard else str(log_dir / METRICS_FILE)
        lines = error_lines(result)
        assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
        assert re.fullmatch(rf"error: ({failed}): cannot write metrics \(No space left on device\); the run stops, "
                            "since every later metric would be lost", lines[0]), lines[0]
        # The kernel wrote what fitted of the failing row: a partial last row, as a crash leaves one.
        cut_short = not (log_dir / METRICS_FILE).read_bytes().endswith(b"\n")
        assert cut_short or tensorboard
        stopped_at = read_metrics(log_dir, "train")[-1]["step"]  # readers skip a partial last row
        assert 0 < stopped_at < 40

        filler.unlink()  # space again: the same command resumes from the newest checkpoint
        result = run_sft(run)
        assert result.returncode == 0 and not error_lines(result), result.stderr[-4000:]
        assert ("removed a partial last row" in result.stdout) == cut_short
        rows = [json.loads(line) for line in (log_dir / METRICS_FILE).read_text().splitlines()]  # all parse again
        history = read_metrics(log_dir, "train", newest_attempt=True)
    markers = [row for row in rows if row["split"] == "resumed_from"]
    assert len(markers) == 1 and markers[0]["step"] <= stopped_at and markers[0]["step"] % 2 == 0
    assert [row["step"] for row in history] == list(range(1, 41))
