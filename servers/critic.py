"""PPO critic server: value inference, value training and checkpoints of one critic over PyTriton.

    python examples/nlp/gpt/serve_ppo_critic.py critic.init_from=RM_CHECKPOINT [key=value ...]
    torchrun --nproc_per_node N examples/nlp/gpt/serve_ppo_critic.py critic.init_from=... \
        parallel.tensor_model_parallel_size=2

The critic is the reward-model architecture (GPT body + one scalar head, bias trained) initialised
from a reward-model checkpoint (`critic.init_from`; a policy checkpoint gives a fresh head), or, when
`checkpoint.save_dir` already holds a critic checkpoint, resumed from the newest one (model,
optimizer, LR schedule, critic step), so a restarted server continues the run. Rank 0 runs Triton;
every rank of the TP/PP/DP job computes (see `servers.triton.CollectiveServing`). The client is
`aligner.clients.critic.CriticClient`; the names and packing rules both sides share are in
`aligner.clients.protocol`.

Every call (inference, training, saving, the reward pass) runs as one collective call under
CollectiveServing's lock: an inference that arrives during training waits for it, and training
never starts in the middle of an inference.

Triton models (names from `server.*_model_name`; every tensor has a leading batch dimension):

critic_infer  (dynamic batching, like the reward-model server)
  in   tokens            int64 [B, width]   token ids (prompt + response), right-padded
       sequence_lengths  int64 [B, 1]       real tokens per row, 1..width
  out  values            float32 [B, width] column c = the critic's value of the prefix tokens[:c + 1];
                                            0 from the row's length on; NaN for a rejected row.
                                            The value of response token j (whose logprob the actor
                                            reads from logits column prompt_length - 1 + j, see
                                            aligner/generation/logprobs.py) is at column
                                            prompt_length - 1 + j.
       error             bytes [B, 1]       empty if the row was computed, else why it was rejected
       rewards           float32 [B, 1]     combined mode only: the reward model's (normalised) reward
  Rows are validated one by one exactly as the reward-model server does (ids outside the
  vocabulary, empty or too long sequences, lengths beyond the tokens sent, missing inputs, a
  request over `server.max_request_bytes`); the
  client pads widths to powers of two so concurrent requests batch together, and the server cuts
  the padding to the longest row rounded up to `pad_sequence_length_to_multiple`.

critic_train  (no batching: one request is one rollout batch, sent as Triton batch size 1)
  in   tokens            int64 [1, B, width]  prompt + response per row, right-padded
       sequence_lengths  int64 [1, B]         prompt + response length per row
       prompt_lengths    int64 [1, B]         prompt length per row (>= 1, < sequence length)
       returns           float32 [1, B, T]    value targets per response token (T >= longest response;
                                              entries past a response's end are ignored)
       old_values        float32 [1, B, T]    the critic's values at rollout time, same layout
  out  value_loss, clip_fraction, explained_variance, grad_norm, lr, critic_step: float32 [1, 1] each
       error             bytes [1, 1]         empty, or why the batch was rejected (nothing trained)
  A batch of more than `server.max_train_rows` rows or `server.max_request_bytes` bytes is rejected
  before anything is checked or trained.
  Training: `train.epochs_per_call` passes over the batch, in optimizer steps of
  `train.global_batch_size` rows (B must be a multiple of it), each split over the data-parallel
  ranks and into micro batches of `train.micro_batch_size` through megatron's pipeline schedule.
  The loss is `aligner.rl.ppo_math.value_loss` (clipped with `train.clip_val`), the mean over the
  response tokens of the optimizer step. value_loss, clip_fraction and grad_norm are means over
  the call's optimizer steps (one step: the loss before the update); explained_variance compares
  old_values with returns (the critic before the update); lr is the last step's rate; critic_step
  counts optimizer steps since the critic was created.

critic_save
  in   step   int64 [1, 1]   the caller's step (the actor passes its own, so checkpoints pair up)
  out  path   bytes [1, 1]   checkpoint.save_dir/step_<step> (model, optimizer, LR schedule, critic
                             step); the newest checkpoint.keep_last are kept
       error  bytes [1, 1]

reward_model  (combined mode only, `combine_rm_and_critic: true` with `reward_model_file`)
  The reward-model server's model, same inputs and outputs (servers/reward_model.py), so the
  existing RewardClient works unchanged. The reward-model weights stay in (pinned, on GPU) host
  memory and are swapped into the critic's model for each reward pass and swapped out again
  (`aligner.models.weight_swap.HostWeights`): one set of devices holds both models.

Errors. As in the reward-model server, a bad row or request is answered in its `error` output and
the server keeps serving; an exception while the model runs fails that call only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from omegaconf import MISSING

from aligner.clients.protocol import (
    CRITIC_INFER_MODEL,
    CRITIC_SAVE_MODEL,
    CRITIC_TRAIN_INPUTS,
    CRITIC_TRAIN_METRICS,
    CRITIC_TRAIN_MODEL,
    ERROR,
    LENGTHS,
    OLD_VALUES,
    PAD_ID,
    PATH,
    PROMPT_LENGTHS,
    RETURNS,
    REWARD_MODEL,
    REWARDS,
    STEP,
    TOKENS,
    VALUES,
    encode_errors,
    packed_width,
    request_over_size_cap,
    token_outside_vocabulary,
)
from aligner.config import at_least, require_checkpoint_dir
from aligner.generation.logprobs import response_mask, response_values
from aligner.runtime.distributed import ParallelConfig
from aligner.training.setup import OptimConfig
from servers.reward_model import RewardInferenceConfig
from servers.triton import CollectiveServing, ServerConfig, TritonModel, TritonSetupError

LOGGER = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- config schema
@dataclass
class CriticSection:
    init_from: str = MISSING  # reward-model checkpoint (or a policy checkpoint: the value head starts fresh)


@dataclass
class CriticTrainConfig:
    global_batch_size: int = 64  # rows per optimizer step; a train request's rows must be a multiple
    micro_batch_size: int = 4  # rows per forward/backward on each data-parallel rank
    epochs_per_call: int = 1  # passes over each train request's batch
    clip_val: Optional[float] = 0.2  # value clipping around old_values; null: plain squared error
    max_steps: int = 1000  # optimizer steps the LR schedule spans (after them the LR stays at optim.min_lr)


@dataclass
class CriticCheckpointConfig:
    save_dir: str = "results/critic/checkpoints"  # critic_save writes here; a restart resumes from the newest
    keep_last: int = at_least(0, 2, "0: keep all")  # newest checkpoints kept


@dataclass
class CriticServingConfig(ServerConfig):
    """`server:` plus the names of the critic's Triton models (model_name is critic_infer's)."""

    model_name: str = CRITIC_INFER_MODEL
    train_model_name: str = CRITIC_TRAIN_MODEL
    save_model_name: str = CRITIC_SAVE_MODEL
    reward_model_name: str = REWARD_MODEL  # combined mode: the reward-model server's model
    max_request_bytes: int = 256 << 20  # a critic_train request is a whole rollout batch
    max_train_rows: int = 8192  # rows (sequences) of one critic_train request at most


@dataclass
class CriticServerConfig:
    """Schema of conf/gpt_ppo_critic.yaml (examples/nlp/gpt/serve_ppo_critic.py)."""

    critic: CriticSection = field(default_factory=CriticSection)
    combine_rm_and_critic: bool = False  # also serve the reward model from the same devices
    reward_model_file: Optional[str] = None  # combined mode: reward-model checkpoint
    normalize_rewards: bool = True  # combined mode: apply the reward model's stored normalisation
    seed: int = 1234
    precision: str = "auto"  # auto: fp32 on CPU, bf16 mixed precision on GPU
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    inference: RewardInferenceConfig = field(default_factory=RewardInferenceConfig)
    train: CriticTrainConfig = field(default_factory=CriticTrainConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, min_lr=1e-6, decay_style="constant"))
    checkpoint: CriticCheckpointConfig = field(default_factory=CriticCheckpointConfig)
    offload_optimizer_to_cpu: bool = False  # keep the Adam state in host memory between train calls
    server: CriticServingConfig = field(default_factory=CriticServingConfig)
    pad_sequence_length_to_multiple: int = 8

    def validate(self) -> None:
        positive = {"inference.micro_batch_size": self.inference.micro_batch_size,
                    "train.global_batch_size": self.train.global_batch_size,
                    "train.micro_batch_size": self.train.micro_batch_size,
                    "train.epochs_per_call": self.train.epochs_per_call, "train.max_steps": self.train.max_steps,
                    "pad_sequence_length_to_multiple": self.pad_sequence_length_to_multiple}
        for name, value in positive.items():
            if value < 1:
                raise TritonSetupError(f"{name} must be >= 1, got {value}")
        if self.train.clip_val is not None and not self.train.clip_val > 0:
            raise TritonSetupError(f"train.clip_val must be > 0 (or null to disable value clipping), got {self.train.clip_val}")
        if self.server.max_train_rows < self.train.global_batch_size:
            raise TritonSetupError(f"server.max_train_rows ({self.server.max_train_rows}) must be at least "
                                   f"train.global_batch_size ({self.train.global_batch_size})")
        if self.train.global_batch_size % self.train.micro_batch_size:
            raise TritonSetupError(f"train.global_batch_size ({self.train.global_batch_size}) must be a multiple of "
                                   f"train.micro_batch_size ({self.train.micro_batch_size})")
        if self.combine_rm_and_critic and not self.reward_model_file:
            raise TritonSetupError("combine_rm_and_critic=true needs reward_model_file=<reward-model checkpoint>")
        if self.reward_model_file and not self.combine_rm_and_critic:
            raise TritonSetupError("reward_model_file is only used with combine_rm_and_critic=true; set that, or "
                                   "drop reward_model_file")
        if self.parallel.virtual_pipeline_model_parallel_size:
            raise TritonSetupError("the critic server does not use a virtual pipeline; set "
                                   "parallel.virtual_pipeline_model_parallel_size=null")
        if self.parallel.sequence_parallel:
            raise TritonSetupError("the critic server does not use sequence parallelism; set parallel.sequence_parallel=false")
        names = [self.server.model_name, self.server.train_model_name, self.server.save_model_name]
        if self.combine_rm_and_critic:
            names.append(self.server.reward_model_name)
        if len(set(names)) != len(names):
            raise TritonSetupError(f"the server's model names must differ, got {names}")
        self.server.validate()

    def validate_layout(self, data_parallel_size: int) -> None:
        """Checks that need the data-parallel size (known once the job has started)."""
        rows_per_pass = self.train.micro_batch_size * data_parallel_size
        if self.train.global_batch_size % rows_per_pass:
            raise TritonSetupError(
                f"train.global_batch_size ({self.train.global_batch_size}) must be a multiple of train.micro_batch_size "
                f"x data-parallel size = {self.train.micro_batch_size} x {data_parallel_size}")


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
    from aligner.runtime.distributed import host_copy

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


# ----------------------------------------------------------------------------- the critic (every rank)
class Op(enum.IntEnum):
    """What a collective call does; the first tensor every rank receives."""

    VALUES = 0  # values (+ rewards in combined mode)
    REWARDS = 1  # rewards only (the reward_model Triton model)
    TRAIN = 2
    SAVE = 3


class Critic:
    """The critic's model, optimizer and schedule on this rank; every method is collective."""

    def __init__(self, cfg: CriticServerConfig, chunks: list, optimizer, scheduler, model_cfg, tokenizer_dir: str,
                 reward_weights=None, reward_normalization=None, *, run_id: str):
        from aligner.models.reward import RewardInference

        self.cfg = cfg
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.model_cfg = model_cfg
        self.tokenizer_dir = tokenizer_dir
        self.run_id = run_id  # carried by its checkpoints; pruning deletes only those
        self.step = 0
        self.saved_step = 0  # the critic step of the newest checkpoint (saved, or resumed from)
        self.value_inference = RewardInference(chunks, 1, cfg.inference.micro_batch_size)
        self.reward_weights = reward_weights  # HostWeights of the reward model (combined mode) or None
        self.reward_inference = RewardInference(chunks, 1, cfg.inference.micro_batch_size, reward_normalization)
        self.reward_attributes = ["reward"]  # the reward model's attribute name (combined mode)

    # -- the one collective entry point (CollectiveServing calls it on every rank)
    def run(self, op: torch.Tensor, *tensors: torch.Tensor):
        op = Op(int(op[0]))
        if op == Op.VALUES:
            return self.values_and_rewards(*tensors)
        if op == Op.REWARDS:
            return self.rewards(*tensors)
        if op == Op.TRAIN:
            return self.train(*tensors)
        return self.save(int(tensors[0][0]))

    # -- inference
    def values(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, S] values at every column (0 from each row's length on)."""
        return self.value_inference.token_scores(tokens, lengths)[..., 0]

    def rewards(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, 1] reward-model rewards, computed with the reward weights swapped in."""
        if self.reward_weights is None:
            raise RuntimeError("this critic server was started without a reward model (combine_rm_and_critic=false)")
        with self.reward_weights.swapped_in(self.chunks):
            return self.reward_inference.infer(tokens, lengths)

    def values_and_rewards(self, tokens: torch.Tensor, lengths: torch.Tensor):
        values = self.values(tokens, lengths)
        return values, (self.rewards(tokens, lengths) if self.reward_weights is not None else None)

    # -- training
    def train(self, tokens, sequence_lengths, prompt_lengths, returns, old_values) -> dict[str, float]:
        """epochs_per_call passes over the batch in optimizer steps of global_batch_size rows."""
        from megatron.core import parallel_state as ps

        train = self.cfg.train
        dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows_per_rank = train.global_batch_size // dp_size
        response_lengths = sequence_lengths - prompt_lengths
        per_step = []
        with optimizer_state_on_device(self.optimizer, self.cfg.offload_optimizer_to_cpu):
            for _ in range(train.epochs_per_call):
                for start in range(0, tokens.shape[0], train.global_batch_size):
                    first = start + dp_rank * rows_per_rank
                    microbatches = [
                        {"tokens": tokens[row:row + train.micro_batch_size],
                         "position_ids": torch.arange(tokens.shape[1]).expand(train.micro_batch_size, -1),
                         "prompt_lengths": prompt_lengths[row:row + train.micro_batch_size],
                         "response_lengths": response_lengths[row:row + train.micro_batch_size],
                         "returns": returns[row:row + train.micro_batch_size],
                         "old_values": old_values[row:row + train.micro_batch_size]}
                        for row in range(first, first + rows_per_rank, train.micro_batch_size)]
                    per_step.append(self._optimizer_step(microbatches))
        summary = {name: float(np.mean([step[name] for step in per_step]))
                   for name in ("value_loss", "clip_fraction", "grad_norm")}
        return {**summary, "lr": per_step[-1]["lr"], "critic_step": float(self.step)}

    def _optimizer_step(self, microbatches: list[dict]) -> dict[str, float]:
        from aligner.models.forward import run_microbatches
        from aligner.rl.ppo_math import value_loss
        from aligner.training.trainer import reduce_reports

        clip_val = self.cfg.train.clip_val

        def forward(model, batch):
            return model(batch["tokens"], batch["position_ids"], None)

        def loss(batch, scores):
            width = batch["returns"].shape[1]
            values = response_values(scores[..., 0].float(), batch["prompt_lengths"], width)  # [mb, T]
            mask = response_mask(batch["response_lengths"], width)
            mean_loss, stats = value_loss(values, batch["old_values"], batch["returns"], mask, clip_val)
            tokens = mask.sum()
            # Megatron's per-token loss mode divides by the token count of the whole optimizer step
            # (all micro batches and data-parallel ranks): hand it the sum, so the step's loss is
            # value_loss's token mean over the step's global batch.
            loss_sum = mean_loss * tokens
            report = {"loss_sum": loss_sum.detach(), "tokens": tokens.float(),
                      "clipped": stats["clip_fraction"] * tokens}
            return loss_sum, tokens.to(torch.int), report

        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it after)
        reports = run_microbatches(self.chunks, microbatches, forward, loss, forward_only=False,
                                   seq_length=microbatches[0]["tokens"].shape[1],
                                   micro_batch_size=microbatches[0]["tokens"].shape[0])
        totals = reduce_reports(reports)
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise FloatingPointError(f"critic step {self.step + 1}: the optimizer step failed (inf/nan in gradients)")
        self.scheduler.step(increment=1)
        self.step += 1
        tokens = max(totals["tokens"], 1.0)
        return {"value_loss": totals["loss_sum"] / tokens, "clip_fraction": totals["clipped"] / tokens,
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": lr}

    # -- checkpoints
    def state_dict(self) -> dict:
        from aligner.training import schedule

        return {"critic_step": self.step, "scheduler": self.scheduler.state_dict(),
                schedule.STATE_KEY: self.schedule_settings()}

    def schedule_settings(self) -> dict:
        from aligner.training import schedule

        return schedule.schedule_settings(self.cfg.optim, {"train.max_steps": self.cfg.train.max_steps})

    def save(self, step: int):
        from aligner import checkpointing

        with optimizer_state_on_device(self.optimizer, self.cfg.offload_optimizer_to_cpu):
            path = checkpointing.save(
                checkpointing.step_dir(self.cfg.checkpoint.save_dir, step), self.chunks,
                model_config=self.model_cfg.to_dict(), optimizer=self.optimizer,
                trainer_state={**self.state_dict(), "caller_step": step}, tokenizer_dir=self.tokenizer_dir,
                run_id=self.run_id,
                # A reward-model checkpoint with one attribute: it loads as a critic or a reward model.
                extra_meta={"reward": {"type": "value", "attributes": ["value"], "normalization": None},
                            "critic": {"init_from": self.cfg.critic.init_from}})
        checkpointing.remove_old_checkpoints(self.cfg.checkpoint.save_dir, self.cfg.checkpoint.keep_last,
                                             run_id=self.run_id, saved=path)
        self.saved_step = self.step
        return path

    def resume_from(self, checkpoint_dir) -> None:
        from aligner import checkpointing

        with optimizer_state_on_device(self.optimizer, self.cfg.offload_optimizer_to_cpu):
            meta = checkpointing.load(checkpoint_dir, self.chunks, optimizer=self.optimizer)
        state = meta.get("trainer_state", {})
        if "critic_step" not in state:
            raise checkpointing.CheckpointError(
                f"{checkpoint_dir} is not a critic checkpoint (no critic_step in its trainer state); "
                f"checkpoint.save_dir must be the critic's own directory")
        self.step = int(state["critic_step"])
        self.saved_step = self.step
        from aligner.training import schedule

        changes = schedule.resume_schedule(self.scheduler, self.optimizer, state, self.schedule_settings())
        if changes:
            LOGGER.warning("critic %s", schedule.describe_changes(changes, self.step))


def build_critic(cfg: CriticServerConfig) -> tuple[Critic, int]:
    """Every rank: start the job, build the critic (init_from, or resumed from save_dir), load the
    reward weights in combined mode. Returns (critic, data-parallel size)."""
    from aligner import checkpointing
    from aligner.models.reward import HEAD_STATE_PREFIX, RewardModelInfo, RewardNormalization, build_reward_model
    from aligner.models.weight_swap import HostWeights
    from aligner.training import setup

    require_checkpoint_dir(cfg.critic.init_from, "critic.init_from")
    if cfg.combine_rm_and_critic:
        require_checkpoint_dir(cfg.reward_model_file, "reward_model_file")
    init_meta = checkpointing.read_meta(cfg.critic.init_from)
    # A one-attribute reward model's head is the critic's; any other checkpoint gives the body only.
    head_fits = len(init_meta.get("reward", {}).get("attributes", [])) == 1
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed,
        model=setup.ModelSection(init_from=cfg.critic.init_from), tokenizer=setup.TokenizerConfig(), optim=cfg.optim,
        save_dir=cfg.checkpoint.save_dir, resume=True, init_from_key="critic.init_from",
        chunk_builder=lambda model_cfg, config, **kw: build_reward_model(model_cfg, config, num_attributes=1,
                                                                           head_seed=cfg.seed, train_bias=True, **kw),
        skip_prefixes=() if head_fits else (HEAD_STATE_PREFIX,))
    cfg.validate_layout(built.data_parallel_size)
    scheduler = setup.build_scheduler(built.optimizer, cfg.optim, cfg.train.max_steps)
    init_normalization = init_meta.get("reward", {}).get("normalization")
    if head_fits and init_normalization and built.resume_checkpoint is None:
        # Values start in the units of the normalised rewards the actor trains on (not off by the
        # reward model's raw offset, which value clipping would take many steps to walk back).
        from aligner.models.reward import fold_normalization_into_head

        fold_normalization_into_head(built.chunks, RewardNormalization(**init_normalization))
        built.optimizer.reload_model_params()  # mixed precision: the fp32 main copy follows

    reward_weights, normalization = None, None
    if cfg.combine_rm_and_critic:
        reward_meta = checkpointing.read_meta(cfg.reward_model_file)
        info = RewardModelInfo.from_meta(reward_meta, cfg.reward_model_file)
        if len(info.attributes) != 1:
            raise checkpointing.CheckpointError(
                f"{cfg.reward_model_file}: combined mode needs a one-attribute reward model (it shares the critic's "
                f"one-output head shape); this one predicts {info.attributes}")
        if reward_meta["model"] != built.model_cfg.to_dict():
            differing = sorted(key for key, value in reward_meta["model"].items()
                               if built.model_cfg.to_dict().get(key) != value)
            raise checkpointing.CheckpointError(
                f"{cfg.reward_model_file}: combined mode needs the reward model and the critic to share one "
                f"architecture; they differ in {differing}")
        # Load the reward model through the live chunks, keep its weights on the host, put the critic back.
        critic_weights = HostWeights.snapshot(built.chunks)
        checkpointing.load(cfg.reward_model_file, built.chunks)
        reward_weights = HostWeights.snapshot(built.chunks)
        critic_weights.exchange(built.chunks)
        if cfg.normalize_rewards and info.normalization:
            normalization = RewardNormalization(**info.normalization)

    critic = Critic(cfg, built.chunks, built.optimizer, scheduler, built.model_cfg, built.tokenizer_dir,
                    reward_weights, normalization, run_id=built.run_id)
    if cfg.combine_rm_and_critic:
        critic.reward_attributes = list(info.attributes)
    if built.resume_checkpoint is not None:
        critic.resume_from(built.resume_checkpoint)
        LOGGER.info("resumed the critic from %s at critic step %d", built.resume_checkpoint, critic.step)
    if cfg.offload_optimizer_to_cpu:
        move_optimizer_state(critic.optimizer, to_host=True)
    return critic, built.data_parallel_size


# ----------------------------------------------------------------------------- the transport (rank 0)
class _OpChannel:
    """`run(*tensors)` of one op over the critic's CollectiveServing (what RewardModelServer calls)."""

    def __init__(self, serving: CollectiveServing, op: Op):
        self.serving, self.op = serving, op

    def run(self, *tensors: torch.Tensor):
        return self.serving.run(torch.tensor([int(self.op)], dtype=torch.int64), *tensors)


class TrainRequestError(ValueError):
    pass


class CriticServer:
    """Decodes critic requests, runs them collectively, encodes the answers."""

    def __init__(self, cfg: CriticServerConfig, critic: Critic, serving: CollectiveServing, tokenizer,
                 reward_tokenizer=None):
        from aligner.models.reward import LoadedRewardModel, RewardModelInfo
        from servers.reward_model import RewardModelServer

        self.cfg = cfg
        self.serving = serving
        self.combined = critic.reward_weights is not None
        self.vocab_size = critic.model_cfg.vocab_size
        self.max_length = critic.model_cfg.max_position_embeddings
        self.critic_step = critic.step  # at start-up (for the ready line)

        def reward_server(inference, tok, op, attributes):
            view = LoadedRewardModel(inference, tok, critic.model_cfg, RewardModelInfo(attributes=attributes),
                                     critic.chunks)
            return RewardModelServer(view, _OpChannel(serving, op),
                                     pad_sequence_length_to_multiple=cfg.pad_sequence_length_to_multiple,
                                     max_request_bytes=cfg.server.max_request_bytes)

        # The reward-model server's row decoding and validation, reused for critic_infer's rows.
        self.rows = reward_server(critic.value_inference, tokenizer, Op.VALUES, ["value"])
        self.reward_server = (reward_server(critic.reward_inference, reward_tokenizer, Op.REWARDS, critic.reward_attributes)
                              if self.combined else None)

    def triton_models(self, data_parallel_size: int) -> list[TritonModel]:
        from pytriton.model_config import Tensor

        server = self.cfg.server
        preferred = server.preferred_batch_sizes or [
            min(self.cfg.inference.micro_batch_size * data_parallel_size, server.max_batch_size)]
        infer_outputs = [Tensor(name=VALUES, dtype=np.float32, shape=(-1,)), Tensor(name=ERROR, dtype=bytes, shape=(1,))]
        if self.combined:
            infer_outputs.append(Tensor(name=REWARDS, dtype=np.float32, shape=(1,)))
        models = [
            TritonModel(name=server.model_name, infer_fn=self.infer,
                        inputs=[Tensor(name=TOKENS, dtype=np.int64, shape=(-1,), optional=True),
                                Tensor(name=LENGTHS, dtype=np.int64, shape=(1,), optional=True)],
                        outputs=infer_outputs, max_batch_size=server.max_batch_size,
                        max_queue_delay_microseconds=server.max_queue_delay_microseconds,
                        preferred_batch_sizes=list(preferred)),
            # Batch size 1 = one whole rollout batch per request; Triton never merges two of them.
            TritonModel(name=server.train_model_name, infer_fn=self.train,
                        inputs=[Tensor(name=TOKENS, dtype=np.int64, shape=(-1, -1), optional=True),
                                Tensor(name=LENGTHS, dtype=np.int64, shape=(-1,), optional=True),
                                Tensor(name=PROMPT_LENGTHS, dtype=np.int64, shape=(-1,), optional=True),
                                Tensor(name=RETURNS, dtype=np.float32, shape=(-1, -1), optional=True),
                                Tensor(name=OLD_VALUES, dtype=np.float32, shape=(-1, -1), optional=True)],
                        outputs=[*(Tensor(name=name, dtype=np.float32, shape=(1,)) for name in CRITIC_TRAIN_METRICS),
                                 Tensor(name=ERROR, dtype=bytes, shape=(1,))],
                        max_batch_size=1, max_queue_delay_microseconds=0),
            TritonModel(name=server.save_model_name, infer_fn=self.save,
                        inputs=[Tensor(name=STEP, dtype=np.int64, shape=(1,))],
                        outputs=[Tensor(name=PATH, dtype=bytes, shape=(1,)), Tensor(name=ERROR, dtype=bytes, shape=(1,))],
                        max_batch_size=1, max_queue_delay_microseconds=0),
        ]
        if self.combined:
            models.append(self.reward_server.triton_model(dataclasses.replace(server, model_name=server.reward_model_name),
                                                          data_parallel_size))
        return models

    @property
    def model_names(self) -> list[str]:
        server = self.cfg.server
        names = [server.model_name, server.train_model_name, server.save_model_name]
        return names + ([server.reward_model_name] if self.combined else [])

    # -- critic_infer
    def infer(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """One merged batch: validate every row (as the reward server does), compute the valid ones together."""
        decoded = [self.rows.decode_rows(request) for request in requests]
        widths = [request[TOKENS].shape[1] if TOKENS in request and request[TOKENS].ndim == 2 else 1
                  for request in requests]
        values = [np.full((len(rows), width), np.nan, dtype=np.float32) for rows, width in zip(decoded, widths)]
        rewards = [np.full((len(rows), 1), np.nan, dtype=np.float32) for rows in decoded]
        valid = [(request_index, row, ids) for request_index, rows in enumerate(decoded)
                 for row, (ids, _) in enumerate(rows) if ids is not None]
        if valid:
            tokens, lengths = self.rows.pack([ids for _, _, ids in valid])
            try:
                computed_values, computed_rewards = _OpChannel(self.serving, Op.VALUES).run(tokens, lengths)
            except Exception as error:
                LOGGER.exception("the critic failed on a batch of %s", tuple(tokens.shape))
                raise RuntimeError(f"the critic failed on a batch of {tokens.shape[0]} sequences of up to "
                                   f"{tokens.shape[1]} tokens: {type(error).__name__}: {error}") from None
            computed_values = computed_values.float().numpy()  # [valid rows, packed width]
            for index, (request_index, row, ids) in enumerate(valid):
                out = values[request_index][row]
                out[:] = 0.0
                out[:len(ids)] = computed_values[index, :len(ids)]
                if computed_rewards is not None:
                    rewards[request_index][row] = computed_rewards[index].float().numpy()
        answers = []
        for request_values, request_rewards, rows in zip(values, rewards, decoded):
            answer = {VALUES: request_values, ERROR: encode_errors([error for _, error in rows])}
            if self.combined:
                answer[REWARDS] = request_rewards
            answers.append(answer)
        return answers

    # -- critic_train
    def train(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return [self._train_one(request) for request in requests]

    def _train_one(self, request: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from aligner.rl.ppo_math import explained_variance

        try:
            tokens, lengths, prompt_lengths, returns, old_values = self.decode_train(request)
        except TrainRequestError as error:
            return _train_answer({name: float("nan") for name in CRITIC_TRAIN_METRICS}, str(error))
        mask = response_mask(lengths - prompt_lengths, returns.shape[1])
        variance_explained = float(explained_variance(old_values.double(), returns.double(), mask))
        try:
            metrics = _OpChannel(self.serving, Op.TRAIN).run(tokens, lengths, prompt_lengths, returns, old_values)
        except Exception as error:
            LOGGER.exception("critic training failed on a batch of %s", tuple(tokens.shape))
            raise RuntimeError(f"critic training failed on a batch of {tokens.shape[0]} sequences: "
                               f"{type(error).__name__}: {error}") from None
        self.critic_step = int(metrics["critic_step"])
        return _train_answer({**metrics, "explained_variance": variance_explained}, "")

    def decode_train(self, request: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
        """Check a train request; (tokens [B, S], sequence_lengths [B], prompt_lengths [B], returns [B, T],
        old_values [B, T]) cut to the longest row and response, or TrainRequestError saying what is wrong."""
        oversize = request_over_size_cap(request, self.cfg.server.max_request_bytes)
        if oversize:
            raise TrainRequestError(oversize)
        missing = [name for name in CRITIC_TRAIN_INPUTS if name not in request]
        if missing:
            raise TrainRequestError(f"missing input {', '.join(missing)}; a train request carries "
                                    f"{list(CRITIC_TRAIN_INPUTS)}")
        tokens, lengths, prompts, returns, old_values = (request[name] for name in CRITIC_TRAIN_INPUTS)
        rows, max_rows = (tokens.shape[1] if tokens.ndim > 1 else 0), self.cfg.server.max_train_rows
        if rows > max_rows:
            raise TrainRequestError(f"a train batch of {rows} rows is more than the server accepts ({max_rows} rows, "
                                    f"server.max_train_rows): split the rollout batch, or restart the server with a "
                                    f"larger server.max_train_rows")
        if tokens.shape[0] != 1:
            raise TrainRequestError(f"one train request is one rollout batch (Triton batch size 1); got {tokens.shape[0]}")
        tokens, lengths, prompts, returns, old_values = (x[0] for x in (tokens, lengths, prompts, returns, old_values))
        rows = tokens.shape[0]
        if lengths.shape != (rows,) or prompts.shape != (rows,):
            raise TrainRequestError(f"{LENGTHS} and {PROMPT_LENGTHS} need one entry per row of {TOKENS} ({rows}); "
                                    f"got shapes {list(lengths.shape)} and {list(prompts.shape)}")
        if returns.shape != old_values.shape or returns.shape[0] != rows:
            raise TrainRequestError(f"{RETURNS} and {OLD_VALUES} must both be [rows={rows}, response width]; got "
                                    f"{list(returns.shape)} and {list(old_values.shape)}")
        global_batch = self.cfg.train.global_batch_size
        if rows == 0 or rows % global_batch:
            raise TrainRequestError(f"a train batch of {rows} rows is not a multiple of train.global_batch_size "
                                    f"({global_batch})")
        width, response_width = tokens.shape[1], returns.shape[1]
        for row in range(rows):
            length, prompt = int(lengths[row]), int(prompts[row])
            where = f"row {row}:"
            if not 1 <= prompt < length:
                raise TrainRequestError(f"{where} {PROMPT_LENGTHS} {prompt} must be >= 1 and less than its "
                                        f"{LENGTHS} {length} (at least one response token)")
            if length > min(width, self.max_length):
                raise TrainRequestError(f"{where} {LENGTHS} {length} exceeds the {width} token columns sent or the "
                                        f"model's max_position_embeddings ({self.max_length})")
            if length - prompt > response_width:
                raise TrainRequestError(f"{where} its response has {length - prompt} tokens but {RETURNS} has only "
                                        f"{response_width} columns")
            outside = token_outside_vocabulary(tokens[row, :length], self.vocab_size)
            if outside:
                raise TrainRequestError(f"{where} {outside}")
            for name, array in ((RETURNS, returns), (OLD_VALUES, old_values)):
                if not np.isfinite(array[row, :length - prompt]).all():
                    raise TrainRequestError(f"{where} {name} has a non-finite value within the response")
        longest, longest_response = int(lengths.max()), int((lengths - prompts).max())
        packed_columns = packed_width(longest, self.cfg.pad_sequence_length_to_multiple, self.max_length)
        packed = np.full((rows, packed_columns), PAD_ID, dtype=np.int64)  # the sender's padding may be anything
        for row in range(rows):
            packed[row, :lengths[row]] = tokens[row, :lengths[row]]
        as_tensor = lambda array, dtype: torch.from_numpy(np.ascontiguousarray(array)).to(dtype)  # noqa: E731
        return (as_tensor(packed, torch.int64), as_tensor(lengths, torch.int64), as_tensor(prompts, torch.int64),
                as_tensor(returns[:, :longest_response], torch.float32),
                as_tensor(old_values[:, :longest_response], torch.float32))

    # -- critic_save
    def save(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        answers = []
        for request in requests:
            step = int(np.asarray(request[STEP]).reshape(-1)[0])
            if step < 0:
                answers.append(_save_answer("", f"{STEP} must be >= 0, got {step}"))
                continue
            try:
                path = _OpChannel(self.serving, Op.SAVE).run(torch.tensor([step], dtype=torch.int64))
            except Exception as error:
                LOGGER.exception("saving the critic failed")
                raise RuntimeError(f"saving the critic at step {step} failed: {type(error).__name__}: {error}") from None
            LOGGER.info("saved the critic to %s", path)
            answers.append(_save_answer(str(path), ""))
        return answers


def _train_answer(metrics: Mapping[str, float], error: str) -> dict[str, np.ndarray]:
    answer = {name: np.array([[metrics[name]]], dtype=np.float32) for name in CRITIC_TRAIN_METRICS}
    answer[ERROR] = encode_errors([error])
    return answer


def _save_answer(path: str, error: str) -> dict[str, np.ndarray]:
    return {PATH: np.array([[path.encode()]], dtype=object), ERROR: encode_errors([error])}


def serve_critic(cfg: CriticServerConfig) -> None:
    """Build the critic on every rank of the job and serve it until SIGINT/SIGTERM (then raise
    `stopping.Interrupted`: the entry point exits 128 + the signal number)."""
    from pathlib import Path

    from aligner import checkpointing
    from aligner.runtime import distributed
    from aligner.tokenizer import Tokenizer
    from servers.triton import check_ports_free, prepare_environment, serve

    cfg.validate()
    if distributed.rank_and_world_from_env()[0] == 0:  # fail before loading a model if Triton cannot start
        prepare_environment()
        check_ports_free(cfg.server)
    try:
        critic, data_parallel_size = build_critic(cfg)
        serving = CollectiveServing(critic.run)
        reward_tokenizer = (Tokenizer(Path(cfg.reward_model_file) / checkpointing.TOKENIZER_DIR)
                            if cfg.combine_rm_and_critic else None)
        server = CriticServer(cfg, critic, serving, Tokenizer(critic.tokenizer_dir), reward_tokenizer)
        ready = (f"critic server ready on {cfg.server.http_url} (models {server.model_names}, "
                 f"critic step {critic.step})")
        try:
            serve(cfg.server, server.triton_models(data_parallel_size), serving, ready_message=ready)
        except KeyboardInterrupt:
            if critic.step != critic.saved_step:
                # Not saved here: a critic checkpoint must pair with the actor's checkpoint of the same
                # PPO step, and only the actor knows that step (it asks for critic_save when it saves,
                # also when it is stopped; launch_ppo.py stops the actor before the servers).
                LOGGER.warning("stopping with %d critic steps that no checkpoint holds (critic step %d, newest "
                               "checkpoint at critic step %d): the actor's next checkpoint request would have saved them",
                               critic.step - critic.saved_step, critic.step, critic.saved_step)
            raise
    finally:
        distributed.shutdown()
