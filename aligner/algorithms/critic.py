"""The PPO critic: a value model trained on the actor's returns (served by servers/critic.py).

The critic is the reward-model architecture (GPT body + one scalar head, bias trained) initialised
from a reward-model checkpoint (`critic.init_from`; a policy checkpoint gives a fresh head), or,
when `checkpoint.save_dir` already holds a critic checkpoint, resumed from the newest one (model,
optimizer, LR schedule, critic step), so a restarted server continues the run.

Combined mode (`combined.reward_model_init_from` set): the same devices also hold a reward model.
Its weights stay in (pinned, on GPU) host memory and are swapped into the critic's model for each
reward pass and swapped out again (`aligner.models.weight_swap.HostWeights`).

Training (`Critic.train`, one call per rollout batch): `train.epochs_per_call` passes over the
batch, in optimizer steps of `train.global_batch_size` rows, each split over the data-parallel
ranks and into micro batches of `train.micro_batch_size` through megatron's pipeline schedule.
Each step is the trainers' `optimizer_step` on a `ValueObjective`: `aligner.rl.shaping.value_loss_sum`
(clipped with `train.clip_val`) as (sum, count), so the step's loss is the token mean over the response
tokens of the optimizer step; the values of response token j are read at the column
the actor reads its logprob from (`aligner.models.logprobs.response_values`).

Reads top to bottom: config schema, optimizer-state offloading, the train batch and its metrics,
`Critic` (values, rewards, training, checkpoints) and `build_critic`. Every method of `Critic`
is collective: every rank of the job calls it with the same arguments.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from omegaconf import MISSING

from aligner import checkpointing
from aligner.config import ConfigError, at_least, one_of
from aligner.hf.sources import resolve_model_source, source_kind
from aligner.models.logprobs import response_mask, response_values
from aligner.models.lora import PEFTConfig, load_merged
from aligner.models.reward import (
    HEAD_STATE_PREFIX,
    RewardInference,
    RewardInferenceConfig,
    RewardModelInfo,
    RewardNormalization,
    build_reward_model,
    fold_normalization_into_head,
)
from aligner.models.weight_swap import HostWeights
from aligner.rl.masked import explained_variance
from aligner.rl.shaping import value_loss_sum
from aligner.runtime.distributed import PRECISIONS, ParallelConfig, host_copy
from aligner.training import schedule, setup
from aligner.training.checkpointed import Checkpointed
from aligner.training.metrics import get_logger
from aligner.training.setup import OptimConfig
from aligner.training.trainer import optimizer_step

LOGGER = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- config schema
@dataclass
class CriticSection:
    init_from: str = MISSING  # reward-model checkpoint (or a policy checkpoint: the value head starts fresh)


@dataclass
class CombinedSection:
    """Combined mode: the critic's devices also serve a reward model (one set of devices, two models)."""

    reward_model_init_from: Optional[str] = None  # the reward model's checkpoint; set: combined mode, null: critic only
    normalize_rewards: bool = True  # apply the reward model's stored normalisation

    @property
    def enabled(self) -> bool:
        return bool(self.reward_model_init_from)


@dataclass
class CriticTrainConfig:
    global_batch_size: int = at_least(1, 64)  # rows per optimizer step; a train batch's rows must be a multiple
    micro_batch_size: int = at_least(1, 4)  # rows per forward/backward on each data-parallel rank
    epochs_per_call: int = at_least(1, 1)  # passes over each train batch
    clip_val: Optional[float] = 0.2  # value clipping around old_values; null: plain squared error
    # optimizer steps the LR schedule spans (after them the LR stays at optim.min_lr)
    max_steps: int = at_least(1, 1000)

    def check_fields(self) -> Optional[tuple[str, str]]:
        if self.clip_val is not None and not self.clip_val > 0:
            return "clip_val", "must be > 0 (or null to disable value clipping)"
        if self.global_batch_size % self.micro_batch_size:
            return "global_batch_size", f"must be a multiple of train.micro_batch_size={self.micro_batch_size}"
        return None


