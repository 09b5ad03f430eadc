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
import time
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
)
from aligner.rl import ppo_math as M
from aligner.rl import reinforce_math as R
from aligner.training.setup import RunConfig


# ----------------------------------------------------------------------------- config schema
@dataclass
class ReinforceSection:
    prompts_per_step: int = 64  # distinct prompts per step over all data-parallel ranks
    samples_per_prompt: int = 4  # k rollouts of each prompt (a group); rollouts per step = prompts_per_step * k
    baseline: str = "rloo"  # rloo: mean of the other k-1 rewards | mean: group mean (GRPO) | none
    normalize_by_group_std: bool = False  # (r - baseline) / (group reward std + std_eps), GRPO-style
    std_eps: float = 1.0e-6
    epochs: int = 1  # passes over each step's rollouts; minibatch = trainer.global_batch_size responses
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
        rf, trainer = self.reinforce, self.trainer
        if trainer.max_epochs is not None:
            raise ValueError("REINFORCE counts rollout steps: set trainer.max_steps and leave trainer.max_epochs null")
        if rf.baseline not in R.BASELINES:
            raise ValueError(f"reinforce.baseline must be one of {R.BASELINES}, got {rf.baseline!r}")
        needs_group = rf.baseline == "rloo" or rf.normalize_by_group_std
        if rf.samples_per_prompt < (2 if needs_group else 1):
            raise ValueError(f"reinforce.samples_per_prompt={rf.samples_per_prompt}: the rloo baseline and "
                             "normalize_by_group_std need at least 2 samples per prompt")
        per_rank, remainder = divmod(rf.prompts_per_step, data_parallel_size)
        if remainder or per_rank == 0:
            raise ValueError(f"reinforce.prompts_per_step={rf.prompts_per_step} must be a positive multiple of the "
                             f"data-parallel size {data_parallel_size} (each rank trains on whole prompt groups)")
        rollouts_per_rank = per_rank * rf.samples_per_prompt
        minibatch_per_rank, remainder = divmod(trainer.global_batch_size, data_parallel_size)
        if remainder or minibatch_per_rank == 0 or rollouts_per_rank % minibatch_per_rank:
            raise ValueError(f"trainer.global_batch_size={trainer.global_batch_size} (responses per minibatch) must be "
                             f"a multiple of the data-parallel size {data_parallel_size} and divide the rollouts per "
                             f"step, reinforce.prompts_per_step * samples_per_prompt = {self.rollouts_per_step}")
        if minibatch_per_rank % trainer.micro_batch_size:
            raise ValueError(f"trainer.micro_batch_size={trainer.micro_batch_size} must divide the per-rank minibatch "
                             f"{minibatch_per_rank}")
        if self.kl.estimator not in M.KL_ESTIMATORS:
            raise ValueError(f"kl.estimator must be one of {M.KL_ESTIMATORS}, got {self.kl.estimator!r}")
        if rf.loss_aggregation not in M.AGGREGATIONS:
            raise ValueError(f"reinforce.loss_aggregation must be one of {M.AGGREGATIONS}, got {rf.loss_aggregation!r}")
        if rf.adam_epsilon_style not in ("torch", "tf"):
            raise ValueError(f"reinforce.adam_epsilon_style must be torch or tf, got {rf.adam_epsilon_style!r}")
        if not rf.scale_logits_by_temperature and not rf.recompute_old_logprobs:
            raise ValueError("the engine's logprobs are temperature-scaled: with reinforce.scale_logits_by_temperature"
                             "=false set reinforce.recompute_old_logprobs=true")
        if self.generation.temperature <= 0:
            raise ValueError("REINFORCE samples its rollouts: generation.temperature must be > 0")
        if self.reward.source not in ("server", "function"):
            raise ValueError(f"reward.source must be server or function (REINFORCE has no critic), "
                             f"got {self.reward.source!r}")
        if self.reward.source == "function" and not self.reward.function:
            raise ValueError("reward.source=function needs reward.function='package.module:function'")
        if self.generation.engine not in ("native", "trtllm"):
            raise ValueError(f"generation.engine must be native or trtllm, got {self.generation.engine!r}")
        if self.generation.router not in ("dynamic", "static"):
            raise ValueError(f"generation.router must be dynamic or static, got {self.generation.router!r}")


