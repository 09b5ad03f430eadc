"""PPO actor: rollout -> score -> advantages -> update, with the critic and reward model as servers.

Reads top to bottom: the config schema (every implementation detail of "The N Implementation
Details of RLHF with PPO" is a switch here, with its default named), the PPO objective the shared
trainer runs on each minibatch, and `PPOTrainer`, whose `train_step` is one PPO step:

  1. refit the generation engine (free for the native engine: it reads the training weights)
  2. generate the step's prompts through the router; right after each generation micro-batch,
     send the reward and critic-value requests as futures (scoring overlaps generation)
  3. actor logprobs, then reference logprobs with the reference weights swapped in from host memory
  4. scores -> per-token rewards (stop penalty, normalisation, clipping, KL penalty) -> GAE -> whitening
  5. send the critic its training batch (async: it trains while the actor does)
  6. PPO epochs over minibatches through megatron's schedule (any TP/PP/DP)
  7. KL controller, EMA, metrics, checkpoint (the critic saves at the same step)

The math is in `aligner.rl.ppo_math`, experience collection in `aligner.rl.rollouts`.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from aligner.clients.protocol import CRITIC_INFER_MODEL, REWARD_MODEL
from aligner.config import at_least
from aligner.rl import ppo_math as M
from aligner.runtime.seeds import SAMPLER_SEED_RANGE, derive_seed
from aligner.training.metrics import LoggingConfig
from aligner.training.setup import RunConfig


# ----------------------------------------------------------------------------- config schema
@dataclass
class ServerAddress:
    host: str = "127.0.0.1"
    port: int = 5555
    model_name: str = REWARD_MODEL
    timeout_s: float = 300.0  # one request, queueing included
    ready_timeout_s: float = 120.0  # how long the first request waits for the server to come up


@dataclass
class RewardSection:
    # server: a reward-model server | critic: the critic server in combined mode (rewards come back with
    # the values, one request) | function: a Python function
    source: str = "server"
    server: ServerAddress = field(default_factory=ServerAddress)
    function: Optional[str] = None  # "package.module:function": fn(prompt as in the data, response_text) -> float
    attribute_index: int = 0  # which output of a multi-attribute reward model is the reward


@dataclass
class CriticSection:
    # model_name: the server's inference model; its train/save models are named critic_train/critic_save
    server: ServerAddress = field(default_factory=lambda: ServerAddress(port=5560, model_name=CRITIC_INFER_MODEL))
    warmup_steps: int = at_least(0, 0)  # rollout rounds in which only the critic trains, before the actor's first update


@dataclass
class GenerationSection:
    engine: str = "native"  # native | trtllm (GPU clusters, optional extra)
    max_new_tokens: int = at_least(1, 32)
    min_new_tokens: int = at_least(0, 0)  # stop tokens are masked until this many tokens (truncation after a minimum length)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    fixed_length: bool = False  # keep sampling past the stop token (OpenAI's original setting)
    stop_strings: list = field(default_factory=list)
    micro_batch_size: int = at_least(1, 16)  # prompts per generate call and per router hand-out
    router: str = "dynamic"  # dynamic: a shared queue (slow ranks take fewer prompts) | static
    trtllm_work_dir: str = "results/trtllm"


@dataclass
class KLSection:
    estimator: str = "k1"  # k1 | abs | k2 | k3 (per-token KL penalty in the reward)
    adaptive: bool = False  # Ziegler et al.'s controller; false: fixed coefficient init_coef
    init_coef: float = 0.05
    target: float = 6.0  # adaptive: KL per sequence to steer towards
    horizon: float = 10000.0  # adaptive: samples over which the error is corrected


@dataclass
class PPOSection:
    prompts_per_step: int = at_least(1, 64)  # rollouts per step, over all data-parallel ranks
    epochs: int = at_least(1, 1)  # passes over each step's rollouts; minibatch = trainer.global_batch_size responses
    clip_ratio: float = 0.2
    entropy_coef: float = 0.0  # entropy bonus
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True  # masked, with the statistics of the global batch (across DP)
    whiten_rewards: bool = False  # per-token rewards scaled to unit variance (mean kept)
    reward_normalization_mean: Optional[float] = None  # scores -> (score - mean) / std; null: off
    reward_normalization_std: float = 1.0
    reward_clip: Optional[float] = None  # scores clamped to [-clip, clip]; null: off
    missing_stop_penalty: Optional[float] = None  # score of a response that never stopped; null: off
    loss_aggregation: str = "token_mean"  # token_mean | sequence_mean
    scale_logits_by_temperature: bool = True  # logprobs of logits / sampling temperature
    recompute_old_logprobs: bool = True  # false: use the engine's logprobs as the rollout policy's
    disable_dropout: bool = True
    adam_epsilon_style: str = "torch"  # torch | tf (epsilon outside the bias correction, as TF's Adam)


@dataclass
class PTXSection:
    data: Optional[str] = None  # SFT-format JSONL for the pretraining/next-token loss mixture; null: off
    coef: float = 0.0
    max_seq_length: int = 512


@dataclass
class EMASection:
    decay: Optional[float] = None  # e.g. 0.992; an EMA copy of the actor saved beside it; null: off


@dataclass
class PPODataSection:
    prompts: str = "???"  # JSONL, {"prompt": text or [{"role", "content"}, ...]} per line
    validation_prompts: Optional[str] = None
    max_prompt_length: int = at_least(1, 64)
    shuffle: bool = True
    chat_template: bool = True  # render prompts with the tokenizer's chat template (if it has one)


@dataclass
class PolicySection:
    init_from: str = "???"  # the starting policy (an SFT checkpoint); also the reference policy


@dataclass
class PPOLoggingConfig(LoggingConfig):
    samples_interval: int = at_least(0, 10, "0: off")  # steps between tables of sample generations (TensorBoard text)
    num_samples: int = at_least(0, 4)


@dataclass
class PPOConfig(RunConfig):
    """conf/gpt_ppo_actor.yaml. trainer.global_batch_size = responses per PPO minibatch (optimizer step);
    trainer.max_steps = PPO steps (rollout rounds); trainer.limit_val_samples = validation prompts."""

    name: str = "gpt_ppo_actor"
    model: PolicySection = field(default_factory=PolicySection)
    data: PPODataSection = field(default_factory=PPODataSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    kl: KLSection = field(default_factory=KLSection)
    reward: RewardSection = field(default_factory=RewardSection)
    critic: CriticSection = field(default_factory=CriticSection)
    ptx: PTXSection = field(default_factory=PTXSection)
    ema: EMASection = field(default_factory=EMASection)
    logging: PPOLoggingConfig = field(default_factory=PPOLoggingConfig)

    def validate(self, data_parallel_size: int) -> None:
        check_actor_config(self, "ppo", self.ppo.prompts_per_step, data_parallel_size,
                           reward_sources=("server", "critic", "function"))
        if self.ptx.data is not None and self.ptx.coef <= 0:
            raise ValueError("ptx.data is set but ptx.coef is not > 0")
        if self.ema.decay is not None and not 0 < self.ema.decay < 1:
            raise ValueError(f"ema.decay must lie in (0, 1), got {self.ema.decay}")


def check_actor_config(cfg, section_name: str, rollouts_per_step: int, data_parallel_size: int,
                       reward_sources: tuple) -> None:
    """Checks shared by the RL actors (PPO, REINFORCE): batch arithmetic over data-parallel ranks and
    the generation, KL, loss and reward settings. `cfg.ppo` is the actor's update section, named
    `section_name` in its yaml."""
    section, gen, trainer = cfg.ppo, cfg.generation, cfg.trainer
    if trainer.max_epochs is not None:
        raise ValueError("RL actors count rollout steps: set trainer.max_steps and leave trainer.max_epochs null")
    per_rank, remainder = divmod(rollouts_per_step, data_parallel_size)
    if remainder or per_rank == 0:
        raise ValueError(f"{section_name}.prompts_per_step: {rollouts_per_step} rollouts per step must be a positive "
                         f"multiple of the data-parallel size {data_parallel_size}")
    minibatch_per_rank, remainder = divmod(trainer.global_batch_size, data_parallel_size)
    if remainder or minibatch_per_rank == 0 or per_rank % minibatch_per_rank:
        raise ValueError(f"trainer.global_batch_size={trainer.global_batch_size} (responses per minibatch) must be a "
                         f"multiple of the data-parallel size {data_parallel_size} and divide the {rollouts_per_step} "
                         f"rollouts per step ({section_name}.prompts_per_step)")
    if minibatch_per_rank % trainer.micro_batch_size:
        raise ValueError(f"trainer.micro_batch_size={trainer.micro_batch_size} must divide the per-rank minibatch "
                         f"{minibatch_per_rank}")
    if cfg.kl.estimator not in M.KL_ESTIMATORS:
        raise ValueError(f"kl.estimator must be one of {M.KL_ESTIMATORS}, got {cfg.kl.estimator!r}")
    if section.loss_aggregation not in M.AGGREGATIONS:
        raise ValueError(f"{section_name}.loss_aggregation must be one of {M.AGGREGATIONS}, "
                         f"got {section.loss_aggregation!r}")
    if section.adam_epsilon_style not in ("torch", "tf"):
        raise ValueError(f"{section_name}.adam_epsilon_style must be torch or tf, got {section.adam_epsilon_style!r}")
    if not section.scale_logits_by_temperature and not section.recompute_old_logprobs:
        raise ValueError(f"the engine's logprobs are temperature-scaled: with {section_name}.scale_logits_by_temperature"
                         f"=false set {section_name}.recompute_old_logprobs=true")
    if gen.temperature <= 0:
        raise ValueError("the actor samples its rollouts: generation.temperature must be > 0")
    if cfg.reward.source not in reward_sources:
        raise ValueError(f"reward.source must be one of {', '.join(reward_sources)}, got {cfg.reward.source!r}")
    if cfg.reward.source == "function" and not cfg.reward.function:
        raise ValueError("reward.source=function needs reward.function='package.module:function'")
    if gen.engine not in ("native", "trtllm"):
        raise ValueError(f"generation.engine must be native or trtllm, got {gen.engine!r}")
    if gen.router not in ("dynamic", "static"):
        raise ValueError(f"generation.router must be dynamic or static, got {gen.router!r}")


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


# ----------------------------------------------------------------------------- the objective
class PPOObjective:
    """Loss of one micro batch: clipped surrogate - entropy bonus (+ the PTX next-token loss).

    Megatron divides the summed loss by the summed counts of the whole minibatch. Every micro batch
    returns count 1 and its loss pre-divided by the global normaliser of its kind (response
    tokens or responses for PPO, label tokens for PTX), times the number of micro batches: so the
    minibatch loss is exactly sum(PPO terms) / N_ppo + coef * sum(PTX terms) / N_ptx at any layout.
    """

    def __init__(self, vocab_size: int, temperature: float, clip_ratio: float, entropy_coef: float,
                 aggregation: str, ptx_coef: float):
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.clip_ratio = clip_ratio
        self.entropy_coef = entropy_coef
        self.aggregation = aggregation
        self.ptx_coef = ptx_coef
        self.normalizers = {"ppo": 1.0, "ptx": 1.0, "microbatches": 1.0}  # set per minibatch

    def forward(self, model, batch):
        return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))

    def loss(self, batch, logits):
        scale = self.normalizers["microbatches"]
        one = torch.tensor(1, dtype=torch.int)
        if batch["kind"] == "ptx":
            from aligner.algorithms.sft import response_token_loss

            loss_sum, tokens = response_token_loss(logits, batch["labels"], batch["loss_mask"], self.vocab_size)
            scaled = loss_sum * (scale * self.ptx_coef / self.normalizers["ptx"])
            return scaled, one, {"ptx_loss_sum": loss_sum.detach(), "ptx_tokens": tokens.detach().float()}
        from megatron.core import parallel_state as ps

        from aligner.generation.logprobs import response_columns, response_logprobs
        from aligner.models.gpt import mask_padded_vocab

        mask = batch["mask"]
        width = mask.shape[1]
        logprobs = response_logprobs(logits, batch["tokens"], batch["prompt_lengths"], batch["response_lengths"],
                                     vocab_size=self.vocab_size, temperature=self.temperature, response_width=width)
        per_token, ratio, clipped = M.clipped_surrogate(logprobs, batch["old_logprobs"], batch["advantages"],
                                                        self.clip_ratio)
        # Entropy of the sampling distribution at each response position (vocab-parallel, never gathered).
        columns = response_columns(batch["prompt_lengths"].to(mask.device), width, logits.shape[1] - 1)
        response_logits = logits.gather(1, columns.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        response_logits = mask_padded_vocab(response_logits.float(), self.vocab_size) / self.temperature
        group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        with torch.set_grad_enabled(self.entropy_coef != 0 and torch.is_grad_enabled()):
            entropy = M.entropy_from_logits(response_logits, mask, group=group)
        policy_sum, count = M.aggregate_loss(per_token, mask, self.aggregation)
        entropy_sum, _ = M.aggregate_loss(entropy, mask, self.aggregation)
        objective_sum = policy_sum - self.entropy_coef * entropy_sum
        scaled = objective_sum * (scale / self.normalizers["ppo"])
        with torch.no_grad():
            log_ratio = M.zero_off_mask(logprobs - batch["old_logprobs"], mask)
            valid = mask.bool()
            report = {
                "policy_loss_sum": policy_sum.detach(), "count": count.detach().float(),
                "entropy_sum": entropy_sum.detach(), "tokens": valid.sum().float(),
                "clipped_tokens": (clipped & valid).sum().float(),
                "approx_kl_sum": (0.5 * log_ratio.pow(2))[valid].sum(),
                "ratio_sum": ratio.detach()[valid].sum(),
                "ratio_max": torch.where(valid, ratio.detach(), -math.inf).max(),
                "ratio_min": torch.where(valid, ratio.detach(), math.inf).min(),
            }
        return scaled, one, report

    def summarize(self, totals):
        tokens, count = max(totals.get("tokens", 0.0), 1.0), max(totals.get("count", 0.0), 1.0)
        metrics = {
            "policy_loss": totals["policy_loss_sum"] / count, "entropy": totals["entropy_sum"] / count,
            "clip_fraction": totals["clipped_tokens"] / tokens, "approx_kl": totals["approx_kl_sum"] / tokens,
            "ratio_mean": totals["ratio_sum"] / tokens, "ratio_max": totals["ratio_max"],
            "ratio_min": totals["ratio_min"],
        }
        if "ptx_tokens" in totals:
            metrics["ptx_loss"] = totals["ptx_loss_sum"] / max(totals["ptx_tokens"], 1.0)
        metrics["loss"] = metrics["policy_loss"] - self.entropy_coef * metrics["entropy"] + (
            self.ptx_coef * metrics.get("ptx_loss", 0.0))
        return metrics


# ----------------------------------------------------------------------------- the trainer
class PPOTrainer:
    """fit / train_step / validate / save / resume of the PPO actor (collective over the job)."""

    def __init__(self, cfg: PPOConfig, *, policy, reference, engine, router, reward_source, critic, prompts,
                 validation_prompts, ptx_loader, tokenizer, model_cfg, metrics, ema=None):
        from megatron.core import parallel_state as ps

        self.cfg = cfg
        self.policy = policy  # aligner.training.trainer.Trainer: chunks, optimizer, scheduler, train_step
        self.chunks = policy.chunks
        self.reference = reference  # HostWeights of the initial policy
        self.engine = engine
        self.router = router
        self.reward_source = reward_source
        self.critic = critic
        self.prompts = prompts
        self.validation_prompts = validation_prompts
        self.ptx_loader = ptx_loader
        self.tokenizer = tokenizer
        self.model_cfg = model_cfg
        self.metrics = metrics
        self.ema = ema  # HostWeights, or None
        self.objective: PPOObjective = policy.objective
        if cfg.kl.adaptive:
            self.kl_controller = M.AdaptiveKLController(cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon)
        else:
            self.kl_controller = M.FixedKLController(cfg.kl.init_coef)
        from aligner.rl.rollouts import PromptOrder

        self.order = PromptOrder(len(prompts), cfg.seed, cfg.data.shuffle)
        self.step = 0
        self.optimizer_steps = 0
        self.critic_warmup_done = 0
        self.pending_critic_train: Optional[Future] = None
        self.saved: Optional[tuple[int, int]] = None  # (step, critic warm-up rounds) of the newest checkpoint of this run
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.mp_group = ps.get_model_parallel_group()
        self.is_replica_leader = dist.get_rank(self.mp_group) == 0  # talks to the servers for its replica
        self.response_width = cfg.generation.max_new_tokens
        self.seq_length = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
        self.temperature = cfg.generation.temperature if cfg.ppo.scale_logits_by_temperature else 1.0
        self._ptx_batches = None

    # -- sampling settings
    def sampling(self, greedy: bool = False, seed: int = 0):
        from aligner.generation.engine import SamplingParams

        gen = self.cfg.generation
        return SamplingParams(max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
                              temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, greedy=greedy,
                              stop_strings=list(gen.stop_strings), fixed_length=gen.fixed_length, seed=seed)

    # -- the loop
    def fit(self) -> None:
        from aligner.runtime import stopping

        max_steps = self.cfg.trainer.max_steps
        try:
            with stopping.deferred(self.cfg.checkpoint.stop_grace_s) as stop:
                warmup_steps = self.cfg.critic.warmup_steps if self.critic is not None else 0
                while self.critic_warmup_done < warmup_steps and self.step == 0:
                    stop.check(self.step, self.save_unless_saved)  # a warm-up round's state resumes too
                    metrics = self.train_step(update_actor=False)
                    self.critic_warmup_done += 1
                    self.metrics.log(self.critic_warmup_done, metrics, prefix="critic_warmup")
                while self.step < max_steps:
                    stop.check(self.step, self.save_unless_saved)
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
                if self.cfg.checkpoint.save_at_end:
                    self.save_unless_saved()
                stop.check(self.step, self.save_unless_saved)
        finally:
            self.router.close()
            for client in (self.reward_source, self.critic):
                if hasattr(client, "close"):
                    client.close()

    def rollout_indices(self) -> list[int]:
        """The prompt indices this step generates, one rollout each."""
        return self.order.take(self.cfg.ppo.prompts_per_step)

    def step_seed(self) -> int:
        """A fresh sampling seed per step (and per warm-up round), inside the samplers' 32-bit range."""
        return derive_seed(self.cfg.seed, self.step, self.critic_warmup_done, weights=(7_919, 1),
                           modulus=SAMPLER_SEED_RANGE)

    def train_step(self, update_actor: bool = True) -> dict[str, float]:
        """One step (update_actor=False: a critic warm-up round). Without a critic (REINFORCE) the
        values are skipped and nothing is sent for critic training."""
        start = time.perf_counter()
        timings: dict[str, float] = {}
        indices = self.rollout_indices()
        has_critic = self.critic is not None
        batch, generated = self.make_experience(indices, timings, seed=self.step_seed(), with_values=has_critic)

        # Logprobs of the rollout policy (same forward as training: the ratio starts at exactly 1)
        # and of the reference policy (its weights swapped in from host memory, then out again).
        tick = time.perf_counter()
        old_logprobs = self.logprobs(batch) if self.cfg.ppo.recompute_old_logprobs else batch.engine_logprobs
        with self.reference.swapped_in(self.chunks):
            reference_logprobs = self.logprobs(batch)
        timings["time_logprobs"] = time.perf_counter() - tick

        experience = self.advantages(batch, old_logprobs, reference_logprobs)
        if has_critic:
            tick = time.perf_counter()
            self.send_critic_train(batch, experience)  # the critic trains while the actor does
            timings["time_critic_send"] = time.perf_counter() - tick

        metrics = dict(experience["metrics"])
        if update_actor:
            tick = time.perf_counter()
            metrics.update(self.update_policy(batch, old_logprobs, experience["advantages"]))
            timings["time_train"] = time.perf_counter() - tick
            if self.ema is not None:
                from aligner.models.weight_swap import named_parameters

                update_ema(self.ema.tensors, dict(named_parameters(self.chunks)), self.cfg.ema.decay)
            self.kl_controller.update(metrics["kl"], len(indices))
        metrics["kl_coef"] = self.kl_controller.value
        if has_critic:
            tick = time.perf_counter()
            metrics.update(self._finish_critic_train())
            timings["time_critic_wait"] = time.perf_counter() - tick
        timings["step_time"] = time.perf_counter() - start
        metrics.update(timings)
        metrics["rollout_tokens_per_second"] = generated / max(timings["time_generation"], 1e-9)
        if self._should_log_samples():
            self.log_samples(batch, experience)
        return metrics

    # -- 1-2: rollouts and their scores
    def make_experience(self, indices: list[int], timings: dict, *, seed: int, greedy: bool = False,
                        prompts=None, with_values: bool = True):
        """Generate the prompts `indices` through the router, score them; returns (this rank's RolloutBatch,
        response tokens generated over all ranks)."""
        from aligner.generation.router_client import rebalance_rollouts
        from aligner.rl.rollouts import RolloutBatch, collect_rollouts, full_sequences, values_at_response

        prompts = self.prompts if prompts is None else prompts
        step_prompts = [prompts.tokens[i] for i in indices]
        given_prompts = [prompts.prompts[i] for i in indices]  # as the data gave them, for reward functions
        pending = []  # (micro-batch indices, reward future, values future)

        def send_scoring(micro_indices, rollout):
            if not self.is_replica_leader:
                return
            sequences = full_sequences(rollout)
            responses = [self.response_text(rollout.response_tokens[row, :int(rollout.response_lengths[row])])
                         for row in range(len(micro_indices))]
            values = self.critic.infer_async(sequences) if (with_values or self.reward_source is None) else None
            rewards = None  # combined critic server: the rewards arrive with the values
            if self.reward_source is not None:
                rewards = self.reward_source.score_async(sequences, [given_prompts[i] for i in micro_indices],
                                                         responses)
            pending.append((micro_indices, rewards, values))

        tick = time.perf_counter()
        self.engine.refit(self.chunks)
        local = collect_rollouts(self.engine, self.router, step_prompts, self.sampling(greedy, seed), send_scoring)
        for position, row in local.items():
            row["given_prompt"] = given_prompts[position]
        if hasattr(self.engine, "free") and self.cfg.generation.engine != "native":
            self.engine.free()  # the KV cache of the native engine is small and kept for the next step
        timings["time_generation"] = time.perf_counter() - tick

        tick = time.perf_counter()
        for micro_indices, rewards, values in pending:
            inferred = values.result() if values is not None else None
            scores = rewards.result() if rewards is not None else inferred.rewards
            if scores is None:
                raise RuntimeError("reward.source=critic, but the critic server sent no rewards: start it in combined "
                                   "mode (combine_rm_and_critic=true reward_model_file=<reward-model checkpoint>)")
            value_rows = inferred.values if (inferred is not None and with_values) else None  # [rows, columns]
            for k, index in enumerate(micro_indices):
                row = local[index]
                row["score"] = float(scores[k])
                if value_rows is not None:
                    row["values"] = values_at_response(torch.as_tensor(value_rows[k], dtype=torch.float32),
                                                       len(row["prompt"]), len(row["response"]))
        timings["time_scoring_wait"] = time.perf_counter() - tick
        if dist.get_world_size(self.mp_group) > 1:  # the replica's other ranks get the scores too
            holder = [local]
            dist.broadcast_object_list(holder, src=dist.get_global_rank(self.mp_group, 0), group=self.mp_group)
            local = holder[0]
        generated = torch.tensor([float(sum(len(row["response"]) for row in local.values()))])
        dist.all_reduce(generated, group=self.dp_group)
        mine = rebalance_rollouts(local, len(indices), data_parallel_group=self.dp_group)
        batch = RolloutBatch.from_rows(mine, self.tokenizer.pad_id, seq_length=self.seq_length,
                                       response_width=self.response_width)
        return batch, float(generated.item())

    def response_text(self, response_tokens: torch.Tensor) -> str:
        """What reward functions and sample tables read; the tokens themselves go on unchanged."""
        ids = [t for t in response_tokens.tolist() if t != self.tokenizer.eos_id]
        return self.tokenizer.decode(ids)

    # -- 3: logprobs
    def logprobs(self, batch) -> torch.Tensor:
        from aligner.generation.logprobs import sequence_logprobs

        return sequence_logprobs(self.chunks, batch.tokens, batch.prompt_lengths, batch.response_lengths,
                                 vocab_size=self.model_cfg.vocab_size, temperature=self.temperature,
                                 response_width=self.response_width,
                                 micro_batch_size=self.cfg.trainer.micro_batch_size).cpu()

    # -- 4: scores -> rewards -> advantages
    def advantages(self, batch, old_logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> dict:
        ppo, mask, group = self.cfg.ppo, batch.mask, self.dp_group
        raw_scores = batch.row_tensor("score")
        scores = raw_scores
        if ppo.missing_stop_penalty is not None:
            scores = M.apply_missing_stop_penalty(scores, batch.ended_with_stop, ppo.missing_stop_penalty)
        if ppo.reward_normalization_mean is not None:
            scores = M.normalize_scores(scores, ppo.reward_normalization_mean, ppo.reward_normalization_std)
        if ppo.reward_clip is not None:
            scores = M.clip_scores(scores, ppo.reward_clip)
        kl = M.kl_penalty(old_logprobs, reference_logprobs, self.cfg.kl.estimator, mask)  # [B, T]
        rewards = M.token_rewards(scores, kl, mask, self.kl_controller.value)
        if ppo.whiten_rewards:
            rewards = M.masked_whiten(rewards, mask, shift_mean=False, group=group)
        values = batch.token_tensor("values") if "values" in batch.rows[0] else torch.zeros(mask.shape)
        advantages, returns = M.gae_advantages(rewards, values, mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = M.masked_whiten(advantages, mask, group=group)

        # Sequence-level statistics over the global batch.
        lengths = batch.response_lengths.float()
        per_sequence = torch.stack([raw_scores, raw_scores.pow(2), kl.sum(dim=1), lengths,
                                    batch.ended_with_stop.float(), torch.ones_like(lengths)], dim=1).double().sum(0)
        dist.all_reduce(per_sequence, group=group)
        total, total_sq, kl_sum, length_sum, stopped, count = per_sequence.tolist()
        mean = total / count
        metrics = {
            "reward_mean": mean, "reward_std": math.sqrt(max(total_sq / count - mean * mean, 0.0)),
            "kl": kl_sum / count, "response_length": length_sum / count, "stopped_fraction": stopped / count,
            "values_mean": float(M.masked_mean(values, mask, group=group)),
            "returns_mean": float(M.masked_mean(returns, mask, group=group)),
            "explained_variance": float(M.explained_variance(values, returns, mask, group=group)),
        }
        return {"advantages": advantages, "returns": returns, "values": values, "scores": scores, "metrics": metrics}

    # -- 5: the critic trains on this step's returns (asynchronously)
    def send_critic_train(self, batch, experience) -> None:
        """Gather the global batch to rank 0, which sends one critic_train request and keeps the future."""
        from megatron.core import parallel_state as ps

        if ps.get_tensor_model_parallel_rank() != 0 or ps.get_pipeline_model_parallel_rank() != 0:
            return
        part = {"sequences": [row["prompt"] + row["response"].tolist() for row in batch.rows],
                "prompt_lengths": batch.prompt_lengths.tolist(), "returns": experience["returns"],
                "old_values": experience["values"]}
        parts = [part]
        if self.dp_size > 1:
            parts = [None] * self.dp_size
            dist.all_gather_object(parts, part, group=self.dp_group)
        if dist.get_rank() == 0:
            self.pending_critic_train = self.critic.train_async(
                [s for p in parts for s in p["sequences"]], [n for p in parts for n in p["prompt_lengths"]],
                torch.cat([p["returns"] for p in parts]).numpy(), torch.cat([p["old_values"] for p in parts]).numpy())

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

    # -- 6: PPO epochs over minibatches
    def update_policy(self, batch, old_logprobs: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
        ppo, trainer = self.cfg.ppo, self.cfg.trainer
        rows = batch.tokens.shape[0]
        minibatch_rows = trainer.global_batch_size // self.dp_size
        micro = trainer.micro_batch_size
        positions = torch.arange(self.seq_length).unsqueeze(0).expand(micro, -1)
        minibatch_metrics, first = [], None
        for epoch in range(ppo.epochs):
            generator = torch.Generator().manual_seed(derive_seed(
                self.cfg.seed, self.step, epoch, self.dp_rank, weights=(131, 17, 1), seed_weight=7919))
            order = torch.randperm(rows, generator=generator)
            for start in range(0, rows, minibatch_rows):
                ids = order[start:start + minibatch_rows]
                microbatches = [{
                    "kind": "ppo", "tokens": batch.tokens[part], "position_ids": positions,
                    "prompt_lengths": batch.prompt_lengths[part], "response_lengths": batch.response_lengths[part],
                    "mask": batch.mask[part], "old_logprobs": old_logprobs[part], "advantages": advantages[part],
                } for part in ids.split(micro)]
                microbatches += self.ptx_microbatches()
                self._set_normalizers(microbatches)
                if ppo.adam_epsilon_style == "tf":
                    self._set_tf_epsilon()
                result = self.policy.train_step(microbatches)
                self.optimizer_steps += 1
                first = first or result
                minibatch_metrics.append(result)
        per_step = ("step_time", "time_forward_backward", "time_optimizer", "consumed_samples", "tokens_per_second",
                    "mfu", "ratio_max", "ratio_min")  # timings are measured for the whole step instead
        averaged = {key: sum(m[key] for m in minibatch_metrics) / len(minibatch_metrics)
                    for key in minibatch_metrics[0] if key not in per_step}
        averaged["ratio_max"] = max(m["ratio_max"] for m in minibatch_metrics)
        averaged["ratio_min"] = min(m["ratio_min"] for m in minibatch_metrics)
        # The first minibatch runs on the rollout policy's own weights: its ratio must be exactly 1.
        averaged.update({"first_ratio_mean": first["ratio_mean"], "first_ratio_max": first["ratio_max"],
                         "first_ratio_min": first["ratio_min"], "first_approx_kl": first["approx_kl"]})
        return averaged

    def ptx_microbatches(self) -> list[dict]:
        if self.ptx_loader is None:
            return []
        if self._ptx_batches is None:
            self._ptx_batches = self.ptx_loader.iterate(0)

        def pad(tensor, value):  # to the PPO sequence length: one length per pipeline schedule
            return torch.nn.functional.pad(tensor, (0, self.seq_length - tensor.shape[1]), value=value)

        padded = []
        for mb in next(self._ptx_batches):
            padded.append({"kind": "ptx", "tokens": pad(mb["tokens"], self.tokenizer.pad_id),
                           "labels": pad(mb["labels"], self.tokenizer.pad_id), "loss_mask": pad(mb["loss_mask"], 0.0),
                           "position_ids": pad(mb["position_ids"], 0), "attention_mask": None,
                           "lengths": mb["lengths"]})
        return padded

    def _set_normalizers(self, microbatches: list[dict]) -> None:
        ppo_count, ptx_count = 0.0, 0.0
        for mb in microbatches:
            if mb["kind"] == "ptx":
                ptx_count += float(mb["loss_mask"].sum())
            elif self.cfg.ppo.loss_aggregation == "token_mean":
                ppo_count += float(mb["mask"].sum())
            else:
                ppo_count += float((mb["response_lengths"] > 0).sum())
        totals = torch.tensor([ppo_count, ptx_count, float(len(microbatches))], dtype=torch.float64)
        dist.all_reduce(totals, group=self.dp_group)
        ppo_total, ptx_total, microbatch_total = totals.tolist()
        self.objective.normalizers = {"ppo": max(ppo_total, 1.0), "ptx": max(ptx_total, 1.0),
                                      "microbatches": microbatch_total}

    def _set_tf_epsilon(self) -> None:
        eps = tf_adam_epsilon(self.cfg.optim.eps, self.cfg.optim.betas[1], self.optimizer_steps + 1)
        for group in self.policy.optimizer.param_groups:
            group["eps"] = eps

    # -- validation and samples
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Greedy rollouts on held-out prompts: mean reward and response length."""
        limit = self.cfg.trainer.limit_val_samples or len(self.validation_prompts)
        count = min(limit, len(self.validation_prompts)) // self.dp_size * self.dp_size
        timings: dict = {}
        batch, _ = self.make_experience(list(range(count)), timings, seed=0, greedy=True,
                                        prompts=self.validation_prompts, with_values=False)
        sums = torch.tensor([float(batch.row_tensor("score").sum()), float(batch.response_lengths.sum()),
                             float(len(batch.indices))], dtype=torch.float64)
        dist.all_reduce(sums, group=self.dp_group)
        return {"reward_mean": sums[0].item() / sums[2].item(), "response_length": sums[1].item() / sums[2].item(),
                "time": timings["time_generation"] + timings["time_scoring_wait"]}

    def _should_log_samples(self) -> bool:
        interval = self.cfg.logging.samples_interval
        return interval > 0 and (self.step % interval == 0)

    def log_samples(self, batch, experience) -> None:
        from aligner.data.conversation import prompt_text

        rows = []
        for b in range(min(self.cfg.logging.num_samples, len(batch.indices))):
            prompt = prompt_text(batch.rows[b]["given_prompt"])
            response = self.response_text(batch.rows[b]["response"])
            rows.append(f"| {prompt!r} | {response!r} | {batch.rows[b]['score']:.3f} |")
        table = "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows)
        self.metrics.log_text(self.step + 1, "samples", table)

    # -- checkpoints
    def state_dict(self) -> dict:
        from aligner.training import schedule

        return {"step": self.step, "optimizer_steps": self.optimizer_steps, "kl": self.kl_controller.state_dict(),
                "prompts": self.order.state_dict(), "critic_warmup_done": self.critic_warmup_done,
                "scheduler": self.policy.scheduler.state_dict(), schedule.STATE_KEY: self.policy.schedule_settings}

    def load_state_dict(self, state: dict) -> dict[str, tuple]:
        """Continue from a checkpoint's trainer state under this run's schedule settings; returns
        {key: (checkpoint value, current value)} of the settings that changed."""
        from aligner.training import schedule

        self.step = state["step"]
        self.optimizer_steps = state["optimizer_steps"]
        self.kl_controller.load_state_dict(state["kl"])
        self.order.load_state_dict(state["prompts"])
        self.critic_warmup_done = state["critic_warmup_done"]
        return schedule.resume_schedule(self.policy.scheduler, self.policy.optimizer, state,
                                        self.policy.schedule_settings)

    def save(self) -> Path:
        from aligner import checkpointing

        save_dir = self.cfg.checkpoint.save_dir
        path = checkpointing.save(
            checkpointing.step_dir(save_dir, self.step), self.chunks, model_config=self.model_cfg.to_dict(),
            optimizer=self.policy.optimizer, trainer_state=self.state_dict(), tokenizer_dir=self.policy.tokenizer_dir,
            save_rng=True, run_id=self.policy.run_id,
        )
        if self.ema is not None:
            with self.ema.swapped_in(self.chunks):
                ema_path = checkpointing.save(checkpointing.step_dir(Path(save_dir) / "ema", self.step), self.chunks,
                                              model_config=self.model_cfg.to_dict(),
                                              tokenizer_dir=self.policy.tokenizer_dir, run_id=self.policy.run_id)
            checkpointing.remove_old_checkpoints(Path(save_dir) / "ema", self.cfg.checkpoint.keep_last,
                                                 run_id=self.policy.run_id, saved=ema_path)
        if dist.get_rank() == 0:
            critic_path = self.critic.save(self.step) if self.critic is not None else "none"  # REINFORCE has none
            self.metrics.write(f"saved checkpoint {path} (critic: {critic_path})")
        dist.barrier()
        checkpointing.remove_old_checkpoints(save_dir, self.cfg.checkpoint.keep_last, run_id=self.policy.run_id,
                                             saved=path)
        self.saved = (self.step, self.critic_warmup_done)
        return path

    def save_unless_saved(self) -> Path:
        """The checkpoint of the current step (and warm-up round): saved now unless this run already wrote it."""
        from aligner import checkpointing

        if self.saved == (self.step, self.critic_warmup_done):
            return checkpointing.step_dir(self.cfg.checkpoint.save_dir, self.step)
        return self.save()

    def resume_from(self, checkpoint_dir: Path) -> None:
        from aligner import checkpointing
        from aligner.training import schedule

        meta = checkpointing.load(checkpoint_dir, self.chunks, optimizer=self.policy.optimizer, load_rng=True)
        changes = self.load_state_dict(meta["trainer_state"])
        self.saved = (self.step, self.critic_warmup_done)
        if self.metrics.progress is not None:
            self.metrics.progress.update(self.step)
        self.metrics.log_resume(self.step, checkpoint_dir, changes)
        self.metrics.write(f"resumed from {checkpoint_dir} at step {self.step}")
        if changes:
            self.metrics.write(schedule.describe_changes(changes, self.step))


# ----------------------------------------------------------------------------- building a run
@dataclass
class ActorParts:
    """What every RL actor is built from (see `build_actor_parts`)."""

    policy: object  # aligner.training.trainer.Trainer: chunks, optimizer, scheduler, objective
    reference: object  # HostWeights of the starting policy
    engine: object
    router: object
    reward_source: object
    prompts: object
    validation_prompts: object
    tokenizer: object
    model_cfg: object
    metrics: object
    resume: Optional[Path]  # the checkpoint to resume from (loaded by the trainer)
    minibatches_per_step: int
    summary: str  # one line for the log


def build_actor_parts(cfg, rollouts_per_step: int, *, reward_source=None, ptx_coef: float = 0.0) -> ActorParts:
    """Runtime, policy + reference weights, prompts, engine, router, reward source, optimizer and schedule.

    cfg: a PPO-style config (`cfg.ppo` is the update section); reward_source None builds it from cfg.reward.
    """
    from aligner import checkpointing
    from aligner.models.gpt import num_parameters
    from aligner.models.weight_swap import HostWeights
    from aligner.rl.rollouts import PromptDataset
    from aligner.training import setup

    section = cfg.ppo
    overrides = {"hidden_dropout": 0.0, "attention_dropout": 0.0} if section.disable_dropout else None
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume, model_overrides=overrides,
    )
    cfg.validate(built.data_parallel_size)
    chunks, model_cfg, tokenizer = built.chunks, built.model_cfg, built.tokenizer
    # The reference policy is the starting policy, also when resuming (the chunks then hold random
    # init until the resume load, so the starting weights are loaded first, copied, then replaced).
    if built.resume_checkpoint is not None:
        checkpointing.load(cfg.model.init_from, chunks)
    reference = HostWeights.snapshot(chunks)

    prompts = PromptDataset(cfg.data.prompts, tokenizer, cfg.data.max_prompt_length, cfg.data.chat_template)
    validation = None
    if cfg.data.validation_prompts:
        validation = PromptDataset(cfg.data.validation_prompts, tokenizer, cfg.data.max_prompt_length,
                                   cfg.data.chat_template)
    engine, router = build_engine_and_router(cfg.generation, chunks, model_cfg, tokenizer, cfg.data.max_prompt_length)
    if reward_source is None and cfg.reward.source != "critic":
        reward_source = build_reward_source(cfg.reward)

    trainer_cfg = cfg.trainer
    minibatches_per_step = rollouts_per_step // trainer_cfg.global_batch_size
    objective = PPOObjective(model_cfg.vocab_size, cfg.generation.temperature if section.scale_logits_by_temperature
                             else 1.0, section.clip_ratio, section.entropy_coef, section.loss_aggregation, ptx_coef)
    # Steps are PPO steps; the LR schedule counts optimizer steps (epochs x minibatches per step).
    policy = setup.build_trainer(cfg, built, objective, total_steps=trainer_cfg.max_steps,
                                 optimizer_steps=trainer_cfg.max_steps * section.epochs * minibatches_per_step)
    metrics = policy.metrics
    summary = (f"{cfg.name}: {num_parameters(model_cfg) / 1e6:.2f}M parameters, layout "
               f"TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
               f"DP={built.data_parallel_size}; {len(prompts)} prompts ({prompts.too_long} longer than "
               f"{cfg.data.max_prompt_length} tokens skipped); reference policy {cfg.model.init_from} on host memory "
               f"({reference.num_bytes / 2**20:.1f} MiB)")
    return ActorParts(policy, reference, engine, router, reward_source, prompts, validation, tokenizer, model_cfg,
                      metrics, built.resume_checkpoint, minibatches_per_step, summary)


def build_ppo_trainer(cfg: PPOConfig, *, critic=None, reward_source=None) -> PPOTrainer:
    """The PPO actor: `build_actor_parts` plus the critic client, the PTX data and the EMA copy; resumed
    from the newest checkpoint in checkpoint.save_dir if there is one.

    critic / reward_source: objects with the client interfaces (`CriticClient`, `score_async`);
    None builds them from the config (tests pass in-process ones).
    """
    from aligner import checkpointing
    from aligner.models.weight_swap import HostWeights
    from aligner.training import setup

    parts = build_actor_parts(cfg, cfg.ppo.prompts_per_step, reward_source=reward_source,
                              ptx_coef=cfg.ptx.coef if cfg.ptx.data else 0.0)
    chunks, resume = parts.policy.chunks, parts.resume
    ema = None
    if cfg.ema.decay is not None:
        if resume is not None:
            ema_checkpoint = Path(cfg.checkpoint.save_dir) / "ema" / resume.name
            if not ema_checkpoint.exists():
                raise checkpointing.CheckpointError(f"resuming {resume} with ema.decay set, but its EMA copy "
                                                    f"{ema_checkpoint} is missing")
            checkpointing.load(ema_checkpoint, chunks)
        ema = HostWeights.snapshot(chunks)  # the starting policy, or the saved EMA when resuming
    seq_length = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
    ptx_loader = None
    if cfg.ptx.data is not None:
        from aligner.data.sft import SFTDataset

        if cfg.ptx.max_seq_length > seq_length + 1:
            raise ValueError(f"ptx.max_seq_length={cfg.ptx.max_seq_length} must be at most data.max_prompt_length + "
                             f"generation.max_new_tokens + 1 = {seq_length + 1}: PTX and PPO micro batches share one "
                             "sequence length in the pipeline schedule")
        ptx_set = SFTDataset(cfg.ptx.data, parts.tokenizer, cfg.ptx.max_seq_length,
                             use_template=cfg.data.chat_template)
        from megatron.core import parallel_state as ps

        ptx_loader = setup.build_loader(ptx_set, trainer_cfg=cfg.trainer,
                                        data_parallel_size=ps.get_data_parallel_world_size(), seed=cfg.seed,
                                        shuffle=True, pad_id=parts.tokenizer.pad_id, pad_to_multiple_of=1)
    if critic is None:
        critic = build_critic_client(cfg.critic)
    trainer = PPOTrainer(cfg, policy=parts.policy, reference=parts.reference, engine=parts.engine, router=parts.router,
                         reward_source=parts.reward_source, critic=critic, prompts=parts.prompts,
                         validation_prompts=parts.validation_prompts, ptx_loader=ptx_loader, tokenizer=parts.tokenizer,
                         model_cfg=parts.model_cfg, metrics=parts.metrics, ema=ema)
    if resume is not None:
        trainer.resume_from(resume)
    parts.metrics.write(f"{parts.summary}; {cfg.ppo.prompts_per_step} rollouts per step, {cfg.ppo.epochs} epoch(s) of "
                        f"{parts.minibatches_per_step} minibatch(es)")
    return trainer


def build_engine_and_router(gen: GenerationSection, chunks, model_cfg, tokenizer, max_prompt_length: int):
    """The generation engine on this replica and the router that hands it prompts (collective)."""
    from megatron.core import parallel_state as ps

    from aligner.generation.router_client import DynamicRouter, StaticRouter

    seq_length = max_prompt_length + gen.max_new_tokens
    if gen.engine == "native":
        from aligner.generation.native import NativeEngine

        engine = NativeEngine(chunks, model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                              max_batch_size=gen.micro_batch_size, max_sequence_length=seq_length,
                              decode=tokenizer.decode)
    else:
        from aligner.generation.trtllm import TensorRTLLMEngine

        engine = TensorRTLLMEngine(model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                                   work_dir=Path(gen.trtllm_work_dir) / f"replica_{ps.get_data_parallel_rank()}",
                                   max_batch_size=gen.micro_batch_size, max_input_len=max_prompt_length,
                                   max_sequence_length=seq_length)
    if gen.router == "dynamic":
        router = DynamicRouter(micro_batch_size=gen.micro_batch_size, data_parallel_group=ps.get_data_parallel_group(),
                               model_parallel_group=ps.get_model_parallel_group())
    else:
        router = StaticRouter(micro_batch_size=gen.micro_batch_size, data_parallel_group=ps.get_data_parallel_group())
    return engine, router


def build_reward_source(section: RewardSection):
    """What scores responses; None when the critic server sends the rewards with its values."""
    from aligner.rl.rollouts import RewardServerSource, RuleRewardSource

    if section.source == "critic":
        return None
    if section.source == "function":
        return RuleRewardSource(section.function)
    from aligner.clients.reward import RewardClient

    server = section.server
    return RewardServerSource(RewardClient(server.host, server.port, server.model_name, timeout_s=server.timeout_s,
                                           ready_timeout_s=server.ready_timeout_s), section.attribute_index)


def build_critic_client(section: CriticSection):
    from aligner.clients.critic import CriticClient

    server = section.server
    return CriticClient(server.host, server.port, infer_model=server.model_name, timeout_s=server.timeout_s,
                        ready_timeout_s=server.ready_timeout_s)
