"""The training loop shared by every loss-over-batches algorithm (SFT, reward models, DPO, ...).

An algorithm supplies an *objective*: how a model chunk is run on a micro batch, the loss, and how
summed per-micro-batch reports become metrics. The `Trainer` owns everything else: megatron's
pipeline schedule, the optimizer and LR steps (`optimizer_step`, the critic's too), validation, checkpoints,
resume and metrics. Its loop is `aligner.training.loop`'s and its checkpoint lifecycle
`aligner.training.checkpointed`'s, shared with the RL actor (and, for checkpoints, the critic).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from aligner.config import at_least
from aligner.data.loader import row_lengths
from aligner.models.forward import run_microbatches
from aligner.runtime.distributed import device
from aligner.training import schedule
from aligner.training.checkpointed import Checkpointed
from aligner.training.loop import Cadence, run_loop
from aligner.training.metrics import MetricsLogger, PeakRate, transformer_flops_per_token


@dataclass
class TrainerConfig:
    """The `trainer:` section."""

    # 0: no training step (the initial weights are saved as step 0); with max_epochs set: no step limit
    max_steps: int = at_least(0, 100, "0: no training step, or no step limit when max_epochs is set")
    max_epochs: Optional[int] = at_least(1, None, "null: max_steps alone")
    global_batch_size: int = at_least(1, 32)
    micro_batch_size: int = at_least(1, 4)
    val_check_interval: int = 50  # steps; <= 0 disables
    limit_val_samples: Optional[int] = at_least(1, None, "null: the whole validation set")


@dataclass
class CheckpointConfig:
    """The `checkpoint:` section."""

    save_dir: str = "results/checkpoints"
    save_interval: int = at_least(0, 0, "0: only at the end")  # steps
    keep_last: int = at_least(0, 2, "0: keep all")
    save_at_end: bool = True
    resume: bool = True  # continue from the newest checkpoint in save_dir if there is one
    # One live run per save_dir: seconds to wait for a run that holds it to end (a Slurm requeue while the
    # old job still stops) before refusing; 0 refuses at once
    lock_wait_s: float = at_least(0.0, 0.0)
    # SIGTERM/SIGINT: stop at the next step boundary and save, within this many seconds of the
    # signal, else exit without the checkpoint (aligner/runtime/stopping.py)
    stop_grace_s: float = at_least(1.0, 600.0)


class Objective(Protocol):
    """What an algorithm tells the trainer.

    loss(batch, output) returns (loss_sum, count, report): megatron divides the gradient by the
    count summed over the whole global batch (all micro batches and data-parallel ranks), so the
    loss is a mean over that batch whatever the layout. `report` values are 1-element tensors that
    are summed the same way and handed to `summarize` to become metrics. An objective whose loss
    reads the logits at some positions only sets `reads_logits_at_positions = True`: its loss then
    gets `aligner.models.deferred_output.HiddenStates` on GPT chunks (the output layer applied where it reads).
    """

    def forward(self, model: torch.nn.Module, batch: dict) -> torch.Tensor: ...

    def loss(self, batch: dict, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]: ...

    def summarize(self, totals: dict[str, float]) -> dict[str, float]: ...


@dataclass
class OptimizerStep:
    """What one optimizer step reports: the objective's summed reports, the rate it used, the gradient norm."""

    totals: dict[str, float]
    lr: float
    grad_norm: float
    forward_backward_done: float  # perf_counter when the forward and backward passes had finished


def run_objective(chunks, objective: Objective, microbatches: list, forward_only: bool) -> dict[str, float]:
    """One pass of megatron's pipeline schedule; returns the reports summed over micro batches and DP."""
    tokens = batch_tokens(microbatches[0])
    reports = run_microbatches(
        chunks, microbatches, objective.forward, objective.loss, forward_only=forward_only,
        seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
        defer_output_layer=getattr(objective, "reads_logits_at_positions", False),
    )
    return reduce_reports(reports)


def optimizer_step(chunks, optimizer, scheduler, objective: Objective, microbatches: list,
                   name: str) -> OptimizerStep:
    """The one train step of every trainer (the critic's too): zero the gradients, forward and backward
    through the schedule, the optimizer step (FloatingPointError naming `name` on inf/nan gradients), the
    scheduler step."""
    for chunk in chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it after)
    totals = run_objective(chunks, objective, microbatches, forward_only=False)
    forward_backward_done = time.perf_counter()
    update_ok, grad_norm, _ = optimizer.step()
    if not update_ok:
        raise FloatingPointError(f"{name}: the optimizer step failed (inf/nan in gradients)")
    scheduler.step(increment=1)
    return OptimizerStep(totals, lr, float(grad_norm) if grad_norm is not None else float("nan"),
                         forward_backward_done)


