"""Entry points start quietly: nothing a user cannot act on, while a real error still shows as one line.

Runs SFT (random init, 2 steps) and chat batch mode on its checkpoint in subprocesses with Python's
default warning filters (no PYTHONWARNINGS=ignore, unlike the other functional tests), and asserts
their output has none of the notices megatron-core and Triton print on every start. The reward
server's start is checked in tests/functional/test_reward_server.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aligner.runtime import cpu_bridge

from ..conftest import REPO_ROOT, write_jsonl

GPT = REPO_ROOT / "examples" / "nlp" / "gpt"
# Lines that used to appear on every start: megatron's missing apex/transformer-engine (CPU only:
# with CUDA they stay, installing those is a real option there), its rerun state machine, any
# Python warning, and Triton's CUDA/NVML errors on a machine without a GPU.
NOISE = ("Rerun State Machine", "RerunStateMachine", "Warning:", "warnings.warn", "NVML", "DCGM", "CudaDriverHelper")
NOISE += ("not installed",) if cpu_bridge.needed() else ()


def noise_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if any(pattern in line for pattern in NOISE)]


def run(script: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The entry point in a fresh process with Python's default warning filters."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONWARNINGS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, str(script), *overrides], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=600)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, arithmetic_tokenizer_dir):
    from aligner.demo import arithmetic

    root = tmp_path_factory.mktemp("startup_noise")
    train = write_jsonl(root / "sft.jsonl", arithmetic.sft_records(16, seed=0))
    result = run(GPT / "train_gpt_sft.py", f"tokenizer.path={arithmetic_tokenizer_dir}",
                 f"data.train=[{{path: {train}}}]", "data.split='100,0'", "data.max_seq_length=16",
                 "model.architecture.num_layers=1", "model.architecture.hidden_size=32",
                 "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
                 "model.architecture.ffn_hidden_size=64",
                 "trainer.max_steps=2", "trainer.global_batch_size=8", "trainer.micro_batch_size=8",
                 "trainer.val_check_interval=0", "logging.progress_bar=false", "logging.tensorboard=false",
                 f"checkpoint.save_dir={root / 'sft'}", f"logging.log_dir={root / 'sft_logs'}")
    assert result.returncode == 0, result.stderr[-4000:]
    return root, result


def test_sft_starts_and_trains_without_noise(sft_run):
    _, result = sft_run
    assert noise_lines(result.stdout + result.stderr) == [] and result.stderr == ""
    assert "gpt_sft:" in result.stdout  # the run's own log lines are still there


def test_chat_answers_without_noise_and_still_reports_a_bad_record(sft_run):
    root, _ = sft_run
    checkpoint = root / "sft" / "step_00000002"
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": "12+7="}, {"prompt": "3+4="}])
    result = run(GPT / "chat.py", f"init_from={checkpoint}", f"prompts_file={prompts}",
                 f"output_file={root / 'answers.jsonl'}", "sampling.max_new_tokens=4")
    assert result.returncode == 0, result.stderr[-4000:]
    assert noise_lines(result.stdout + result.stderr) == [] and result.stderr == ""
    assert len((root / "answers.jsonl").read_text().splitlines()) == 2

    bad = root / "bad_prompts.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"question": "2+2="}) + "\n")
    result = run(GPT / "chat.py", f"init_from={checkpoint}", f"prompts_file={bad}",
                 f"output_file={root / 'bad_answers.jsonl'}", "sampling.max_new_tokens=4")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {bad}:2: record has neither 'prompt' nor 'messages' "
                                     "(keys present: 'question')")
