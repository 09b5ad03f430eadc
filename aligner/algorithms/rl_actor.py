"""The RL actor: rollout -> score -> advantages -> policy update, one trainer for PPO and the GRPO family.

An algorithm is a choice of registered pure functions, not a class:

  PPO           advantage.estimator=gae (needs the critic server) + loss.policy_loss=ppo_clip
  RLOO          advantage.estimator=rloo, rollout.samples_per_prompt=k
  GRPO          advantage.estimator=grpo (group mean / group std)
  Dr. GRPO      advantage.estimator=dr_grpo + loss.aggregation=constant_sum
  REINFORCE++   advantage.estimator=reinforce_plus_plus (batch-level whitening)
  DAPO          grpo + loss.clip_high=0.28 + loss.aggregation=token_mean + rollout.dynamic_sampling=true
                + reward.overlong_buffer
  GSPO / CISPO  loss.policy_loss=gspo | cispo

`algorithm=NAME` sets one of these (`aligner.algorithms.rl_config.ALGORITHMS`) under the keys the user sets.

The estimators are in `aligner.rl.advantages`, the losses and their aggregation in
`aligner.rl.policy_losses`, the train/inference mismatch and its correction in `aligner.rl.mismatch`;
the trainer calls exactly those functions. Around this module: the config schema (`rl_config`), the
rollouts and their scores (`rl_rollouts.RolloutCollector`), the objective megatron's schedule runs on
each micro batch (`rl_objective`), the micro batches (`aligner.training.microbatch_plan`) and the
builders (`rl_build.build_rl_actor`). Here: the typed record of a step and `RLActor`, whose
`train_step` is one step:

  1. refit the generation engine (free for the native engine: it reads the training weights)
  2. generate k samples of each of the step's prompts through the router; right after each
     generation micro-batch, send the reward (and, with a critic, value) requests as futures;
     with dynamic sampling, groups whose samples all scored the same are dropped and more prompts
     are drawn until the batch is full (or the round cap is reached)
  3. actor logprobs, then reference logprobs with the reference weights swapped in from host memory;
     the mismatch between the engine's logprobs and the trainer's is measured (and optionally corrected);
     with one update per step and no KL, the update's forward gives the actor logprobs instead
  4. scores -> shaped scores -> the estimator's advantages (GAE with the critic's values, or a group/batch baseline)
  5. with a critic: send it its training batch (it trains while the actor does)
  6. policy epochs over minibatches through megatron's schedule (any TP/PP/DP), the micro batches laid
     out by the run's `MicroBatchPlanner`, handed the step's rollouts once
  7. KL controller, EMA, metrics, checkpoint (the critic saves at the same step)

With rollout.asynchronous (`rl_async.AsyncRollouts`) step 1 comes from a generation worker that is already
generating the next steps (step 2 scores its rollouts here, a critic's values from the critic as it is now), and
after step 6 the worker is sent the new weights.

Groups never straddle data-parallel ranks: rank r trains on rollouts [r*N/D, (r+1)*N/D) and the
config requires prompts_per_step to be a multiple of D, so group baselines need no communication.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from aligner import checkpointing
from aligner.algorithms.rl_async import AsyncRollouts
from aligner.algorithms.rl_config import RLActorConfig
from aligner.algorithms.rl_episodes import Environments, EpisodeCollector
from aligner.algorithms.rl_objective import PolicyObjective
from aligner.algorithms.rl_rollouts import RolloutCollector
from aligner.data.conversation import prompt_text
from aligner.data.loader import MicroBatchLoader
from aligner.generation.rollouts import PromptOrder, RolloutBatch
from aligner.models import packing
from aligner.models.weight_swap import named_parameters
from aligner.rl import advantages, masked, mismatch, shaping
from aligner.runtime.seeds import SAMPLER_SEED_RANGE, derive_seed
from aligner.training import schedule
from aligner.training.checkpointed import Checkpointed
from aligner.training.loop import Cadence, run_loop
from aligner.training.microbatch_plan import (
    DataParallel,
    MicroBatchPlanner,
    PolicyTargets,
    SequenceRows,
    StepPlan,
)


# ----------------------------------------------------------------------------- pure helpers
def tf_adam_epsilon(epsilon: float, beta2: float, step: int) -> float:
    """PyTorch-Adam epsilon that reproduces TF's Adam at optimizer step `step` (1-based).

    TF adds epsilon to sqrt(v) before the bias correction: lr * m_hat / (sqrt(v_hat) + eps / sqrt(1 - beta2^t)).
    """
    return epsilon / math.sqrt(1.0 - beta2 ** step)


def update_ema(ema: dict, params: dict, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * params, in place (host tensors)."""
    for name, value in params.items():
        ema[name].mul_(decay).add_(value.detach().to(ema[name].device, ema[name].dtype), alpha=1.0 - decay)