class Trainer(Checkpointed):
    """fit / train_step / validate / save / resume over megatron model chunks wrapped in DDP."""

    def __init__(self, *, name: str, trainer_cfg: TrainerConfig, checkpoint_cfg: CheckpointConfig, objective: Objective,
                 chunks, optimizer, scheduler, train_loader, val_loader, metrics: MetricsLogger,
                 checkpoint_meta: dict, tokenizer_dir: Optional[str], num_params: int, num_layers: int,
                 hidden_size: int, peak_rate: PeakRate, run_id: str, schedule_settings: Optional[dict] = None):
        self.name = name
        self.trainer_cfg = trainer_cfg
        self.checkpoint_cfg = checkpoint_cfg
        self.objective = objective
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.metrics = metrics
        self.checkpoint_meta = checkpoint_meta  # {"model": GPTConfig dict, ...extra sections}
        self.tokenizer_dir = tokenizer_dir
        self.num_params, self.num_layers, self.hidden_size = num_params, num_layers, hidden_size
        self.peak_rate = peak_rate
        self.run_id = run_id  # carried by this run's checkpoints; pruning deletes only those
        self.save_dir, self.keep_last = checkpoint_cfg.save_dir, checkpoint_cfg.keep_last
        # what the LR schedule was built from (aligner.training.schedule), saved to tell a resume what changed
        self.schedule_settings = schedule_settings or {}
        self.step = 0
        self.consumed_samples = 0

    @property
    def total_steps(self) -> int:
        return self.train_loader.total_steps(self.trainer_cfg.max_steps, self.trainer_cfg.max_epochs)

    def nothing_to_train(self) -> Optional[tuple[str, str]]:
        """("already at step N of KEY=...", the key that sets the length) when a resumed run has no step left
        (re-running a finished run), else None."""
        total = self.total_steps
        if self.saved_at is None or self.step < total:  # a fresh run (max_steps=0 saves the start) or steps left
            return None
        limit = self.trainer_cfg.max_epochs
        if limit is None:
            return f"already at step {self.step} of trainer.max_steps={total}", "trainer.max_steps"
        return (f"already at step {self.step} of {total} (trainer.max_epochs={limit}, trainer.max_steps="
                f"{self.trainer_cfg.max_steps})", "trainer.max_epochs")

    # -- the loop
    def fit(self) -> None:
        batches = self.train_loader.iterate(self.consumed_samples)

        def step() -> dict[str, float]:
            # The step's time starts before its batch: loading may compute (DPO's swapped-in reference pass).
            fetch_start = time.perf_counter()
            return self.train_step(next(batches), started=fetch_start)

        validation = self.trainer_cfg.val_check_interval if self.val_loader is not None else 0
        with run_loop(self, Cadence.of(self.checkpoint_cfg, validation)) as loop:
            loop.run_until(self.total_steps, step)

    def count_step(self) -> None:
        self.step += 1
        self.consumed_samples += self.trainer_cfg.global_batch_size

    def train_step(self, microbatches: list, started: Optional[float] = None) -> dict[str, float]:
        """One optimizer step on `microbatches`. started: when the step began (perf_counter), if getting
        its batch took time that belongs to it; step_time, tokens/s and MFU then count that time too."""
        start = time.perf_counter()
        started = start if started is None else started
        done = optimizer_step(self.chunks, self.optimizer, self.scheduler, self.objective, microbatches,
                              f"step {self.step + 1}")
        optimizer_done = time.perf_counter()
        elapsed = optimizer_done - started
        tokens = global_token_count(microbatches)
        tokens_per_second = tokens / elapsed
        flops_per_token = transformer_flops_per_token(self.num_params, self.num_layers, self.hidden_size,
                                                      batch_tokens(microbatches[0]).shape[1])
        world = dist.get_world_size() if dist.is_initialized() else 1
        achieved = flops_per_token * tokens_per_second / world  # per device
        return {
            **self.objective.summarize(done.totals),
            "tokens": tokens,
            "lr": done.lr,
            "grad_norm": done.grad_norm,
            "tokens_per_second": tokens_per_second,
            "mfu": achieved / self.peak_rate.refresh(achieved),
            "step_time": elapsed,
            "time_data": start - started,
            "time_forward_backward": done.forward_backward_done - start,
            "time_optimizer": optimizer_done - done.forward_backward_done,
            "consumed_samples": self.consumed_samples + self.trainer_cfg.global_batch_size,
        }

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for microbatches in self.val_loader.iterate(0, epochs=1, limit_samples=self.trainer_cfg.limit_val_samples):
            for key, value in run_objective(self.chunks, self.objective, microbatches, forward_only=True).items():
                totals[key] = totals.get(key, 0.0) + value
        return self.objective.summarize(totals)

    # -- checkpoints (the lifecycle: aligner.training.checkpointed)
    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "scheduler": self.scheduler.state_dict(),
                schedule.STATE_KEY: self.schedule_settings}

    def load_state_dict(self, state: dict) -> dict[str, tuple]:
        """Continue from a checkpoint's trainer state under this run's schedule settings; returns
        {key: (checkpoint value, current value)} of the settings that changed."""
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples"]
        return schedule.resume_schedule(self.scheduler, self.optimizer, state, self.schedule_settings)

    def checkpoint_fields(self) -> dict:
        return {"model_config": self.checkpoint_meta["model"],
                "extra_meta": {k: v for k, v in self.checkpoint_meta.items() if k != "model"},
                "tokenizer_dir": self.tokenizer_dir, "save_rng": True}

    def resume_note(self, meta: dict) -> str:
        return (f" ({self.consumed_samples} samples consumed"
                f"{'' if meta['rng_restored'] else '; RNG not restored: the parallel layout changed'})")


