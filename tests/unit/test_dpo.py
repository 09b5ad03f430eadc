"""DPO: preference data (layouts, SFT token layout, errors), reference logprobs (precompute = swap),
loss log 2 at the start for several betas, and a tiny run whose loss falls."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from aligner.algorithms.dpo import (
    DPOConfig,
    DPOObjective,
    DPOSection,
    SwappedReferenceLoader,
    build_dpo_trainer,
    precompute_reference_logprobs,
)
from aligner.config import CONF_DIR, load_config
from aligner.data.conversation import ChatEncoder
from aligner.data.jsonl import DataError
from aligner.data.preference import PreferenceDataset, collate_preferences
from aligner.data.sft import encode_record
from aligner.demo import arithmetic
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.models.weight_swap import HostWeights
from aligner.runtime import seeds
from aligner.tokenizer import Tokenizer

from ..conftest import CHAT_KINDS, SAMPLE_ANSWERS, SAMPLE_PROMPTS, metrics_rows, sft_reference, write_jsonl

pytestmark = pytest.mark.usefixtures("single_process")


@pytest.fixture(scope="module")
def tokenizer(arithmetic_tokenizer_dir) -> Tokenizer:
    return Tokenizer(arithmetic_tokenizer_dir)


def _model(tokenizer: Tokenizer, seed: int = 0):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=8, max_position_embeddings=32)
    seeds.set_seed(seed)
    return build_gpt_model(cfg, transformer_config(cfg)), cfg


# ----------------------------------------------------------------------------- data
def test_both_key_layouts_give_the_sft_token_layout(tmp_path, tokenizer):
    nemo = write_jsonl(tmp_path / "nemo.jsonl",
                       [{"prompt": "12+7=", "chosen_response": "19", "rejected_response": "18"}])
    short = write_jsonl(tmp_path / "short.jsonl", [{"prompt": "12+7=", "chosen": "19", "rejected": "18"}])
    for path in (nemo, short):
        item = PreferenceDataset.from_jsonl(path, tokenizer, 32)[0]
        for side, answer in (("chosen", "19"), ("rejected", "18")):
            sft = encode_record({"input": "12+7=", "output": answer}, tokenizer, path, 1)
            assert item["prompt"].tolist() + item[side].tolist() == sft.tokens
            # The response is exactly what SFT puts loss on.
            assert len(item[side]) == sum(sft.loss_mask) and item[side][-1] == tokenizer.eos_id
            assert item["prompt"][0] == tokenizer.bos_id


def test_data_errors_name_file_and_line(tmp_path, tokenizer):
    good = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    cases = [
        ([good, {"prompt": "1+1=", "chosen": "2"}], r"bad.jsonl:2: expected 'prompt' with 'chosen_response'"),
        ([{**good, "chosen_reward": 1.0}], r"bad.jsonl:1: 'chosen_reward' without 'rejected_reward'"),
        ([{**good, "chosen_reward": "high", "rejected_reward": 0}], r"bad.jsonl:1: 'chosen_reward' is 'high'"),
        ([{**good, "chosen_reward": 1, "rejected_reward": 0}, good], r"bad.jsonl:2: no rewards here"),
        ([good, {"prompt": "", "chosen": "2", "rejected": "3"}], r"bad.jsonl:2: key 'prompt' is empty"),
    ]
    for records, message in cases:
        with pytest.raises(DataError, match=message):
            PreferenceDataset.from_jsonl(write_jsonl(tmp_path / "bad.jsonl", records), tokenizer, 32)
    with pytest.raises(DataError, match=r"bad.jsonl: no usable pairs among the 1: 1 longer than max_seq_length=4"):
        PreferenceDataset.from_jsonl(write_jsonl(tmp_path / "bad.jsonl", [good]), tokenizer, 4)


def test_pairs_whose_chosen_and_rejected_are_the_same_tokens_are_dropped_and_counted(tmp_path, tokenizer):
    """Their margin is 0 whatever the weights: no preference loss has a gradient on them, yet they would
    dilute their batch's mean and pull the logged loss and accuracy toward a tie."""
    records = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
               {"prompt": "1+1=", "chosen": "2", "rejected": "2"},
               {"prompt": "2+2=", "chosen": "4", "rejected": {"role": "assistant", "content": "4"}},
               {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    dataset = PreferenceDataset.from_jsonl(write_jsonl(tmp_path / "pairs.jsonl", records), tokenizer, 32)
    assert (dataset.stats.records, dataset.stats.dropped_identical, dataset.stats.kept, len(dataset)) == (4, 2, 2, 2)
    assert all(item["chosen"].tolist() != item["rejected"].tolist() for item in dataset)
    with pytest.raises(DataError, match=r"^\S*same.jsonl: no usable pairs among the 1: 0 longer than "
                                        r"max_seq_length=32, 1 with chosen == rejected"):
        PreferenceDataset.from_jsonl(write_jsonl(tmp_path / "same.jsonl", records[1:2]), tokenizer, 32)


REJECTED_ANSWERS = {"text": "Lyon.", "message": {"role": "assistant", "content": "4, 6 and 8."},
                    "message_list": [{"role": "assistant", "content": "twenty"}]}


@pytest.mark.parametrize("kind", CHAT_KINDS)
@pytest.mark.parametrize("prompt_name", sorted(SAMPLE_PROMPTS))
@pytest.mark.parametrize("answer_name", sorted(SAMPLE_ANSWERS))
def test_conversational_pairs_are_the_sft_encoding_of_each_conversation(tmp_path, chat_tokenizers, kind, prompt_name,
                                                                       answer_name):
    tokenizer = chat_tokenizers[kind]
    prompt, chosen, rejected = SAMPLE_PROMPTS[prompt_name], SAMPLE_ANSWERS[answer_name], REJECTED_ANSWERS[answer_name]
    records = [{"prompt": prompt, "chosen": chosen, "rejected": rejected},
               {"prompt": prompt, "chosen_response": chosen, "rejected_response": rejected}]
    dataset = PreferenceDataset.from_jsonl(write_jsonl(tmp_path / "pairs.jsonl", records), tokenizer, 256)
    for item in dataset:
        for side, answer in (("chosen", chosen), ("rejected", rejected)):
            tokens, answer_start = sft_reference(tokenizer, prompt, answer)
            assert item["prompt"].tolist() + item[side].tolist() == tokens
            assert len(item["prompt"]) == answer_start


@pytest.mark.parametrize("kind", CHAT_KINDS)
def test_implicit_prompt_pairs_equal_explicit_ones(tmp_path, chat_tokenizers, kind):
    tokenizer = chat_tokenizers[kind]
    prompt = SAMPLE_PROMPTS["multi_turn_system"]
    explicit = {"prompt": prompt, "chosen": "nineteen", "rejected": "twenty"}
    implicit = {"chosen": prompt + [{"from": "gpt", "value": "nineteen"}],
                "rejected": prompt + [{"role": "assistant", "content": "twenty"}]}
    dataset = PreferenceDataset.from_jsonl(write_jsonl(tmp_path / "pairs.jsonl", [explicit, implicit]), tokenizer, 256)
    for key in ("prompt", "chosen", "rejected"):
        assert dataset[0][key].tolist() == dataset[1][key].tolist()


def test_chat_template_false_gives_the_plain_layout(tmp_path, chat_tokenizers):
    tokenizer = chat_tokenizers["smollm2"]
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "12+7=", "chosen": "19", "rejected": "18"}])
    item = PreferenceDataset.from_jsonl(path, tokenizer, 64, use_template=False)[0]
    assert item["prompt"].tolist() == [tokenizer.bos_id] + tokenizer.encode("12+7=")
    assert item["chosen"].tolist() == tokenizer.encode("19") + [tokenizer.eos_id]
    templated = PreferenceDataset.from_jsonl(path, tokenizer, 64)[0]
    assert templated["prompt"].tolist() == ChatEncoder(tokenizer).prompt_tokens([{"role": "user", "content": "12+7="}])