def _truncated(text: str, width: int) -> str:
    """A text on one console line: its repr (newlines visible), cut to `width` characters with ' ...'."""
    shown = repr(text)
    return shown if len(shown) <= width else shown[:width - 4] + " ..."


def reward_and_kl(metrics: dict) -> dict[str, float]:
    """The progress bar's postfix of an RL step."""
    shown = {"reward": metrics["reward_mean"]}
    if "kl" in metrics:
        shown["kl"] = metrics["kl"]
    return shown


# ----------------------------------------------------------------------------- records of a step
@dataclass
class Experience:
    """This rank's rollouts of a step with everything the update needs ([B, T] over response tokens)."""

    batch: RolloutBatch  # tokens, lengths, mask, engine logprobs, rows
    # [B, T] the rollout policy's (recomputed by the trainer, or the engine's); None: the update's own
    # forward gives them (`RLActorConfig.old_logprobs_in_update`)
    old_logprobs: Optional[torch.Tensor]
    advantages: torch.Tensor  # [B, T]
    importance_weights: Optional[torch.Tensor]  # [B, T] truncated IS weights (engine -> trainer), or None
    returns: Optional[torch.Tensor]  # [B, T] the critic's targets (gae), or None
    values: Optional[torch.Tensor]  # [B, T] the critic's values at rollout time, or None
    scores: torch.Tensor  # [B] shaped scores
    sequence_rewards: torch.Tensor  # [B] score - kl_coef * summed KL: what the estimator credited
    metrics: dict

    @property
    def targets(self) -> PolicyTargets:
        return PolicyTargets(self.advantages, self.old_logprobs, self.importance_weights)


