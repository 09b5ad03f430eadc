"""KTO: the loss against a float64 reference, unpaired data (plain and conversational, errors with file and
line), the closed form at policy = reference, learning, and both reference modes agreeing."""
from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aligner.algorithms.kto import KTOConfig, build_kto_trainer
from aligner.config import CONF_DIR, ConfigError, load_config
from aligner.data.jsonl import DataError
from aligner.data.unpaired import UnpairedDataset, collate_unpaired
from aligner.demo import arithmetic
from aligner.rl import kto_math
from aligner.tokenizer import Tokenizer

from ..conftest import REPO_ROOT, metrics_rows, write_jsonl

KTO_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_kto.py"


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.7)])
def test_the_loss_and_the_reference_point_equal_a_float64_reference(weights):
    rng = random.Random(3)
    ratios = [rng.uniform(-3, 3) for _ in range(9)]
    labels = [rng.random() < 0.5 for _ in range(9)]
    mismatched = [rng.uniform(-1, 2) for _ in range(9)]
    beta, (w_desirable, w_undesirable) = 0.3, weights
    z = max(0.0, sum(mismatched) / len(mismatched))
    expected = [w_desirable * (1 - _sigmoid(beta * (r - z))) if good else w_undesirable * (1 - _sigmoid(beta * (z - r)))
                for r, good in zip(ratios, labels)]
    kl = kto_math.kl_estimate(torch.tensor(mismatched, dtype=torch.float64))
    assert float(kl) == pytest.approx(z, abs=1e-15)
    losses = kto_math.kto_loss(torch.tensor(ratios, dtype=torch.float64), torch.tensor(labels), kl, beta=beta,
                               desirable_weight=w_desirable, undesirable_weight=w_undesirable)
    assert losses.tolist() == pytest.approx(expected, abs=1e-14)
    # A negative mean log-ratio is clamped: the reference point is never below 0.
    assert float(kto_math.kl_estimate(torch.tensor([-1.0, -0.5]))) == 0.0


def test_the_reference_point_carries_no_gradient_and_the_loss_at_equal_policies_is_half_the_weight():
    ratios = torch.zeros(4, requires_grad=True)
    mismatched = torch.tensor([0.5, 1.5], requires_grad=True)
    labels = torch.tensor([True, False, True, False])
    losses = kto_math.kto_loss(ratios, labels, kto_math.kl_estimate(mismatched), beta=1.0, desirable_weight=2.0)
    losses.sum().backward()
    assert mismatched.grad is None and ratios.grad is not None
    assert ratios.grad[0] < 0 < ratios.grad[1]  # desirable: raise the log-ratio; undesirable: lower it
    at_reference = kto_math.kto_loss(torch.zeros(4), labels, torch.tensor(0.0), beta=0.5, desirable_weight=2.0)
    assert at_reference.tolist() == [1.0, 0.5, 1.0, 0.5]


# ----------------------------------------------------------------------------- data
def test_plain_and_conversational_examples_and_their_mismatched_completions(tmp_path, arithmetic_tokenizer_dir):
    tokenizer = Tokenizer(arithmetic_tokenizer_dir)
    records = [{"prompt": "12+7=", "completion": "19", "label": True},
               {"prompt": [{"role": "user", "content": "3+4="}], "completion": {"role": "assistant", "content": "8"},
                "label": False},
               {"prompt": "5+5=", "completion": "10", "label": True},
               {"prompt": "99+99=", "completion": "1" * 40, "label": False}]  # too long: dropped
    dataset = UnpairedDataset.from_jsonl(write_jsonl(tmp_path / "kto.jsonl", records), tokenizer, max_seq_length=32,
                                         use_template=False)
    assert (dataset.stats.records, dataset.stats.dropped_too_long, dataset.stats.desirable,
            dataset.stats.undesirable) == (4, 1, 2, 1)
    items = [dataset[i] for i in range(3)]
    assert [bool(item["desirable"]) for item in items] == [True, False, True]
    assert tokenizer.decode(items[0]["completion"].tolist()).strip() == "19"
    # Each example's mismatched completion is the next example's (the last takes the first's).
    for index, item in enumerate(items):
        assert torch.equal(item["mismatched"], items[(index + 1) % 3]["completion"])
    batch = collate_unpaired(items, pad_id=tokenizer.pad_id)
    assert batch["tokens"].shape[0] == 6 and batch["desirable"].tolist() == [True, True, False, False, True, True]
    assert batch["response_lengths"][1::2].tolist() == [len(items[1]["completion"]), len(items[2]["completion"]),
                                                       len(items[0]["completion"])]