USER, ASSISTANT = {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}


@pytest.mark.parametrize("record, message", [
    ({"prompt": [USER, ASSISTANT], "chosen": "2", "rejected": "3"}, "'prompt' ends with an assistant turn"),
    ({"prompt": [{"role": "robot", "content": "1+1="}], "chosen": "2", "rejected": "3"},
     r"prompt\[0\] has unknown role 'robot'"),
    ({"prompt": [USER], "chosen": [USER], "rejected": "3"}, r"'chosen' holds 1 message\(s\) \(user\); expected one "
                                                            "assistant message"),
    ({"prompt": [USER], "chosen": "2", "rejected": {"role": "assistant", "content": ""}},
     r"rejected\[0\] is an assistant turn with empty content"),
    ({"chosen": [USER, ASSISTANT], "rejected": [{"role": "user", "content": "1+2="}, ASSISTANT]},
     "'chosen' and 'rejected' differ before their last message"),
    ({"chosen": [USER, ASSISTANT], "rejected": [USER]},
     "'rejected' without a 'prompt' key must be a whole conversation"),
    ({"chosen": "2", "rejected": "3"}, "missing key 'prompt'"),
])
def test_malformed_conversational_pairs_name_file_line_and_key(tmp_path, chat_tokenizers, record, message):
    good = {"prompt": [USER], "chosen": ASSISTANT, "rejected": "3"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(DataError, match=rf"^{tmp_path}/bad\.jsonl:2: {message}"):
        PreferenceDataset.from_jsonl(path, chat_tokenizers["smollm2"], 64)


def test_collate_interleaves_pairs_and_micro_batches_hold_whole_pairs(tmp_path, tokenizer):
    records = [{"prompt": "1+1=", "chosen": "2", "rejected": "11", "chosen_reward": 1.0, "rejected_reward": -1.0},
               {"prompt": "10+15=", "chosen": "25", "rejected": "5", "chosen_reward": 0.5, "rejected_reward": 0.0}]
    dataset = PreferenceDataset.from_jsonl(write_jsonl(tmp_path / "p.jsonl", records), tokenizer, 32)
    batch = collate_preferences([dataset[0], dataset[1]], tokenizer.pad_id, pad_to_multiple_of=8)
    assert batch["tokens"].shape == (4, 16)
    assert batch["prompt_lengths"].tolist() == [5, 5, 7, 7]
    assert batch["response_lengths"].tolist() == [2, 3, 3, 2]
    assert batch["rewards"].tolist() == [1.0, -1.0, 0.5, 0.0]
    assert tokenizer.decode(batch["tokens"][1, 1:8].tolist()) == "1+1=11"
    assert (batch["tokens"][1, 8:] == tokenizer.pad_id).all()


# ----------------------------------------------------------------------------- reference logprobs and the loss
def _pairs(tmp_path, tokenizer, n=12, seed=0) -> PreferenceDataset:
    path = write_jsonl(tmp_path / f"pairs{seed}.jsonl", arithmetic.preference_records(n, seed=seed))
    return PreferenceDataset.from_jsonl(path, tokenizer, 32)


def test_loss_is_log2_and_rewards_zero_when_policy_is_the_reference(tmp_path, tokenizer):
    model, cfg = _model(tokenizer)
    dataset = _pairs(tmp_path, tokenizer)
    precompute_reference_logprobs(dataset, [model], vocab_size=cfg.vocab_size, pad_id=tokenizer.pad_id,
                                  pairs_per_forward=5)  # other batch shapes than the loss's
    batch = collate_preferences([dataset[i] for i in range(len(dataset))], tokenizer.pad_id, 8)
    logits = model(batch["tokens"], batch["position_ids"], None)
    for beta in [0.01, 0.1, 1.0, 10.0]:
        for average in (False, True):
            objective = DPOObjective(DPOSection(beta=beta, preference_average_logprobs=average), cfg.vocab_size)
            loss_sum, pairs, report = objective.loss(batch, logits)
            summary = objective.summarize({k: float(v) for k, v in report.items()})
            assert int(pairs) == len(dataset)
            assert summary["loss"] == pytest.approx(math.log(2), abs=1e-6), (beta, average)
            assert (abs(summary["chosen_reward"]) < 1e-6 * beta * 10
                    and abs(summary["rejected_reward"]) < 1e-6 * beta * 10)
            assert abs(summary["margin"]) < 1e-6 * beta * 10


def test_objective_matches_a_float64_reference_computed_per_pair(tmp_path, tokenizer):
    """Policy != reference: the loss is recomputed from full-vocabulary log_softmax in float64."""
    policy, cfg = _model(tokenizer, seed=1)
    reference, _ = _model(tokenizer, seed=2)
    dataset = _pairs(tmp_path, tokenizer, n=6, seed=3)
    precompute_reference_logprobs(dataset, [reference], vocab_size=cfg.vocab_size, pad_id=tokenizer.pad_id,
                                  pairs_per_forward=6)
    batch = collate_preferences([dataset[i] for i in range(len(dataset))], tokenizer.pad_id, 1)
    section = DPOSection(beta=0.5, label_smoothing=0.1, sft_loss_weight=0.3)
    with torch.no_grad():
        logits = policy(batch["tokens"], batch["position_ids"], None)
        reference_logits = reference(batch["tokens"], batch["position_ids"], None)
    loss_sum, _, report = DPOObjective(section, cfg.vocab_size).loss(batch, logits)

    def summed(all_logits, row):
        logprobs = torch.log_softmax(all_logits[row, :, : cfg.vocab_size].double(), dim=-1)
        start, n = int(batch["prompt_lengths"][row]), int(batch["response_lengths"][row])
        return [float(logprobs[start + t - 1, batch["tokens"][row, start + t]]) for t in range(n)]

    expected = 0.0
    for pair in range(len(dataset)):
        c, r = 2 * pair, 2 * pair + 1
        margin = 0.5 * ((sum(summed(logits, c)) - sum(summed(reference_logits, c)))
                        - (sum(summed(logits, r)) - sum(summed(reference_logits, r))))
        dpo = -0.9 * math.log(1 / (1 + math.exp(-margin))) - 0.1 * math.log(1 / (1 + math.exp(margin)))
        nll = -sum(summed(logits, c)) / int(batch["response_lengths"][c])
        expected += dpo + 0.3 * nll
    assert float(loss_sum) == pytest.approx(expected, rel=1e-5)


def test_swapped_reference_equals_precomputed(tmp_path, tokenizer):
    policy, cfg = _model(tokenizer, seed=1)
    reference_model, _ = _model(tokenizer, seed=2)
    dataset = _pairs(tmp_path, tokenizer, n=8, seed=4)
    precompute_reference_logprobs(dataset, [reference_model], vocab_size=cfg.vocab_size, pad_id=tokenizer.pad_id,
                                  pairs_per_forward=8)
    expected = dataset.reference_logprobs.reshape(-1)
    dataset.reference_logprobs = None

    class OneStep:  # the loader interface the wrapper needs
        def iterate(self):
            batch = collate_preferences([dataset[i] for i in range(len(dataset))], tokenizer.pad_id, 8)
            yield [{k: None if v is None else v[:8] for k, v in batch.items()},
                   {k: None if v is None else v[8:] for k, v in batch.items()}]

    before = [p.detach().clone() for p in policy.parameters()]
    loader = SwappedReferenceLoader(OneStep(), [policy], HostWeights.snapshot([reference_model]), cfg.vocab_size)
    microbatches = next(loader.iterate())
    got = torch.cat([batch["reference_logprobs"] for batch in microbatches])
    assert torch.allclose(got, expected, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))  # policy weights are back


