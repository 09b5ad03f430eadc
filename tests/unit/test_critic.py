"""The critic (aligner/algorithms/critic.py): value alignment with the actor's logprobs, optimizer offloading."""
from __future__ import annotations

import pytest
import torch

from aligner.algorithms.critic import move_optimizer_state, optimizer_state_on_device
from aligner.generation.rollouts import values_at_response
from aligner.models.logprobs import response_mask, response_values


def test_response_values_read_the_column_before_each_response_token():
    """Response token j of a row with prompt length P is chosen at the prefix ending at column P - 1 + j:
    the same column `response_logprobs` reads that token's logprob from."""
    torch.manual_seed(0)
    token_values = torch.randn(3, 10, dtype=torch.float64)
    prompt_lengths = torch.tensor([1, 4, 7])
    response_lengths = torch.tensor([5, 6, 3])
    width = 6
    values = response_values(token_values, prompt_lengths, width)
    mask = response_mask(response_lengths, width)
    for row in range(3):
        for j in range(width):
            assert bool(mask[row, j]) == (j < int(response_lengths[row]))
            if mask[row, j]:
                assert values[row, j] == token_values[row, int(prompt_lengths[row]) - 1 + j]
    assert values.shape == (3, width) and mask.dtype == torch.bool
    # The actor's one-row reading of the critic's answer is the same column.
    for row in range(3):
        length = int(response_lengths[row])
        assert torch.equal(values_at_response(token_values[row], int(prompt_lengths[row]), length),
                           values[row, :length])


def test_optimizer_state_moves_to_host_and_back_without_changing_training():
    """Offloading handles every Adam moment (not the scalar step) and the run continues identically."""
    def run(offload: bool) -> torch.Tensor:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        inputs = torch.randn(16, 4)
        for _ in range(3):
            with optimizer_state_on_device(optimizer, offload):
                optimizer.zero_grad()
                model(inputs).pow(2).mean().backward()
                optimizer.step()
            if offload:
                for state in optimizer.state.values():
                    assert state["exp_avg"].device.type == "cpu" and state["step"].dim() == 0
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    assert torch.equal(run(offload=True), run(offload=False))
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert move_optimizer_state(optimizer, to_host=True) == 4  # exp_avg and exp_avg_sq of weight and bias
    assert move_optimizer_state(optimizer, to_host=False) == 4


def test_token_scores_equal_a_direct_forward_of_each_unpadded_row(single_process):
    """RewardInference.token_scores (the critic's values): per row, the model's outputs on that row
    alone, 0 past its length, whatever the padding and micro batching; its last real column is the reward."""
    from aligner.models.gpt import GPTConfig, transformer_config
    from aligner.models.reward import RewardInference, build_reward_model
    from aligner.runtime import seeds

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=40, make_vocab_size_divisible_by=8, max_position_embeddings=32)
    seeds.set_seed(3)
    model = build_reward_model(cfg, transformer_config(cfg), num_attributes=1)
    lengths = torch.tensor([5, 1, 12, 7, 9])
    tokens = torch.randint(0, 40, (5, 16))  # the padding after each length is random ids
    inference = RewardInference([model], 1, micro_batch_size=2)
    scores = inference.token_scores(tokens, lengths)  # [5, 16, 1]
    model.eval()
    with torch.no_grad():
        for row, length in enumerate(lengths.tolist()):
            alone = model(tokens[row:row + 1, :length], torch.arange(length).unsqueeze(0), None)[0]  # [length, 1]
            assert (scores[row, :length] - alone).abs().max() < 1e-5
            assert (scores[row, length:] == 0).all()
    rewards = inference.infer(tokens, lengths)
    assert torch.equal(rewards, scores[torch.arange(5), lengths - 1])


# ----------------------------------------------------------------------------- the library critic in process
ROWS, GLOBAL_BATCH, MICRO_BATCH, CLIP_VAL = 4, 4, 2, 0.2


