"""Supervised fine-tuning: next-token loss on response tokens, megatron TP/PP/DP.

Reads top to bottom: config schema, loss, the trainer (fit -> train_step / validate / save),
then `build_sft_run`, which turns a config into the trainer's components.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from aligner import checkpointing
from aligner.models.gpt import GPTConfig, mask_padded_vocab
from aligner.models.forward import run_microbatches
from aligner.runtime.distributed import ParallelConfig
from aligner.training.metrics import LoggingConfig, MetricsLogger, get_logger, transformer_flops_per_token
from aligner.training.setup import OptimConfig


# ----------------------------------------------------------------------------- config schema
@dataclass
class DatasetEntry:
    path: str = "???"
    weight: float = 1.0


@dataclass
class SFTDataConfig:
    train: list[DatasetEntry] = field(default_factory=list)
    validation: list[DatasetEntry] = field(default_factory=list)  # empty: carve `split` out of train
    split: str = "98,2"
    max_seq_length: int = 512
    pack_sequences: bool = False
    shuffle: bool = True
    pad_to_multiple_of: int = 8


@dataclass
class ModelSection:
    init_from: Optional[str] = None  # aligner checkpoint (HF import or earlier run); None: random init
    architecture: GPTConfig = field(default_factory=GPTConfig)  # used only for random init


@dataclass
class TokenizerConfig:
    path: Optional[str] = None  # HF tokenizer directory; None: the one stored in model.init_from


@dataclass
class TrainerConfig:
    max_steps: int = 100
    max_epochs: Optional[int] = None
    global_batch_size: int = 32
    micro_batch_size: int = 4
    val_check_interval: int = 50  # steps; <= 0 disables
    limit_val_samples: Optional[int] = None


@dataclass
class CheckpointConfig:
    save_dir: str = "results/checkpoints"
    save_interval: int = 0  # steps; <= 0: only at the end
    keep_last: int = 2
    save_at_end: bool = True
    resume: bool = True  # continue from the newest checkpoint in save_dir if there is one


@dataclass
class SFTConfig:
    name: str = "gpt_sft"
    seed: int = 1234
    precision: str = "auto"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ----------------------------------------------------------------------------- loss
def response_token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int):
    """Summed next-token cross entropy over response tokens, and their count.

    logits: [batch, seq, vocab_shard] (tensor-parallel shard); labels, loss_mask: [batch, seq].
    Returned as (loss_sum, num_tokens) so megatron normalises by the token count of the whole
    global batch (across micro batches and data-parallel ranks): the loss is then the same
    whatever the parallel layout or micro-batch split.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(logits.float(), vocab_size)
    per_token = vocab_parallel_cross_entropy(logits, labels)
    loss_sum = (per_token * loss_mask).sum()
    return loss_sum, loss_mask.sum().to(torch.int)


