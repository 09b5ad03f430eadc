"""SPIN through the real entry point at DP=2 and TP=2 (torchrun, gloo): the same self-play pairs and
losses as one process. Generation is split over the data-parallel replicas and sampled, so this
also checks that each generation batch draws from its own seeds whatever replica runs it."""
from __future__ import annotations

import pytest

from aligner.demo import arithmetic
from aligner.demo.tokenizer import train_char_tokenizer

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun, write_jsonl
from .test_sft_parity import SFT_SCRIPT, _run_python

SPIN_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_spin.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_spin_matches_one_process_at_dp2_and_tp2(tmp_path):
    records = arithmetic.correct_sft_records(24, seed=5)
    train = write_jsonl(tmp_path / "sft.jsonl", records)
    train_char_tokenizer(["0123456789+="], tmp_path / "tokenizer")
    architecture = ["model.architecture.num_layers=2", "model.architecture.hidden_size=64",
                    "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
                    "model.architecture.ffn_hidden_size=128"]
    quiet = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0"]
    _run_python(SFT_SCRIPT, f"tokenizer.path={tmp_path / 'tokenizer'}", f"data.train=[{{path: {train}}}]",
                "trainer.max_steps=0", *architecture, *quiet, "trainer.global_batch_size=8", "data.split='100,0'",
                f"checkpoint.save_dir={tmp_path / 'policy'}", f"logging.log_dir={tmp_path / 'policy'}")
    common = [f"model.init_from={tmp_path / 'policy' / 'step_00000000'}", f"data.train=[{{path: {train}}}]",
              "data.max_seq_length=16", "spin.num_iterations=2", "spin.steps_per_iteration=2",
              "spin.kl_betas=[0.5]", "spin.generation.greedy=false", "spin.generation.max_new_tokens=4",
              "spin.generation.batch_size=4", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
              "optim.lr=3e-3", "optim.warmup_steps=0", "checkpoint.save_at_end=false", *quiet]
    results = {}
    for tp, dp in [(1, 1), (1, 2), (2, 1)]:
        log_dir = tmp_path / f"spin_tp{tp}_dp{dp}"
        run_torchrun(SPIN_SCRIPT, tp * dp, *common, f"parallel.tensor_model_parallel_size={tp}",
                     f"checkpoint.save_dir={log_dir / 'ckpt'}", f"logging.log_dir={log_dir}")
        results[(tp, dp)] = metrics_rows(log_dir)
    reference = results[(1, 1)]
    assert [row["split"] for row in reference] == ["spin", "train", "train", "spin", "train", "train"]
    # Sampled self-play answers some prompts wrongly: the pairs are not all identical, so they train.
    assert all(row["self_match"] < 1.0 for row in reference if row["split"] == "spin")
    for layout, rows in results.items():
        assert [row["split"] for row in rows] == [row["split"] for row in reference], layout
        for row, expected in zip(rows, reference):
            if row["split"] == "spin":
                assert row["self_match"] == expected["self_match"], (layout, row, expected)
                continue
            for key in ("loss", "preference_loss", "margin"):
                assert row[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (layout, row["step"], key)
