"""Rejection sampling at DP=2 (torchrun, gloo): the replicas split the generation and the scoring, and
the run keeps and trains on exactly what one process does."""
from __future__ import annotations

import json

import pytest

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun, train_tiny_arithmetic_policy

RS_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_rs.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_replicas_keep_and_train_on_what_one_process_does(tmp_path):
    (tmp_path / "policy").mkdir()
    policy, prompts = train_tiny_arithmetic_policy(tmp_path / "policy", seed=3, num_prompts=64, steps=20)
    common = [f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
              "reward.function=tests.unit.test_rejection_sampling:starts_with_one", "rs.min_score=1.0",
              "rs.num_iterations=2", "rs.prompts_per_iteration=40", "rs.samples_per_prompt=4",
              "rs.generation.max_new_tokens=5", "rs.generation.batch_size=8", "rs.epochs_per_iteration=2",
              "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=0",
              "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0"]
    runs = {}
    for dp in (1, 2):
        log_dir = tmp_path / f"dp{dp}"
        run_torchrun(RS_SCRIPT, dp, *common, f"checkpoint.save_dir={log_dir / 'ckpt'}", f"logging.log_dir={log_dir}")
        samples = [[json.loads(line) for line in (log_dir / "rejection_sampling" / f"iteration_00{i}.jsonl")
                    .read_text().splitlines()] for i in (1, 2)]
        runs[dp] = samples, metrics_rows(log_dir, "train")
    (one_samples, one_rows), (two_samples, two_rows) = runs[1], runs[2]
    assert one_samples == two_samples  # 5 batches of 8 prompt rows dealt to 2 replicas: same tokens, scores, kept
    assert sum(sample["kept"] for sample in one_samples[1]) >= 8 and len(one_rows) >= 2
    assert len(one_rows) == len(two_rows)
    for one, two in zip(one_rows, two_rows):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), one["step"]
