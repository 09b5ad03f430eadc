"""Episodes as the RL actor's rows: a single-turn episode is today's row bit for bit; a multi-turn episode trains
on the model's tokens only (zero gradient at every prompt, environment and boundary position)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from aligner.agents.episode import Episode
from aligner.agents.rollout import episode_row
from aligner.algorithms.rl_config import LossSection
from aligner.algorithms.rl_objective import PolicyObjective
from aligner.generation.engine import SamplingParams
from aligner.generation.native import NativeEngine
from aligner.generation.rollouts import RolloutBatch, RolloutRow
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.training.microbatch_plan import PolicyMicrobatch
from tests.chat_tokenizers import build_chat_tokenizer
from tests.unit.test_agent_rollout import binary_search, runner

pytestmark = pytest.mark.usefixtures("single_process")


def tiny_model(vocab: int, seed: int = 0):
    cfg = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                          vocab_size=vocab, make_vocab_size_divisible_by=64, max_position_embeddings=512)
    torch.manual_seed(seed)
    model = build_gpt_model(cfg, transformer_config(cfg))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.1 * torch.randn(param.shape))
    return cfg, model


def test_a_single_turn_episode_is_todays_row_bit_for_bit():
    cfg, model = tiny_model(100)
    engine = NativeEngine([model.eval()], cfg, pad_id=0, eos_id=2, max_batch_size=8, max_sequence_length=64)
    prompts = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 5, 12)]
    stopping = SamplingParams(max_new_tokens=10, temperature=0.9, seed=4, stop_token_ids=list(range(2, 100, 9)))
    cut = SamplingParams(max_new_tokens=2, temperature=0.9, seed=5)  # eos alone: rows end at the token limit
    today, episodes = [], []
    for rollout in (engine.generate(prompts, stopping), engine.generate(prompts, cut)):
        for row, prompt in enumerate(prompts):
            length = int(rollout.response_lengths[row])
            ids, logprobs = rollout.response_tokens[row, :length], rollout.logprobs[row, :length]
            stopped = bool(rollout.ended_with_stop[row])
            today.append((len(today), RolloutRow(list(prompt), ids.clone(), logprobs.clone(), stopped)))
            episode = Episode.single_turn(prompt, ids.tolist(), logprobs.tolist(), policy_version=0, stopped=stopped)
            episodes.append((len(episodes), episode_row(episode)))
    assert {row.ended_with_stop for _, row in today} == {True, False}  # both kinds of ending are covered
    before = RolloutBatch.from_rows(today, 0, seq_length=32, response_width=10)
    after = RolloutBatch.from_rows(episodes, 0, seq_length=32, response_width=10)
    for field in ("tokens", "prompt_lengths", "response_lengths", "mask", "engine_logprobs", "ended_with_stop"):
        assert torch.equal(getattr(before, field), getattr(after, field)), field
        assert getattr(before, field).dtype == getattr(after, field).dtype, field


def test_a_multi_turn_episode_trains_on_the_model_tokens_only(tmp_path):
    tokenizer = build_chat_tokenizer(tmp_path / "chatml", "smollm2")
    batch = runner(tokenizer, binary_search, max_turns=3).run([{"secret": 37}, {"secret": 80}], ["a", "b"])
    assert all(e.model_turns >= 2 for e in batch.episodes)
    rows = RolloutBatch.from_rows([(i, episode_row(e)) for i, e in enumerate(batch.episodes)], tokenizer.pad_id)
    for b, episode in enumerate(batch.episodes):  # the mask is exactly the model tokens
        prompt = episode.prompt_length
        assert rows.mask[b, :len(episode) - prompt].tolist() == [bool(m) for m in episode.loss_mask[prompt:]]
        assert int(rows.mask[b].sum()) == episode.count("model")
    cfg, model = tiny_model(tokenizer.vocab_size)
    objective = PolicyObjective(cfg.vocab_size, 1.0, LossSection(entropy_coef=0.01), clip_high=0.2,
                                constant_normalizer=1.0, ptx_coef=0.0)
    positions = torch.arange(rows.tokens.shape[1]).expand_as(rows.tokens)
    advantages = torch.randn(rows.mask.shape, generator=torch.Generator().manual_seed(1))
    micro = PolicyMicrobatch(rows.tokens, positions, rows.prompt_lengths, rows.response_lengths, rows.mask,
                             old_logprobs=None, advantages=advantages, importance_weights=None, loss_scale=1.0)
    logits = model(rows.tokens, positions, None).detach().requires_grad_()
    loss, _, report = objective.loss(micro, logits)
    loss.backward()
    # the logits at column c predict token c + 1: a gradient exactly where the next token is the model's
    for b, episode in enumerate(batch.episodes):
        trained = torch.zeros(rows.tokens.shape[1], dtype=torch.bool)
        trained[:len(episode) - 1] = torch.tensor(episode.loss_mask[1:], dtype=torch.bool)
        touched = logits.grad[b].abs().sum(dim=-1) > 0
        assert torch.equal(touched, trained), b
    assert report["tokens"] == sum(e.count("model") for e in batch.episodes)


def test_a_truncated_last_turn_is_not_ended_with_stop():
    episode = Episode.single_turn([1, 2], [5, 6, 7], [-0.1, -0.2, -0.3], policy_version=0, stopped=False)
    row = episode_row(episode)
    assert (row.ended_with_stop, row.loss_mask) == (False, None)
    assert dataclasses.replace(row, loss_mask=None) == row