def test_a_micro_batch_is_packed_once_for_the_swapped_reference_its_forward_and_its_loss(tmp_path, tokenizer,
                                                                                         monkeypatch):
    """With packing, the swapped-in reference pass lays each micro batch out in packed rows, and the
    training forward and loss read those very rows (carried in the batch to the device): one layout
    per micro batch, so with policy = reference every implicit reward is exactly 0 and the loss log 2."""
    from aligner.models import packing
    from aligner.models.forward import batch_to_device

    policy, cfg = _model(tokenizer, seed=1)
    dataset = _pairs(tmp_path, tokenizer, n=8, seed=4)
    layouts = []
    pack_rows = packing.pack_rows
    monkeypatch.setattr(packing, "pack_rows", lambda *args, **kwargs: layouts.append(pack_rows(*args, **kwargs))
                        or layouts[-1])

    class OneStep:  # the loader interface the wrapper needs: two micro batches of 4 pairs
        def iterate(self):
            yield [collate_preferences([dataset[i] for i in range(start, start + 4)], tokenizer.pad_id)
                   for start in (0, 4)]

    section = packing.PackingSection(row_length=24)  # two or more sequences per row
    loader = SwappedReferenceLoader(OneStep(), [policy], HostWeights.snapshot([policy]), cfg.vocab_size, section,
                                    tokenizer.pad_id)
    microbatches = next(loader.iterate())
    assert len(layouts) == 2
    objective = DPOObjective(DPOSection(beta=0.5), cfg.vocab_size, section, tokenizer.pad_id)
    policy.train()
    for layout, batch in zip(layouts, microbatches):
        on_device = batch_to_device(batch, torch.device("cpu"))
        assert torch.equal(on_device["packed"].tokens, layout.tokens)
        assert torch.equal(on_device["packed"].starts, layout.starts)
        assert layout.tokens.shape[0] < batch["tokens"].shape[0]  # rows really were packed
        loss_sum, pairs, report = objective.loss(on_device, objective.forward(policy, on_device))
        assert float(report["chosen_sum"]) == 0.0 and float(report["rejected_sum"]) == 0.0  # bit-equal sums
        assert float(loss_sum) == pytest.approx(4 * math.log(2), rel=1e-6)
    assert len(layouts) == 2  # the forward and the loss built nothing more


