"""What a training run prints, through a real entry point (SFT, random init, 3 steps, in a subprocess): a short
line for the first and the last step although logging.log_interval is longer than the run, the full metric set
in metrics.jsonl, the end-of-run summary; the same command again says in one line that there is nothing to train,
trains nothing and exits 0. (The RL actor's console: tests/unit/test_rl_actor.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aligner.training.metrics import read_metrics

from ..conftest import REPO_ROOT, write_jsonl

SFT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"


def _lines(stdout: str) -> list[str]:
    """The messages of the run's log lines, without the `[HH:MM:SS aligner] ` prefix."""
    return [line.split("] ", 1)[1] for line in stdout.splitlines() if line.startswith("[") and "] " in line]


@pytest.mark.slow  # two runs in subprocesses: ~15 s on a quiet machine, 40 s under load
def test_a_run_prints_first_and_last_step_a_summary_and_a_finished_run_trains_nothing(tmp_path,
                                                                                      arithmetic_tokenizer_dir):
    from aligner.demo import arithmetic

    train = write_jsonl(tmp_path / "sft.jsonl", arithmetic.sft_records(16, seed=0))
    save_dir, log_dir = tmp_path / "sft", tmp_path / "logs"
    command = [sys.executable, str(SFT), f"tokenizer.path={arithmetic_tokenizer_dir}",
               f"data.train=[{{path: {train}}}]", "data.split='100,0'", "data.max_seq_length=16",
               "model.architecture.num_layers=1", "model.architecture.hidden_size=32",
               "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
               "model.architecture.ffn_hidden_size=64", "trainer.max_steps=3", "trainer.global_batch_size=8",
               "trainer.micro_batch_size=8", "trainer.val_check_interval=0", "logging.log_interval=100",
               "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0",
               f"checkpoint.save_dir={save_dir}", f"logging.log_dir={log_dir}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("OMP_NUM_THREADS", "1")
    first = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    lines = _lines(first.stdout)
    rows = read_metrics(log_dir, "train")
    assert len(rows) == 3 and {"grad_norm", "mfu", "time_optimizer", "consumed_samples"} <= set(rows[0])

    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1/3", "step 3/3"]  # log_interval=100: first and last
    for line, row in zip(steps, (rows[0], rows[2])):
        assert 40 <= len(line) <= 200, line
        fields = dict(part.split("=") for part in line.split(": ", 1)[1].split(" "))
        assert list(fields) == ["loss", "lr", "tokens/s", "time"]
        assert float(fields["loss"]) == round(row["loss"], 4)
        assert int(fields["tokens/s"]) == round(row["tokens_per_second"])
        assert fields["time"] == f"{row['step_time']:.2f}s"

    checkpoint = save_dir / "step_00000003"
    done = next(index for index, line in enumerate(lines) if line.startswith("done: "))
    tokens = sum(row["tokens"] for row in rows)
    assert lines[done] == (f"done: 3 step(s) in {lines[done].split(' in ')[1].split(' s,')[0]} s, now at step 3/3, "
                           f"final loss {rows[-1]['loss']:.4f}; {tokens:,.0f} tokens trained")
    assert lines[done + 1:done + 4] == [
        f"checkpoint: {checkpoint}", f"next: python examples/nlp/gpt/chat.py init_from={checkpoint}",
        f"next: python -m aligner.hf export --checkpoint {checkpoint} --output {save_dir / 'hf'}"]

    saved = sorted((path.name, path.stat().st_mtime_ns) for path in checkpoint.rglob("*"))
    again = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    finished = [line for line in _lines(again.stdout) if "nothing to train" in line]
    assert finished == [f"already at step 3 of trainer.max_steps=3 in checkpoint.save_dir={save_dir}: nothing to "
                        "train; to start fresh use another checkpoint.save_dir, to train on raise trainer.max_steps"]
    assert not any(line.startswith(("step ", "done: ", "saved checkpoint")) for line in _lines(again.stdout))
    assert read_metrics(log_dir, "train") == rows  # nothing trained
    assert [name for name, _ in saved] and sorted((path.name, path.stat().st_mtime_ns)
                                                  for path in checkpoint.rglob("*")) == saved
    assert [path.name for path in save_dir.glob("step_*")] == ["step_00000003"]