@dataclass
class CriticCheckpointConfig:
    save_dir: str = "results/critic/checkpoints"  # save() writes step_<N> here; a restart resumes from the newest
    keep_last: int = at_least(0, 2, "0: keep all")  # newest checkpoints kept
    lock_wait_s: float = at_least(0.0, 0.0)  # one live critic per save_dir: seconds to wait for another to end


@dataclass
class CriticConfig:
    """The critic's settings (the critic server's schema adds its `server:` section)."""

    critic: CriticSection = field(default_factory=CriticSection)
    peft: PEFTConfig = field(default_factory=PEFTConfig)
    combined: CombinedSection = field(default_factory=CombinedSection)
    seed: int = 1234
    precision: str = one_of(PRECISIONS, "auto")  # auto: fp32 on CPU, bf16 mixed precision on GPU
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    inference: RewardInferenceConfig = field(default_factory=RewardInferenceConfig)
    train: CriticTrainConfig = field(default_factory=CriticTrainConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, min_lr=1e-6, decay_style="constant"))
    checkpoint: CriticCheckpointConfig = field(default_factory=CriticCheckpointConfig)
    offload_optimizer_to_cpu: bool = False  # keep the Adam state in host memory between train calls

    def validate(self) -> None:
        """Checks across sections (the schema checks single values when the config loads)."""
        if self.parallel.virtual_pipeline_model_parallel_size:
            raise ConfigError("the critic does not use a virtual pipeline; set "
                              "parallel.virtual_pipeline_model_parallel_size=null")
        if self.parallel.sequence_parallel:
            raise ConfigError("the critic does not use sequence parallelism; set parallel.sequence_parallel=false")
        if self.peft.enabled and self.combined.enabled:
            # The reward model is swapped in as whole weights; the critic's adapters would stay on top of them.
            raise ConfigError("peft.scheme=lora is not supported in combined mode (combined.reward_model_init_from "
                              "set); serve the reward model on its own, or set peft.scheme=none")

    def require_checkpoints(self) -> None:
        """The models named exist (checked before anything slow: a server checks this before its ports)."""
        source_kind(self.critic.init_from, "critic.init_from")
        if self.combined.enabled:
            source_kind(self.combined.reward_model_init_from, "combined.reward_model_init_from")

    def resolve_starts(self) -> None:
        """Set each start to the checkpoint it names (a run directory's latest, an HF/GGUF source's cached
        import: `aligner.hf.sources`); the critic reads them again later (its checkpoints record them)."""
        log = get_logger().info  # rank 0 prints
        self.critic.init_from = str(resolve_model_source(self.critic.init_from, "critic.init_from", log))
        if self.combined.enabled:
            self.combined.reward_model_init_from = str(resolve_model_source(
                self.combined.reward_model_init_from, "combined.reward_model_init_from", log))

    def validate_layout(self, data_parallel_size: int) -> None:
        """Checks that need the data-parallel size (known once the job has started, or to a launcher)."""
        rows_per_pass = self.train.micro_batch_size * data_parallel_size
        if self.train.global_batch_size % rows_per_pass:
            raise ConfigError(
                f"train.global_batch_size ({self.train.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size x data-parallel size = {self.train.micro_batch_size} x {data_parallel_size}")


# ----------------------------------------------------------------------------- optimizer offloading
def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron optimizer (chained or not)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(part, "optimizer", part) for part in parts]


def move_optimizer_state(optimizer, to_host: bool) -> int:
    """Move the optimizer's per-parameter state tensors (Adam's moments) to host memory, or back next
    to their parameters; returns how many tensors it handled. A no-op copy-free move on CPU.

    Scalar entries (Adam's `step`) stay where they are: torch's Adam keeps them on the CPU.
    """
    handled = 0
    for inner in _inner_optimizers(optimizer):
        for param, state in inner.state.items():
            for key, value in state.items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue
                target = torch.device("cpu") if to_host else param.device
                if value.device != target:
                    state[key] = host_copy(value) if to_host else value.to(target, non_blocking=True)
                handled += 1
    return handled