def _critic_config(init_from, save_dir, *, offload: bool):
    from aligner.algorithms.critic import CriticCheckpointConfig, CriticConfig, CriticSection, CriticTrainConfig
    from aligner.models.reward import RewardInferenceConfig
    from aligner.training.setup import OptimConfig

    return CriticConfig(critic=CriticSection(init_from=str(init_from)),
                        inference=RewardInferenceConfig(micro_batch_size=3),
                        train=CriticTrainConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                                                clip_val=CLIP_VAL),
                        optim=OptimConfig(lr=1e-3, min_lr=0.0, weight_decay=0.0, decay_style="constant",
                                          clip_grad=1000.0),
                        checkpoint=CriticCheckpointConfig(save_dir=str(save_dir)), offload_optimizer_to_cpu=offload)


def _float64_value_loss(init_from, batch) -> tuple[float, float, float]:
    """(value loss, gradient norm, clip fraction) of the checkpoint's weights on the batch, in float64."""
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, transformer_config
    from aligner.models.reward import build_reward_model
    from aligner.rl.shaping import value_loss

    model_cfg = GPTConfig.from_dict(checkpointing.read_meta(init_from)["model"])
    model = build_reward_model(model_cfg, transformer_config(model_cfg), num_attributes=1)
    checkpointing.load(init_from, [model])
    model = model.double()
    positions = torch.arange(batch.tokens.shape[1]).expand(batch.rows, -1)
    token_values = model(batch.tokens, positions, None)[..., 0]  # [B, S] float64
    width = batch.returns.shape[1]
    values = response_values(token_values, batch.prompt_lengths, width)
    loss, stats = value_loss(values, batch.old_values.double(), batch.returns.double(),
                             response_mask(batch.response_lengths, width), CLIP_VAL)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(grad_norm), float(stats["clip_fraction"])


def test_library_critic_infers_trains_offloads_and_resumes(tmp_path):
    """aligner.algorithms.critic without a server: values equal the init checkpoint's model; the first
    train call's loss, gradient norm and clip fraction equal a float64 value_loss of the initial
    weights; training with the Adam state offloaded equals training without; save + rebuild resumes."""
    import dataclasses

    import numpy as np

    from aligner.algorithms.critic import CriticTrainBatch, CriticTrainMetrics, build_critic, move_optimizer_state
    from aligner.clients.protocol import CRITIC_TRAIN_METRICS
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.models.reward import load_reward_model
    from aligner.rl.masked import explained_variance
    from aligner.runtime import distributed
    from tests.functional.test_critic_server import make_one_attribute_checkpoint, right_padded

    assert tuple(spec.name for spec in dataclasses.fields(CriticTrainMetrics)) == CRITIC_TRAIN_METRICS
    distributed.initialize(distributed.ParallelConfig())
    try:
        train_char_tokenizer(["0123456789+= abcdefghij"], tmp_path / "tokenizer")
        init_from = make_one_attribute_checkpoint(tmp_path / "init", tmp_path / "tokenizer", seed=5)
        critic, data_parallel_size = build_critic(_critic_config(init_from, tmp_path / "offloaded", offload=True))
        assert data_parallel_size == 1 and critic.step == 0 and not critic.combined

        generator = torch.Generator().manual_seed(0)
        prompt_lengths, response_lengths = torch.tensor([3, 1, 6, 2]), torch.tensor([5, 7, 2, 4])
        sequences = [torch.randint(0, critic.model_cfg.vocab_size, (int(p + r),), generator=generator).tolist()
                     for p, r in zip(prompt_lengths, response_lengths)]
        tokens, lengths = right_padded(sequences)
        values = critic.values(tokens, lengths)  # [B, S]
        reference = load_reward_model(init_from, micro_batch_size=2).inference
        assert (values - reference.token_scores(tokens, lengths)[..., 0]).abs().max() < 1e-5

        width = int(response_lengths.max()) + 2  # wider than any response: the extra columns are ignored
        old_values = (response_values(values, prompt_lengths, width)
                      + 0.5 * torch.randn(ROWS, width, generator=generator))
        returns = old_values + torch.randn(ROWS, width, generator=generator)
        batch = CriticTrainBatch(tokens, lengths, prompt_lengths, returns.float(), old_values.float())
        assert torch.equal(batch.response_lengths, response_lengths)
        loss, grad_norm, clip_fraction = _float64_value_loss(init_from, batch)
        assert 0.0 < clip_fraction < 1.0  # both branches of the clipped loss are exercised

        metrics = critic.train(batch)
        print(f"\nlibrary critic: loss {metrics.value_loss:.7f} vs float64 {loss:.7f}, "
              f"grad norm {metrics.grad_norm:.6f} vs {grad_norm:.6f}")
        assert metrics.value_loss == pytest.approx(loss, rel=1e-5)
        assert metrics.grad_norm == pytest.approx(grad_norm, rel=1e-4)
        assert metrics.clip_fraction == pytest.approx(clip_fraction, abs=1e-6)
        mask = response_mask(response_lengths, width)
        assert metrics.explained_variance == pytest.approx(
            float(explained_variance(old_values.double(), returns.double(), mask)), abs=1e-6)
        assert (metrics.lr, metrics.critic_step, critic.step) == (pytest.approx(1e-3), 1.0, 1)
        assert not torch.equal(critic.values(tokens, lengths), values)  # the update reached the weights
        with pytest.raises(ValueError, match="not a multiple of train.global_batch_size"):
            critic.train(CriticTrainBatch(*(tensor[:3] for tensor in batch.tensors())))

        # Offloaded (the Adam moments live on the host between calls) trains exactly as kept on the device.
        critic.train(batch)
        kept = build_critic(_critic_config(init_from, tmp_path / "kept", offload=False))[0]
        for _ in range(2):
            kept.train(batch)
        assert torch.equal(critic.values(tokens, lengths), kept.values(tokens, lengths))
        parameters = sum(1 for chunk in critic.chunks for p in chunk.parameters() if p.requires_grad)
        assert move_optimizer_state(critic.optimizer, to_host=True) == 2 * parameters  # exp_avg, exp_avg_sq each

        # Saved and rebuilt from the same save_dir: the critic resumes where it was.
        path = critic.save(7)
        assert path.name == "step_00000007" and critic.saved_step == 2
        resumed = build_critic(_critic_config(init_from, tmp_path / "offloaded", offload=True))[0]
        assert resumed.step == 2
        assert np.array_equal(resumed.values(tokens, lengths).numpy(), critic.values(tokens, lengths).numpy())
        assert resumed.train(batch).value_loss == pytest.approx(critic.train(batch).value_loss, rel=1e-6)
    finally:
        distributed.shutdown()


