"""SPIN: betas per iteration, self-play pairs from the native engine, the loss against a float64
reference, and a tiny two-iteration run (the reference is re-taken at each iteration's start)."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.algorithms.dpo import DPOObjective, precompute_reference_logprobs
from aligner.algorithms.spin import (
    SPINConfig,
    SPINSection,
    build_spin_run,
    dpo_section,
    iteration_betas,
    load_demonstrations,
    self_play_pairs,
)
from aligner.config import CONF_DIR, composed_config, load_config
from aligner.data.jsonl import DataError
from aligner.data.preference import PreferenceDataset, collate_preferences
from aligner.demo import arithmetic
from aligner.generation.engine import SamplingParams
from aligner.generation.native import NativeEngine
from aligner.generation.reference import generate_full_forward
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.runtime import seeds
from aligner.tokenizer import Tokenizer

from ..conftest import dotted_keys, metrics_rows, write_jsonl

pytestmark = pytest.mark.usefixtures("single_process")


def test_every_schema_key_is_in_the_shipped_yamls():
    from omegaconf import OmegaConf

    from aligner.algorithms.dpo import DPOConfig

    for schema, name in ((SPINConfig, "gpt_spin.yaml"), (DPOConfig, "gpt_dpo.yaml")):
        schema_keys = dotted_keys(OmegaConf.structured(schema))
        in_yaml = dotted_keys(composed_config(CONF_DIR / name))  # with the bases it extends
        assert schema_keys - in_yaml == set(), f"keys missing from aligner/conf/{name}"
        load_config(schema, CONF_DIR / name, ["data.train=[{path: x.jsonl}]"])  # unknown yaml keys would raise


def test_betas_per_iteration():
    assert iteration_betas(SPINSection(num_iterations=3, kl_betas=[0.2])) == [0.2, 0.2, 0.2]
    assert iteration_betas(SPINSection(num_iterations=2, kl_betas=[0.2, 0.05])) == [0.2, 0.05]
    with pytest.raises(ValueError, match="2 values for spin.num_iterations=3"):
        iteration_betas(SPINSection(num_iterations=3, kl_betas=[0.2, 0.1]))
    with pytest.raises(ValueError, match="must be > 0"):
        iteration_betas(SPINSection(num_iterations=1, kl_betas=[0.0]))


def test_demonstrations_split_prompt_and_response(tmp_path, arithmetic_tokenizer_dir):
    tokenizer = Tokenizer(arithmetic_tokenizer_dir)
    path = write_jsonl(tmp_path / "sft.jsonl", [{"input": "12+7=", "output": "19"}])
    [(prompt, response)] = load_demonstrations(path, tokenizer, 32)
    assert prompt == [tokenizer.bos_id] + tokenizer.encode("12+7=")
    assert response == tokenizer.encode("19") + [tokenizer.eos_id]
    # A conversation's demonstration is its last turn; the earlier ones, replies included, are its prompt.
    turns = [{"from": "User", "value": "1+1="}, {"from": "Assistant", "value": "2"},
             {"from": "User", "value": "2+2="}, {"from": "Assistant", "value": "4"}]
    [(prompt, response)] = load_demonstrations(write_jsonl(tmp_path / "two.jsonl", [{"conversations": turns}]),
                                               tokenizer, 32)
    earlier = [{"role": t["from"].lower(), "content": t["value"]} for t in turns[:3]]
    assert prompt == tokenizer.encode_chat(earlier, add_generation_prompt=True)[0]
    assert response == tokenizer.encode("4") + [tokenizer.eos_id]
    with pytest.raises(DataError, match=r"user.jsonl:1: 'conversations' ends with a user turn"):
        load_demonstrations(write_jsonl(tmp_path / "user.jsonl", [{"conversations": turns[:3]}]), tokenizer, 32)


def _model(tokenizer: Tokenizer, seed: int):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=8, max_position_embeddings=32)
    seeds.set_seed(seed)
    return build_gpt_model(cfg, transformer_config(cfg)), cfg


def test_spin_loss_on_self_play_pairs_matches_a_float64_reference(tmp_path, arithmetic_tokenizer_dir):
    """Rejected = the model's own greedy answer; the loss is DPO's with the demonstration chosen."""
    tokenizer = Tokenizer(arithmetic_tokenizer_dir)
    policy, cfg = _model(tokenizer, seed=3)
    reference, _ = _model(tokenizer, seed=4)
    path = write_jsonl(tmp_path / "sft.jsonl", arithmetic.correct_sft_records(6, seed=1))
    demonstrations = load_demonstrations(path, tokenizer, 32)
    engine = NativeEngine([reference], cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id, max_batch_size=4,
                          max_sequence_length=16)
    pairs, self_match = self_play_pairs(engine, demonstrations, SamplingParams(max_new_tokens=4, greedy=True), 4)
    expected_rejected = generate_full_forward([reference], [p for p, _ in demonstrations], vocab_size=cfg.vocab_size,
                                              eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, max_new_tokens=4)
    assert [pair.rejected for pair in pairs] == [list(tokens) for tokens in expected_rejected]
    assert [pair.chosen for pair in pairs] == [response for _, response in demonstrations]
    assert self_match == sum(p.chosen == p.rejected for p in pairs) / len(pairs)

    dataset = PreferenceDataset(pairs)
    precompute_reference_logprobs(dataset, [reference], vocab_size=cfg.vocab_size, pad_id=tokenizer.pad_id,
                                  pairs_per_forward=3)
    batch = collate_preferences([dataset[i] for i in range(len(dataset))], tokenizer.pad_id, 1)
    beta = 0.3
    with torch.no_grad():
        logits = policy(batch["tokens"], batch["position_ids"], None)
        reference_logits = reference(batch["tokens"], batch["position_ids"], None)
    loss_sum, pairs_count, _ = DPOObjective(dpo_section(SPINSection(kl_betas=[beta]), beta), cfg.vocab_size).loss(
        batch, logits)

    def summed(all_logits, row):
        logprobs = torch.log_softmax(all_logits[row, :, : cfg.vocab_size].double(), dim=-1)
        start, n = int(batch["prompt_lengths"][row]), int(batch["response_lengths"][row])
        return sum(float(logprobs[start + t - 1, batch["tokens"][row, start + t]]) for t in range(n))

    expected = 0.0
    for pair in range(len(dataset)):
        real, generated = 2 * pair, 2 * pair + 1
        margin = beta * ((summed(logits, real) - summed(reference_logits, real))
                         - (summed(logits, generated) - summed(reference_logits, generated)))
        expected += math.log1p(math.exp(-margin))
    assert int(pairs_count) == len(dataset)
    assert float(loss_sum) == pytest.approx(expected, rel=1e-5)


def test_tiny_run_retakes_the_reference_each_iteration_and_learns(tmp_path, arithmetic_tokenizer_dir):
    train = write_jsonl(tmp_path / "sft.jsonl", arithmetic.correct_sft_records(16, seed=2))
    cfg = load_config(SPINConfig, CONF_DIR / "gpt_spin.yaml", [
        f"tokenizer.path={arithmetic_tokenizer_dir}", f"data.train=[{{path: {train}}}]", "data.max_seq_length=16",
        "model.architecture.num_layers=2", "model.architecture.hidden_size=32",
        "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
        "model.architecture.ffn_hidden_size=64",
        "spin.num_iterations=2", "spin.steps_per_iteration=6", "spin.kl_betas=[0.5, 0.25]",
        "spin.generation.max_new_tokens=4", "spin.generation.batch_size=8",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "optim.lr=3e-3", "optim.warmup_steps=0",
        "optim.decay_style=constant", f"checkpoint.save_dir={tmp_path / 'ckpt'}", f"logging.log_dir={tmp_path}",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0",
        "logging.log_interval=100",
    ])
    run = build_spin_run(cfg)
    run.fit()
    run.trainer.metrics.close()
    rows = metrics_rows(tmp_path)
    train_rows = [row for row in rows if row["split"] == "train"]
    assert [row["iteration"] for row in train_rows] == [1] * 6 + [2] * 6
    assert [row["beta"] for row in train_rows] == [0.5] * 6 + [0.25] * 6
    assert len([row for row in rows if row["split"] == "spin"]) == 2
    # Each iteration starts with policy = its reference: the preference loss is log 2 exactly.
    for first in (train_rows[0], train_rows[6]):
        assert first["preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
        assert abs(first["margin"]) < 1e-5
    # Within an iteration the model comes to prefer the demonstrations over its own answers.
    assert train_rows[5]["preference_loss"] < 0.5 and train_rows[5]["accuracy"] > 0.5, train_rows[5]
    assert (tmp_path / "ckpt" / "step_00000012").is_dir()


def _tiny_spin_config(tmp_path, arithmetic_tokenizer_dir, train, name: str, *overrides) -> SPINConfig:
    return load_config(SPINConfig, CONF_DIR / "gpt_spin.yaml", [
        f"tokenizer.path={arithmetic_tokenizer_dir}", f"data.train=[{{path: {train}}}]", "data.max_seq_length=16",
        "model.architecture.num_layers=2", "model.architecture.hidden_size=32",
        "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
        "model.architecture.ffn_hidden_size=64",
        "spin.num_iterations=2", "spin.steps_per_iteration=3", "spin.kl_betas=[0.5, 0.25]",
        "spin.generation.max_new_tokens=4", "spin.generation.batch_size=8", "spin.generation.greedy=false",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "optim.lr=3e-3", "optim.warmup_steps=1",
        "optim.decay_style=cosine", "checkpoint.save_interval=3", f"checkpoint.save_dir={tmp_path / name / 'ckpt'}",
        f"logging.log_dir={tmp_path / name}", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.peak_tflops=1.0", "logging.log_interval=100", *overrides,
    ])


@pytest.mark.parametrize("mode", ["swap", "precompute"])
def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path, arithmetic_tokenizer_dir, monkeypatch, mode):
    """Also the check that the second iteration's self-play samples the weights trained in the first (the
    resumed run builds its engine afresh; the uninterrupted one must see the optimizer's writes)."""
    import aligner.algorithms.spin as spin_module

    reference = f"spin.reference_logprobs={mode}"
    train = write_jsonl(tmp_path / "sft.jsonl", arithmetic.correct_sft_records(16, seed=2))
    whole = build_spin_run(_tiny_spin_config(tmp_path, arithmetic_tokenizer_dir, train, "whole", reference))
    whole.fit()
    whole.trainer.metrics.close()

    # The same run, stopped when the second iteration starts (after the first one's checkpoint).
    calls = []
    real_self_play = spin_module.self_play_pairs

    def crash_at_second_iteration(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real_self_play(*args, **kwargs)

    monkeypatch.setattr(spin_module, "self_play_pairs", crash_at_second_iteration)
    first = build_spin_run(_tiny_spin_config(tmp_path, arithmetic_tokenizer_dir, train, "interrupted", reference))
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.fit()
    first.trainer.metrics.close()
    assert (tmp_path / "interrupted" / "ckpt" / "step_00000003").is_dir()
    monkeypatch.setattr(spin_module, "self_play_pairs", real_self_play)

    resumed = build_spin_run(_tiny_spin_config(tmp_path, arithmetic_tokenizer_dir, train, "interrupted",
                                               f"logging.log_dir={tmp_path / 'resumed'}", reference))
    assert resumed.trainer.step == 3
    resumed.fit()
    resumed.trainer.metrics.close()

    expected = metrics_rows(tmp_path / "whole", "train", "spin")
    got = metrics_rows(tmp_path / "interrupted", "train", "spin") + metrics_rows(tmp_path / "resumed", "train", "spin")
    assert [(row["split"], row["step"]) for row in got] == [(row["split"], row["step"]) for row in expected]
    for want, have in zip(expected, got):
        for key in ("loss", "preference_loss", "margin", "lr", "grad_norm", "self_match", "beta"):
            if key in want:
                assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (key, want, have)
    assert (tmp_path / "interrupted" / "ckpt" / "step_00000006").is_dir()



def test_resuming_from_a_step_that_is_not_an_iteration_end_is_refused(tmp_path, arithmetic_tokenizer_dir):
    train = write_jsonl(tmp_path / "sft.jsonl", arithmetic.correct_sft_records(16, seed=2))
    run = build_spin_run(_tiny_spin_config(tmp_path, arithmetic_tokenizer_dir, train, "run", "spin.num_iterations=1",
                                         "spin.kl_betas=[0.5]"))
    run.fit()
    run.trainer.metrics.close()
    assert (tmp_path / "run" / "ckpt" / "step_00000003").is_dir()
    # The same save_dir with another iteration length: step 3 is not the end of an iteration.
    with pytest.raises(ValueError, match="step 3 is not at the end of a SPIN iteration"):
        build_spin_run(_tiny_spin_config(tmp_path, arithmetic_tokenizer_dir, train, "run", "spin.steps_per_iteration=2",
                                         f"logging.log_dir={tmp_path / 'again'}"))
