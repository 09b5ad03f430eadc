"""DPO through the real entry point at several parallel layouts (torchrun, gloo): same losses."""
from __future__ import annotations

import math

import pytest

from aligner.demo import arithmetic
from aligner.demo.tokenizer import train_char_tokenizer

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun, write_jsonl
from .test_sft_parity import SFT_SCRIPT, _run_python

DPO_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_dpo.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_dpo_losses_match_across_layouts_and_reference_modes(tmp_path):
    pairs = arithmetic.preference_records(64, seed=11)
    train = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    train_char_tokenizer([p["prompt"] + p["chosen"] + p["rejected"] for p in pairs], tmp_path / "tokenizer")
    architecture = ["model.architecture.num_layers=4", "model.architecture.hidden_size=64",
                    "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
                    "model.architecture.ffn_hidden_size=128"]
    quiet = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0"]
    # One initial policy (random init) for every layout; it is also the reference.
    sft = write_jsonl(tmp_path / "sft.jsonl", arithmetic.sft_records(16, seed=11))
    _run_python(SFT_SCRIPT, f"tokenizer.path={tmp_path / 'tokenizer'}", f"data.train=[{{path: {sft}}}]",
                "trainer.max_steps=0", *architecture, *quiet, "trainer.global_batch_size=8", "data.split='100,0'",
                f"checkpoint.save_dir={tmp_path / 'policy'}", f"logging.log_dir={tmp_path / 'policy'}")
    common = [f"model.init_from={tmp_path / 'policy' / 'step_00000000'}", f"data.train=[{{path: {train}}}]",
              "data.split='75,25'", "data.max_seq_length=16", "trainer.max_steps=3", "trainer.global_batch_size=8",
              "trainer.micro_batch_size=2", "trainer.val_check_interval=3", "optim.lr=1e-3", "optim.warmup_steps=0",
              "dpo.beta=0.2", "dpo.sft_loss_weight=0.1", "checkpoint.save_at_end=false", *quiet]
    results = {}
    # budget: token-budget micro batches of at most 2 packed rows, balanced across the DP ranks. Each parallel
    # dimension once, each reference mode under a split model, budgets with the swapped reference and DP=2: the
    # layouts alone are test_sft_parity.py's, so the rest of their product adds launches (~16 s each), not coverage.
    for tp, pp, dp, mode, budget in [(1, 1, 1, "precompute", None), (2, 1, 1, "swap", None),
                                     (1, 2, 1, "precompute", None), (1, 1, 2, "swap", 32)]:
        log_dir = tmp_path / f"dpo_{tp}{pp}{dp}_{mode}_{budget}"
        run_torchrun(DPO_SCRIPT, tp * pp * dp, *common, f"parallel.tensor_model_parallel_size={tp}",
                     f"parallel.pipeline_model_parallel_size={pp}", f"dpo.reference_logprobs={mode}",
                     f"checkpoint.save_dir={log_dir / 'ckpt'}", f"logging.log_dir={log_dir}",
                     *([f"packing.micro_batch_tokens={budget}"] if budget else []))
        results[(tp, pp, dp, mode, budget)] = metrics_rows(log_dir)
    reference = results[(1, 1, 1, "precompute", None)]
    assert [row["split"] for row in reference] == ["train", "train", "train", "validation"]
    first = reference[0]
    # Policy = reference at step 1: the preference loss is log 2 and the implicit rewards are 0.
    assert first["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(first["margin"]) < 1e-6 and abs(first["chosen_reward"]) < 1e-6
    for layout, rows in results.items():
        assert len(rows) == len(reference)
        for row, expected in zip(rows, reference):
            for key in ("loss", "preference_loss", "sft_loss"):
                relative = abs(row[key] - expected[key]) / abs(expected[key])
                assert relative < 1e-5, (layout, row["split"], row["step"], key, row[key], expected[key])
            for key in ("margin", "chosen_reward", "rejected_reward"):
                assert row[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (layout, row["step"], key)
