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

`algorithm=NAME` sets one of these (`ALGORITHMS`, below) under the keys the user sets.

The estimators are in `aligner.rl.advantages`, the losses and their aggregation in
`aligner.rl.policy_losses`, the train/inference mismatch and its correction in `aligner.rl.mismatch`;
the trainer calls exactly those functions. Reads top to bottom: the config schema, the typed
records of a step, the objective megatron's schedule runs on each micro batch, and `RLActor`,
whose `train_step` is one step:

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
  6. policy epochs over minibatches through megatron's schedule (any TP/PP/DP)
  7. KL controller, EMA, metrics, checkpoint (the critic saves at the same step)

Groups never straddle data-parallel ranks: rank r trains on rollouts [r*N/D, (r+1)*N/D) and the
config requires prompts_per_step to be a multiple of D, so group baselines need no communication.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

import torch
import torch.distributed as dist

from aligner import checkpointing
from aligner.algorithms.sft import response_token_loss
from aligner.clients.critic import CriticClient
from aligner.clients.protocol import CRITIC_INFER_MODEL, REWARD_MODEL
from aligner.clients.reward import RewardClient
from aligner.config import ConfigError, at_least, describe_preset, one_of
from aligner.data.conversation import prompt_text
from aligner.data.records import Layouts
from aligner.data.sft import SFT_LAYOUTS, SFTDataset
from aligner.generation.engine import SamplingParams
from aligner.generation.logprobs import response_logprobs_and_entropy
from aligner.generation.native import NativeEngine
from aligner.generation.packed_logprobs import response_logprobs_and_entropy as packed_pass
from aligner.generation.packed_logprobs import sequence_logprobs
from aligner.generation.rollouts import (
    PROMPT_LAYOUTS,
    PromptDataset,
    PromptOrder,
    RolloutBatch,
    collect_rollouts,
    first_prompt_record,
    full_sequences,
    values_at_response,
)
from aligner.generation.router_client import DynamicRouter, StaticRouter, rebalance_rollouts
from aligner.generation.trtllm import TensorRTLLMEngine
from aligner.hf.sources import resolve_model_source
from aligner.models import lora, packing
from aligner.models.gpt import ACTIVATION_RECOMPUTE, GPTConfig, build_model_chunks, num_parameters
from aligner.models.packing import SharedPromptPackingSection, packed_forward, zero_loss
from aligner.models.weight_swap import HostWeights, named_parameters
from aligner.rl import advantages, masked, mismatch, policy_losses, ppo_math
from aligner.rl.rewards import RewardFunctionSettings, RewardServerSource, RuleRewardSource, ScoreCheck, wait_for
from aligner.runtime import stopping
from aligner.runtime.distributed import device
from aligner.runtime.seeds import SAMPLER_SEED_RANGE, derive_seed
from aligner.tokenizer import Tokenizer
from aligner.training import schedule, setup
from aligner.training.metrics import LoggingConfig, get_logger
from aligner.training.setup import RunConfig

# The settings that make each algorithm: `algorithm=NAME` on either RL entry point sets them (under the
# user's explicit keys, see aligner.config.load_config); README's table shows them. Each preset names every
# key that tells the algorithms apart, so it means the same whatever the config file set before it. ppo needs
# the critic server (train_gpt_ppo_actor.py / launch_ppo.py). DAPO's overlong shaping
# (reward.overlong_buffer) depends on generation.max_new_tokens and is left to the user.
_CLIPPED_TOKEN_MEAN = {"loss.policy_loss": "ppo_clip", "loss.clip_ratio": 0.2, "loss.clip_high": None,
                       "loss.aggregation": "token_mean", "rollout.dynamic_sampling": False}
ALGORITHMS: dict[str, dict[str, object]] = {
    "ppo": {"advantage.estimator": "gae", **_CLIPPED_TOKEN_MEAN},
    "rloo": {"advantage.estimator": "rloo", **_CLIPPED_TOKEN_MEAN},
    "grpo": {"advantage.estimator": "grpo", "advantage.group_std": True, **_CLIPPED_TOKEN_MEAN},
    "dr_grpo": {"advantage.estimator": "dr_grpo", **_CLIPPED_TOKEN_MEAN, "loss.aggregation": "constant_sum"},
    "reinforce_plus_plus": {"advantage.estimator": "reinforce_plus_plus", **_CLIPPED_TOKEN_MEAN},
    "dapo": {"advantage.estimator": "grpo", "advantage.group_std": True, **_CLIPPED_TOKEN_MEAN,
             "loss.clip_high": 0.28, "rollout.dynamic_sampling": True},
    "gspo": {"advantage.estimator": "grpo", "advantage.group_std": True, **_CLIPPED_TOKEN_MEAN,
             "loss.policy_loss": "gspo", "loss.clip_ratio": 3e-4, "loss.clip_high": 4e-4,
             "loss.aggregation": "sequence_mean_token_mean"},
    "cispo": {"advantage.estimator": "grpo", "advantage.group_std": True, **_CLIPPED_TOKEN_MEAN,
              "loss.policy_loss": "cispo", "loss.clip_ratio": 1.0, "loss.clip_high": 4.0},
}


# ----------------------------------------------------------------------------- config schema
@dataclass
class ServerAddress:
    host: str = "127.0.0.1"
    port: int = 5555
    model_name: str = REWARD_MODEL
    timeout_s: float = 300.0  # one request, queueing included
    ready_timeout_s: float = 120.0  # how long the first request waits for the server to come up


@dataclass
class RewardSection(RewardFunctionSettings):
    # server: a reward-model server | combined: the critic server in combined mode (rewards come back with
    # the values, one request) | function: Python functions (function / functions: RewardFunctionSettings'
    # keys). The score checks (timeout_s, max_abs, on_invalid, invalid_value) are RewardChecks'.
    source: str = one_of(("server", "combined", "function"), "server")
    server: ServerAddress = field(default_factory=ServerAddress)
    attribute_index: int = 0  # which output of a multi-attribute reward model is the reward
    # Score shaping, in this order:
    missing_stop_penalty: Optional[float] = None  # score of a response that never stopped; null: off
    normalization_mean: Optional[float] = None  # scores -> (score - mean) / std; null: off
    normalization_std: float = 1.0
    clip: Optional[float] = None  # scores clamped to [-clip, clip]; null: off
    overlong_buffer: Optional[int] = None  # DAPO: the last this many tokens before max_new_tokens cost up to
    overlong_penalty: float = 1.0  # ... this much, linearly (soft overlong punishment); null buffer: off

    def __post_init__(self):
        if self.source == "critic":  # the combined mode's old name on the actor's side
            print("deprecated: reward.source=critic is now reward.source=combined (the old name goes in the next "
                  "release)", file=sys.stderr)
            self.source = "combined"


@dataclass
class CriticSection:
    # model_name: the server's inference model; its train/save models are named critic_train/critic_save
    server: ServerAddress = field(default_factory=lambda: ServerAddress(port=5560, model_name=CRITIC_INFER_MODEL))
    # rollout rounds in which only the critic trains, before the actor's first update
    warmup_steps: int = at_least(0, 0)


@dataclass
class GenerationSection:
    engine: str = one_of(("native", "trtllm"), "native")  # trtllm: GPU clusters, optional extra
    max_new_tokens: int = at_least(1, 32)
    # stop tokens are masked until this many tokens (truncation after a minimum length)
    min_new_tokens: int = at_least(0, 0)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    fixed_length: bool = False  # keep sampling past the stop token (OpenAI's original setting)
    stop_strings: list = field(default_factory=list)
    micro_batch_size: int = at_least(1, 16)  # rollouts per router hand-out; the engine's cache rows (refilled)
    router: str = one_of(("dynamic", "static"), "dynamic")  # dynamic: a shared queue (slow ranks take fewer)
    # the dynamic router's queue: a TCP port global rank 0 listens on ($MASTER_ADDR, else 127.0.0.1)
    router_port: int = at_least(0, 0, "0: a free port")
    trtllm_work_dir: str = "results/trtllm"


@dataclass
class KLSection:
    estimator: str = one_of(ppo_math.KL_ESTIMATORS, "k1")  # per-token KL penalty in the reward
    adaptive: bool = False  # Ziegler et al.'s controller; false: fixed coefficient init_coef
    init_coef: float = 0.05
    target: float = 6.0  # adaptive: KL per sequence to steer towards
    horizon: float = 10000.0  # adaptive: samples over which the error is corrected


@dataclass
class RolloutSection:
    prompts_per_step: int = at_least(1, 64)  # distinct prompts per step over all data-parallel ranks
    samples_per_prompt: int = at_least(1, 1)  # k samples of each prompt (a group); rollouts per step = prompts x k
    dynamic_sampling: bool = False  # DAPO: drop groups whose k scores are equal, draw more prompts until full
    max_sampling_rounds: int = at_least(1, 4)  # dynamic sampling: generation rounds per step at most


@dataclass
class AdvantageSection:
    estimator: str = one_of(tuple(advantages.ADVANTAGE_ESTIMATORS), "gae")
    gamma: float = 1.0  # gae, reinforce_plus_plus
    lam: float = 0.95  # gae
    whiten_advantages: bool = True  # gae: masked, with the statistics of the global batch (across DP)
    whiten_rewards: bool = False  # gae: per-token rewards scaled to unit variance (mean kept)
    group_std: bool = True  # grpo: divide the scores (not the KL penalty) by the group's score std
    std_eps: float = 1.0e-6