# ----------------------------------------------------------------------------- the trainer
class RLActor(Checkpointed):
    """fit / train_step / validate / save / resume of the RL actor (collective over the job); its loop is
    `aligner.training.loop`'s, its checkpoint lifecycle `aligner.training.checkpointed`'s.

    critic: a critic client when the advantage estimator needs values (PPO's GAE), else None.
    """

    def __init__(self, cfg: RLActorConfig, *, policy, reference, engine, router, reward_source, critic, prompts,
                 validation_prompts, ptx_loader, tokenizer, model_cfg, metrics, ema=None, teacher=None,
                 environments: Optional[Environments] = None):
        from megatron.core import parallel_state as ps

        self.cfg = cfg
        self.policy = policy  # aligner.training.trainer.Trainer: chunks, optimizer, scheduler, train_step
        self.chunks = policy.chunks
        self.objective: PolicyObjective = policy.objective
        self.reference = reference  # HostWeights of the initial policy (LoRA: lora.BaseReference); None: no KL
        self.teacher = teacher  # (chunks, GPTConfig) of the teacher, the reference in on-policy distillation
        self.reward_names = list(getattr(reward_source, "names", ()))  # reward functions: metrics reward/<name>
        self.critic = critic
        self.prompts = prompts
        self.validation_prompts = validation_prompts
        self.tokenizer = tokenizer
        self.model_cfg = model_cfg
        self.metrics = metrics
        self.ema = ema  # HostWeights, or None
        self.advantage_settings = advantages.AdvantageSettings(
            gamma=cfg.advantage.gamma, lam=cfg.advantage.lam, whiten_advantages=cfg.advantage.whiten_advantages,
            whiten_rewards=cfg.advantage.whiten_rewards, group_std=cfg.advantage.group_std,
            std_eps=cfg.advantage.std_eps)
        if cfg.kl.adaptive:
            self.kl_controller = shaping.AdaptiveKLController(cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon)
        else:
            self.kl_controller = shaping.FixedKLController(cfg.kl.init_coef)
        self.order = PromptOrder(len(prompts), cfg.seed, cfg.data.shuffle)
        self.step = 0
        self.optimizer_steps = 0
        self.critic_warmup_done = 0
        self.pending_critic_train: Optional[Future] = None
        self.save_dir, self.keep_last = cfg.checkpoint.save_dir, cfg.checkpoint.keep_last
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        data_parallel = DataParallel(self.dp_group, self.dp_rank, self.dp_size)
        if environments is not None:  # multi-turn episodes (rollout.environment / rollout.tools)
            self.rollouts = EpisodeCollector(cfg, chunks=self.chunks, engine=engine, reward_source=reward_source,
                                             critic=critic, prompts=prompts, order=self.order, tokenizer=tokenizer,
                                             data_parallel=data_parallel, environments=environments)
        else:
            self.rollouts = RolloutCollector(cfg, chunks=self.chunks, engine=engine, router=router,
                                             reward_source=reward_source, critic=critic, prompts=prompts,
                                             order=self.order, tokenizer=tokenizer, data_parallel=data_parallel,
                                             model_parallel_group=ps.get_model_parallel_group())
        self.asynchronous: Optional[AsyncRollouts] = None
        if cfg.rollout.asynchronous.enabled:  # rollouts from a generation worker, overlapping training
            self.rollouts = self.asynchronous = AsyncRollouts(
                cfg, self.rollouts, chunks=self.chunks, model_cfg=model_cfg, tokenizer_dir=policy.tokenizer_dir,
                seed_of=self.seed_of, log=metrics.write)
        self.response_width = cfg.response_width
        self.temperature = cfg.generation.temperature if cfg.loss.scale_logits_by_temperature else 1.0
        self.planner = policy_planner(cfg, self.chunks[0], tokenizer.pad_id, self.objective, data_parallel, ptx_loader)

    def nothing_to_train(self) -> Optional[tuple[str, str]]:
        """("already at step N of trainer.max_steps=N", its key) when a resumed run has no step left, else None."""
        max_steps = self.cfg.trainer.max_steps
        if self.saved_at is None or self.step < max_steps:
            return None
        return f"already at step {self.step} of trainer.max_steps={max_steps}", "trainer.max_steps"

    # -- the loop
    def fit(self) -> None:
        validation = self.cfg.trainer.val_check_interval if self.validation_prompts is not None else 0
        try:
            with run_loop(self, Cadence.of(self.cfg.checkpoint, validation), shown=reward_and_kl) as loop:
                warmup_steps = self.cfg.critic.warmup_steps if self.critic is not None else 0
                while self.critic_warmup_done < warmup_steps and self.step == 0:
                    loop.check()  # a warm-up round's state resumes too
                    metrics = self.train_step(update_actor=False)
                    self.critic_warmup_done += 1
                    self.metrics.log(self.critic_warmup_done, metrics, prefix="critic_warmup")
                loop.run_until(self.cfg.trainer.max_steps, self.train_step)
        finally:
            self.rollouts.close()
            if hasattr(self.critic, "close"):
                self.critic.close()

    def count_step(self) -> None:
        self.step += 1

    def step_seed(self) -> int:
        """A fresh sampling seed per step (and per warm-up round), inside the samplers' 32-bit range."""
        return self.seed_of(self.step)

    def seed_of(self, step: int) -> int:
        """The sampling seed of `step` (after the critic's warm-up rounds done so far: all of them, once the
        policy's steps begin)."""
        return derive_seed(self.cfg.seed, step, self.critic_warmup_done, weights=(7_919, 1),
                           modulus=SAMPLER_SEED_RANGE)

    def train_step(self, update_actor: bool = True) -> dict[str, float]:
        """One step (update_actor=False: a critic warm-up round)."""
        start = time.perf_counter()
        timings: dict[str, float] = {}
        # A critic's warm-up round generates in the trainer (the worker starts with the policy's first step).
        rollouts = self.rollouts if update_actor or self.asynchronous is None else self.asynchronous.collector
        batch, rollout_metrics = rollouts.collect(self.step_seed(), timings, policy_version=self.step)
        plan = self.planner.plan_step(self.step, SequenceRows.of(batch))

        # Logprobs of the rollout policy (same forward as training: the ratio starts at exactly 1; or
        # none here, when the update's forward gives them) and of the reference policy (its weights
        # swapped in from host memory, then out again).
        old_logprobs = None
        if not self.cfg.old_logprobs_in_update:
            tick = time.perf_counter()
            old_logprobs = self.logprobs(plan) if self.cfg.loss.recompute_old_logprobs else batch.engine_logprobs
            timings["time_logprobs"] = time.perf_counter() - tick
        reference_logprobs = None
        if self.cfg.measures_kl:
            tick = time.perf_counter()
            if self.teacher is not None:  # the teacher is the reference (on-policy distillation)
                reference_logprobs = self.logprobs(plan, self.teacher)
            else:
                with self.reference.swapped_in(self.chunks):
                    reference_logprobs = self.logprobs(plan)
            timings["time_reference"] = time.perf_counter() - tick

        experience = self.make_experience(batch, old_logprobs, reference_logprobs)
        if self.critic is not None:
            tick = time.perf_counter()
            self.send_critic_train(experience)  # the critic trains while the actor does
            timings["time_critic_send"] = time.perf_counter() - tick

        metrics = {**rollout_metrics, **experience.metrics}
        if update_actor:
            tick = time.perf_counter()
            metrics.update(self.update_policy(experience, plan))
            timings["time_train"] = time.perf_counter() - tick
            if self.ema is not None:
                update_ema(self.ema.tensors, dict(named_parameters(self.chunks)), self.cfg.ema.decay)
            if self.cfg.measures_kl:
                self.kl_controller.update(metrics["kl"], self.cfg.rollouts_per_step)
            if self.asynchronous is not None:  # the generation worker gets the new weights
                self.asynchronous.after_update(self.step + 1, timings)
        metrics["kl_coef"] = self.kl_controller.value
        if self.critic is not None:
            tick = time.perf_counter()
            metrics.update(self._finish_critic_train())
            timings["time_critic_wait"] = time.perf_counter() - tick
        timings["step_time"] = time.perf_counter() - start
        metrics.update(timings)
        # Where the step's time went, as shares of it (the critic's training overlaps the actor's).
        metrics.update({f"share_{key.removeprefix('time_')}": value / timings["step_time"]
                        for key, value in timings.items() if key.startswith("time_")})
        # (asynchronous: the worker's own generation time, which the collector measured)
        metrics.setdefault("rollout_tokens_per_second",
                           rollout_metrics["generated_tokens"] / max(timings["time_generation"], 1e-9))
        if self._should_log_samples():
            self.log_samples(batch)
        return metrics

    # -- 3: logprobs
    def logprobs(self, plan: StepPlan, teacher=None) -> torch.Tensor:
        """This rank's rollouts' logprobs [B, T] under the policy (or the `teacher`: its chunks and config),
        laid out as the step's first epoch trains them (`StepPlan.logprobs`)."""
        chunks, model_cfg = (self.chunks, self.model_cfg) if teacher is None else teacher
        return plan.logprobs(chunks, model_cfg.vocab_size, self.temperature, self.response_width)

    # -- 4: scores -> shaped scores -> advantages
    def shaped_scores(self, batch: RolloutBatch) -> torch.Tensor:
        reward = self.cfg.reward
        scores = batch.scores()
        if reward.missing_stop_penalty is not None:
            scores = shaping.apply_missing_stop_penalty(scores, batch.ended_with_stop, reward.missing_stop_penalty)
        if reward.overlong_buffer is not None:
            scores = scores + shaping.overlong_penalty(batch.response_lengths, self.cfg.generation.max_new_tokens,
                                                 reward.overlong_buffer, reward.overlong_penalty)
        if reward.normalization_mean is not None:
            scores = shaping.normalize_scores(scores, reward.normalization_mean, reward.normalization_std)
        if reward.clip is not None:
            scores = shaping.clip_scores(scores, reward.clip)
        return scores

    def make_experience(self, batch: RolloutBatch, old_logprobs: Optional[torch.Tensor],
                        reference_logprobs: Optional[torch.Tensor]) -> Experience:
        """reference_logprobs None: no KL penalty (a fixed coefficient of 0), and no KL metric.
        old_logprobs None: the update's forward gives them, and measures the mismatch."""
        cfg, mask, group = self.cfg, batch.mask, self.dp_group
        k = cfg.rollout.samples_per_prompt
        # Group estimators need this rank's rows to be whole groups, in order.
        assert len(batch.indices) % k == 0 and batch.indices[0] % k == 0, batch.indices
        raw_scores = batch.scores()
        scores = self.shaped_scores(batch)
        if reference_logprobs is None:
            kl = torch.zeros(mask.shape)
        else:
            kl = shaping.kl_penalty(old_logprobs, reference_logprobs, cfg.kl.estimator, mask)  # [B, T]
        values = batch.values() if self.critic is not None else None
        estimated = advantages.compute_advantages(cfg.advantage.estimator, advantages.AdvantageInputs(
            scores=scores, kl=kl, kl_coef=self.kl_controller.value, mask=mask, group_size=k, values=values,
            group=group), self.advantage_settings)

        # Sequence-level statistics over the global batch. A group whose k scores are all equal
        # teaches a group estimator nothing: their fraction says how much of the step was useful.
        lengths = batch.response_lengths.float()
        uniform_groups = (~advantages.informative_groups(raw_scores, k)).double().sum() if k > 1 else torch.zeros((),
                                                                                                       dtype=torch.float64)
        replaced = torch.tensor([float(row.score_replaced) for row in batch.rows])
        # Each reward function's own (unweighted) scores, summed over the batch with the rest
        parts = torch.tensor([[row.score_parts[name] for name in self.reward_names] for row in batch.rows],
                             dtype=torch.float64).reshape(len(batch.rows), len(self.reward_names)).sum(0)
        sums = torch.cat([torch.stack([raw_scores, raw_scores.pow(2), kl.sum(dim=1), lengths,
                                       batch.ended_with_stop.float(), torch.ones_like(lengths),
                                       estimated.sequence_rewards.float(), replaced], dim=1).double().sum(0),
                          uniform_groups.reshape(1), parts])
        dist.all_reduce(sums, group=group)
        total, total_sq, kl_sum, length_sum, stopped, count, reward_sum, replaced_sum, uniform = sums[:9].tolist()
        mean = total / count
        metrics = {
            "reward_mean": mean, "reward_std": math.sqrt(max(total_sq / count - mean * mean, 0.0)),
            "response_length": length_sum / count, "stopped_fraction": stopped / count,
            "penalized_reward_mean": reward_sum / count,
        }
        metrics.update({f"reward/{name}": part / count for name, part in zip(self.reward_names, sums[9:].tolist())})
        if cfg.reward.on_invalid == "replace":  # the step's rollouts whose invalid score was replaced
            metrics["invalid_rewards"] = replaced_sum
        if reference_logprobs is not None:
            metrics["kl"] = kl_sum / count
        if k > 1:
            metrics["uniform_group_fraction"] = uniform / (count / k)
        if values is not None:
            metrics.update({
                "values_mean": float(masked.masked_mean(values, mask, group=group)),
                "returns_mean": float(masked.masked_mean(estimated.returns, mask, group=group)),
                "explained_variance": float(masked.explained_variance(values, estimated.returns, mask, group=group)),
            })
        weights = None
        if cfg.loss.recompute_old_logprobs and old_logprobs is not None:  # the engine's against the trainer's
            metrics.update(mismatch.mismatch_metrics(old_logprobs, batch.engine_logprobs, mask, group=group))
            if cfg.loss.importance_sampling != "none":
                weights = mismatch.truncated_importance_weights(old_logprobs, batch.engine_logprobs, mask,
                                                                cfg.loss.importance_sampling,
                                                                cfg.loss.importance_sampling_cap)
                metrics.update(mismatch.weight_metrics(weights, mask, cfg.loss.importance_sampling_cap, group=group))
        versions = [row.policy_version for row in batch.rows if row.policy_version is not None]
        if versions:  # a generation worker's rollouts (every rank's, or none: a critic's warm-up round's)
            staleness = torch.tensor([float(self.step - version) for version in versions], dtype=torch.float64)
            totals = torch.stack([staleness.sum(), torch.tensor(float(len(staleness)), dtype=torch.float64)])
            largest = staleness.max()
            dist.all_reduce(totals, group=group)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
            metrics["async/staleness_mean"] = float(totals[0] / totals[1])
            metrics["async/staleness_max"] = float(largest)
        fixed = {b: row.fixed_advantage for b, row in enumerate(batch.rows) if row.fixed_advantage is not None}
        if cfg.rollout.episodes and cfg.rollout.on_bad_call == "fixed_advantage":  # the same on every rank
            count = torch.tensor([float(len(fixed))])
            dist.all_reduce(count, group=group)
            metrics["fixed_advantage_rows"] = float(count.item())
        return Experience(batch=batch, old_logprobs=old_logprobs,
                          advantages=advantages.with_fixed_rows(estimated.advantages, mask, fixed),
                          importance_weights=weights, returns=estimated.returns, values=values, scores=scores,
                          sequence_rewards=estimated.sequence_rewards, metrics=metrics)

    # -- 5: the critic trains on this step's returns (asynchronously)
    def send_critic_train(self, experience: Experience) -> None:
        """Gather the global batch to rank 0, which sends one critic_train request and keeps the future."""
        from megatron.core import parallel_state as ps

        if ps.get_tensor_model_parallel_rank() != 0 or ps.get_pipeline_model_parallel_rank() != 0:
            return
        batch = experience.batch
        part = {"sequences": [row.prompt + row.response.tolist() for row in batch.rows],
                "prompt_lengths": batch.prompt_lengths.tolist(), "returns": experience.returns,
                "old_values": experience.values, "loss_mask": batch.mask}
        parts = [part]
        if self.dp_size > 1:
            parts = [None] * self.dp_size
            dist.all_gather_object(parts, part, group=self.dp_group)
        if dist.get_rank() == 0:
            self.pending_critic_train = self.critic.train_async(
                [s for p in parts for s in p["sequences"]], [n for p in parts for n in p["prompt_lengths"]],
                torch.cat([p["returns"] for p in parts]).numpy(), torch.cat([p["old_values"] for p in parts]).numpy(),
                loss_mask=torch.cat([p["loss_mask"] for p in parts]).numpy())

    def _finish_critic_train(self) -> dict[str, float]:
        """Wait for the pending critic_train request (rank 0); its metrics, on every rank."""
        metrics = {}
        if self.pending_critic_train is not None:
            metrics = {f"critic_{key.removeprefix('critic_')}": float(value)
                       for key, value in self.pending_critic_train.result().items()}
            self.pending_critic_train = None
        holder = [metrics]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    # -- 6: policy epochs over minibatches
    def update_policy(self, experience: Experience, plan: StepPlan) -> dict[str, float]:
        loss = self.cfg.loss
        rows, minibatch_rows = experience.batch.tokens.shape[0], self.planner.minibatch_rows
        if experience.old_logprobs is None and (loss.epochs, rows) != (1, minibatch_rows):
            raise RuntimeError(f"the update's forward stands for the rollout policy only in a single update: "
                               f"{loss.epochs} epoch(s) of {rows} rows in minibatches of {minibatch_rows}")
        minibatch_metrics = []
        for microbatches in plan.minibatches(experience.targets, loss.epochs):
            if loss.adam_epsilon_style == "tf":
                # TF's Adam epsilon, as the torch optimizer's, for this optimizer step.
                eps = tf_adam_epsilon(self.cfg.optim.eps, self.cfg.optim.betas[1], self.optimizer_steps + 1)
                for param_group in self.policy.optimizer.param_groups:
                    param_group["eps"] = eps
            minibatch_metrics.append(self.policy.train_step(microbatches))
            self.optimizer_steps += 1
        first = minibatch_metrics[0]
        # Timings are measured for the whole step instead; the ratio's extremes are taken below.
        per_step = ("step_time", "time_data", "time_forward_backward", "time_optimizer", "consumed_samples",
                    "tokens_per_second", "mfu", "ratio_max", "ratio_min", "tokens")
        averaged = {key: sum(m[key] for m in minibatch_metrics) / len(minibatch_metrics)
                    for key in minibatch_metrics[0] if key not in per_step}
        averaged["tokens"] = sum(m["tokens"] for m in minibatch_metrics)  # trained over the step's minibatches
        averaged["ratio_max"] = max(m["ratio_max"] for m in minibatch_metrics)
        averaged["ratio_min"] = min(m["ratio_min"] for m in minibatch_metrics)
        # The first minibatch runs on the rollout policy's own weights: its ratio must be exactly 1.
        averaged.update({"first_ratio_mean": first["ratio_mean"], "first_ratio_max": first["ratio_max"],
                         "first_ratio_min": first["ratio_min"], "first_approx_kl": first["approx_kl"]})
        return averaged

    # -- validation and samples
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Greedy rollouts on held-out prompts: mean reward and response length."""
        limit = self.cfg.trainer.limit_val_samples or len(self.validation_prompts)
        count = min(limit, len(self.validation_prompts)) // self.dp_size * self.dp_size
        timings: dict = {}
        local, _ = self.rollouts.generate_and_score(list(range(count)), timings, seed=0, greedy=True,
                                           prompts=self.validation_prompts, with_values=False)
        rows = list(local.values())
        sums = torch.tensor([sum(row.score for row in rows), float(sum(len(row.response) for row in rows)),
                             float(len(rows))], dtype=torch.float64)
        dist.all_reduce(sums, group=self.dp_group)
        return {"reward_mean": sums[0].item() / sums[2].item(), "response_length": sums[1].item() / sums[2].item(),
                "time": timings["time_generation"] + timings["time_scoring_wait"]}

    def _should_log_samples(self) -> bool:
        """At the step about to finish (self.step + 1): the first, every samples_interval-th, and the last."""
        interval, step = self.cfg.logging.samples_interval, self.step + 1
        return interval > 0 and (step == 1 or step % interval == 0 or step == self.cfg.trainer.max_steps)

    def log_samples(self, batch: RolloutBatch) -> None:
        """One rollout of each of this rank's first logging.num_samples prompts: on the console (truncated) and as
        a TensorBoard text table (whole)."""
        picks = list(range(0, len(batch.indices), self.cfg.rollout.samples_per_prompt))[:self.cfg.logging.num_samples]
        rows, count, width = [], len(picks), self.cfg.logging.sample_chars
        for number, b in enumerate(picks):
            prompt = prompt_text(batch.rows[b].given_prompt)
            response = self.rollouts.response_text(batch.rows[b].response)
            score = batch.rows[b].score
            rows.append(f"| {prompt!r} | {response!r} | {score:.3f} |")
            self.metrics.write(f"sample {number + 1}/{count} at step {self.step + 1}: reward={score:.4g}\n"
                               f"  prompt:   {_truncated(prompt, width)}\n  response: {_truncated(response, width)}")
        table = "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows)
        self.metrics.log_text(self.step + 1, "samples", table)

    # -- checkpoints (the lifecycle: aligner.training.checkpointed)
    def state_dict(self) -> dict:
        state = {"step": self.step, "optimizer_steps": self.optimizer_steps, "kl": self.kl_controller.state_dict(),
                 "prompts": self.order.state_dict(), "critic_warmup_done": self.critic_warmup_done,
                 "scheduler": self.policy.scheduler.state_dict(), schedule.STATE_KEY: self.policy.schedule_settings}
        if self.asynchronous is not None:  # the rollouts a resumed run cannot generate again
            state["asynchronous"] = self.asynchronous.state_dict(self.step)
        return state

    def load_state_dict(self, state: dict) -> dict[str, tuple]:
        """Continue from a checkpoint's trainer state under this run's schedule settings; returns
        {key: (checkpoint value, current value)} of the settings that changed."""
        self.step = state["step"]
        self.optimizer_steps = state["optimizer_steps"]
        self.kl_controller.load_state_dict(state["kl"])
        self.order.load_state_dict(state["prompts"])
        self.critic_warmup_done = state["critic_warmup_done"]
        if self.asynchronous is not None:
            self.asynchronous.load_state_dict(state.get("asynchronous", {}))
        return schedule.resume_schedule(self.policy.scheduler, self.policy.optimizer, state,
                                        self.policy.schedule_settings)

    @property
    def optimizer(self):
        return self.policy.optimizer  # the checkpoints' (aligner.training.checkpointed)

    @property
    def run_id(self) -> str:
        return self.policy.run_id

    def position(self) -> tuple[int, int]:
        return self.step, self.critic_warmup_done  # a warm-up round's state is a checkpoint of its own

    def checkpoint_fields(self) -> dict:
        return {"model_config": self.model_cfg.to_dict(), "tokenizer_dir": self.policy.tokenizer_dir,
                "save_rng": True, "extra_meta": self._extra_meta()}

    def _extra_meta(self) -> dict:
        return {key: value for key, value in self.policy.checkpoint_meta.items() if key != "model"}  # peft

    def before_save(self, step: int) -> str:
        """The critic's checkpoint of the same step, before the actor's: an actor checkpoint always has its
        critic's (a server lost between the two leaves the critic one checkpoint ahead, which `resume_from`
        undoes)."""
        note = ""
        if dist.get_rank() == 0 and self.critic is not None:
            note = f" (critic: {self.critic.save(step)})"
        dist.barrier()
        return note

    def resume_from(self, checkpoint_dir: Path) -> None:
        """The actor's checkpoint, and the critic server put back to its checkpoint of the same step (the server
        may have trained past it, or been restarted from a newer one)."""
        super().resume_from(checkpoint_dir)
        if self.critic is None:
            return
        if dist.get_rank() == 0:
            path = self.critic.restore(self.step)
            self.metrics.write(f"restored the critic server to its checkpoint of step {self.step} ({path})")
        dist.barrier()

    def after_save(self, path: Path) -> str:
        """The EMA weights' checkpoint (save_dir/ema)."""
        save_dir = Path(self.save_dir)
        if self.ema is not None:
            with self.ema.swapped_in(self.chunks):
                ema_path = checkpointing.save(checkpointing.step_dir(save_dir / "ema", self.step), self.chunks,
                                              model_config=self.model_cfg.to_dict(), extra_meta=self._extra_meta(),
                                              tokenizer_dir=self.policy.tokenizer_dir, run_id=self.run_id)
            checkpointing.remove_old_checkpoints(save_dir / "ema", self.keep_last, run_id=self.run_id, saved=ema_path)
        return ""


def policy_planner(cfg: RLActorConfig, model: torch.nn.Module, pad_id: int, objective: PolicyObjective,
                   data_parallel: DataParallel, ptx_loader: Optional[MicroBatchLoader] = None) -> MicroBatchPlanner:
    """The micro-batch planner of a run of `cfg` on `model` (a chunk: its attention decides whether packed
    rows can share prompts)."""
    return MicroBatchPlanner(
        cfg.packing, packs=packing.packs_here(cfg.packing),
        shares_prompts=packing.shares_prompts_here(cfg.packing, model),
        seq_length=cfg.sequence_length,
        micro_batch_size=cfg.trainer.micro_batch_size, minibatch_size=cfg.trainer.global_batch_size,
        samples_per_prompt=cfg.rollout.samples_per_prompt, seed=cfg.seed, pad_id=pad_id, data_parallel=data_parallel,
        normalizer=objective.normalizer, ptx_coef=objective.ptx_coef, ptx_loader=ptx_loader)