def test_a_mismatched_completion_comes_from_another_prompt(tmp_path, arithmetic_tokenizer_dir):
    """A file listing each prompt's good and bad answer side by side pairs each example with the next
    prompt's answer, not with the other answer to its own prompt."""
    records = arithmetic.unpaired_records(3, seed=1)  # p0 good, p0 bad, p1 good, p1 bad, p2 good, p2 bad
    dataset = UnpairedDataset.from_jsonl(write_jsonl(tmp_path / "kto.jsonl", records),
                                         Tokenizer(arithmetic_tokenizer_dir), 16, use_template=False)
    items = [dataset[i] for i in range(6)]
    for index, item in enumerate(items):
        partner = items[(index // 2 * 2 + 2) % 6]  # the next prompt's first (good) answer
        assert torch.equal(item["mismatched"], partner["completion"]), index
        assert not torch.equal(item["prompt"], partner["prompt"])


def test_a_mismatched_completion_is_cut_to_fit_after_its_prompt(tmp_path, arithmetic_tokenizer_dir):
    tokenizer = Tokenizer(arithmetic_tokenizer_dir)
    records = [{"prompt": "1+1=" * 3, "completion": "2", "label": True},
               {"prompt": "1=", "completion": "1234567", "label": False}]
    dataset = UnpairedDataset.from_jsonl(write_jsonl(tmp_path / "kto.jsonl", records), tokenizer, max_seq_length=16,
                                         use_template=False)
    first = dataset[0]
    assert len(first["prompt"]) + len(first["mismatched"]) == 16
    assert len(first["mismatched"]) < len(dataset[1]["completion"])


@pytest.mark.parametrize("record, message", [
    ({"prompt": "1+1=", "completion": "2", "label": "yes"}, "kto.jsonl:2: 'label' is 'yes'; expected true"),
    ({"prompt": "1+1=", "completion": "2"}, "kto.jsonl:2: missing key 'label'"),
    ({"prompt": "1+1=", "label": True}, "kto.jsonl:2: missing key 'completion'"),
])
def test_bad_records_name_the_file_and_line(tmp_path, arithmetic_tokenizer_dir, record, message):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "1+2=", "completion": "3", "label": True}, record])
    with pytest.raises(DataError, match=message.replace("+", r"\+")):
        UnpairedDataset.from_jsonl(path, Tokenizer(arithmetic_tokenizer_dir), 16, use_template=False)


def test_one_example_is_not_enough_for_the_kl_estimate(tmp_path, arithmetic_tokenizer_dir):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "1+2=", "completion": "3", "label": True}])
    with pytest.raises(DataError, match="KTO needs at least 2 usable examples"):
        UnpairedDataset.from_jsonl(path, Tokenizer(arithmetic_tokenizer_dir), 16, use_template=False)


@pytest.mark.parametrize("setting, message", [("kto.beta=0", "kto.beta must be > 0"),
                                              ("kto.undesirable_weight=-1", "kto.undesirable_weight must be > 0")])
def test_bad_settings_are_refused_with_the_key_named(setting, message):
    cfg = load_config(KTOConfig, CONF_DIR / "gpt_kto.yaml", ["data.train=[{path: x.jsonl}]", setting])
    with pytest.raises(ConfigError, match=message):
        build_kto_trainer(cfg)
    with pytest.raises(ConfigError, match="kto.reference_logprobs='never' is not one of precompute, swap"):
        load_config(KTOConfig, CONF_DIR / "gpt_kto.yaml",
                    ["data.train=[{path: x.jsonl}]", "kto.reference_logprobs=never"])


# ----------------------------------------------------------------------------- a tiny run
def _run_config(tmp_path: Path, tokenizer_dir, train: Path, mode: str, *extra: str) -> KTOConfig:
    return load_config(KTOConfig, CONF_DIR / "gpt_kto.yaml", [
        f"tokenizer.path={tokenizer_dir}", f"data.train=[{{path: {train}}}]", "data.split='100,0'",
        "data.max_seq_length=16", "model.architecture.num_layers=2", "model.architecture.hidden_size=32",
        "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
        "model.architecture.ffn_hidden_size=64", "trainer.max_steps=12", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.val_check_interval=0", "optim.lr=3e-3", "optim.warmup_steps=0",
        "optim.decay_style=constant", "kto.beta=0.5", f"kto.reference_logprobs={mode}", *extra,
        "checkpoint.save_at_end=false", "checkpoint.resume=false", f"checkpoint.save_dir={tmp_path / mode}",
        f"logging.log_dir={tmp_path / mode}", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.peak_tflops=1.0", "logging.log_interval=100",
    ])