@dataclass
class LossSection:
    policy_loss: str = one_of(tuple(policy_losses.POLICY_LOSSES), "ppo_clip")
    clip_ratio: float = 0.2  # ratio clip: [1 - clip_ratio, 1 + clip_high]
    clip_high: Optional[float] = None  # upper clip (DAPO's clip-higher, e.g. 0.28); null: clip_ratio
    aggregation: str = one_of(policy_losses.AGGREGATIONS, "token_mean")
    constant_normalizer: Optional[int] = None  # constant_sum: tokens per response it divides by; null: max_new_tokens
    entropy_coef: float = 0.0  # entropy bonus
    epochs: int = at_least(1, 1)  # passes over each step's rollouts; minibatch = trainer.global_batch_size responses
    importance_sampling: str = one_of(("none",) + mismatch.TIS_LEVELS, "none")  # truncated IS against the engine
    importance_sampling_cap: float = 2.0
    scale_logits_by_temperature: bool = True  # logprobs of logits / sampling temperature
    recompute_old_logprobs: bool = True  # false: use the engine's logprobs as the rollout policy's
    # With one update per step (one epoch, one minibatch) and nothing that reads the rollout policy's
    # logprobs before it (no KL, no importance sampling), the update's own forward runs on the rollout
    # weights: its logprobs, detached, are the recomputed ones, so no separate pass (TRL does the same).
    old_logprobs_from_update: bool = True
    disable_dropout: bool = True
    adam_epsilon_style: str = one_of(("torch", "tf"), "torch")  # tf: epsilon outside the bias correction


@dataclass
class PTXSection:
    data: Optional[str] = None  # SFT data (any format) for the pretraining/next-token loss mixture; null: off
    coef: float = 0.0
    max_seq_length: int = 512


@dataclass
class EMASection:
    decay: Optional[float] = None  # e.g. 0.992; an EMA copy of the actor saved beside it; null: off


@dataclass
class RLDataSection:
    prompts: str = "???"  # JSONL/Parquet/Arrow/datasets dir, {"prompt": text or [{"role", "content"}, ...]} per record
    validation_prompts: Optional[str] = None
    max_prompt_length: int = at_least(1, 64)
    shuffle: bool = True
    chat_template: bool = True  # render prompts with the tokenizer's chat template (if it has one)

    def sources(self) -> list[tuple[str, Optional[str]]]:
        return [("data.prompts", self.prompts), ("data.validation_prompts", self.validation_prompts)]


@dataclass
class PolicySection:
    init_from: str = "???"  # the starting policy (an SFT checkpoint); also the reference policy
    activation_recompute: str = one_of(ACTIVATION_RECOMPUTE, "none")  # as setup.ModelSection's


@dataclass
class TeacherSection:
    """On-policy distillation: a teacher model takes the reference policy's place (the KL penalty and metric
    are then the reverse KL to it). It may be larger than the policy or of another architecture; it must
    share the policy's tokenizer."""

    init_from: Optional[str] = None  # the teacher checkpoint (an adapter checkpoint loads onto its base); null: none


@dataclass
class RLLoggingConfig(LoggingConfig):
    # Sample completions (prompt, response, reward) on the console, truncated, and as a TensorBoard text table:
    # at the first step, every this many steps and the last step
    samples_interval: int = at_least(0, 10, "0: off")
    num_samples: int = at_least(0, 2)  # completions shown each time
    sample_chars: int = at_least(16, 160)  # the console shows at most this many characters of a prompt or response


def _renamed_update_keys(section: str) -> tuple:
    """The old `ppo.*` / `reinforce.*` keys and where they live now."""
    moved = {
        "prompts_per_step": "rollout.prompts_per_step", "samples_per_prompt": "rollout.samples_per_prompt",
        "epochs": "loss.epochs", "clip_ratio": "loss.clip_ratio", "entropy_coef": "loss.entropy_coef",
        "loss_aggregation": "loss.aggregation", "scale_logits_by_temperature": "loss.scale_logits_by_temperature",
        "recompute_old_logprobs": "loss.recompute_old_logprobs", "disable_dropout": "loss.disable_dropout",
        "adam_epsilon_style": "loss.adam_epsilon_style", "gamma": "advantage.gamma", "lam": "advantage.lam",
        "whiten_advantages": "advantage.whiten_advantages", "whiten_rewards": "advantage.whiten_rewards",
        "reward_normalization_mean": "reward.normalization_mean",
        "reward_normalization_std": "reward.normalization_std", "reward_clip": "reward.clip",
        "missing_stop_penalty": "reward.missing_stop_penalty", "baseline": "advantage.estimator",
        "normalize_by_group_std": "advantage.group_std", "std_eps": "advantage.std_eps",
    }
    return tuple((f"{section}.{old}", new) for old, new in moved.items())