# ----------------------------------------------------------------------------- trainer
class SFTTrainer:
    """fit / train_step / validate / save over megatron model chunks wrapped in DDP."""

    def __init__(self, cfg: SFTConfig, model_cfg: GPTConfig, chunks, optimizer, scheduler, train_loader, val_loader,
                 metrics: MetricsLogger, tokenizer_dir: Optional[str], num_params: int, peak_tflops: float,
                 pad_id: int, step: int = 0, consumed_samples: int = 0):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.metrics = metrics
        self.tokenizer_dir = tokenizer_dir
        self.step = step
        self.consumed_samples = consumed_samples
        self.num_params = num_params
        self.peak_tflops = peak_tflops
        self.pad_id = pad_id
        self.logger = get_logger()

    # -- the loop
    def fit(self) -> None:
        total = self.train_loader.total_steps(self.cfg.trainer.max_steps, self.cfg.trainer.max_epochs)
        batches = self.train_loader.iterate(self.consumed_samples)
        while self.step < total:
            metrics = self.train_step(next(batches))
            self.step += 1
            self.consumed_samples += self.cfg.trainer.global_batch_size
            self.metrics.log(self.step, metrics)
            self.metrics.advance(loss=metrics["loss"], lr=metrics["lr"])
            interval = self.cfg.trainer.val_check_interval
            if self.val_loader is not None and interval > 0 and (self.step % interval == 0 or self.step == total):
                self.metrics.log(self.step, self.validate(), prefix="validation")
            interval = self.cfg.checkpoint.save_interval
            if interval > 0 and self.step % interval == 0 and self.step < total:
                self.save()
        if self.cfg.checkpoint.save_at_end and not self._saved_at(self.step):
            self.save()

    def _forward(self, model, batch):
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"])

    def _loss(self, batch, logits):
        loss_sum, num_tokens = response_token_loss(logits, batch["labels"], batch["loss_mask"], self.model_cfg.vocab_size)
        return loss_sum, num_tokens, {"loss": torch.stack([loss_sum.detach(), num_tokens.detach().float()])}

    def _run(self, microbatches: list[dict], forward_only: bool) -> tuple[float, float]:
        """One pass of the pipeline schedule; returns (summed loss, token count) over the data-parallel group."""
        seq_length = microbatches[0]["tokens"].shape[1]
        reports = run_microbatches(
            self.chunks, microbatches, self._forward, self._loss,
            forward_only=forward_only, seq_length=seq_length,
            micro_batch_size=microbatches[0]["tokens"].shape[0],
        )
        return _reduce_loss_reports(reports)

    def train_step(self, microbatches: list[dict]) -> dict[str, float]:
        start = time.perf_counter()
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it after)
        loss_sum, num_tokens = self._run(microbatches, forward_only=False)
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise FloatingPointError(f"step {self.step + 1}: the optimizer step failed (inf/nan in gradients)")
        self.scheduler.step(increment=1)
        elapsed = time.perf_counter() - start
        tokens = _global_token_count(microbatches, self.pad_id)
        tokens_per_second = tokens / elapsed
        flops_per_token = transformer_flops_per_token(
            self.num_params, self.model_cfg.num_layers, self.model_cfg.hidden_size, microbatches[0]["tokens"].shape[1]
        )
        world = dist.get_world_size() if dist.is_initialized() else 1
        return {
            "loss": loss_sum / max(num_tokens, 1),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens_per_second": tokens_per_second,
            "mfu": flops_per_token * tokens_per_second / (self.peak_tflops * 1e12 * world),
            "step_time": elapsed,
            "consumed_samples": self.consumed_samples + self.cfg.trainer.global_batch_size,
        }

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        total_loss, total_tokens = 0.0, 0.0
        for microbatches in self.val_loader.iterate(0, epochs=1, limit_samples=self.cfg.trainer.limit_val_samples):
            loss_sum, num_tokens = self._run(microbatches, forward_only=True)
            total_loss += loss_sum
            total_tokens += num_tokens
        return {"loss": total_loss / max(total_tokens, 1), "tokens": total_tokens}

    # -- checkpoints
    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples"]
        self.scheduler.load_state_dict(state["scheduler"])

    def _saved_at(self, step: int) -> bool:
        return checkpointing.step_dir(self.cfg.checkpoint.save_dir, step).exists()

    def save(self) -> Path:
        path = checkpointing.save(
            checkpointing.step_dir(self.cfg.checkpoint.save_dir, self.step), self.chunks,
            model_config=self.model_cfg.to_dict(), optimizer=self.optimizer, trainer_state=self.state_dict(),
            tokenizer_dir=self.tokenizer_dir, save_rng=True,
        )
        checkpointing.remove_old_checkpoints(self.cfg.checkpoint.save_dir, self.cfg.checkpoint.keep_last)
        self.metrics.write(f"saved checkpoint {path}")
        return path

    def resume_from(self, checkpoint_dir: Path) -> None:
        meta = checkpointing.load(checkpoint_dir, self.chunks, optimizer=self.optimizer, load_rng=True)
        self.load_state_dict(meta["trainer_state"])
        self.metrics.write(
            f"resumed from {checkpoint_dir} at step {self.step} ({self.consumed_samples} samples consumed"
            f"{'' if meta['rng_restored'] else '; RNG not restored: the parallel layout changed'})"
        )


