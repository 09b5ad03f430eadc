"""KTO through the real entry point at several parallel layouts (torchrun, gloo): same losses, reference
points and rewards as one process, in both reference modes."""
from __future__ import annotations

import pytest

from aligner.demo import arithmetic
from aligner.demo.tokenizer import train_char_tokenizer

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun, write_jsonl
from .test_sft_parity import SFT_SCRIPT, _run_python

KTO_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_kto.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_kto_matches_across_layouts_and_reference_modes(tmp_path):
    examples = arithmetic.unpaired_records(32, seed=5)
    train = write_jsonl(tmp_path / "kto.jsonl", examples)
    train_char_tokenizer([e["prompt"] + e["completion"] for e in examples], tmp_path / "tokenizer")
    architecture = ["model.architecture.num_layers=4", "model.architecture.hidden_size=64",
                    "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
                    "model.architecture.ffn_hidden_size=128"]
    quiet = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0"]
    sft = write_jsonl(tmp_path / "sft.jsonl", arithmetic.sft_records(16, seed=5))
    _run_python(SFT_SCRIPT, f"tokenizer.path={tmp_path / 'tokenizer'}", f"data.train=[{{path: {sft}}}]",
                "trainer.max_steps=0", *architecture, *quiet, "trainer.global_batch_size=8", "data.split='100,0'",
                f"checkpoint.save_dir={tmp_path / 'policy'}", f"logging.log_dir={tmp_path / 'policy'}")
    common = [f"model.init_from={tmp_path / 'policy' / 'step_00000000'}", f"data.train=[{{path: {train}}}]",
              "data.split='75,25'", "data.max_seq_length=16", "trainer.max_steps=3", "trainer.global_batch_size=8",
              "trainer.micro_batch_size=2", "trainer.val_check_interval=3", "optim.lr=3e-3", "optim.warmup_steps=0",
              "kto.beta=0.5", "kto.undesirable_weight=1.5", "checkpoint.save_at_end=false", *quiet]
    results = {}
    for tp, pp, dp, mode in [(1, 1, 1, "precompute"), (2, 1, 1, "precompute"), (1, 2, 1, "precompute"),
                             (1, 1, 2, "swap")]:
        log_dir = tmp_path / f"kto_{tp}{pp}{dp}_{mode}"
        run_torchrun(KTO_SCRIPT, tp * pp * dp, *common, f"parallel.tensor_model_parallel_size={tp}",
                     f"parallel.pipeline_model_parallel_size={pp}", f"kto.reference_logprobs={mode}",
                     f"checkpoint.save_dir={log_dir / 'ckpt'}", f"logging.log_dir={log_dir}")
        results[(tp, pp, dp, mode)] = metrics_rows(log_dir)
    reference = results[(1, 1, 1, "precompute")]
    assert [row["split"] for row in reference] == ["train", "train", "train", "validation"]
    first = reference[0]
    share = first["desirable_fraction"]
    assert first["loss"] == pytest.approx(0.5 * (share + (1 - share) * 1.5), abs=1e-6)  # policy = reference
    assert abs(reference[2]["mismatched_log_ratio"]) > 1e-3 and abs(reference[2]["reward_margin"]) > 1e-3  # moved
    for layout, rows in results.items():
        worst = max(abs(row["loss"] - ref["loss"]) / abs(ref["loss"]) for row, ref in zip(rows, reference))
        print(f"{layout}: worst relative loss difference {worst:.1e}; last train row {rows[2]}")
        assert len(rows) == len(reference)
        for row, expected in zip(rows, reference):
            assert row["loss"] == pytest.approx(expected["loss"], rel=1e-5), (layout, row["split"], row["step"])
            for key in ("kl", "mismatched_log_ratio", "desirable_reward", "undesirable_reward"):
                assert row[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (layout, row["step"], key)