# ----------------------------------------------------------------------------- the trainer
class ReinforceTrainer(PPOTrainer):
    """fit / train_step / validate / save / resume of the REINFORCE/RLOO actor (collective over the job).

    Built with critic=None, no PTX data and no EMA; inherits the PPO actor's experience collection
    (`make_experience`), `logprobs`, `update_policy`, `validate`, checkpointing and state.
    """

    def fit(self) -> None:
        from aligner import checkpointing

        max_steps = self.cfg.trainer.max_steps
        try:
            while self.step < max_steps:
                metrics = self.train_step()
                self.step += 1
                self.metrics.log(self.step, metrics)
                self.metrics.advance(reward=metrics["reward_mean"], kl=metrics["kl"])
                interval = self.cfg.trainer.val_check_interval
                if self.validation_prompts is not None and interval > 0 and (
                        self.step % interval == 0 or self.step == max_steps):
                    self.metrics.log(self.step, self.validate(), prefix="validation")
                interval = self.cfg.checkpoint.save_interval
                if interval > 0 and self.step % interval == 0 and self.step < max_steps:
                    self.save()
            if self.cfg.checkpoint.save_at_end and not checkpointing.step_dir(self.cfg.checkpoint.save_dir,
                                                                                self.step).exists():
                self.save()
        finally:
            self.router.close()
            if hasattr(self.reward_source, "close"):
                self.reward_source.close()

    def group_indices(self, prompt_indices: list[int]) -> list[int]:
        """Each prompt samples_per_prompt times, adjacent: rollout j is a sample of prompt_indices[j // k]."""
        k = self.cfg.reinforce.samples_per_prompt
        return [index for index in prompt_indices for _ in range(k)]

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        timings: dict[str, float] = {}
        rollout_prompts = self.group_indices(self.order.take(self.cfg.reinforce.prompts_per_step))
        seed = (self.cfg.seed * 1_000_003 + self.step) % 2**32
        batch, generated = self.make_experience(rollout_prompts, timings, seed=seed, with_values=False)

        tick = time.perf_counter()
        old_logprobs = self.logprobs(batch) if self.cfg.reinforce.recompute_old_logprobs else batch.engine_logprobs
        with self.reference.swapped_in(self.chunks):
            reference_logprobs = self.logprobs(batch)
        timings["time_logprobs"] = time.perf_counter() - tick

        experience = self.advantages(batch, old_logprobs, reference_logprobs)
        tick = time.perf_counter()
        metrics = dict(experience["metrics"])
        metrics.update(self.update_policy(batch, old_logprobs, experience["advantages"]))
        timings["time_train"] = time.perf_counter() - tick
        self.kl_controller.update(metrics["kl"], self.cfg.rollouts_per_step)
        metrics["kl_coef"] = self.kl_controller.value
        timings["step_time"] = time.perf_counter() - start
        metrics.update(timings)
        metrics["rollout_tokens_per_second"] = generated / max(timings["time_generation"], 1e-9)
        if self._should_log_samples():
            self.log_samples(batch, experience)
        return metrics

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
    from aligner import checkpointing
    from aligner.algorithms.ppo import PPOObjective, build_engine_and_router, build_reward_source
    from aligner.models.gpt import num_parameters
    from aligner.models.weight_swap import HostWeights
    from aligner.rl.rollouts import PromptDataset
    from aligner.training import setup
    from aligner.training.metrics import MetricsLogger, peak_tflops_per_device
    from aligner.training.trainer import Trainer

    rf = cfg.reinforce
    overrides = {"hidden_dropout": 0.0, "attention_dropout": 0.0} if rf.disable_dropout else None
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume, model_overrides=overrides,
    )
    cfg.validate(built.data_parallel_size)
    chunks, model_cfg, tokenizer = built.chunks, built.model_cfg, built.tokenizer
    resume = built.resume_checkpoint
    # The reference policy is the starting policy, also when resuming (see build_ppo_trainer).
    if resume is not None:
        checkpointing.load(cfg.model.init_from, chunks)
    reference = HostWeights.snapshot(chunks)

    prompts = PromptDataset(cfg.data.prompts, tokenizer, cfg.data.max_prompt_length)
    validation = None
    if cfg.data.validation_prompts:
        validation = PromptDataset(cfg.data.validation_prompts, tokenizer, cfg.data.max_prompt_length)
    engine, router = build_engine_and_router(cfg.generation, chunks, model_cfg, tokenizer, cfg.data.max_prompt_length)
    if reward_source is None:
        reward_source = build_reward_source(cfg.reward)

    trainer_cfg = cfg.trainer
    minibatches_per_step = cfg.rollouts_per_step // trainer_cfg.global_batch_size
    scheduler = setup.build_scheduler(built.optimizer, cfg.optim, trainer_cfg.max_steps * rf.epochs * minibatches_per_step)
    metrics = MetricsLogger(cfg.logging, cfg.name, trainer_cfg.max_steps)
    objective = PPOObjective(model_cfg.vocab_size, cfg.generation.temperature if rf.scale_logits_by_temperature else 1.0,
                             rf.clip_ratio, rf.entropy_coef, rf.loss_aggregation, ptx_coef=0.0)
    policy = Trainer(
        name=cfg.name, trainer_cfg=trainer_cfg, checkpoint_cfg=cfg.checkpoint, objective=objective, chunks=chunks,
        optimizer=built.optimizer, scheduler=scheduler, train_loader=None, val_loader=None, metrics=metrics,
        checkpoint_meta={"model": model_cfg.to_dict()}, tokenizer_dir=built.tokenizer_dir,
        num_params=num_parameters(model_cfg), num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
        peak_tflops=peak_tflops_per_device(cfg.logging.peak_tflops), pad_id=tokenizer.pad_id,
    )
    trainer = ReinforceTrainer(cfg, policy=policy, reference=reference, engine=engine, router=router,
                               reward_source=reward_source, critic=None, prompts=prompts, validation_prompts=validation,
                               ptx_loader=None, tokenizer=tokenizer, model_cfg=model_cfg, metrics=metrics)
    if resume is not None:
        trainer.resume_from(resume)
    metrics.write(
        f"{cfg.name}: {num_parameters(model_cfg) / 1e6:.2f}M parameters, layout TP={cfg.parallel.tensor_model_parallel_size} "
        f"PP={cfg.parallel.pipeline_model_parallel_size} DP={built.data_parallel_size}; {len(prompts)} prompts "
        f"({prompts.too_long} longer than {cfg.data.max_prompt_length} tokens skipped); {rf.prompts_per_step} prompts x "
        f"{rf.samples_per_prompt} samples per step, baseline {rf.baseline}"
        f"{' / group std' if rf.normalize_by_group_std else ''}, {rf.epochs} epoch(s) of {minibatches_per_step} "
        f"minibatch(es); reference policy {cfg.model.init_from} on host memory ({reference.num_bytes / 2**20:.1f} MiB)"
    )
    return trainer