def _reduce_loss_reports(reports: list[dict]) -> tuple[float, float]:
    """Sum (loss, tokens) over micro batches and data-parallel ranks; the result reaches every rank."""
    from megatron.core import parallel_state as ps

    totals = torch.zeros(2)
    for report in reports:
        totals += report["loss"].float().cpu()
    device_totals = totals.to(_comm_device())
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        dist.all_reduce(device_totals, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(device_totals, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    loss_sum, num_tokens = device_totals.tolist()
    return loss_sum, num_tokens


def _global_token_count(microbatches: list[dict], pad_id: int) -> float:
    """Non-padding input tokens of the global batch (for tokens/s and MFU)."""
    from megatron.core import parallel_state as ps

    local = torch.tensor([float(sum(int((b["tokens"] != pad_id).sum()) for b in microbatches))], device=_comm_device())
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    return float(local.item())


def _comm_device() -> torch.device:
    from aligner.runtime.distributed import device

    return device()


# ----------------------------------------------------------------------------- building a run
def build_sft_trainer(cfg: SFTConfig) -> SFTTrainer:
    """Turn a config into a ready trainer: runtime, tokenizer, model, optimizer, data, metrics, resume."""
    from megatron.core import parallel_state as ps

    from aligner.data.blending import BlendedDataset, IndexedSubset, split_indices
    from aligner.data.loader import MicroBatchLoader
    from aligner.data.sft import PackedSFTDataset, SFTDataset
    from aligner.models.gpt import num_parameters
    from aligner.runtime import distributed, seeds
    from aligner.tokenizer import Tokenizer
    from aligner.training import setup
    from aligner.training.metrics import peak_tflops_per_device

    data_parallel_size = distributed.initialize(cfg.parallel)
    params_dtype = distributed.resolve_precision(cfg.precision)
    logger = get_logger()

    init_from = cfg.model.init_from
    tokenizer_dir = cfg.tokenizer.path or (str(Path(init_from) / checkpointing.TOKENIZER_DIR) if init_from else None)
    if tokenizer_dir is None:
        raise checkpointing.CheckpointError("set tokenizer.path (or model.init_from to a checkpoint that holds a tokenizer)")
    tokenizer = Tokenizer(tokenizer_dir)
    if init_from:
        model_cfg = GPTConfig.from_dict(checkpointing.read_meta(init_from)["model"])
    else:
        model_cfg = GPTConfig.from_dict(cfg.model.architecture.to_dict())
        model_cfg.vocab_size = model_cfg.vocab_size or tokenizer.vocab_size
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise checkpointing.CheckpointError(
            f"tokenizer {tokenizer_dir} has {tokenizer.vocab_size} tokens but the model's vocabulary is {model_cfg.vocab_size}"
        )

    seeds.set_seed(cfg.seed)
    chunks = setup.build_model_chunks(model_cfg, cfg.parallel, params_dtype)
    latest = checkpointing.latest_checkpoint(cfg.checkpoint.save_dir) if cfg.checkpoint.resume else None
    if init_from and latest is None:
        checkpointing.load(init_from, chunks)
        logger.info(f"initialised from {init_from}")
    chunks = setup.wrap_for_training(chunks)
    optimizer = setup.build_optimizer(chunks, cfg.optim, params_dtype)
    setup.attach_grad_hooks(chunks, optimizer)

    def load_dataset(entry: DatasetEntry) -> SFTDataset:
        dataset = SFTDataset(entry.path, tokenizer, cfg.data.max_seq_length)
        stats = dataset.stats
        logger.info(f"{entry.path}: {stats.kept} examples ({stats.truncated} truncated to "
                    f"{cfg.data.max_seq_length} tokens, {stats.dropped} dropped: no response token left)")
        return dataset

    if not cfg.data.train:
        raise checkpointing.CheckpointError("data.train is empty: give at least one {path, weight} entry")
    train_sets, val_sets = [], [load_dataset(entry) for entry in cfg.data.validation]
    for entry in cfg.data.train:
        dataset = load_dataset(entry)
        if cfg.data.validation:
            train_sets.append(dataset)
            continue
        train_idx, val_idx = split_indices(len(dataset), cfg.data.split, cfg.seed)
        train_sets.append(IndexedSubset(dataset, train_idx))
        if val_idx:
            val_sets.append(IndexedSubset(dataset, val_idx))

    trainer_cfg = cfg.trainer
    if len(train_sets) == 1:
        train_set = train_sets[0]
    else:
        num_samples = max(sum(len(d) for d in train_sets), trainer_cfg.max_steps * trainer_cfg.global_batch_size)
        train_set = BlendedDataset(train_sets, [e.weight for e in cfg.data.train], num_samples, cfg.seed)
    val_set = None
    if val_sets:
        val_set = val_sets[0] if len(val_sets) == 1 else torch.utils.data.ConcatDataset(val_sets)
    if cfg.data.pack_sequences:
        train_set = PackedSFTDataset(train_set, cfg.data.max_seq_length, cfg.seed)
        val_set = PackedSFTDataset(val_set, cfg.data.max_seq_length, cfg.seed) if val_set is not None else None

    def loader(dataset, shuffle):
        return MicroBatchLoader(
            dataset, global_batch_size=trainer_cfg.global_batch_size, micro_batch_size=trainer_cfg.micro_batch_size,
            data_parallel_rank=ps.get_data_parallel_rank(), data_parallel_size=data_parallel_size,
            seed=cfg.seed, shuffle=shuffle, pad_id=tokenizer.pad_id, pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        )

    train_loader = loader(train_set, cfg.data.shuffle)
    val_loader = loader(val_set, False) if val_set is not None and len(val_set) >= trainer_cfg.global_batch_size else None
    if val_set is not None and val_loader is None:
        logger.warning(f"validation set ({len(val_set)} samples) is smaller than one global batch: validation is off")
    total_steps = train_loader.total_steps(trainer_cfg.max_steps, trainer_cfg.max_epochs)
    scheduler = setup.build_scheduler(optimizer, cfg.optim, total_steps)

    metrics = MetricsLogger(cfg.logging, cfg.name, total_steps)
    trainer = SFTTrainer(
        cfg, model_cfg, chunks, optimizer, scheduler, train_loader, val_loader, metrics, tokenizer_dir,
        num_params=num_parameters(model_cfg), peak_tflops=peak_tflops_per_device(cfg.logging.peak_tflops),
        pad_id=tokenizer.pad_id,
    )
    if latest is not None:
        trainer.resume_from(latest)
        if metrics.progress is not None:
            metrics.progress.update(trainer.step)
    metrics.write(
        f"{cfg.name}: {num_parameters(model_cfg) / 1e6:.2f}M parameters, layout TP={cfg.parallel.tensor_model_parallel_size} "
        f"PP={cfg.parallel.pipeline_model_parallel_size} DP={data_parallel_size}, {len(train_set)} train samples, "
        f"{total_steps} steps of {trainer_cfg.global_batch_size} ({train_loader.num_microbatches} micro batches per rank), "
        f"precision {params_dtype}"
    )
    return trainer