def test_tiny_run_starts_at_the_closed_form_and_learns_in_both_reference_modes(tmp_path, arithmetic_tokenizer_dir):
    # 8 problems, each with its right (desirable) and a wrong (undesirable) answer, seen again and again.
    train = write_jsonl(tmp_path / "train.jsonl", arithmetic.unpaired_records(8, seed=7))
    weights = (1.0, 1.5)
    rows = {}
    for mode in ("precompute", "swap"):
        trainer = build_kto_trainer(_run_config(tmp_path, arithmetic_tokenizer_dir, train, mode,
                                                "optim.lr=1e-2", f"kto.desirable_weight={weights[0]}",
                                                f"kto.undesirable_weight={weights[1]}"))
        trainer.fit()
        trainer.metrics.close()
        rows[mode] = metrics_rows(tmp_path / mode, "train")
    for mode, values in rows.items():
        assert len(values) == 12
        first, last = values[0], values[-1]
        # Policy = reference: every log-ratio and the reference point are 0, each example's loss is its weight / 2.
        share = first["desirable_fraction"]
        assert first["loss"] == pytest.approx(0.5 * (share * weights[0] + (1 - share) * weights[1]), abs=1e-6), mode
        assert abs(first["kl"]) < 1e-6 and abs(first["reward_margin"]) < 1e-6
        assert last["loss"] < 0.7 * first["loss"], (mode, [row["loss"] for row in values])
        assert last["reward_margin"] > 0.5 and last["desirable_reward"] > 0 > last["undesirable_reward"]
    for a, b in zip(rows["precompute"], rows["swap"]):  # the same run whichever way the reference arrives
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-6)


def test_the_entry_point_reports_bad_data_in_one_line(tmp_path, arithmetic_tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+2=", "completion": "3", "label": 1}])
    done = subprocess.run([sys.executable, str(KTO_SCRIPT), f"tokenizer.path={arithmetic_tokenizer_dir}",
                           f"data.train=[{{path: {train}}}]", f"checkpoint.save_dir={tmp_path / 'ckpt'}",
                           f"logging.log_dir={tmp_path}", "logging.tensorboard=false", "logging.progress_bar=false"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == f"error: {train}:1: 'label' is 1; expected true (desirable) or " \
                                                   "false (undesirable)"


def test_the_sft_term_adds_the_desirable_completions_mean_nll(tmp_path, arithmetic_tokenizer_dir):
    """kto.sft_loss_weight: loss = KTO loss + weight x the per-token mean NLL of each desirable completion,
    averaged over all examples (undesirable ones add none); checked against the metrics' own parts and
    against the plain run's KTO loss at the first step (same weights, policy = reference)."""
    train = write_jsonl(tmp_path / "train.jsonl", arithmetic.unpaired_records(8, seed=7))
    rows = {}
    for weight in (0.0, 0.5):
        cfg = _run_config(tmp_path / str(weight), arithmetic_tokenizer_dir, train, "precompute",
                          f"kto.sft_loss_weight={weight}", "trainer.max_steps=2")
        trainer = build_kto_trainer(cfg)
        trainer.fit()
        trainer.metrics.close()
        rows[weight] = metrics_rows(tmp_path / str(weight) / "precompute", "train")
    plain, with_sft = rows[0.0][0], rows[0.5][0]
    assert with_sft["kto_loss"] == pytest.approx(plain["loss"], abs=1e-7)
    expected = with_sft["kto_loss"] + 0.5 * with_sft["sft_loss"] * with_sft["desirable_fraction"]
    assert with_sft["loss"] == pytest.approx(expected, rel=1e-6)
    assert with_sft["sft_loss"] > 0.1 and plain["sft_loss"] == 0.0


def test_a_file_whose_examples_are_all_too_long_says_so(tmp_path, arithmetic_tokenizer_dir):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "1+2=", "completion": "3" * 40, "label": True}] * 3)
    with pytest.raises(DataError, match="0 usable examples: 3 of 3 are longer than max_seq_length=16"):
        UnpairedDataset.from_jsonl(path, Tokenizer(arithmetic_tokenizer_dir), 16, use_template=False)