def test_critic_with_lora_trains_adapters_and_the_value_head_and_resumes_them(tmp_path):
    """peft.scheme=lora on the critic: B = 0 makes the first loss the float64 loss of the init weights; the
    body's weights stay bit-equal while adapters and head move; the checkpoint holds the adapters and the
    head only, loads back through the reward-model loader with the same values, and a rebuilt critic
    resumes them; combined mode refuses LoRA with one line."""
    import dataclasses

    from aligner import checkpointing
    from aligner.algorithms.critic import CombinedSection, CriticTrainBatch, build_critic
    from aligner.config import ConfigError
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.models import lora
    from aligner.models.reward import load_reward_model
    from aligner.runtime import distributed
    from tests.functional.test_critic_server import make_one_attribute_checkpoint, right_padded

    distributed.initialize(distributed.ParallelConfig())
    try:
        train_char_tokenizer(["0123456789+= abcdefghij"], tmp_path / "tokenizer")
        init_from = make_one_attribute_checkpoint(tmp_path / "init", tmp_path / "tokenizer", seed=5)
        peft = lora.PEFTConfig(scheme="lora", rank=4, alpha=8.0)
        cfg = dataclasses.replace(_critic_config(init_from, tmp_path / "lora", offload=False), peft=peft)
        with pytest.raises(ConfigError, match="peft.scheme=lora is not supported in combined mode"):
            dataclasses.replace(cfg, combined=CombinedSection(reward_model_init_from=str(init_from))).validate()
        critic = build_critic(cfg)[0]
        frozen = {name: p.detach().clone() for chunk in critic.chunks for name, p in chunk.named_parameters()
                  if not p.requires_grad}
        trained = {name: p.detach().clone() for chunk in critic.chunks for name, p in chunk.named_parameters()
                   if p.requires_grad}
        assert {name for name in trained if not lora.is_adapter_key(name)} == {"module.output_layer.weight",
                                                                               "module.output_layer.bias"}

        generator = torch.Generator().manual_seed(0)
        prompt_lengths, response_lengths = torch.tensor([3, 1, 6, 2]), torch.tensor([5, 7, 2, 4])
        tokens, lengths = right_padded([
            torch.randint(0, critic.model_cfg.vocab_size, (int(p + r),), generator=generator).tolist()
            for p, r in zip(prompt_lengths, response_lengths)])
        values = critic.values(tokens, lengths)
        width = int(response_lengths.max())
        old_values = response_values(values, prompt_lengths, width) + 0.5 * torch.randn(ROWS, width,
                                                                                        generator=generator)
        batch = CriticTrainBatch(tokens, lengths, prompt_lengths,
                                 (old_values + torch.randn(ROWS, width, generator=generator)).float(),
                                 old_values.float())
        loss, _, _ = _float64_value_loss(init_from, batch)
        assert critic.train(batch).value_loss == pytest.approx(loss, rel=1e-5)
        for _ in range(2):
            critic.train(batch)
        after = {name: p.detach() for chunk in critic.chunks for name, p in chunk.named_parameters()}
        assert all(torch.equal(after[name], value) for name, value in frozen.items())
        moved = [name for name, value in trained.items() if not torch.equal(after[name], value)]
        assert "module.output_layer.weight" in moved and any(lora.is_adapter_key(name) for name in moved)

        path = critic.save(3)
        assert checkpointing.read_meta(path)["peft"]["train_whole"] == ["output_layer."]
        assert checkpointing.checkpoint_bytes(path) < checkpointing.checkpoint_bytes(init_from)
        trained_values = critic.values(tokens, lengths)
        served = load_reward_model(path, micro_batch_size=2).inference.token_scores(tokens, lengths)[..., 0]
        assert (served - trained_values).abs().max() < 1e-5
        resumed = build_critic(cfg)[0]
        assert resumed.step == 3 and torch.equal(resumed.values(tokens, lengths), trained_values)
        assert resumed.train(batch).value_loss == pytest.approx(critic.train(batch).value_loss, rel=1e-6)
    finally:
        distributed.shutdown()


