"""Knowledge distillation (SFT-KD): the top-k KL against a float64 reference, the student's logprobs at the
teacher's ids, the teacher pass and its file, a student learning from it, and the data check."""
from __future__ import annotations

import math
import random

import pytest
import torch

from aligner.algorithms.distillation import (
    KDConfig,
    TeacherTopKConfig,
    build_kd_trainer,
    compute_teacher_topk,
    student_logprobs_at,
)
from aligner.config import CONF_DIR, load_config
from aligner.data.jsonl import DataError
from aligner.rl.distillation_math import topk_kl

from ..conftest import metrics_rows, train_tiny_arithmetic_policy


def test_the_topk_kl_equals_a_float64_reference():
    rng = random.Random(4)
    vocab, k = 11, 4
    for _ in range(5):
        student_logits = [rng.gauss(0, 2) for _ in range(vocab)]
        ids = rng.sample(range(vocab), k)
        teacher = [rng.gauss(0, 2) for _ in range(k)]
        log_z = math.log(sum(math.exp(v) for v in student_logits))
        student_at = [student_logits[i] - log_z for i in ids]  # log-softmax over the whole vocabulary
        restricted_z = math.log(sum(math.exp(v) for v in student_at))
        teacher_z = math.log(sum(math.exp(v) for v in teacher))
        expected = sum(math.exp(t - teacher_z) * ((t - teacher_z) - (s - restricted_z))
                       for t, s in zip(teacher, student_at))
        got = topk_kl(torch.tensor([student_at], dtype=torch.float64), torch.tensor([teacher], dtype=torch.float64))
        assert float(got) == pytest.approx(expected, abs=1e-13)
    # The student ranking the k tokens as the teacher does (any other mass elsewhere): KL 0.
    same = torch.tensor([[1.0, 0.5, -2.0]], dtype=torch.float64)
    assert float(topk_kl(same - 3.0, same)) == pytest.approx(0.0, abs=1e-15)


def test_student_logprobs_at_the_teacher_ids_are_the_log_softmax_over_the_real_vocabulary(single_process):
    logits = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    rows, columns = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 4])
    ids = torch.tensor([[3, 7], [0, 11], [9, 2]])
    got = student_logprobs_at(logits, rows, columns, ids, vocab_size=12)  # columns 12..15 are padding
    expected = torch.log_softmax(logits[rows, columns][:, :12].double(), dim=-1).gather(-1, ids)
    assert torch.allclose(got.double(), expected, atol=1e-6)
    got.sum().backward()
    assert logits.grad[:, :, 12:].abs().max() == 0  # the padding takes no part


@pytest.fixture(scope="module")
def teacher_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("kd")
    teacher, _ = train_tiny_arithmetic_policy(root, seed=5, steps=60)
    return root, teacher


def _teacher_pass(root, teacher, output, *extra):
    return compute_teacher_topk(load_config(TeacherTopKConfig, CONF_DIR / "teacher_topk.yaml", [
        f"teacher={teacher}", f"data.path={root / 'sft.jsonl'}", "data.max_seq_length=16", "top_k=4",
        f"output={output}", *extra]))


def _student_config(root, teacher, topk, name, *extra) -> KDConfig:
    return load_config(KDConfig, CONF_DIR / "gpt_knowledge_distillation.yaml", [
        f"tokenizer.path={root / 'tokenizer'}", f"data.train=[{{path: {root / 'sft.jsonl'}, teacher_topk: {topk}}}]",
        "data.split='100,0'", "data.max_seq_length=16", "model.architecture.num_layers=1",
        "model.architecture.hidden_size=32", "model.architecture.num_attention_heads=4",
        "model.architecture.num_query_groups=2", "model.architecture.ffn_hidden_size=64", "trainer.max_steps=30",
        "trainer.global_batch_size=32", "trainer.micro_batch_size=16", "trainer.val_check_interval=0",
        "optim.lr=3e-3", "optim.warmup_steps=0", "optim.decay_style=constant", f"checkpoint.save_dir={root / name}",
        f"logging.log_dir={root / name}", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.peak_tflops=1.0", "logging.log_interval=100", "checkpoint.resume=false", *extra])


def test_the_teacher_pass_from_the_teachers_run_directory_reads_its_latest_checkpoint(teacher_and_data, tmp_path):
    from aligner.data.teacher_topk import TeacherTopK

    root, teacher = teacher_and_data
    from_checkpoint = TeacherTopK(_teacher_pass(root, teacher, tmp_path / "checkpoint.safetensors"))
    from_run = TeacherTopK(_teacher_pass(root, teacher.parent, tmp_path / "run.safetensors"))
    assert from_run.meta["teacher"] == str(teacher.resolve()) == from_checkpoint.meta["teacher"]
    assert torch.equal(from_run.ids, from_checkpoint.ids) and torch.equal(from_run.logits, from_checkpoint.logits)


def test_a_student_distils_the_teachers_top_k_and_other_data_is_refused(teacher_and_data):
    from aligner.data.teacher_topk import TeacherTopK

    root, teacher = teacher_and_data
    topk_path = _teacher_pass(root, teacher, root / "sft.topk.safetensors")
    topk = TeacherTopK(topk_path)
    assert topk.k == 4 and topk.ids.shape == topk.logits.shape and topk.ids.shape[1] == 4
    assert (topk.logits[:, :-1] >= topk.logits[:, 1:]).all()  # most likely first
    assert topk.meta["examples"] + 1 == len(topk.offsets)

    trainer = build_kd_trainer(_student_config(root, teacher, topk_path, "student", "kd.sft_loss_weight=0.5"))
    trainer.fit()
    trainer.metrics.close()
    rows = metrics_rows(root / "student", "train")
    first, last = rows[0], rows[-1]
    assert first["loss"] == pytest.approx(first["kd_loss"] + 0.5 * first["sft_loss"], rel=1e-6)
    assert last["kd_loss"] < 0.5 * first["kd_loss"], [row["kd_loss"] for row in rows]

    # A top-k file of other examples (the data file has changed since) is refused before training.
    lines = (root / "sft.jsonl").read_text().splitlines(keepends=True)
    (root / "changed.jsonl").write_text("".join(lines[1:] + lines[:1]))
    with pytest.raises(DataError, match="was computed for other examples than .*changed.jsonl"):
        build_kd_trainer(_student_config(root, teacher, topk_path, "mismatch",
                                         f"data.train=[{{path: {root / 'changed.jsonl'}, teacher_topk: {topk_path}}}]"))
