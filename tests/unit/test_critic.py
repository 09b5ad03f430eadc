"""The critic server's pure parts: value alignment with the actor's logprobs, optimizer offloading."""
from __future__ import annotations

import torch

from aligner.generation.logprobs import response_mask, response_values
from aligner.rl.rollouts import values_at_response
from servers.critic import move_optimizer_state, optimizer_state_on_device


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