@contextlib.contextmanager
def optimizer_state_on_device(optimizer, offload: bool) -> Iterator[None]:
    """With offload: the optimizer state comes to the device for the block and goes back to host memory after."""
    if not offload:
        yield
        return
    move_optimizer_state(optimizer, to_host=False)
    try:
        yield
    finally:
        move_optimizer_state(optimizer, to_host=True)


# ----------------------------------------------------------------------------- the train batch and its metrics
@dataclass
class CriticTrainBatch:
    """One rollout batch to train on, the same on every rank (the server checked it)."""

    tokens: torch.Tensor  # int64 [B, S]: prompt + response per row, right-padded
    sequence_lengths: torch.Tensor  # int64 [B]: prompt + response length per row
    prompt_lengths: torch.Tensor  # int64 [B]: >= 1, < sequence length
    returns: torch.Tensor  # float32 [B, T]: value targets per response token (entries past a response are ignored)
    old_values: torch.Tensor  # float32 [B, T]: the critic's values at rollout time, same layout
    # float32 [B, T]: 1 on the response tokens trained on (an agent episode's model tokens), 0 elsewhere
    loss_mask: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = torch.ones_like(self.returns)

    def mask(self) -> torch.Tensor:
        """[B, T] bool: the response tokens the value loss trains on."""
        return response_mask(self.response_lengths, self.returns.shape[1]) & self.loss_mask.bool()

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.sequence_lengths - self.prompt_lengths

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in order: `CriticTrainBatch(*batch.tensors())` rebuilds it (e.g. on another rank)."""
        return tuple(getattr(self, spec.name) for spec in dataclasses.fields(self))


@dataclass
class CriticTrainMetrics:
    """What one training call reports (the names of the critic server's critic_train outputs)."""

    value_loss: float  # mean over the call's optimizer steps (one step: the loss before the update)
    clip_fraction: float  # mean over the call's optimizer steps
    explained_variance: float  # old_values against returns: the critic before the call
    grad_norm: float  # mean over the call's optimizer steps
    lr: float  # the last step's rate
    critic_step: float  # optimizer steps since the critic was created


# ----------------------------------------------------------------------------- the critic (every rank)
class ValueObjective:
    """The critic's `Objective` (aligner.training.trainer): the clipped value loss over the response tokens,
    as (sum, count) like the policy losses (`aligner.rl.shaping.value_loss_sum`). Micro batches are
    `CriticTrainBatch` fields as dicts; the values of response token j are read where the actor reads its
    logprob (`response_values`)."""

    def __init__(self, clip_val: Optional[float]):
        self.clip_val = clip_val

    def forward(self, model, batch: dict) -> torch.Tensor:
        tokens = batch["tokens"]
        rows, seq_length = tokens.shape
        return model(tokens, torch.arange(seq_length, device=tokens.device).expand(rows, -1), None)

    def loss(self, fields: dict, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        batch = CriticTrainBatch(**fields)  # the schedule hands each micro batch over as a dict, on the device
        width = batch.returns.shape[1]
        values = response_values(scores[..., 0].float(), batch.prompt_lengths, width)  # [mb, T]
        mask = batch.mask()
        loss_sum, tokens, clipped = value_loss_sum(values, batch.old_values, batch.returns, mask, self.clip_val)
        report = {"loss_sum": loss_sum.detach(), "tokens": tokens.float(), "clipped": clipped.float()}
        return loss_sum, tokens.to(torch.int), report

    def summarize(self, totals: dict[str, float]) -> dict[str, float]:
        tokens = max(totals["tokens"], 1.0)
        return {"value_loss": totals["loss_sum"] / tokens, "clip_fraction": totals["clipped"] / tokens}


class Critic(Checkpointed):
    """The critic's model, optimizer and schedule on this rank, and the reward model's weights in
    combined mode; every method is collective. Its steps are the trainers' `optimizer_step` on a
    `ValueObjective`; its checkpoints follow `aligner.training.checkpointed` (no metrics: no messages)."""

    def __init__(self, cfg: CriticConfig, chunks: list, optimizer, scheduler, model_cfg, tokenizer_dir: str, *,
                 run_id: str, reward_weights=None, reward_normalization=None,
                 reward_attributes: tuple = ("reward",), peft_meta: Optional[dict] = None):
        self.cfg = cfg
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.model_cfg = model_cfg
        self.tokenizer_dir = tokenizer_dir
        self.run_id = run_id  # carried by its checkpoints; pruning deletes only those
        self.peft_meta = peft_meta  # LoRA: its settings and base, in every checkpoint
        self.step = 0
        self.objective = ValueObjective(cfg.train.clip_val)
        self.save_dir, self.keep_last = cfg.checkpoint.save_dir, cfg.checkpoint.keep_last
        self.metrics = None  # the server logs; checkpoints are reported to the actor by path
        self.value_inference = RewardInference(chunks, 1, cfg.inference.micro_batch_size)
        self.reward_weights = reward_weights  # HostWeights of the reward model (combined mode) or None
        self.reward_inference = RewardInference(chunks, 1, cfg.inference.micro_batch_size, reward_normalization)
        self.reward_attributes = list(reward_attributes)  # the reward model's attribute name (combined mode)

    @property
    def combined(self) -> bool:
        return self.reward_weights is not None

    @property
    def reward_tokenizer_dir(self) -> Optional[Path]:
        init_from = self.cfg.combined.reward_model_init_from
        return Path(init_from) / checkpointing.TOKENIZER_DIR if self.combined else None

    # -- inference
    def values(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] right-padded, lengths [B] -> values [B, S]: column c is the value of the prefix
        tokens[:c + 1]; 0 from each row's length on."""
        return self.value_inference.token_scores(tokens, lengths)[..., 0]

    def rewards(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, 1] reward-model rewards (combined mode), computed with the reward weights swapped in."""
        if not self.combined:
            raise RuntimeError("this critic has no reward model (combined.reward_model_init_from is not set)")
        with self.reward_weights.swapped_in(self.chunks):
            return self.reward_inference.infer(tokens, lengths)

    def values_and_rewards(self, tokens: torch.Tensor, lengths: torch.Tensor):
        """(values [B, S], rewards [B, 1] in combined mode, else None)."""
        values = self.values(tokens, lengths)
        return values, (self.rewards(tokens, lengths) if self.combined else None)

    # -- training
    def train(self, batch: CriticTrainBatch) -> CriticTrainMetrics:
        """epochs_per_call passes over the batch in optimizer steps of train.global_batch_size rows
        (batch.rows must be a multiple of it)."""
        from megatron.core import parallel_state as ps

        train = self.cfg.train
        if batch.rows == 0 or batch.rows % train.global_batch_size:
            raise ValueError(f"a train batch of {batch.rows} rows is not a multiple of train.global_batch_size "
                             f"({train.global_batch_size})")
        mask = batch.mask()
        variance_explained = float(explained_variance(batch.old_values.double(), batch.returns.double(), mask))
        dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows_per_rank = train.global_batch_size // dp_size
        micro = train.micro_batch_size
        per_step = []
        with optimizer_state_on_device(self.optimizer, self.cfg.offload_optimizer_to_cpu):
            for _ in range(train.epochs_per_call):
                for start in range(0, batch.rows, train.global_batch_size):
                    first = start + dp_rank * rows_per_rank
                    microbatches = [CriticTrainBatch(*(tensor[row:row + micro] for tensor in batch.tensors()))
                                    for row in range(first, first + rows_per_rank, micro)]
                    per_step.append(self._optimizer_step(microbatches))
        return CriticTrainMetrics(
            value_loss=float(np.mean([step["value_loss"] for step in per_step])),
            clip_fraction=float(np.mean([step["clip_fraction"] for step in per_step])),
            explained_variance=variance_explained,
            grad_norm=float(np.mean([step["grad_norm"] for step in per_step])),
            lr=per_step[-1]["lr"], critic_step=float(self.step))

    def _optimizer_step(self, microbatches: list[CriticTrainBatch]) -> dict[str, float]:
        """One optimizer step through the trainers' own (`aligner.training.trainer.optimizer_step`)."""
        done = optimizer_step(self.chunks, self.optimizer, self.scheduler, self.objective,
                              [vars(batch) for batch in microbatches], f"critic step {self.step + 1}")
        self.step += 1
        return {**self.objective.summarize(done.totals), "grad_norm": done.grad_norm, "lr": done.lr}

    # -- checkpoints (the lifecycle: aligner.training.checkpointed)
    def state_dict(self) -> dict:
        return {"critic_step": self.step, "scheduler": self.scheduler.state_dict(),
                schedule.STATE_KEY: self.schedule_settings()}

    @property
    def saved_step(self) -> int:
        """The critic step of the newest checkpoint (saved, or resumed from); 0 before the first."""
        return self.saved_at or 0

    def restore(self, step: int) -> Path:
        """Load the checkpoint `save(step)` wrote (step: the caller's), whatever the critic trained since: a
        resumed actor's critic is then the one saved with the actor's checkpoint. CheckpointError (the same on
        every rank, before any collective) if save_dir holds no such checkpoint."""
        path = checkpointing.step_dir(self.save_dir, step)
        if not (path / checkpointing.META_FILE).is_file():
            held = [str(held_step) for held_step, _ in checkpointing.step_checkpoints(self.save_dir)]
            raise checkpointing.CheckpointError(
                f"the critic's checkpoint.save_dir={self.save_dir} holds no checkpoint of step {step} (it holds "
                f"{'steps ' + ', '.join(held) if held else 'none'}): the actor resumed from its step {step} and "
                f"its critic must be the one saved with it; keep checkpoint.keep_last of the critic at 2 or more "
                f"(its checkpoint of a step is written just before the actor's)")
        self.resume_from(path)
        return path

    def saved_state(self, step: int) -> dict:
        """save(step) names the checkpoint by the caller's step, so the actor's and the critic's pair up."""
        return {**self.state_dict(), "caller_step": step}

    def load_state_dict(self, state: dict) -> dict[str, tuple]:
        self.step = int(state["critic_step"])
        return schedule.resume_schedule(self.scheduler, self.optimizer, state, self.schedule_settings())

    def schedule_settings(self) -> dict:
        return schedule.schedule_settings(self.cfg.optim, {"train.max_steps": self.cfg.train.max_steps})

    def checkpoint_fields(self) -> dict:
        return {"model_config": self.model_cfg.to_dict(), "tokenizer_dir": self.tokenizer_dir,
                # A reward-model checkpoint with one attribute: it loads as a critic or a reward model.
                "extra_meta": {"reward": {"type": "value", "attributes": ["value"], "normalization": None},
                               "critic": {"init_from": self.cfg.critic.init_from},
                               **({"peft": self.peft_meta} if self.peft_meta else {})}}

    def load_fields(self) -> dict:
        return {}

    def optimizer_state_ready(self):
        return optimizer_state_on_device(self.optimizer, self.cfg.offload_optimizer_to_cpu)

    def check_trainer_state(self, checkpoint_dir: Path, state: dict) -> None:
        if "critic_step" not in state:
            raise checkpointing.CheckpointError(
                f"{checkpoint_dir} is not a critic checkpoint (no critic_step in its trainer state); "
                f"checkpoint.save_dir must be the critic's own directory")

    def report_resume(self, checkpoint_dir: Path, meta: dict, changes: dict) -> None:
        if changes:
            LOGGER.warning("critic %s", schedule.describe_changes(changes, self.step))


def build_critic(cfg: CriticConfig) -> tuple[Critic, int]:
    """Every rank: start the job, build the critic (critic.init_from, or resumed from
    checkpoint.save_dir), load the reward model's weights in combined mode. Returns (critic,
    data-parallel size)."""
    cfg.validate()
    cfg.require_checkpoints()
    cfg.resolve_starts()
    reward_init = cfg.combined.reward_model_init_from
    init_meta = checkpointing.read_meta(cfg.critic.init_from)
    # A one-attribute reward model's head is the critic's; any other checkpoint gives the body only.
    head_fits = len(init_meta.get("reward", {}).get("attributes", [])) == 1
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed,
        model=setup.ModelSection(init_from=cfg.critic.init_from), tokenizer=setup.TokenizerConfig(), optim=cfg.optim,
        save_dir=cfg.checkpoint.save_dir, resume=True, lock_wait_s=cfg.checkpoint.lock_wait_s,
        init_from_key="critic.init_from",
        sequence_lengths=(),  # the actor's rollouts: each request is checked against the positions (servers/critic.py)
        chunk_builder=lambda model_cfg, config, **kw: build_reward_model(model_cfg, config, num_attributes=1,
                                                                           head_seed=cfg.seed, train_bias=True, **kw),
        skip_prefixes=() if head_fits else (HEAD_STATE_PREFIX,),
        peft=cfg.peft, train_whole_with_lora=(HEAD_STATE_PREFIX,))  # LoRA: the value head trains whole
    cfg.validate_layout(built.data_parallel_size)
    scheduler = setup.build_scheduler(built.optimizer, cfg.optim, cfg.train.max_steps)
    init_normalization = init_meta.get("reward", {}).get("normalization")
    if head_fits and init_normalization and built.resume_checkpoint is None:
        # Values start in the units of the normalised rewards the actor trains on (not off by the
        # reward model's raw offset, which value clipping would take many steps to walk back).
        fold_normalization_into_head(built.chunks, RewardNormalization(**init_normalization))
        built.optimizer.reload_model_params()  # mixed precision: the fp32 main copy follows

    reward_weights, normalization, attributes = None, None, ("reward",)
    if cfg.combined.enabled:
        reward_meta = checkpointing.read_meta(reward_init)
        info = RewardModelInfo.from_meta(reward_meta, reward_init)
        if len(info.attributes) != 1:
            raise checkpointing.CheckpointError(
                f"combined.reward_model_init_from={reward_init}: combined mode needs a one-attribute reward model "
                f"(it shares the critic's one-output head shape); this one predicts {info.attributes}")
        if reward_meta["model"] != built.model_cfg.to_dict():
            differing = sorted(key for key, value in reward_meta["model"].items()
                               if built.model_cfg.to_dict().get(key) != value)
            raise checkpointing.CheckpointError(
                f"combined.reward_model_init_from={reward_init}: combined mode needs the reward model and the critic "
                f"to share one architecture; they differ in {differing}")
        # Load the reward model through the live chunks, keep its weights on the host, put the critic back.
        critic_weights = HostWeights.snapshot(built.chunks)
        load_merged(reward_init, built.chunks)  # (a LoRA reward model: merged into its base)
        reward_weights = HostWeights.snapshot(built.chunks)
        critic_weights.exchange(built.chunks)
        if cfg.combined.normalize_rewards and info.normalization:
            normalization = RewardNormalization(**info.normalization)
        attributes = tuple(info.attributes)

    critic = Critic(cfg, built.chunks, built.optimizer, scheduler, built.model_cfg, built.tokenizer_dir,
                    run_id=built.run_id, reward_weights=reward_weights, reward_normalization=normalization,
                    reward_attributes=attributes, peft_meta=built.peft_meta)
    if built.resume_checkpoint is not None:
        critic.resume_from(built.resume_checkpoint)
        LOGGER.info("resumed the critic from %s at critic step %d", built.resume_checkpoint, critic.step)
    if cfg.offload_optimizer_to_cpu:
        move_optimizer_state(critic.optimizer, to_host=True)
    return critic, built.data_parallel_size