def reduce_reports(reports: list[dict]) -> dict[str, float]:
    """Sum report values over micro batches and data-parallel ranks; the result reaches every rank.

    Keys ending in `_max` / `_min` are reduced with max / min instead of a sum (e.g. PPO's ratio
    extremes). Reports exist only on the last pipeline stage; the key set travels with the values so
    that every stage can take part in the collectives.
    """
    from megatron.core import parallel_state as ps

    # micro batches of different kinds may report different keys
    keys = sorted(set().union(*reports)) if reports else []
    if ps.get_pipeline_model_parallel_world_size() > 1:
        holder = [keys]
        dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        keys = holder[0]
    kinds = {"sum": [k for k in keys if not k.endswith(("_max", "_min"))],
             "max": [k for k in keys if k.endswith("_max")], "min": [k for k in keys if k.endswith("_min")]}
    start = {"sum": 0.0, "max": -math.inf, "min": math.inf}
    combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
    op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    result: dict[str, float] = {}
    for kind, names in kinds.items():
        if not names:
            continue
        totals = torch.full((len(names),), start[kind], dtype=torch.float64)
        for report in reports:
            values = [report[key].detach().double().cpu().reshape(()) if key in report else torch.tensor(start[kind],
                      dtype=torch.float64) for key in names]  # a key a micro batch lacks counts as neutral
            totals = combine[kind](totals, torch.stack(values))
        totals = totals.to(device())
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            dist.all_reduce(totals, op=op[kind], group=ps.get_data_parallel_group())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(totals, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        result.update(zip(names, totals.cpu().tolist()))
    return {key: result[key] for key in keys}


def batch_tokens(batch) -> torch.Tensor:
    """The token ids [B, S] of a micro batch: a dict's "tokens", or a record's `tokens`."""
    return batch["tokens"] if isinstance(batch, dict) else batch.tokens


def real_token_count(batch) -> int:
    """Real (not padding) tokens the micro batch's forward ran over, from the lengths the batch carries.

    A record (the RL actor's micro batches) says so itself, in `real_tokens`; so do packed rows
    (`batch["packed"]`, where a shared prompt counts once).

    Dict batches: `aligner.data.loader.row_lengths`.
    """
    if not isinstance(batch, dict):
        return batch.real_tokens
    if batch.get("packed") is not None:
        return batch["packed"].real_tokens
    return int(row_lengths(batch).sum())


def global_token_count(microbatches: list) -> float:
    """Real input tokens of the global batch (for tokens/s and MFU)."""
    from megatron.core import parallel_state as ps

    local = torch.tensor([float(sum(real_token_count(batch) for batch in microbatches))], device=device())
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    return float(local.item())