@dataclass
class RLActorConfig(RunConfig):
    """conf/gpt_ppo_actor.yaml, conf/gpt_reinforce_actor.yaml. trainer.global_batch_size = responses per
    minibatch (optimizer step); trainer.max_steps = rollout rounds; trainer.limit_val_samples = validation prompts."""

    LR_METHOD = "rl"  # its row in aligner/training/lr_ranges.py
    RENAMED_KEYS: ClassVar[tuple] = _renamed_update_keys("ppo") + _renamed_update_keys("reinforce")
    PRESETS: ClassVar[tuple] = ("algorithm", ALGORITHMS)

    name: str = "gpt_rl_actor"
    algorithm: Optional[str] = None  # a preset of ALGORITHMS (ppo | rloo | grpo | ...); null: the file's settings
    model: PolicySection = field(default_factory=PolicySection)
    data: RLDataSection = field(default_factory=RLDataSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    advantage: AdvantageSection = field(default_factory=AdvantageSection)
    loss: LossSection = field(default_factory=LossSection)
    kl: KLSection = field(default_factory=KLSection)
    reward: RewardSection = field(default_factory=RewardSection)
    critic: CriticSection = field(default_factory=CriticSection)
    ptx: PTXSection = field(default_factory=PTXSection)
    ema: EMASection = field(default_factory=EMASection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    packing: SharedPromptPackingSection = field(default_factory=SharedPromptPackingSection)
    logging: RLLoggingConfig = field(default_factory=RLLoggingConfig)

    @property
    def rollouts_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt

    @property
    def uses_critic(self) -> bool:
        return advantages.ADVANTAGE_ESTIMATORS[self.advantage.estimator].needs_values

    @property
    def measures_kl(self) -> bool:
        """Whether a step runs the reference policy: not for a fixed KL coefficient of 0, whose penalty
        is 0 whatever the reference says (the pass would cost a forward over every rollout)."""
        return self.kl.adaptive or self.kl.init_coef != 0

    @property
    def old_logprobs_in_update(self) -> bool:
        """Whether the rollout policy's logprobs are taken from the update's forward (`LossSection`)."""
        loss = self.loss
        return (loss.recompute_old_logprobs and loss.old_logprobs_from_update and loss.disable_dropout
                and loss.epochs == 1 and self.trainer.global_batch_size == self.rollouts_per_step
                and not self.measures_kl and loss.importance_sampling == "none")

    @property
    def clip_high(self) -> float:
        return self.loss.clip_ratio if self.loss.clip_high is None else self.loss.clip_high

    @property
    def constant_normalizer(self) -> float:
        value = self.loss.constant_normalizer
        return float(self.generation.max_new_tokens if value is None else value)

    def data_layouts(self) -> Layouts:
        return PROMPT_LAYOUTS

    def data_sources(self) -> list[tuple[str, Optional[str], Optional[Layouts]]]:
        return super().data_sources() + [("ptx.data", self.ptx.data, SFT_LAYOUTS)]

    def sequence_lengths(self) -> list[tuple[int, str]]:
        # A rollout: a prompt + its response (the PTX rows are at most this long: `build_ptx_loader`).
        prompt, new = self.data.max_prompt_length, self.generation.max_new_tokens
        return [(prompt + new, f"data.max_prompt_length + generation.max_new_tokens = {prompt} + {new} = "
                               f"{prompt + new}")]

    def validate(self, data_parallel_size: int) -> None:
        """Checks across sections (single values are checked when the config loads)."""
        rollout, loss, gen, trainer = self.rollout, self.loss, self.generation, self.trainer
        estimator = advantages.ADVANTAGE_ESTIMATORS[self.advantage.estimator]
        k = rollout.samples_per_prompt
        if k < estimator.min_group_size:
            raise ConfigError(f"rollout.samples_per_prompt={k}: advantage.estimator={estimator.name} needs at least "
                              f"{estimator.min_group_size} samples per prompt")
        if self.teacher.init_from is not None and not self.measures_kl:
            raise ConfigError("teacher.init_from is read through the KL term: set a KL coefficient > 0 (kl.init_coef)")
        if estimator.name == "on_policy_distillation" and (self.teacher.init_from is None or not self.measures_kl):
            raise ConfigError("advantage.estimator=on_policy_distillation learns from the reverse KL to a teacher: set "
                              "teacher.init_from and a KL coefficient > 0 (kl.init_coef)")
        if rollout.dynamic_sampling and k < 2:
            raise ConfigError("rollout.dynamic_sampling drops groups whose samples scored alike: it needs "
                              "rollout.samples_per_prompt >= 2")
        if trainer.max_epochs is not None:
            raise ConfigError("RL actors count rollout steps: set trainer.max_steps and leave trainer.max_epochs null")
        if rollout.prompts_per_step % data_parallel_size:
            raise ConfigError(f"rollout.prompts_per_step={rollout.prompts_per_step} must be a multiple of the "
                              f"data-parallel size {data_parallel_size} (each rank trains on whole prompt groups)")
        per_rank = self.rollouts_per_step // data_parallel_size
        minibatch_per_rank, remainder = divmod(trainer.global_batch_size, data_parallel_size)
        if remainder or minibatch_per_rank == 0 or per_rank % minibatch_per_rank:
            raise ConfigError(f"trainer.global_batch_size={trainer.global_batch_size} (responses per minibatch) "
                              f"must be a multiple of the data-parallel size {data_parallel_size} and divide the "
                              f"{self.rollouts_per_step} rollouts per step (rollout.prompts_per_step x "
                              "rollout.samples_per_prompt)")
        if minibatch_per_rank % trainer.micro_batch_size:
            raise ConfigError(f"trainer.micro_batch_size={trainer.micro_batch_size} must divide the per-rank "
                              f"minibatch {minibatch_per_rank}")
        if not loss.clip_ratio > 0 or not self.clip_high > 0:
            raise ConfigError(f"loss.clip_ratio={loss.clip_ratio} and loss.clip_high={loss.clip_high} must be > 0")
        if not loss.scale_logits_by_temperature and not loss.recompute_old_logprobs:
            raise ConfigError("the engine's logprobs are temperature-scaled: "
                              "with loss.scale_logits_by_temperature=false set loss.recompute_old_logprobs=true")
        self.packing.check_layout(self.parallel.pipeline_model_parallel_size,
                                  self.data.max_prompt_length + gen.max_new_tokens,
                                  "data.max_prompt_length + generation.max_new_tokens",
                                  self.parallel.expert_model_parallel_size)
        if loss.importance_sampling != "none" and not loss.recompute_old_logprobs:
            raise ConfigError("loss.importance_sampling corrects the engine's logprobs towards the trainer's: it needs "
                              "loss.recompute_old_logprobs=true")
        if gen.temperature <= 0:
            raise ConfigError("the actor samples its rollouts: generation.temperature must be > 0")
        if self.reward.source == "function" and not self.reward.function_entries():
            raise ConfigError("reward.source=function needs reward.function='path/to/file.py:function' (or "
                              "'package.module:function', or a weighted list in reward.functions)")
        if self.reward.source == "combined" and not self.uses_critic:
            raise ConfigError(f"reward.source=combined takes the rewards from the critic server, but "
                              f"advantage.estimator={estimator.name} uses no critic: use reward.source=server")
        buffer = self.reward.overlong_buffer
        if buffer is not None and not 0 < buffer <= gen.max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer={buffer} must lie in 1..generation.max_new_tokens "
                              f"({gen.max_new_tokens})")
        if self.ptx.data is not None and self.ptx.coef <= 0:
            raise ConfigError("ptx.data is set but ptx.coef is not > 0")
        if self.ema.decay is not None and not 0 < self.ema.decay < 1:
            raise ConfigError(f"ema.decay must lie in (0, 1), got {self.ema.decay}")
        row_length, longest = self.packing.row_length, self.data.max_prompt_length + gen.max_new_tokens
        if row_length is not None and row_length < longest:
            raise ConfigError(f"packing.row_length={row_length} must hold the longest rollout: at least "
                              f"data.max_prompt_length + generation.max_new_tokens = {longest}")


@dataclass
class GroupRLActorConfig(RLActorConfig):
    """train_gpt_reinforce_actor.py's schema: its yaml and launch start no critic server, so algorithm=ppo is
    refused when the config loads (before its data files are read or anything is built)."""

    def check_fields(self) -> Optional[tuple[str, str]]:
        if self.algorithm == "ppo":
            return "algorithm", ("PPO trains a critic alongside the actor: use examples/nlp/gpt/train_gpt_ppo_actor.py "
                                 "(examples/nlp/gpt/launch_ppo.py starts the critic server with it)")
        return None


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


def group_indices(prompt_indices: list[int], samples_per_prompt: int) -> list[int]:
    """Each prompt samples_per_prompt times, adjacent: rollout j is a sample of prompt_indices[j // k]."""
    return [index for index in prompt_indices for _ in range(samples_per_prompt)]


def _truncated(text: str, width: int) -> str:
    """A text on one console line: its repr (newlines visible), cut to `width` characters with ' ...'."""
    shown = repr(text)
    return shown if len(shown) <= width else shown[:width - 4] + " ..."


# ----------------------------------------------------------------------------- records of a step
@dataclass
class Experience:
    """This rank's rollouts of a step with everything the update needs ([B, T] over response tokens)."""

    batch: object  # aligner.generation.rollouts.RolloutBatch: tokens, lengths, mask, engine logprobs, rows
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


@dataclass
class PolicyMicrobatch:
    """One micro batch of the policy loss; loss_scale turns its aggregated sum into its share of the
    minibatch loss (see `PolicyObjective`). Packed (`packed` set): tokens and position_ids are its b
    sequences laid end to end in r rows (`aligner.models.packing`); the per-sequence tensors are as
    in the padded layout."""

    tokens: torch.Tensor  # [b, S], or [r, L] packed
    position_ids: torch.Tensor  # [b, S], or [r, L] packed
    prompt_lengths: torch.Tensor  # [b]
    response_lengths: torch.Tensor  # [b]
    mask: torch.Tensor  # [b, T] bool
    old_logprobs: Optional[torch.Tensor]  # [b, T]; None: this forward's own logprobs, detached
    advantages: torch.Tensor  # [b, T]
    importance_weights: Optional[torch.Tensor]  # [b, T] or None
    loss_scale: float
    packed: Optional[object] = None  # aligner.models.packing.PackedRows of the b sequences, or None: padded
    engine_logprobs: Optional[torch.Tensor] = None  # [b, T] with old_logprobs None: the mismatch is measured here

    @property
    def real_tokens(self) -> int:
        """Tokens the forward runs over, padding not counted (a shared prompt once)."""
        if self.packed is not None:
            return self.packed.real_tokens
        return int(self.prompt_lengths.sum() + self.response_lengths.sum())


@dataclass
class PTXMicrobatch:
    """One micro batch of the next-token (PTX) loss mixed into the policy update."""

    tokens: torch.Tensor  # [b, S]
    labels: torch.Tensor  # [b, S]
    loss_mask: torch.Tensor  # [b, S]
    position_ids: torch.Tensor  # [b, S]
    lengths: torch.Tensor  # [b]
    loss_scale: float

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


# ----------------------------------------------------------------------------- the objective
class PolicyObjective:
    """Loss of one micro batch: the registered policy loss aggregated - entropy bonus (+ the PTX loss).

    Megatron divides the summed loss by the summed counts of the whole minibatch. Every micro batch
    returns count 1 and its aggregated loss times its `loss_scale` = (micro batches in the minibatch)
    / (the minibatch's normaliser of its kind, over all ranks): so the minibatch loss is exactly
    sum(policy terms) / N_policy + coef * sum(PTX terms) / N_ptx at any layout.
    """

    reads_logits_at_positions = True  # response (and PTX loss) positions only: the output layer runs there

    def __init__(self, vocab_size: int, temperature: float, loss: LossSection, clip_high: float,
                 constant_normalizer: float, ptx_coef: float):
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.policy_loss = loss.policy_loss
        self.clip_low, self.clip_high = loss.clip_ratio, clip_high
        self.aggregation = loss.aggregation
        self.constant_normalizer = constant_normalizer
        self.entropy_coef = loss.entropy_coef
        self.ptx_coef = ptx_coef

    def normalizer(self, mask: torch.Tensor) -> float:
        """What the aggregation divides a batch's summed loss by, for rows `mask` [b, T]."""
        return float(policy_losses.aggregate_loss(torch.zeros(mask.shape), mask, self.aggregation,
                                                  self.constant_normalizer)[1])

    def forward(self, model, batch):
        if getattr(batch, "packed", None) is not None:
            return packed_forward(model, batch.packed.to(batch.tokens.device))
        return model(batch.tokens, batch.position_ids, None)

    def loss(self, batch, logits):
        one = torch.tensor(1, dtype=torch.int)
        if isinstance(batch, PTXMicrobatch):
            loss_sum, tokens = response_token_loss(logits, batch.labels, batch.loss_mask, self.vocab_size)
            return loss_sum * batch.loss_scale, one, {"ptx_loss_sum": loss_sum.detach(),
                                                      "ptx_tokens": tokens.detach().float()}
        if batch.packed is not None and batch.packed.lengths.numel() == 0:  # evens a token-budget plan's count
            return zero_loss(logits), one, {}
        mask = batch.mask
        width = mask.shape[1]
        # Logprobs and the entropy of the sampling distribution at each response position, in one
        # chunked pass (vocab-parallel, never gathered), both 0 off `mask`; packed rows are read in place.
        entropy_grad = self.entropy_coef != 0 and torch.is_grad_enabled()
        if batch.packed is not None:
            logprobs, entropy = packed_pass(
                logits, batch.packed, batch.prompt_lengths, batch.response_lengths, vocab_size=self.vocab_size,
                temperature=self.temperature, response_width=width, entropy_grad=entropy_grad)
        else:
            logprobs, entropy = response_logprobs_and_entropy(
                logits, batch.tokens, batch.prompt_lengths, batch.response_lengths, vocab_size=self.vocab_size,
                temperature=self.temperature, response_width=width, entropy_grad=entropy_grad)
        old_logprobs = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs
        terms = policy_losses.policy_loss_terms(self.policy_loss, logprobs, old_logprobs, batch.advantages, mask,
                                                clip_low=self.clip_low, clip_high=self.clip_high,
                                                weights=batch.importance_weights)
        policy_sum, count = policy_losses.aggregate_loss(terms.per_token, mask, self.aggregation,
                                                         self.constant_normalizer)
        entropy_sum, _ = policy_losses.aggregate_loss(entropy, mask, self.aggregation, self.constant_normalizer)
        objective_sum = policy_sum - self.entropy_coef * entropy_sum
        with torch.no_grad():
            valid = mask.bool()
            ratio = terms.ratio.detach()
            log_ratio = masked.zero_off_mask(logprobs.detach() - old_logprobs, mask)
            report = {
                "policy_loss_sum": policy_sum.detach(), "count": count.detach().float(),
                "entropy_sum": entropy_sum.detach(), "tokens": valid.sum().float(),
                "clipped_tokens": (terms.clipped & valid).sum().float(),
                "approx_kl_sum": (0.5 * log_ratio.pow(2))[valid].sum(),
                "ratio_sum": ratio[valid].sum(),
                "ratio_max": torch.where(valid, ratio, -math.inf).max(),
                "ratio_min": torch.where(valid, ratio, math.inf).min(),
            }
            if batch.engine_logprobs is not None:
                report.update(mismatch.mismatch_sums(logprobs, batch.engine_logprobs, mask))
        return objective_sum * batch.loss_scale, one, report

    def summarize(self, totals):
        tokens, count = max(totals.get("tokens", 0.0), 1.0), max(totals.get("count", 0.0), 1.0)
        metrics = {
            "policy_loss": totals["policy_loss_sum"] / count, "entropy": totals["entropy_sum"] / count,
            "clip_fraction": totals["clipped_tokens"] / tokens, "approx_kl": totals["approx_kl_sum"] / tokens,
            "ratio_mean": totals["ratio_sum"] / tokens, "ratio_max": totals["ratio_max"],
            "ratio_min": totals["ratio_min"],
        }
        if "mismatch_tokens" in totals:
            metrics.update(mismatch.metrics_from_sums(totals))
        if "ptx_tokens" in totals:
            metrics["ptx_loss"] = totals["ptx_loss_sum"] / max(totals["ptx_tokens"], 1.0)
        metrics["loss"] = metrics["policy_loss"] - self.entropy_coef * metrics["entropy"] + (
            self.ptx_coef * metrics.get("ptx_loss", 0.0))
        return metrics


# ----------------------------------------------------------------------------- the trainer
class RLActor:
    """fit / train_step / validate / save / resume of the RL actor (collective over the job).

    critic: a critic client when the advantage estimator needs values (PPO's GAE), else None.
    """

    def __init__(self, cfg: RLActorConfig, *, policy, reference, engine, router, reward_source, critic, prompts,
                 validation_prompts, ptx_loader, tokenizer, model_cfg, metrics, ema=None, teacher=None):
        from megatron.core import parallel_state as ps

        self.cfg = cfg
        self.policy = policy  # aligner.training.trainer.Trainer: chunks, optimizer, scheduler, train_step
        self.chunks = policy.chunks
        self.objective: PolicyObjective = policy.objective
        self.reference = reference  # HostWeights of the initial policy (LoRA: lora.BaseReference); None: no KL
        self.teacher = teacher  # (chunks, GPTConfig) of the teacher, the reference in on-policy distillation
        self.engine = engine
        self.router = router
        self.reward_source = reward_source  # None: the combined critic server sends the rewards with the values
        self.reward_names = list(getattr(reward_source, "names", ()))  # reward functions: metrics reward/<name>
        critic_server = cfg.critic.server
        self.combined_check = ScoreCheck(f"critic server {critic_server.host}:{critic_server.port} (combined mode)",
                                         cfg.reward)
        self.critic = critic
        self.prompts = prompts
        self.validation_prompts = validation_prompts
        self.ptx_loader = ptx_loader
        self.tokenizer = tokenizer
        self.model_cfg = model_cfg
        self.metrics = metrics
        self.ema = ema  # HostWeights, or None
        self.advantage_settings = advantages.AdvantageSettings(
            gamma=cfg.advantage.gamma, lam=cfg.advantage.lam, whiten_advantages=cfg.advantage.whiten_advantages,
            whiten_rewards=cfg.advantage.whiten_rewards, group_std=cfg.advantage.group_std,
            std_eps=cfg.advantage.std_eps)
        if cfg.kl.adaptive:
            self.kl_controller = ppo_math.AdaptiveKLController(cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon)
        else:
            self.kl_controller = ppo_math.FixedKLController(cfg.kl.init_coef)
        self.order = PromptOrder(len(prompts), cfg.seed, cfg.data.shuffle)
        self.step = 0
        self.optimizer_steps = 0
        self.critic_warmup_done = 0
        self.pending_critic_train: Optional[Future] = None
        # (step, critic warm-up rounds) of the newest checkpoint of this run
        self.saved: Optional[tuple[int, int]] = None
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.mp_group = ps.get_model_parallel_group()
        self.is_replica_leader = dist.get_rank(self.mp_group) == 0  # talks to the servers for its replica
        self.response_width = cfg.generation.max_new_tokens
        self.seq_length = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
        self.temperature = cfg.generation.temperature if cfg.loss.scale_logits_by_temperature else 1.0
        self._ptx_batches = None

    # -- sampling settings
    def sampling(self, greedy: bool = False, seed: int = 0):
        gen = self.cfg.generation
        return SamplingParams(max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
                              temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, greedy=greedy,
                              stop_strings=list(gen.stop_strings), fixed_length=gen.fixed_length, seed=seed)

    def nothing_to_train(self) -> Optional[tuple[str, str]]:
        """("already at step N of trainer.max_steps=N", its key) when a resumed run has no step left, else None."""
        max_steps = self.cfg.trainer.max_steps
        if self.saved is None or self.step < max_steps:
            return None
        return f"already at step {self.step} of trainer.max_steps={max_steps}", "trainer.max_steps"

    # -- the loop
    def fit(self) -> None:
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
                    shown = {"reward": metrics["reward_mean"]}
                    if "kl" in metrics:
                        shown["kl"] = metrics["kl"]
                    self.metrics.advance(**shown)
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

    def step_seed(self) -> int:
        """A fresh sampling seed per step (and per warm-up round), inside the samplers' 32-bit range."""
        return derive_seed(self.cfg.seed, self.step, self.critic_warmup_done, weights=(7_919, 1),
                           modulus=SAMPLER_SEED_RANGE)

    def train_step(self, update_actor: bool = True) -> dict[str, float]:
        """One step (update_actor=False: a critic warm-up round)."""
        start = time.perf_counter()
        timings: dict[str, float] = {}
        batch, rollout_metrics = self.collect_batch(timings)

        # Logprobs of the rollout policy (same forward as training: the ratio starts at exactly 1; or
        # none here, when the update's forward gives them) and of the reference policy (its weights
        # swapped in from host memory, then out again).
        old_logprobs = None
        if not self.cfg.old_logprobs_in_update:
            tick = time.perf_counter()
            old_logprobs = self.logprobs(batch) if self.cfg.loss.recompute_old_logprobs else batch.engine_logprobs
            timings["time_logprobs"] = time.perf_counter() - tick
        reference_logprobs = None
        if self.cfg.measures_kl:
            tick = time.perf_counter()
            if self.teacher is not None:  # the teacher is the reference (on-policy distillation)
                reference_logprobs = self.logprobs(batch, self.teacher)
            else:
                with self.reference.swapped_in(self.chunks):
                    reference_logprobs = self.logprobs(batch)
            timings["time_reference"] = time.perf_counter() - tick

        experience = self.make_experience(batch, old_logprobs, reference_logprobs)
        if self.critic is not None:
            tick = time.perf_counter()
            self.send_critic_train(experience)  # the critic trains while the actor does
            timings["time_critic_send"] = time.perf_counter() - tick

        metrics = {**rollout_metrics, **experience.metrics}
        if update_actor:
            tick = time.perf_counter()
            metrics.update(self.update_policy(experience))
            timings["time_train"] = time.perf_counter() - tick
            if self.ema is not None:
                update_ema(self.ema.tensors, dict(named_parameters(self.chunks)), self.cfg.ema.decay)
            if self.cfg.measures_kl:
                self.kl_controller.update(metrics["kl"], self.cfg.rollouts_per_step)
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
        metrics["rollout_tokens_per_second"] = rollout_metrics["generated_tokens"] / max(timings["time_generation"],
                                                                                         1e-9)
        if self._should_log_samples():
            self.log_samples(batch)
        return metrics

    # -- 1-2: rollouts and their scores
    def collect_batch(self, timings: dict):
        """This rank's RolloutBatch of the step (k samples per prompt, scored) and the rollout metrics."""
        rollout, k = self.cfg.rollout, self.cfg.rollout.samples_per_prompt
        timings["time_generation"] = timings["time_scoring_wait"] = 0.0
        if not rollout.dynamic_sampling:
            indices = group_indices(self.order.take(rollout.prompts_per_step), k)
            local, generated = self.generate_and_score(indices, timings, seed=self.step_seed(),
                                                       with_values=self.critic is not None)
            mine = rebalance_rollouts(local, len(indices), data_parallel_group=self.dp_group)
            return self.to_batch(mine), {"generated_tokens": generated}
        return self.collect_informative_batch(timings)

    def collect_informative_batch(self, timings: dict):
        """DAPO's dynamic sampling: generate rounds of prompts_per_step prompts x k, keep the groups whose
        k scores differ (the others have advantage 0 and teach nothing), until prompts_per_step groups
        are kept or rollout.max_sampling_rounds rounds ran; a batch still short is filled with the most
        recent uniform groups (counted in `dynamic_sampling_filled_groups`)."""
        rollout, k = self.cfg.rollout, self.cfg.rollout.samples_per_prompt
        needed = rollout.prompts_per_step
        kept: list[list] = []  # groups of RolloutRows
        uniform: list[list] = []
        generated, rounds = 0.0, 0
        while len(kept) < needed and rounds < rollout.max_sampling_rounds:
            indices = group_indices(self.order.take(needed), k)
            seed = self.step_seed() if rounds == 0 else derive_seed(self.step_seed(), rounds,
                                                                    modulus=SAMPLER_SEED_RANGE)
            local, round_tokens = self.generate_and_score(indices, timings, seed=seed,
                                                          with_values=self.critic is not None)
            generated += round_tokens
            rows = self._all_rows(local, len(indices))
            scores = torch.tensor([row.score for row in rows], dtype=torch.float64)
            informative = advantages.informative_groups(scores, k).tolist()
            for group, keep in enumerate(informative):
                (kept if keep else uniform).append(rows[group * k:(group + 1) * k])
            rounds += 1
        filled = max(needed - len(kept), 0)
        groups = kept[:needed] + uniform[len(uniform) - filled:]  # the newest uniform groups when short
        share = needed // self.dp_size
        mine = [(position, row) for group in range(self.dp_rank * share, (self.dp_rank + 1) * share)
                for position, row in enumerate(groups[group], start=group * k)]
        metrics = {"generated_tokens": generated, "dynamic_sampling_rounds": float(rounds),
                   "dynamic_sampling_kept_fraction": len(kept) / (rounds * needed),
                   "dynamic_sampling_filled_groups": float(filled)}
        return self.to_batch(mine), metrics

    def _all_rows(self, local: dict, count: int) -> list:
        """Every rank's rows of a round, in rollout order, on every rank."""
        parts = [local]
        if self.dp_size > 1:
            parts = [None] * self.dp_size
            dist.all_gather_object(parts, local, group=self.dp_group)
        merged = {position: row for part in parts for position, row in part.items()}
        return [merged[position] for position in range(count)]

    def to_batch(self, mine: list[tuple]):
        return RolloutBatch.from_rows(mine, self.tokenizer.pad_id, seq_length=self.seq_length,
                                      response_width=self.response_width)

    def generate_and_score(self, indices: list[int], timings: dict, *, seed: int, greedy: bool = False,
                           prompts=None, with_values: bool = True) -> tuple[dict, float]:
        """Generate the prompts `indices` through the router and score them; returns (this replica's rows
        by position in `indices`, response tokens generated over all ranks). Collective."""
        prompts = self.prompts if prompts is None else prompts
        step_prompts = [prompts.tokens[i] for i in indices]
        given_prompts = [prompts.prompts[i] for i in indices]  # as the data gave them, for reward functions
        given_columns = [prompts.columns(i) for i in indices]  # the records' other columns, for reward functions
        records = [prompts.record(i) for i in indices]  # "file:line", for messages about a prompt's score
        pending = []  # (micro-batch positions, pending scores, values future)

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
                                                         responses, [records[i] for i in micro_indices],
                                                         columns=[given_columns[i] for i in micro_indices])
            pending.append((micro_indices, rewards, values))

        tick = time.perf_counter()
        self.engine.refit(self.chunks)
        local = collect_rollouts(self.engine, self.router, step_prompts, self.sampling(greedy, seed), send_scoring)
        for position, row in local.items():
            row.given_prompt = given_prompts[position]
        if self.cfg.generation.engine == "native":
            # The KV cache is small and kept for the next step; the packed weight copies would be
            # stale after this step's update (refit repacks them), so training gets their memory.
            self.engine.drop_packed_weights()
        elif hasattr(self.engine, "free"):
            self.engine.free()
        timings["time_generation"] = timings.get("time_generation", 0.0) + time.perf_counter() - tick

        tick = time.perf_counter()
        critic = self.cfg.critic.server
        for micro_indices, rewards, values in pending:
            inferred = wait_for(values, lambda: f"the critic server {critic.host}:{critic.port}") if (
                values is not None) else None
            if rewards is not None:
                scores = rewards.result()
            elif inferred.rewards is None:
                raise ConfigError("reward.source=combined, but the critic server sent no rewards: start it in combined "
                                  "mode (combined.reward_model_init_from=<reward-model checkpoint>)")
            else:
                scores = self.combined_check(inferred.rewards.tolist(), [records[i] for i in micro_indices])
            value_rows = inferred.values if (inferred is not None and with_values) else None  # [rows, columns]
            for j, position in enumerate(micro_indices):
                row = local[position]
                row.score, row.score_replaced = float(scores.values[j]), bool(scores.replaced[j])
                row.score_parts = {name: float(part[j]) for name, part in scores.parts.items()}
                if value_rows is not None:
                    row.values = values_at_response(torch.as_tensor(value_rows[j], dtype=torch.float32),
                                                    len(row.prompt), len(row.response))
        timings["time_scoring_wait"] = timings.get("time_scoring_wait", 0.0) + time.perf_counter() - tick
        if dist.get_world_size(self.mp_group) > 1:  # the replica's other ranks get the scores too
            holder = [local]
            dist.broadcast_object_list(holder, src=dist.get_global_rank(self.mp_group, 0), group=self.mp_group)
            local = holder[0]
        generated = torch.tensor([float(sum(len(row.response) for row in local.values()))])
        dist.all_reduce(generated, group=self.dp_group)
        return local, float(generated.item())

    def response_text(self, response_tokens: torch.Tensor) -> str:
        """What reward functions and sample tables read; the tokens themselves go on unchanged."""
        ids = [t for t in response_tokens.tolist() if t != self.tokenizer.eos_id]
        return self.tokenizer.decode(ids)

    # -- 3: logprobs
    def logprobs(self, batch, teacher=None) -> torch.Tensor:
        """This rank's rollouts' logprobs [B, T] under the policy (or the `teacher`: its chunks and config).
        With token budgets every rank computes the rows the first epoch trains on it (of the rollouts of
        all ranks); the sum over ranks (each row nonzero on one rank only, so exact) hands each rank its
        own rows."""
        budget = self.uses_token_budget
        rows = self.all_ranks_rows(batch) if budget else batch
        chunks, model_cfg = (self.chunks, self.model_cfg) if teacher is None else teacher
        result = sequence_logprobs(chunks, rows.tokens, rows.prompt_lengths, rows.response_lengths,
                                   vocab_size=model_cfg.vocab_size, packing=self.cfg.packing,
                                   pad_id=self.tokenizer.pad_id, temperature=self.temperature,
                                   response_width=self.response_width,
                                   micro_batch_size=self.rows_per_micro_batch, plan=self.logprob_plan(rows),
                                   row_length=self.row_length, share_prompts=self.shares_prompts, trim=True)
        if budget:
            result = result.to(device())
            dist.all_reduce(result, group=self.dp_group)
            local = batch.tokens.shape[0]
            result = result[self.dp_rank * local:(self.dp_rank + 1) * local]
        return result.cpu()

    # -- 4: scores -> shaped scores -> advantages
    def shaped_scores(self, batch) -> torch.Tensor:
        reward = self.cfg.reward
        scores = batch.scores()
        if reward.missing_stop_penalty is not None:
            scores = ppo_math.apply_missing_stop_penalty(scores, batch.ended_with_stop, reward.missing_stop_penalty)
        if reward.overlong_buffer is not None:
            scores = scores + ppo_math.overlong_penalty(batch.response_lengths, self.cfg.generation.max_new_tokens,
                                                 reward.overlong_buffer, reward.overlong_penalty)
        if reward.normalization_mean is not None:
            scores = ppo_math.normalize_scores(scores, reward.normalization_mean, reward.normalization_std)
        if reward.clip is not None:
            scores = ppo_math.clip_scores(scores, reward.clip)
        return scores

    def make_experience(self, batch, old_logprobs: Optional[torch.Tensor],
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
            kl = ppo_math.kl_penalty(old_logprobs, reference_logprobs, cfg.kl.estimator, mask)  # [B, T]
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
        return Experience(batch=batch, old_logprobs=old_logprobs, advantages=estimated.advantages,
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
                "old_values": experience.values}
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

    # -- 6: policy epochs over minibatches
    def update_policy(self, experience: Experience) -> dict[str, float]:
        loss, trainer = self.cfg.loss, self.cfg.trainer
        batch = experience.batch
        rows = batch.tokens.shape[0]
        minibatch_rows = trainer.global_batch_size // self.dp_size
        micro = trainer.micro_batch_size
        positions = torch.arange(self.seq_length).unsqueeze(0).expand(micro, -1)
        minibatch_metrics, first = [], None
        budget = self.uses_token_budget
        if experience.old_logprobs is None and (loss.epochs, rows) != (1, minibatch_rows):
            raise RuntimeError(f"the update's forward stands for the rollout policy only in a single update: "
                               f"{loss.epochs} epoch(s) of {rows} rows in minibatches of {minibatch_rows}")
        if budget:  # every rank's rollouts, rows in rank order: a token-budget plan draws on them all
            experience = self.all_ranks_experience(experience)
        for epoch in range(loss.epochs):
            order = self.minibatch_order(rows, epoch)
            for minibatch, start in enumerate(range(0, rows, minibatch_rows)):
                ids = order[start:start + minibatch_rows]
                plan = self.budget_plan(experience.batch, epoch, minibatch) if budget else None
                microbatches = self.policy_microbatches(experience, ids, positions, plan)
                microbatches = self.scale_losses(microbatches + self.ptx_microbatches())
                if loss.adam_epsilon_style == "tf":
                    # TF's Adam epsilon, as the torch optimizer's, for this optimizer step.
                    eps = tf_adam_epsilon(self.cfg.optim.eps, self.cfg.optim.betas[1], self.optimizer_steps + 1)
                    for param_group in self.policy.optimizer.param_groups:
                        param_group["eps"] = eps
                result = self.policy.train_step(microbatches)
                self.optimizer_steps += 1
                first = first or result
                minibatch_metrics.append(result)
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

    def minibatch_order(self, rows: int, epoch: int, dp_rank: Optional[int] = None) -> torch.Tensor:
        """A rank's (default: this one's) rows in the order an epoch's minibatches take them (consecutive slices)."""
        generator = torch.Generator().manual_seed(derive_seed(
            self.cfg.seed, self.step, epoch, self.dp_rank if dp_rank is None else dp_rank, weights=(131, 17, 1),
            seed_weight=7919))
        return torch.randperm(rows, generator=generator)

    @property
    def shares_prompts(self) -> bool:
        """Whether packed rows hold the samples of one prompt with the prompt once (`packing.share_prompts`)."""
        return packing.shares_prompts_here(self.cfg.packing, self.chunks[0])

    @property
    def row_length(self) -> int:
        """Tokens per packed row: packing.row_length; null: the padded row's length, twice that where
        several samples of a prompt share it without a token budget (room for a group: prompt + samples;
        attention's cost per token, which grows with the row, at most doubles). Rows are then cut to
        the longest of each micro batch (`pack_rows(trim=True)`)."""
        packing = self.cfg.packing
        if packing.row_length is not None:
            return packing.row_length
        return self.seq_length * (2 if self._doubles_rows else 1)

    @property
    def _doubles_rows(self) -> bool:
        packing = self.cfg.packing
        return (packing.row_length is None and packing.micro_batch_tokens is None
                and self.cfg.rollout.samples_per_prompt > 1 and self.shares_prompts)

    @property
    def rows_per_micro_batch(self) -> int:
        """Packed rows per micro batch: trainer.micro_batch_size (half that, at least 1, of the doubled
        default rows: about as many token slots as before)."""
        micro = self.cfg.trainer.micro_batch_size
        return max(1, micro // 2) if self._doubles_rows else micro

    def prompts_of(self, rows, members: list[int]) -> Optional[tuple[list[int], list[tuple]]]:
        """(prompt lengths, prompt keys) of the sequences `members` of `rows` where prompts are shared
        (`packing.shared_prompt_rows` lays out each prompt's samples together), else None."""
        if not self.shares_prompts:
            return None
        ids = torch.tensor(members, dtype=torch.long)  # long also when empty (an evened micro batch)
        prompt_lengths = rows.prompt_lengths[ids]
        return prompt_lengths.tolist(), packing.prompt_keys(rows.tokens[ids], prompt_lengths)

    @property
    def uses_token_budget(self) -> bool:
        return self.cfg.packing.micro_batch_tokens is not None and packing.packs_here(self.cfg.packing)

    def all_ranks_rows(self, batch):
        """The rollouts of every data-parallel rank (rank r's rows at r * B ...), on every rank."""
        from types import SimpleNamespace

        return SimpleNamespace(tokens=self.gather_rows(batch.tokens),
                               prompt_lengths=self.gather_rows(batch.prompt_lengths),
                               response_lengths=self.gather_rows(batch.response_lengths),
                               mask=self.gather_rows(batch.mask))

    def all_ranks_experience(self, experience: Experience) -> Experience:
        """What the policy update reads of `experience`, for every rank's rollouts (`all_ranks_rows`)."""
        from dataclasses import replace

        weights, old_logprobs = experience.importance_weights, experience.old_logprobs
        rows = self.all_ranks_rows(experience.batch)
        if old_logprobs is None:  # the update measures the mismatch against the engine's
            rows.engine_logprobs = self.gather_rows(experience.batch.engine_logprobs)
        return replace(experience, batch=rows,
                       old_logprobs=None if old_logprobs is None else self.gather_rows(old_logprobs),
                       advantages=self.gather_rows(experience.advantages),
                       importance_weights=None if weights is None else self.gather_rows(weights))

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's `tensor` (each [B, ...], equal B), concatenated in rank order."""
        if self.dp_size == 1:
            return tensor
        local = tensor.to(device())
        parts = [torch.empty_like(local) for _ in range(self.dp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.dp_group)
        return torch.cat(parts).to(tensor.device)

    def budget_plan(self, rows, epoch: int, minibatch: int) -> list[list[list[int]]]:
        """This rank's token-budget micro batches of a minibatch, as row indices (into the rows of every
        rank, `all_ranks_rows`) per packed row per micro batch; an empty micro batch has no rows. The
        minibatch holds every rank's share of it (each rank's own order), balanced across ranks. Where
        prompts are shared, a prompt's samples are planned together and its tokens counted once."""
        local = rows.tokens.shape[0] // self.dp_size
        minibatch_rows = self.cfg.trainer.global_batch_size // self.dp_size
        window = slice(minibatch * minibatch_rows, (minibatch + 1) * minibatch_rows)
        ids = torch.cat([self.minibatch_order(local, epoch, rank)[window] + rank * local
                         for rank in range(self.dp_size)]).tolist()
        lengths = (rows.prompt_lengths + rows.response_lengths).tolist()
        prompts = self.prompts_of(rows, ids)
        if prompts is None:  # an item a sequence
            items, item_prompts = [[position] for position in range(len(ids))], None
        else:  # an item a prompt's samples that share a row with it once, counted so
            items = packing.shared_prompt_parts([lengths[i] for i in ids], *prompts, self.row_length)
            item_prompts = [[(prompts[0][p], prompts[1][p]) for p in item] for item in items]
        plan = packing.plan_token_budget([[lengths[ids[p]] for p in item] for item in items], self.dp_size,
                                         self.cfg.packing.micro_batch_tokens, self.row_length,
                                         item_prompts)[self.dp_rank]
        micro_batches = []
        for batch in plan:
            positions = [p for item in batch for p in items[item]]
            shared = None  # the minibatch's prompt keys, computed once above
            if prompts is not None:
                shared = ([prompts[0][p] for p in positions], [prompts[1][p] for p in positions])
            layout = packing.packed_rows_plan([lengths[ids[p]] for p in positions], self.row_length, shared,
                                              no_more_rows=True)
            micro_batches.append([[ids[positions[i]] for i in row] for row in layout])
        return micro_batches

    def packed_plan(self, batch, ids: torch.Tensor) -> list[list[list[int]]]:
        """Packed micro batches of the rows `ids` of `batch`: row indices per packed row per micro batch."""
        lengths = (batch.prompt_lengths[ids] + batch.response_lengths[ids]).tolist()
        return [[[int(ids[i]) for i in row] for row in rows]
                for rows in packing.plan_micro_batches(lengths, self.row_length, self.rows_per_micro_batch,
                                                       self.prompts_of(batch, ids.tolist()))]

    def logprob_plan(self, batch) -> list[list[list[int]]]:
        """The packed logprob pass's micro batches: the first epoch's, so the first minibatch's rows are
        laid out exactly as its training rows (a sequence's float rounding depends on its place in a
        row; with the same rows the first minibatch's ratio is exactly 1). With token budgets `batch`
        holds every rank's rows (`all_ranks_rows`) and the plan is this rank's share of them."""
        minibatch_rows = self.cfg.trainer.global_batch_size // self.dp_size
        if self.uses_token_budget:
            minibatches = batch.tokens.shape[0] // self.dp_size // minibatch_rows
            return [micro for minibatch in range(minibatches) for micro in self.budget_plan(batch, 0, minibatch)
                    if micro]
        rows = batch.tokens.shape[0]
        order = self.minibatch_order(rows, 0)
        return [micro for start in range(0, rows, minibatch_rows)
                for micro in self.packed_plan(batch, order[start:start + minibatch_rows])]

    def policy_microbatches(self, experience: Experience, ids: torch.Tensor, positions: torch.Tensor,
                            plan: Optional[list[list[list[int]]]] = None) -> list[PolicyMicrobatch]:
        """The minibatch `ids` (rows of the experience) as micro batches of trainer.micro_batch_size rows:
        padded rows, one per sequence; or packed (`packing`), the minibatch's sequences laid end to end
        in rows of packing.row_length (default: the padded row's length), so fewer micro batches carry
        the same tokens; or as `plan` says (packed rows of experience rows per micro batch, a token-budget
        plan: `budget_plan`). Every loss aggregation is a sum over sequences, so the minibatch loss is
        the same whichever micro batch a sequence lands in."""
        batch, weights, old_logprobs = experience.batch, experience.importance_weights, experience.old_logprobs

        def microbatch(part: torch.Tensor, **layout) -> PolicyMicrobatch:
            return PolicyMicrobatch(
                prompt_lengths=batch.prompt_lengths[part], response_lengths=batch.response_lengths[part],
                mask=batch.mask[part], old_logprobs=None if old_logprobs is None else old_logprobs[part],
                advantages=experience.advantages[part], importance_weights=None if weights is None else weights[part],
                loss_scale=1.0, engine_logprobs=batch.engine_logprobs[part] if old_logprobs is None else None,
                **layout)

        micro = self.cfg.trainer.micro_batch_size
        if not packing.packs_here(self.cfg.packing):
            return [microbatch(part, tokens=batch.tokens[part], position_ids=positions[:len(part)])
                    for part in ids.split(micro)]
        lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
        sequences = [batch.tokens[row, :length] for row, length in enumerate(lengths)]
        prompt_lengths = batch.prompt_lengths.tolist() if self.shares_prompts else None
        microbatches = []
        for rows in self.packed_plan(batch, ids) if plan is None else plan:
            if not rows:
                empty = packing.empty_packed_rows(self.tokenizer.pad_id)
                microbatches.append(microbatch(torch.zeros(0, dtype=torch.long), tokens=empty.tokens,
                                               position_ids=empty.position_ids, packed=empty))
                continue
            members, packed = packing.pack_micro_batch(sequences, rows, self.row_length, self.tokenizer.pad_id,
                                                       prompt_lengths, trim=True)
            microbatches.append(microbatch(torch.tensor(members), tokens=packed.tokens,
                                           position_ids=packed.position_ids, packed=packed))
        return microbatches

    def scale_losses(self, microbatches: list) -> list:
        """Each micro batch with its loss_scale: (micro batches in the minibatch over all ranks) / (the
        minibatch's normaliser of its kind over all ranks), times the PTX coefficient for PTX batches."""
        from dataclasses import replace

        policy_count, ptx_count = 0.0, 0.0
        for mb in microbatches:
            if isinstance(mb, PTXMicrobatch):
                ptx_count += float(mb.loss_mask.sum())
            else:
                policy_count += self.objective.normalizer(mb.mask)
        totals = torch.tensor([policy_count, ptx_count, float(len(microbatches))], dtype=torch.float64)
        dist.all_reduce(totals, group=self.dp_group)
        policy_total, ptx_total, microbatch_total = totals.tolist()
        policy_scale = microbatch_total / max(policy_total, 1.0)
        ptx_scale = microbatch_total * self.objective.ptx_coef / max(ptx_total, 1.0)
        return [replace(mb, loss_scale=ptx_scale if isinstance(mb, PTXMicrobatch) else policy_scale)
                for mb in microbatches]

    def ptx_microbatches(self) -> list[PTXMicrobatch]:
        if self.ptx_loader is None:
            return []
        if self._ptx_batches is None:
            self._ptx_batches = self.ptx_loader.iterate(0)

        def pad(tensor, value):  # to the policy batches' sequence length: one length per pipeline schedule
            return torch.nn.functional.pad(tensor, (0, self.seq_length - tensor.shape[1]), value=value)

        return [PTXMicrobatch(tokens=pad(mb["tokens"], self.tokenizer.pad_id),
                              labels=pad(mb["labels"], self.tokenizer.pad_id), loss_mask=pad(mb["loss_mask"], 0.0),
                              position_ids=pad(mb["position_ids"], 0), lengths=mb["lengths"], loss_scale=1.0)
                for mb in next(self._ptx_batches)]

    # -- validation and samples
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Greedy rollouts on held-out prompts: mean reward and response length."""
        limit = self.cfg.trainer.limit_val_samples or len(self.validation_prompts)
        count = min(limit, len(self.validation_prompts)) // self.dp_size * self.dp_size
        timings: dict = {}
        local, _ = self.generate_and_score(list(range(count)), timings, seed=0, greedy=True,
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

    def log_samples(self, batch) -> None:
        """One rollout of each of this rank's first logging.num_samples prompts: on the console (truncated) and as
        a TensorBoard text table (whole)."""
        picks = list(range(0, len(batch.indices), self.cfg.rollout.samples_per_prompt))[:self.cfg.logging.num_samples]
        rows, count, width = [], len(picks), self.cfg.logging.sample_chars
        for number, b in enumerate(picks):
            prompt = prompt_text(batch.rows[b].given_prompt)
            response = self.response_text(batch.rows[b].response)
            score = batch.rows[b].score
            rows.append(f"| {prompt!r} | {response!r} | {score:.3f} |")
            self.metrics.write(f"sample {number + 1}/{count} at step {self.step + 1}: reward={score:.4g}\n"
                               f"  prompt:   {_truncated(prompt, width)}\n  response: {_truncated(response, width)}")
        table = "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows)
        self.metrics.log_text(self.step + 1, "samples", table)

    # -- checkpoints
    def state_dict(self) -> dict:
        return {"step": self.step, "optimizer_steps": self.optimizer_steps, "kl": self.kl_controller.state_dict(),
                "prompts": self.order.state_dict(), "critic_warmup_done": self.critic_warmup_done,
                "scheduler": self.policy.scheduler.state_dict(), schedule.STATE_KEY: self.policy.schedule_settings}

    def load_state_dict(self, state: dict) -> dict[str, tuple]:
        """Continue from a checkpoint's trainer state under this run's schedule settings; returns
        {key: (checkpoint value, current value)} of the settings that changed."""
        self.step = state["step"]
        self.optimizer_steps = state["optimizer_steps"]
        self.kl_controller.load_state_dict(state["kl"])
        self.order.load_state_dict(state["prompts"])
        self.critic_warmup_done = state["critic_warmup_done"]
        return schedule.resume_schedule(self.policy.scheduler, self.policy.optimizer, state,
                                        self.policy.schedule_settings)

    def save(self) -> Path:
        save_dir = self.cfg.checkpoint.save_dir
        extra_meta = {key: value for key, value in self.policy.checkpoint_meta.items() if key != "model"}  # peft
        path = checkpointing.save(
            checkpointing.step_dir(save_dir, self.step), self.chunks, model_config=self.model_cfg.to_dict(),
            optimizer=self.policy.optimizer, trainer_state=self.state_dict(), tokenizer_dir=self.policy.tokenizer_dir,
            save_rng=True, run_id=self.policy.run_id, extra_meta=extra_meta,
        )
        if self.ema is not None:
            with self.ema.swapped_in(self.chunks):
                ema_path = checkpointing.save(checkpointing.step_dir(Path(save_dir) / "ema", self.step), self.chunks,
                                              model_config=self.model_cfg.to_dict(), extra_meta=extra_meta,
                                              tokenizer_dir=self.policy.tokenizer_dir, run_id=self.policy.run_id)
            checkpointing.remove_old_checkpoints(Path(save_dir) / "ema", self.cfg.checkpoint.keep_last,
                                                 run_id=self.policy.run_id, saved=ema_path)
        if dist.get_rank() == 0:
            saved_with = f" (critic: {self.critic.save(self.step)})" if self.critic is not None else ""
            self.metrics.write(f"saved checkpoint {path}{saved_with}")
        dist.barrier()
        checkpointing.remove_old_checkpoints(save_dir, self.cfg.checkpoint.keep_last, run_id=self.policy.run_id,
                                             saved=path)
        self.saved = (self.step, self.critic_warmup_done)
        return path

    def save_unless_saved(self) -> Path:
        """The checkpoint of the current step (and warm-up round): saved now unless this run already wrote it."""
        if self.saved == (self.step, self.critic_warmup_done):
            return checkpointing.step_dir(self.cfg.checkpoint.save_dir, self.step)
        return self.save()

    def resume_from(self, checkpoint_dir: Path) -> None:
        meta = checkpointing.load(checkpoint_dir, self.chunks, optimizer=self.policy.optimizer, load_rng=True,
                                  model_config=self.model_cfg.to_dict())
        changes = self.load_state_dict(meta["trainer_state"])
        self.saved = (self.step, self.critic_warmup_done)
        if self.metrics.progress is not None:
            self.metrics.progress.update(self.step)
        self.metrics.log_resume(self.step, checkpoint_dir, changes)
        self.metrics.write(f"resumed from {checkpoint_dir} at step {self.step}")
        if changes:
            self.metrics.write(schedule.describe_changes(changes, self.step))


# ----------------------------------------------------------------------------- building a run
def build_rl_actor(cfg: RLActorConfig, *, critic=None, reward_source=None) -> RLActor:
    """Runtime, policy + reference weights, prompts, engine, router, reward source, critic client (when
    the estimator needs values), PTX data, EMA copy, optimizer and schedule; resumed from the newest
    checkpoint in checkpoint.save_dir if there is one.

    critic / reward_source: objects with the client interfaces (`CriticClient`, `score_async`);
    None builds them from the config (tests pass in-process ones).
    """
    loss = cfg.loss
    if reward_source is None and cfg.reward.source != "combined":
        # First: a reward function that cannot load or fails on the first prompt record fails in seconds.
        reward_source = build_reward_source(cfg.reward, probe_prompts=cfg.data.prompts)
    overrides = {"hidden_dropout": 0.0, "attention_dropout": 0.0} if loss.disable_dropout else None
    peft = dataclasses.replace(cfg.peft, dropout=0.0) if loss.disable_dropout else cfg.peft
    teacher_from = None  # resolved before the policy's layout is set up (an HF/GGUF teacher is imported at TP=1)
    if cfg.measures_kl and cfg.teacher.init_from is not None:
        teacher_from = resolve_model_source(cfg.teacher.init_from, "teacher.init_from", get_logger().info)
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume,
        lock_wait_s=cfg.checkpoint.lock_wait_s, model_overrides=overrides,
        peft=peft, sequence_lengths=cfg.sequence_lengths(),
    )
    cfg.validate(built.data_parallel_size)
    chunks, model_cfg, tokenizer, resume = built.chunks, built.model_cfg, built.tokenizer, built.resume_checkpoint
    # The reference policy is the starting policy, also when resuming (the chunks then hold random
    # init until the resume load, so the starting weights are loaded first, copied, then replaced).
    # A run that never measures the KL never reads it: no host copy of the weights. With LoRA it is
    # the base, i.e. the live model with its adapters off: no copy either.
    reference = teacher = None
    if teacher_from is not None:
        teacher = build_teacher(teacher_from, cfg.parallel, built, cfg.sequence_lengths())
    elif cfg.measures_kl and built.peft_meta is not None:
        reference = lora.BaseReference()
    elif cfg.measures_kl:
        if resume is not None:
            lora.load_merged(built.init_from, chunks)
        reference = HostWeights.snapshot(chunks)
    ema = None
    if cfg.ema.decay is not None:
        if resume is not None:
            ema_checkpoint = Path(cfg.checkpoint.save_dir) / "ema" / resume.name
            if not ema_checkpoint.exists():
                raise checkpointing.CheckpointError(f"resuming {resume} with ema.decay set, but its EMA copy "
                                                    f"{ema_checkpoint} is missing")
            checkpointing.load(ema_checkpoint, chunks)
        ema = HostWeights.snapshot(chunks)  # the starting policy, or the saved EMA when resuming

    prompts = PromptDataset(cfg.data.prompts, tokenizer, cfg.data.max_prompt_length, cfg.data.chat_template)
    validation = None
    if cfg.data.validation_prompts:
        validation = PromptDataset(cfg.data.validation_prompts, tokenizer, cfg.data.max_prompt_length,
                                   cfg.data.chat_template)
    engine, router = build_engine_and_router(cfg.generation, chunks, model_cfg, tokenizer, cfg.data.max_prompt_length)
    if critic is None and cfg.uses_critic:
        critic = build_critic_client(cfg.critic)
    ptx_loader = build_ptx_loader(cfg, tokenizer)

    trainer_cfg = cfg.trainer
    minibatches_per_step = cfg.rollouts_per_step // trainer_cfg.global_batch_size
    objective = PolicyObjective(model_cfg.vocab_size,
                                cfg.generation.temperature if loss.scale_logits_by_temperature else 1.0, loss,
                                cfg.clip_high, cfg.constant_normalizer, cfg.ptx.coef if cfg.ptx.data else 0.0)
    # Steps are rollout rounds; the LR schedule counts optimizer steps (epochs x minibatches per step).
    policy = setup.build_trainer(cfg, built, objective, total_steps=trainer_cfg.max_steps,
                                 optimizer_steps=trainer_cfg.max_steps * loss.epochs * minibatches_per_step)
    trainer = RLActor(cfg, policy=policy, reference=reference, engine=engine, router=router,
                      reward_source=reward_source, critic=critic if cfg.uses_critic else None, prompts=prompts,
                      validation_prompts=validation, ptx_loader=ptx_loader, tokenizer=tokenizer, model_cfg=model_cfg,
                      metrics=policy.metrics, ema=ema, teacher=teacher)
    if resume is not None:
        trainer.resume_from(resume)
    for prompt_set in (prompts, validation):
        if prompt_set is not None and prompt_set.skipped_note:
            policy.metrics.write(f"warning: {prompt_set.skipped_note}")
    preset = describe_preset(cfg)
    if preset is not None:
        policy.metrics.write(preset)
    rollout = cfg.rollout
    policy.metrics.write(
        f"{cfg.name}: {num_parameters(model_cfg) / 1e6:.2f}M parameters, layout "
        f"TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
        f"DP={built.data_parallel_size}; {len(prompts)} prompts ({prompts.too_long} longer than "
        f"{cfg.data.max_prompt_length} tokens skipped); "
        + (f"teacher {teacher_from} ({num_parameters(teacher[1]) / 1e6:.2f}M parameters) as the reference; "
           if teacher is not None else
           f"reference policy {built.init_from} on host memory ({reference.num_bytes / 2**20:.1f} MiB); "
           if isinstance(reference, HostWeights) else
           "reference policy: the base model with the LoRA adapters off (no copy); " if reference is not None
           else "no reference policy (fixed KL coefficient 0); ")
        + f"{rollout.prompts_per_step} prompts x {rollout.samples_per_prompt} "
        f"samples per step{' (dynamic sampling)' if rollout.dynamic_sampling else ''}; advantages "
        f"{cfg.advantage.estimator}{' with the critic server' if cfg.uses_critic else ''}, loss {loss.policy_loss} "
        f"({loss.aggregation}); {loss.epochs} epoch(s) of {minibatches_per_step} minibatch(es)")
    return trainer


def build_teacher(init_from: Path, parallel, built, sequence_lengths: list[tuple[int, str]]) -> tuple:
    """(chunks, GPTConfig) of the teacher at the policy's layout and precision, in eval mode. Refused unless
    its tokenizer is the policy's (the teacher scores the policy's token ids) and its positions hold the
    rollouts (`RLActorConfig.sequence_lengths`)."""
    teacher_cfg = GPTConfig.from_dict(checkpointing.read_meta(init_from)["model"])
    teacher_cfg.check_sequence_lengths(sequence_lengths,
                                       f"teacher.init_from={init_from}'s model.max_position_embeddings")
    tokenizer_dir = Path(init_from) / checkpointing.TOKENIZER_DIR
    if not tokenizer_dir.is_dir() or Tokenizer(tokenizer_dir).hf.get_vocab() != built.tokenizer.hf.get_vocab():
        raise ConfigError(f"teacher.init_from={init_from}: its tokenizer ({tokenizer_dir}) is not the policy's; "
                          "on-policy distillation needs one tokenizer (the teacher scores the policy's token ids)")
    chunks = build_model_chunks(teacher_cfg, parallel, built.params_dtype)
    lora.load_for_inference(init_from, chunks)
    for chunk in chunks:
        chunk.eval()
        for param in chunk.parameters():
            param.requires_grad = False
    return chunks, teacher_cfg


def build_ptx_loader(cfg: RLActorConfig, tokenizer):
    """The PTX data's loader (SFT-format micro batches), or None when ptx.data is null."""
    if cfg.ptx.data is None:
        return None
    from megatron.core import parallel_state as ps

    seq_length = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
    if cfg.ptx.max_seq_length > seq_length + 1:
        raise ConfigError(f"ptx.max_seq_length={cfg.ptx.max_seq_length} must be at most data.max_prompt_length + "
                          f"generation.max_new_tokens + 1 = {seq_length + 1}: PTX and policy micro batches share one "
                          "sequence length in the pipeline schedule")
    ptx_set = SFTDataset(cfg.ptx.data, tokenizer, cfg.ptx.max_seq_length, use_template=cfg.data.chat_template)
    return setup.build_loader(ptx_set, trainer_cfg=cfg.trainer, data_parallel_size=ps.get_data_parallel_world_size(),
                              seed=cfg.seed, shuffle=True, pad_id=tokenizer.pad_id, pad_to_multiple_of=1)


def build_engine_and_router(gen: GenerationSection, chunks, model_cfg, tokenizer, max_prompt_length: int):
    """The generation engine on this replica and the router that hands it prompts (collective)."""
    from megatron.core import parallel_state as ps

    seq_length = max_prompt_length + gen.max_new_tokens
    if gen.engine == "native":
        engine = NativeEngine(chunks, model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                              max_batch_size=gen.micro_batch_size, max_sequence_length=seq_length,
                              decode=tokenizer.decode)
    else:
        engine = TensorRTLLMEngine(model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                                   work_dir=Path(gen.trtllm_work_dir) / f"replica_{ps.get_data_parallel_rank()}",
                                   max_batch_size=gen.micro_batch_size, max_input_len=max_prompt_length,
                                   max_sequence_length=seq_length)
    if gen.router == "dynamic":
        router = DynamicRouter(micro_batch_size=gen.micro_batch_size, data_parallel_group=ps.get_data_parallel_group(),
                               model_parallel_group=ps.get_model_parallel_group(), port=gen.router_port)
    else:
        router = StaticRouter(micro_batch_size=gen.micro_batch_size, data_parallel_group=ps.get_data_parallel_group())
    return engine, router


def build_reward_source(section: RewardSection, probe_prompts: Optional[str] = None):
    """What scores responses (source server or function; combined: the critic server sends them); the
    section's RewardChecks check their scores. Reward functions are called once on the first record of
    the prompt file `probe_prompts` (when given) with the response "": one that fails there ends the run
    before anything else is built."""
    if section.source == "function":
        source = RuleRewardSource(section)
        if probe_prompts is not None:
            record, prompt, columns = first_prompt_record(probe_prompts)
            source.probe(prompt, columns, record)
        return source
    server = section.server
    return RewardServerSource(RewardClient(server.host, server.port, server.model_name, timeout_s=server.timeout_s,
                                           ready_timeout_s=server.ready_timeout_s), section.attribute_index, section)


def build_critic_client(section: CriticSection):
    server = section.server
    return CriticClient(server.host, server.port, infer_model=server.model_name, timeout_s=server.timeout_s,
                        ready_timeout_s=server.ready_timeout_s)
