"""REINFORCE / RLOO actor: k samples per prompt, a baseline from the other samples of the prompt, no critic.

Reads top to bottom: the config schema, then `ReinforceTrainer`, whose `train_step` is one step:

  1. take `prompts_per_step` prompts and repeat each `samples_per_prompt` (k) times, adjacent, so a
     prompt's samples form a group of consecutive rollout indices; every index samples from its own
     random stream (`aligner.rl.rollouts.micro_batch_seed` + the engine's per-row streams)
  2. generate through the router and score (reward-model server or a "module:function" rule), exactly
     as the PPO actor does
  3. actor logprobs, then reference logprobs with the reference weights swapped in from host memory
  4. sequence reward = score - kl_coef * (summed per-token KL estimate); advantage = reward - baseline
     (RLOO: the mean of the other k-1 rewards of the prompt; or the group mean), optionally divided by
     the group's reward std (GRPO); every response token gets its sequence's advantage
  5. update: the PPO clipped surrogate over minibatches and epochs (with one minibatch and one epoch
     the ratio is 1 and this is plain REINFORCE with a baseline)

Groups never straddle data-parallel ranks: after generation, rank r trains on rollout indices
[r*N/D, (r+1)*N/D) (`rebalance_rollouts`), and the config requires prompts_per_step to be a multiple
of D, so each block holds whole groups and the baseline needs no communication.

Everything but steps 1, 4 and the loop is the PPO actor's (`aligner.algorithms.ppo.PPOTrainer`): the
same engine, router, reward sources, logprob computation, reference weights, objective, metrics and
checkpoints. The math is in `aligner.rl.reinforce_math`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from aligner.algorithms.ppo import (
    GenerationSection,
    KLSection,
    PolicySection,
    PPODataSection,
    PPOLoggingConfig,
    PPOTrainer,
    RewardSection,
    check_actor_config,
)
from aligner.config import at_least
from aligner.rl import ppo_math as M
from aligner.rl import reinforce_math as R
from aligner.runtime.seeds import SAMPLER_SEED_RANGE, derive_seed
from aligner.training.setup import RunConfig


# ----------------------------------------------------------------------------- config schema
@dataclass
class ReinforceSection:
    prompts_per_step: int = at_least(1, 64)  # distinct prompts per step over all data-parallel ranks
    samples_per_prompt: int = at_least(1, 4)  # k rollouts of each prompt (a group); rollouts per step = prompts_per_step * k
    baseline: str = "rloo"  # rloo: mean of the other k-1 rewards | mean: group mean (GRPO) | none
    normalize_by_group_std: bool = False  # (r - baseline) / (group reward std + std_eps), GRPO-style
    std_eps: float = 1.0e-6
    epochs: int = at_least(1, 1)  # passes over each step's rollouts; minibatch = trainer.global_batch_size responses
    clip_ratio: float = 0.2  # PPO-style ratio clip; inactive with one epoch of one minibatch (ratio = 1)
    entropy_coef: float = 0.0
    loss_aggregation: str = "token_mean"  # token_mean | sequence_mean
    scale_logits_by_temperature: bool = True  # logprobs of logits / sampling temperature
    recompute_old_logprobs: bool = True  # false: use the engine's logprobs as the rollout policy's
    disable_dropout: bool = True
    adam_epsilon_style: str = "torch"  # torch | tf


@dataclass
class ReinforceConfig(RunConfig):
    """conf/gpt_reinforce_actor.yaml. trainer.global_batch_size = responses per minibatch (optimizer step);
    trainer.max_steps = rollout rounds; trainer.limit_val_samples = validation prompts."""

    name: str = "gpt_reinforce_actor"
    model: PolicySection = field(default_factory=PolicySection)
    data: PPODataSection = field(default_factory=PPODataSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    reinforce: ReinforceSection = field(default_factory=ReinforceSection)
    kl: KLSection = field(default_factory=KLSection)
    reward: RewardSection = field(default_factory=RewardSection)
    logging: PPOLoggingConfig = field(default_factory=PPOLoggingConfig)

    @property
    def ppo(self) -> ReinforceSection:
        """The PPO actor's update code (logprobs, minibatch epochs, loss normalisers) reads its settings
        from `cfg.ppo`; here they live in the `reinforce` section under the same names."""
        return self.reinforce

    @property
    def rollouts_per_step(self) -> int:
        return self.reinforce.prompts_per_step * self.reinforce.samples_per_prompt

    def validate(self, data_parallel_size: int) -> None:
        rf = self.reinforce
        if rf.baseline not in R.BASELINES:
            raise ValueError(f"reinforce.baseline must be one of {R.BASELINES}, got {rf.baseline!r}")
        needs_group = rf.baseline == "rloo" or rf.normalize_by_group_std
        if rf.samples_per_prompt < (2 if needs_group else 1):
            raise ValueError(f"reinforce.samples_per_prompt={rf.samples_per_prompt}: the rloo baseline and "
                             "normalize_by_group_std need at least 2 samples per prompt")
        if rf.prompts_per_step % data_parallel_size or rf.prompts_per_step == 0:
            raise ValueError(f"reinforce.prompts_per_step={rf.prompts_per_step} must be a positive multiple of the "
                             f"data-parallel size {data_parallel_size} (each rank trains on whole prompt groups)")
        check_actor_config(self, "reinforce", self.rollouts_per_step, data_parallel_size,
                           reward_sources=("server", "function"))


# ----------------------------------------------------------------------------- the trainer
class ReinforceTrainer(PPOTrainer):
    """fit / train_step / validate / save / resume of the REINFORCE/RLOO actor (collective over the job).

    Built with critic=None, no PTX data and no EMA; inherits the PPO actor's step (`train_step`:
    experience, logprobs, update), `validate`, checkpointing and state, and replaces which rollouts a
    step generates (k per prompt), their seed, and the advantages.
    """

    def group_indices(self, prompt_indices: list[int]) -> list[int]:
        """Each prompt samples_per_prompt times, adjacent: rollout j is a sample of prompt_indices[j // k]."""
        k = self.cfg.reinforce.samples_per_prompt
        return [index for index in prompt_indices for _ in range(k)]

    def rollout_indices(self) -> list[int]:
        return self.group_indices(self.order.take(self.cfg.reinforce.prompts_per_step))

    def step_seed(self) -> int:
        return derive_seed(self.cfg.seed, self.step, modulus=SAMPLER_SEED_RANGE)

    def advantages(self, batch, old_logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> dict:
        """Scores -> KL-penalised sequence rewards -> group baseline -> per-token advantages [B, T]."""
        rf, mask = self.cfg.reinforce, batch.mask
        k = rf.samples_per_prompt
        first, rows = batch.indices[0], len(batch.indices)
        # This rank's rows must be whole groups, in order (rebalance_rollouts hands out contiguous blocks).
        assert first % k == 0 and rows % k == 0 and batch.indices == list(range(first, first + rows)), batch.indices
        scores = batch.row_tensor("score")
        kl = M.kl_penalty(old_logprobs, reference_logprobs, self.cfg.kl.estimator, mask)  # [B, T]
        rewards = R.sequence_rewards(scores, kl, mask, self.kl_controller.value)  # [B]
        sequence_advantages = R.group_advantages(rewards, k, rf.baseline, rf.normalize_by_group_std, rf.std_eps)
        advantages = R.token_advantages(sequence_advantages, mask)  # [B, T]

        # Statistics over the global batch. A group whose k scores are all equal teaches nothing
        # (its advantages are only KL noise): their fraction says how much of the step was useful.
        grouped_scores = R.groups(scores, k)
        uniform_groups = (grouped_scores.max(dim=1).values == grouped_scores.min(dim=1).values).float()
        lengths = batch.response_lengths.float()
        sums = torch.stack([scores.sum(), scores.pow(2).sum(), kl.sum(), lengths.sum(),
                            batch.ended_with_stop.float().sum(), torch.tensor(float(rows)),
                            sequence_advantages.abs().sum(), uniform_groups.sum(), torch.tensor(float(rows // k)),
                            rewards.sum()]).double()
        dist.all_reduce(sums, group=self.dp_group)
        (total, total_sq, kl_sum, length_sum, stopped, count, abs_advantage, uniform, group_count,
         reward_sum) = sums.tolist()
        mean = total / count
        metrics = {
            "reward_mean": mean, "reward_std": math.sqrt(max(total_sq / count - mean * mean, 0.0)),
            "kl": kl_sum / count, "response_length": length_sum / count, "stopped_fraction": stopped / count,
            "advantage_abs_mean": abs_advantage / count, "uniform_group_fraction": uniform / group_count,
            "penalized_reward_mean": reward_sum / count,
        }
        return {"advantages": advantages, "rewards": rewards, "scores": scores, "metrics": metrics}


# ----------------------------------------------------------------------------- building a run
def build_reinforce_trainer(cfg: ReinforceConfig, *, reward_source=None) -> ReinforceTrainer:
    """Runtime, policy + reference, engine, router, reward source, data, resume.

    reward_source: an object with `score_async` (tests pass in-process ones); None builds it from the config.
    """
    from aligner.algorithms.ppo import build_actor_parts

    rf = cfg.reinforce
    parts = build_actor_parts(cfg, cfg.rollouts_per_step, reward_source=reward_source, ptx_coef=0.0)
    trainer = ReinforceTrainer(cfg, policy=parts.policy, reference=parts.reference, engine=parts.engine,
                               router=parts.router, reward_source=parts.reward_source, critic=None, prompts=parts.prompts,
                               validation_prompts=parts.validation_prompts, ptx_loader=None, tokenizer=parts.tokenizer,
                               model_cfg=parts.model_cfg, metrics=parts.metrics)
    if parts.resume is not None:
        trainer.resume_from(parts.resume)
    parts.metrics.write(
        f"{parts.summary}; {rf.prompts_per_step} prompts x {rf.samples_per_prompt} samples per step, baseline "
        f"{rf.baseline}{' / group std' if rf.normalize_by_group_std else ''}, {rf.epochs} epoch(s) of "
        f"{parts.minibatches_per_step} minibatch(es)")
    return trainer