def test_rpo_without_rewards_is_a_clear_error(tmp_path, tokenizer):
    model, cfg = _model(tokenizer)
    dataset = _pairs(tmp_path, tokenizer, n=2)
    precompute_reference_logprobs(dataset, [model], vocab_size=cfg.vocab_size, pad_id=tokenizer.pad_id,
                                  pairs_per_forward=2)
    batch = collate_preferences([dataset[0], dataset[1]], tokenizer.pad_id, 8)
    logits = model(batch["tokens"], batch["position_ids"], None)
    with pytest.raises(ValueError, match="rpo_sq needs 'chosen_reward' and 'rejected_reward'"):
        DPOObjective(DPOSection(preference_loss="rpo_sq"), cfg.vocab_size).loss(batch, logits)
    from aligner.algorithms.dpo import DPOConfig
    from aligner.config import CONF_DIR, ConfigError, load_config

    with pytest.raises(ConfigError, match="dpo.reference_logprobs='never' is not one of precompute, swap"):
        load_config(DPOConfig, CONF_DIR / "gpt_dpo.yaml",
                    ["data.train=[{path: x.jsonl}]", "dpo.reference_logprobs=never"])


# ----------------------------------------------------------------------------- a tiny run
def _run_config(tmp_path, arithmetic_tokenizer_dir, train: Path, mode: str, loss: str = "dpo") -> DPOConfig:
    return load_config(DPOConfig, CONF_DIR / "gpt_dpo.yaml", [
        f"tokenizer.path={arithmetic_tokenizer_dir}", f"data.train=[{{path: {train}}}]", "data.split='100,0'",
        "data.max_seq_length=16", "model.architecture.num_layers=2", "model.architecture.hidden_size=32",
        "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
        "model.architecture.ffn_hidden_size=64", "trainer.max_steps=12", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.val_check_interval=0", "optim.lr=3e-3", "optim.warmup_steps=0",
        "optim.decay_style=constant", "dpo.beta=0.5", f"dpo.reference_logprobs={mode}",
        f"dpo.preference_loss={loss}", "checkpoint.save_at_end=false", "checkpoint.resume=false",
        f"checkpoint.save_dir={tmp_path / mode / loss}", f"logging.log_dir={tmp_path / mode / loss}",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0",
        "logging.log_interval=100",
    ])


