"""A tiny SFT run through the real entry point, for the `errors` fault tests (log_dir faults, resumes)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO_ROOT

SFT_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"
REINFORCE_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_reinforce_actor.py"


def ones_reward(prompt, response_text: str) -> float:
    """A reward function for actor runs (reward.function=tests.faults.errors_sft:ones_reward)."""
    return sum(character == "1" for character in response_text) / max(len(response_text), 1)


def write_sft_inputs(root: Path) -> dict:
    """Demo-task demonstrations and a character tokenizer under root; the overrides of a tiny SFT run."""
    from aligner.demo import arithmetic
    from aligner.demo.tokenizer import train_char_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    records = arithmetic.sft_records(128, seed=0)
    (root / "sft.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    train_char_tokenizer([record["input"] + record["output"] for record in records], root / "tokenizer")
    return {
        "tokenizer.path": root / "tokenizer", "data.train": f"[{{path: {root / 'sft.jsonl'}}}]",
        "data.split": "'100,0'", "data.max_seq_length": 16, "model.architecture.num_layers": 2,
        "model.architecture.hidden_size": 32, "model.architecture.num_attention_heads": 4,
        "model.architecture.num_query_groups": 2, "model.architecture.ffn_hidden_size": 64,
        "trainer.global_batch_size": 16, "trainer.micro_batch_size": 16, "trainer.val_check_interval": 0,
        "logging.progress_bar": "false", "logging.tensorboard": "false", "logging.peak_tflops": 1.0,
        "checkpoint.save_dir": root / "checkpoints", "logging.log_dir": root / "logs",
    }


def run_sft(settings: dict, timeout: float = 240, script: Path = SFT_SCRIPT) -> subprocess.CompletedProcess:
    """train_gpt_sft.py (or `script`) with `settings` as key=value overrides (the process is gone when
    this returns)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), *(f"{key}={value}" for key, value in settings.items())]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def scheduled_lr(optimizer_steps: int, *, lr: float, min_lr: float, warmup: int, total: int, style: str) -> float:
    """The LR after `optimizer_steps` steps: linear warmup from 0, then cosine or linear decay to min_lr
    at `total` steps (constant: lr after warmup)."""
    if warmup > 0 and optimizer_steps <= warmup:
        return lr * optimizer_steps / warmup
    if style == "constant":
        return lr
    ratio = (optimizer_steps - warmup) / (total - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)
