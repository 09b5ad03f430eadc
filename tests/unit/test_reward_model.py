"""Reward models: losses against float64 references, the objective's reports, the head, loading."""
from __future__ import annotations

import math

import pytest
import torch

from aligner import checkpointing
from aligner.algorithms.reward_model import (
    RankingObjective,
    RegressionObjective,
    bradley_terry_loss,
    masked_regression_loss,
)
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.models.reward import (
    HEAD_STATE_PREFIX,
    RewardInference,
    RewardNormalization,
    build_reward_model,
    scores_at_last_token,
)

pytestmark = pytest.mark.usefixtures("single_process")


def test_bradley_terry_loss_matches_float64_formula():
    generator = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(50, generator=generator) * 5, torch.randn(50, generator=generator) * 5
    expected = [math.log1p(math.exp(-(c - r))) for c, r in zip(chosen.double().tolist(), rejected.double().tolist())]
    assert torch.allclose(bradley_terry_loss(chosen, rejected).double(), torch.tensor(expected, dtype=torch.float64),
                          rtol=1e-6, atol=1e-6)
    # Large margins must not overflow.
    assert torch.isfinite(bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0]))).all()
    assert float(bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0]))) == pytest.approx(math.log(2))


def test_masked_regression_loss_ignores_unlabelled_entries():
    predictions = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    labels = torch.tensor([[0.5, 100.0], [3.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert masked_regression_loss(predictions, labels, mask).tolist() == [[0.25, 0.0], [0.0, 9.0]]


def test_ranking_objective_reads_pairs_at_the_last_real_token():
    # Rows: chosen0, rejected0, chosen1, rejected1; scores [rows, seq, 1] with the score = position.
    scores = torch.arange(6, dtype=torch.float32).view(1, 6, 1).repeat(4, 1, 1)
    batch = {"lengths": torch.tensor([6, 2, 3, 5])}
    loss_sum, pairs, report = RankingObjective().loss(batch, scores)
    # rewards: chosen = [5, 2], rejected = [1, 4]
    expected = math.log1p(math.exp(-4.0)) + math.log1p(math.exp(2.0))
    assert int(pairs) == 2 and float(loss_sum) == pytest.approx(expected, rel=1e-6)
    summary = RankingObjective().summarize({k: float(v) for k, v in report.items()})
    assert summary["accuracy"] == 0.5 and summary["margin"] == pytest.approx(1.0)
    assert summary["chosen_reward"] == pytest.approx(3.5) and summary["rejected_reward"] == pytest.approx(2.5)


def test_regression_objective_per_attribute_mse():
    scores = torch.zeros(2, 4, 2)
    scores[0, 2] = torch.tensor([1.0, 2.0])
    scores[1, 3] = torch.tensor([3.0, 0.0])
    batch = {"lengths": torch.tensor([3, 4]), "labels": torch.tensor([[0.0, 2.0], [1.0, 5.0]]),
             "label_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]])}
    objective = RegressionObjective(["helpfulness", "correctness"])
    loss_sum, labelled, report = objective.loss(batch, scores)
    assert int(labelled) == 3 and float(loss_sum) == pytest.approx(1.0 + 0.0 + 4.0)
    summary = objective.summarize({k: float(v) for k, v in report.items()})
    assert summary["mse_helpfulness"] == pytest.approx(2.5) and summary["mse_correctness"] == pytest.approx(0.0)


def _small_cfg():
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=30,
                     make_vocab_size_divisible_by=8, max_position_embeddings=32)


def test_ranking_heads_do_not_train_the_bias():
    cfg = _small_cfg()
    ranking = build_reward_model(cfg, transformer_config(cfg), train_bias=False).output_layer
    regression = build_reward_model(cfg, transformer_config(cfg), num_attributes=2).output_layer
    assert not ranking.bias.requires_grad and ranking.weight.requires_grad
    assert regression.bias.requires_grad


def test_head_init_and_shape():
    cfg = _small_cfg()
    model = build_reward_model(cfg, transformer_config(cfg), num_attributes=3, head_seed=7)
    head = model.output_layer
    assert head.weight.shape == (3, 64) and torch.equal(head.bias, torch.zeros(3))
    again = build_reward_model(cfg, transformer_config(cfg), num_attributes=3, head_seed=7).output_layer
    assert torch.equal(head.weight, again.weight), "the head must not depend on the global RNG state"
    big = build_reward_model(dataclass_replace(cfg, hidden_size=256, num_attention_heads=4), transformer_config(
        dataclass_replace(cfg, hidden_size=256, num_attention_heads=4)), num_attributes=2000).output_layer
    assert float(big.weight.std()) == pytest.approx(1 / math.sqrt(257), rel=0.05)
    scores = model(torch.randint(0, 30, (2, 5)), torch.arange(5).expand(2, 5), None)
    assert scores.shape == (2, 5, 3)


def dataclass_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_lm_checkpoint_initialises_the_body_and_leaves_the_head_fresh(tmp_path):
    cfg = _small_cfg()
    lm = build_gpt_model(cfg, transformer_config(cfg))
    checkpointing.save(tmp_path / "lm", [lm], model_config=cfg.to_dict())
    reward_model = build_reward_model(cfg, transformer_config(cfg), num_attributes=1, head_seed=3)
    fresh_head = reward_model.output_layer.weight.detach().clone()
    checkpointing.load(tmp_path / "lm", [reward_model], skip_prefixes=(HEAD_STATE_PREFIX,))
    lm_state, rm_state = lm.state_dict(), reward_model.state_dict()
    body = [k for k in lm_state if not k.startswith("output_layer") and lm_state[k] is not None]
    assert body and all(torch.equal(lm_state[k], rm_state[k]) for k in body)
    assert torch.equal(reward_model.output_layer.weight, fresh_head)
    # Without skipping, the LM checkpoint has no reward head: a clear failure, not a silent init.
    with pytest.raises(checkpointing.CheckpointError,
                       match=r"lm: cannot load it into this model \(missing tensors \['reward_head"):
        checkpointing.load(tmp_path / "lm", [build_reward_model(cfg, transformer_config(cfg))])


def test_inference_is_independent_of_batch_composition():
    cfg = _small_cfg()
    model = build_reward_model(cfg, transformer_config(cfg), num_attributes=2)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 3, 5, 1, 7])
    tokens = torch.randint(0, 30, (5, 9), generator=generator)
    inference = RewardInference([model], 2, micro_batch_size=2)
    batched = inference.infer(tokens, lengths, normalize=False)
    for row in range(5):
        alone = inference.infer(tokens[row:row + 1, :lengths[row]], lengths[row:row + 1], normalize=False)
        assert torch.allclose(batched[row], alone[0], atol=1e-6, rtol=0)
    # The reward is the score at the last real token: padding content must not matter.
    scrambled = tokens.clone()
    for row, length in enumerate(lengths.tolist()):
        scrambled[row, length:] = 29 - scrambled[row, length:]
    assert torch.allclose(inference.infer(scrambled, lengths, normalize=False), batched, atol=1e-6, rtol=0)
    normalization = RewardNormalization(mean=[1.0, -1.0], std=[2.0, 4.0])
    expected = (batched - torch.tensor([1.0, -1.0])) / torch.tensor([2.0, 4.0])
    assert torch.allclose(normalization.apply(batched), expected)


def test_scores_at_last_token():
    scores = torch.arange(12.0).view(2, 3, 2)
    assert scores_at_last_token(scores, torch.tensor([1, 3])).tolist() == [[0.0, 1.0], [10.0, 11.0]]