def test_tiny_run_learns_the_preferences_in_both_reference_modes(tmp_path, arithmetic_tokenizer_dir):
    # 8 pairs, seen again and again: the policy must come to prefer the chosen answers.
    records = arithmetic.preference_records(8, seed=7)
    train = write_jsonl(tmp_path / "train.jsonl", records)
    losses = {}
    for mode in ("precompute", "swap"):
        trainer = build_dpo_trainer(_run_config(tmp_path, arithmetic_tokenizer_dir, train, mode))
        trainer.fit()
        trainer.metrics.close()
        losses[mode] = [row["loss"] for row in metrics_rows(tmp_path / mode / "dpo", "train")]
    for mode, values in losses.items():
        assert len(values) == 12
        assert values[0] == pytest.approx(math.log(2), abs=1e-5), mode
        assert values[-1] < 0.3, (mode, values)
    # The same run whichever way the reference logprobs arrive.
    for a, b in zip(losses["precompute"], losses["swap"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


def test_steps_with_the_output_layer_deferred_equal_steps_on_the_full_logits(tmp_path, arithmetic_tokenizer_dir):
    """The DPO objective reads the response positions only, so the trainer defers the output layer to them
    (`reads_logits_at_positions`): three steps give the losses, margins and gradient norms of the same
    steps with the full logits."""
    train = write_jsonl(tmp_path / "train.jsonl", arithmetic.preference_records(8, seed=7))
    runs = {}
    for deferred in (True, False):
        trainer = build_dpo_trainer(_run_config(tmp_path / str(deferred), arithmetic_tokenizer_dir, train, "swap"))
        assert trainer.objective.reads_logits_at_positions
        trainer.objective.reads_logits_at_positions = deferred
        batches = trainer.train_loader.iterate(0)
        runs[deferred] = [trainer.train_step(next(batches)) for _ in range(3)]
        trainer.metrics.close()
    for deferred, full in zip(runs[True], runs[False]):
        for key in ("loss", "grad_norm", "margin", "chosen_reward"):
            assert deferred[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key
    assert runs[True][-1]["loss"] < runs[True][0]["loss"]  # the weights moved between the compared steps


def test_step_time_counts_the_swapped_in_reference_pass(tmp_path, arithmetic_tokenizer_dir):
    """With dpo.reference_logprobs=swap the reference forward runs while the step's batch is fetched:
    it belongs to the step, so step_time (and tokens/s, MFU) count it, reported as time_data."""
    import time

    train = write_jsonl(tmp_path / "train.jsonl", arithmetic.preference_records(8, seed=7))
    trainer = build_dpo_trainer(_run_config(tmp_path, arithmetic_tokenizer_dir, train, "swap"))
    swapped_in = trainer.train_loader.reference.swapped_in

    def slow_reference_pass(chunks):  # a reference forward that takes 0.2 s
        time.sleep(0.2)
        return swapped_in(chunks)

    trainer.train_loader.reference.swapped_in = slow_reference_pass
    trainer.fit()
    trainer.metrics.close()
    rows = metrics_rows(tmp_path / "swap" / "dpo", "train")
    assert len(rows) == 12
    for row in rows:
        assert row["time_data"] >= 0.2 and row["step_time"] >= row["time_data"] + row["time_forward_backward"]


@pytest.mark.parametrize("loss", ["rpo_sq", "rpo_fwd_kl"])
def test_tiny_rpo_run_moves_the_implicit_margin_to_the_given_one(tmp_path, arithmetic_tokenizer_dir, loss):
    # Every pair's given rewards differ by 0.5: RPO pulls the implicit reward margin to 0.5 and holds
    # it there, where DPO on the same pairs pushes it on without bound.
    records = [{**record, "chosen_reward": 1.0, "rejected_reward": 0.5}
               for record in arithmetic.preference_records(8, seed=7)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    margins = {}
    for kind in (loss, "dpo"):
        trainer = build_dpo_trainer(_run_config(tmp_path, arithmetic_tokenizer_dir, train, "precompute", kind))
        trainer.fit()
        trainer.metrics.close()
        margins[kind] = [row["margin"] for row in metrics_rows(tmp_path / "precompute" / kind, "train")]
    assert abs(margins[loss][0]) < 1e-5 and abs(margins["dpo"][0]) < 1e-5
    print(f"\n{loss}: margin {margins[loss][-1]:.3f} (given 0.5); dpo: {margins['dpo'][-1]:.3f}")
    assert margins[loss][-1] == pytest.approx(0.5, abs=0.15), margins[loss]
    assert margins["dpo"][-1] > 1.0, margins["dpo"]
