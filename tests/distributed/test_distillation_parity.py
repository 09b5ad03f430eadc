"""Knowledge distillation at several layouts (torchrun, gloo): the teacher pass at TP=2 writes TP=1's top-k,
and the student's KD + NLL losses at TP=2, PP=2 and DP=2 equal one process's."""
from __future__ import annotations

import pytest
import torch

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun, train_tiny_arithmetic_policy
from .test_sft_parity import SFT_SCRIPT, _run_python

TEACHER_SCRIPT = REPO_ROOT / "examples" / "nlp" / "data" / "compute_teacher_topk.py"
KD_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_knowledge_distillation.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_teacher_pass_and_student_losses_match_across_layouts(tmp_path):
    from aligner.data.teacher_topk import TeacherTopK

    teacher, _ = train_tiny_arithmetic_policy(tmp_path, seed=6, steps=30)
    files = {}
    for tp in (1, 2):
        files[tp] = tmp_path / f"topk_tp{tp}.safetensors"
        run_torchrun(TEACHER_SCRIPT, tp, f"teacher={teacher}", f"data.path={tmp_path / 'sft.jsonl'}",
                     "data.max_seq_length=16", "top_k=4", f"output={files[tp]}",
                     f"parallel.tensor_model_parallel_size={tp}")
    one, two = TeacherTopK(files[1]), TeacherTopK(files[2])
    assert one.meta["digest"] == two.meta["digest"] and torch.equal(one.offsets, two.offsets)
    assert torch.equal(one.ids, two.ids)
    assert torch.allclose(one.logits, two.logits, atol=1e-5)

    # One random-init student for every layout (random init itself depends on the layout).
    _run_python(SFT_SCRIPT, f"tokenizer.path={tmp_path / 'tokenizer'}",
                f"data.train=[{{path: {tmp_path / 'sft.jsonl'}}}]",
                "trainer.max_steps=0", "model.architecture.num_layers=2", "model.architecture.hidden_size=32",
                "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
                "model.architecture.ffn_hidden_size=64", "data.split='100,0'", "trainer.global_batch_size=8",
                "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0",
                f"checkpoint.save_dir={tmp_path / 'student'}", f"logging.log_dir={tmp_path / 'student'}")
    common = [f"model.init_from={tmp_path / 'student' / 'step_00000000'}",
              f"data.train=[{{path: {tmp_path / 'sft.jsonl'}, teacher_topk: {files[1]}}}]", "data.split='75,25'",
              "data.max_seq_length=16", "trainer.max_steps=3", "trainer.global_batch_size=16",
              "trainer.micro_batch_size=4", "trainer.val_check_interval=3", "optim.lr=3e-3", "optim.warmup_steps=0",
              "kd.sft_loss_weight=0.5", "checkpoint.save_at_end=false", "logging.progress_bar=false",
              "logging.tensorboard=false", "logging.peak_tflops=1.0"]
    results = {}
    for tp, pp, dp in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]:
        log_dir = tmp_path / f"kd_{tp}{pp}{dp}"
        run_torchrun(KD_SCRIPT, tp * pp * dp, *common, f"parallel.tensor_model_parallel_size={tp}",
                     f"parallel.pipeline_model_parallel_size={pp}", f"checkpoint.save_dir={log_dir / 'ckpt'}",
                     f"logging.log_dir={log_dir}")
        results[(tp, pp, dp)] = metrics_rows(log_dir)
    reference = results[(1, 1, 1)]
    assert [row["split"] for row in reference] == ["train", "train", "train", "validation"]
    assert reference[0]["kd_loss"] > 0.1
    for layout, rows in results.items():
        assert len(rows) == len(reference)
        for row, expected in zip(rows, reference):
            for key in ("loss", "kd_loss", "sft_loss"):
                assert row[key] == pytest.approx(expected[key], rel=1e-5), (layout, row["split"], row["step"], key)
