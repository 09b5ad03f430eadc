"""Reward-model training through the real entry point at several parallel layouts (torchrun, gloo)."""
from __future__ import annotations

import json

import pytest

from aligner.demo import arithmetic
from aligner.demo.tokenizer import train_char_tokenizer

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun, write_jsonl
from .test_sft_parity import SFT_SCRIPT, _run_python

RM_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_reward_model.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_reward_model_losses_match_across_layouts_and_normalisation_is_stored(tmp_path):
    pairs = arithmetic.preference_records(256, seed=5)
    train = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    train_char_tokenizer([p["prompt"] + p["chosen"] + p["rejected"] for p in pairs], tmp_path / "tokenizer")
    architecture = ["model.architecture.num_layers=4", "model.architecture.hidden_size=64",
                    "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
                    "model.architecture.ffn_hidden_size=128", "logging.progress_bar=false",
                    "logging.tensorboard=false", "logging.peak_tflops=1.0"]
    # A policy checkpoint to start from (random init: what matters is that every layout starts alike).
    sft = write_jsonl(tmp_path / "sft.jsonl", arithmetic.sft_records(16, seed=5))
    _run_python(SFT_SCRIPT, f"tokenizer.path={tmp_path / 'tokenizer'}", f"data.train=[{{path: {sft}}}]",
                "trainer.max_steps=0", *architecture, "trainer.global_batch_size=8", "data.split='100,0'",
                f"checkpoint.save_dir={tmp_path / 'policy'}", f"logging.log_dir={tmp_path / 'policy'}")
    common = [f"model.init_from={tmp_path / 'policy' / 'step_00000000'}", f"data.train=[{{path: {train}}}]",
              "data.split='75,25'", "data.max_seq_length=16", "trainer.max_steps=3", "trainer.global_batch_size=8",
              "trainer.micro_batch_size=2", "trainer.val_check_interval=3", "optim.lr=1e-3", "optim.warmup_steps=1",
              "reward.normalization_samples=32", *architecture[4:]]
    results = {}
    # budget: token-budget micro batches of at most 2 packed rows of 16, balanced across the DP ranks (DP=2 is
    # launched once, with the budget: fixed micro batches across DP ranks are test_sft_parity.py's)
    for tp, pp, dp, budget in [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, 32)]:
        log_dir = tmp_path / f"rm_{tp}{pp}{dp}_{budget}"
        run_torchrun(RM_SCRIPT, tp * pp * dp, *common, f"parallel.tensor_model_parallel_size={tp}",
                     f"parallel.pipeline_model_parallel_size={pp}", f"checkpoint.save_dir={log_dir / 'ckpt'}",
                     f"logging.log_dir={log_dir}", *([f"packing.micro_batch_tokens={budget}"] if budget else []))
        meta = json.loads((log_dir / "ckpt" / "step_00000003" / "aligner_meta.json").read_text())
        results[(tp, pp, dp, budget)] = (metrics_rows(log_dir), meta["reward"])
    reference_rows, reference_reward = results[(1, 1, 1, None)]
    assert reference_reward["type"] == "binary_ranking" and len(reference_reward["normalization"]["mean"]) == 1
    assert reference_reward["normalization"]["std"][0] > 0
    for layout, (rows, reward_meta) in results.items():
        assert len(rows) == len(reference_rows) == 4  # 3 train steps + 1 validation
        for row, expected in zip(rows, reference_rows):
            for key in ("loss", "accuracy", "margin"):
                assert row[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (layout, row["step"], key)
        for key in ("mean", "std"):
            assert reward_meta["normalization"][key][0] == pytest.approx(reference_reward["normalization"][key][0],
                                                                          rel=1e-5), (layout, key)