def test_the_critic_trains_only_on_the_loss_mask(tmp_path):
    """An agent episode's critic batch carries a loss mask (its model tokens): returns at the other positions do not
    reach the loss or the weights, whatever they are; without the mask they do."""
    from aligner.algorithms.critic import CriticTrainBatch, build_critic
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.runtime import distributed
    from tests.functional.test_critic_server import make_one_attribute_checkpoint, right_padded

    distributed.initialize(distributed.ParallelConfig())
    try:
        train_char_tokenizer(["0123456789+= abcdefghij"], tmp_path / "tokenizer")
        init_from = make_one_attribute_checkpoint(tmp_path / "init", tmp_path / "tokenizer", seed=5)
        generator = torch.Generator().manual_seed(1)
        prompt_lengths, response_lengths = torch.tensor([3, 1, 6, 2]), torch.tensor([5, 7, 2, 4])
        sequences = [torch.randint(0, 20, (int(p + r),), generator=generator).tolist()
                     for p, r in zip(prompt_lengths, response_lengths)]
        tokens, lengths = right_padded(sequences)
        width = int(response_lengths.max())
        old_values = torch.randn(ROWS, width, generator=generator)
        returns = old_values + torch.randn(ROWS, width, generator=generator)
        loss_mask = (torch.rand(ROWS, width, generator=generator) < 0.6).float()  # holes: environment tokens
        loss_mask[:, 0] = 1.0
        elsewhere = returns + 100.0 * (1 - loss_mask)  # other targets where the mask is 0

        def trained(targets, mask, name):
            critic = build_critic(_critic_config(init_from, tmp_path / name, offload=False))[0]
            metrics = critic.train(CriticTrainBatch(tokens, lengths, prompt_lengths, targets.float(),
                                                    old_values.float(), mask))
            return metrics, critic.values(tokens, lengths)

        masked, values = trained(returns, loss_mask, "masked")
        moved, moved_values = trained(elsewhere, loss_mask, "moved")
        assert masked.value_loss == moved.value_loss and torch.equal(values, moved_values)
        unmasked, unmasked_values = trained(elsewhere, None, "unmasked")
        assert unmasked.value_loss > 10 * masked.value_loss and not torch.equal(values, unmasked_values)
    finally:
        distributed.shutdown()
