"""Building the pieces every trainer needs: model chunks in DDP, optimizer, LR schedule.

The same megatron-core objects are used on CPU and GPU: `DistributedDataParallel` for gradient
reduction, `get_megatron_optimizer` (torch AdamW inside an fp32 wrapper on CPU; mixed precision
and the distributed optimizer on GPU), `OptimizerParamScheduler` for warmup + decay.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Optional, Sequence

import torch

from aligner import checkpointing
from aligner.config import at_least, one_of
from aligner.data.blending import BlendedDataset, IndexedSubset, split_indices
from aligner.data.loader import MicroBatchLoader
from aligner.data.records import Layouts, check_data_source
from aligner.hf.sources import resolve_model_source, source_kind
from aligner.models.gpt import (
    ACTIVATION_RECOMPUTE,
    GPTConfig,
    build_gpt_model,
    build_model_chunks,
    num_parameters,
    padded_vocab_size,
)
from aligner.models.lora import PEFTConfig, apply_lora, load_merged
from aligner.models.lora import checkpoint_meta as lora_checkpoint_meta
from aligner.runtime import distributed, seeds
from aligner.runtime.cpu_bridge import mark_written
from aligner.runtime.distributed import PRECISIONS, ParallelConfig
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer
from aligner.training.lr_ranges import lr_warning
from aligner.training.metrics import LoggingConfig, MetricsLogger, PeakRate, get_logger
from aligner.training.schedule import schedule_settings
from aligner.training.trainer import CheckpointConfig, Trainer, TrainerConfig

DECAY_STYLES = ("cosine", "linear", "constant")
MIN_LR_FRACTION = 0.1  # optim.min_lr: null decays to this fraction of optim.lr


@dataclass
class OptimConfig:
    """The `optim:` section."""

    lr: float = at_least(0.0, 1e-4)
    # where the cosine/linear decay ends; null: 0.1 x lr (MIN_LR_FRACTION), so setting lr alone is enough
    min_lr: Optional[float] = at_least(0.0, None, "null: 0.1 x lr")
    weight_decay: float = at_least(0.0, 0.01)
    betas: list = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-8
    warmup_steps: int = at_least(0, 0)
    decay_style: str = one_of(DECAY_STYLES, "cosine")
    clip_grad: float = at_least(0.0, 1.0, "0: no clipping")

    def check_fields(self) -> Optional[tuple[str, str]]:
        if self.decay_style != "constant" and self.min_lr is not None and self.min_lr > self.lr:
            return "min_lr", (f"the {self.decay_style} decay ends at min_lr, which must not exceed lr={self.lr} "
                              f"(null: {MIN_LR_FRACTION} x lr)")
        return None

    @property
    def final_lr(self) -> float:
        """The rate the decay ends at: min_lr, or MIN_LR_FRACTION x lr when min_lr is null."""
        return MIN_LR_FRACTION * self.lr if self.min_lr is None else self.min_lr


def check_trainable(config) -> None:
    """Refuse layouts megatron-core cannot train (config: the chunks' megatron TransformerConfig).

    MoE at TP>1: megatron-core 0.16.1 refuses an MoE forward in training mode at TP>1 without
    sequence parallelism, and the local layer spec's torch norms refuse sequence parallelism, so
    only the transformer-engine spec could. Inference (generation, served models) runs at TP>1.
    """
    if config.num_moe_experts is not None and config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise ConfigError(
            f"an MoE model (model.num_moe_experts={config.num_moe_experts}) trains at tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size} only with parallel.sequence_parallel=true (megatron-core's rule), "
            "which the local layer spec (model.transformer_impl=local) does not support; train MoE models at "
            "tensor_model_parallel_size=1 with expert_model_parallel_size / pipeline / data parallelism"
        )


def wrap_for_training(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Mixed-precision wrapper (bf16) and megatron DDP around each chunk; returns the wrapped chunks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = chunks[0].config
    check_trainable(config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed.supports_distributed_optimizer(),
        check_for_nan_in_grad=True,
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        if config.bf16:
            chunk = Float16Module(config, chunk)
        wrapped.append(
            DistributedDataParallel(
                config,
                ddp_config,
                chunk,
                # Only the first chunk's buffers are bucketed normally (megatron's convention).
                disable_bucketing=index > 0,
            )
        )
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def build_optimizer(chunks: list[torch.nn.Module], optim: OptimConfig, params_dtype: torch.dtype):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.final_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=distributed.supports_distributed_optimizer(),
    )
    optimizer = get_megatron_optimizer(config, chunks)
    use_fused_adam_on_cpu(optimizer)
    return optimizer


def use_fused_adam_on_cpu(optimizer) -> None:
    """Run the torch Adam(W) inside megatron's wrapper with its fused kernel where its parameters are on the CPU.

    Without transformer-engine or apex megatron builds torch's AdamW, whose default on CPU tensors is the
    single-tensor loop (a dozen elementwise passes over every parameter, each a separate kernel); the fused
    kernel makes one pass per tensor with the same update (equal to fp32 rounding) and no extra memory.
    That kernel (torch 2.13, CPU) does not move the parameters' version counters: a step hook does, so
    caches keyed by them (the native engine's packed weights, which SPIN's self-play reads) see the update.
    """

    def mark_fused_groups_written(inner, args, kwargs) -> None:
        for group in inner.param_groups:
            if group.get("fused"):
                for param in group["params"]:
                    mark_written(param)

    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        fused = False
        for group in inner.param_groups:
            if all(param.device.type == "cpu" for param in group["params"]):
                group["fused"], group["foreach"] = True, False
                fused = True
        if fused and not getattr(inner, "_aligner_marks_written", False):
            inner.register_step_post_hook(mark_fused_groups_written)
            inner._aligner_marks_written = True


def build_trainer(cfg: "RunConfig", built: TrainingModel, objective, *, total_steps: int,
                  optimizer_steps: Optional[int] = None, train_loader=None, val_loader=None,
                  checkpoint_meta: Optional[dict] = None, length_settings: Optional[dict] = None):
    """The shared Trainer over a built model: an LR schedule over `optimizer_steps` (default
    total_steps), metrics and progress over `total_steps`, checkpoints that record the model config
    (plus `checkpoint_meta`), and the throughput/MFU settings. Resuming stays with the caller.
    length_settings: the config keys that set the run's length (default trainer.max_steps), which a
    resume reports when they changed."""
    model_cfg = built.model_cfg
    if cfg.model.init_from and cfg.LR_METHOD is not None:  # fine-tuning a pretrained model: is the lr a known one?
        warning = lr_warning(cfg.optim.lr, cfg.LR_METHOD, built.peft_meta is not None, num_parameters(model_cfg))
        if warning is not None:
            get_logger().info(f"warning: {warning}")  # (info: rank 0 alone prints it)
    scheduler = build_scheduler(built.optimizer, cfg.optim, total_steps if optimizer_steps is None else optimizer_steps)
    return Trainer(
        name=cfg.name, trainer_cfg=cfg.trainer, checkpoint_cfg=cfg.checkpoint, objective=objective,
        chunks=built.chunks, optimizer=built.optimizer, scheduler=scheduler, train_loader=train_loader,
        val_loader=val_loader, metrics=MetricsLogger(cfg.logging, cfg.name, total_steps),
        checkpoint_meta={"model": model_cfg.to_dict(), **({"peft": built.peft_meta} if built.peft_meta else {}),
                         **(checkpoint_meta or {})}, tokenizer_dir=built.tokenizer_dir,
        run_id=built.run_id,
        num_params=num_parameters(model_cfg), num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
        peak_rate=PeakRate(cfg.logging.peak_tflops),
        schedule_settings=schedule_settings(cfg.optim, length_settings or {"trainer.max_steps": cfg.trainer.max_steps}),
    )


def build_scheduler(optimizer, optim: OptimConfig, total_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = min(optim.warmup_steps, max(total_steps - 1, 0))
    if optim.warmup_steps and optim.warmup_steps >= total_steps:
        effect = (f"the warm-up is cut to {warmup}, so the first step trains at lr 0 and only the last at "
                  f"optim.lr={optim.lr:g}" if warmup else "the warm-up is dropped")
        get_logger().info(  # (info: rank 0 alone prints it)
            f"warning: optim.warmup_steps={optim.warmup_steps} is not shorter than the run's {total_steps} optimizer "
            f"steps: {effect}; set optim.warmup_steps below {total_steps} (0: no warm-up)")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.final_lr if optim.decay_style != "constant" else optim.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )


def check_resumed_adapters(checkpoint_dir, peft_meta: dict, init_from_key: str) -> None:
    """A LoRA run resumes adapters trained on the same base with the same shape and scale; anything else
    would load (or fail to load) adapters that mean something else."""
    saved = checkpointing.read_meta(checkpoint_dir).get("peft")
    if saved is None:
        return  # a whole-model checkpoint: checkpointing.load names that mismatch
    if saved.get("base_fingerprint") or peft_meta["base_fingerprint"]:
        same_base = saved.get("base_fingerprint") == peft_meta["base_fingerprint"]
    else:  # bases without manifests: only their paths can be compared
        same_base = saved["base"] == peft_meta["base"]
    if not same_base:
        raise ConfigError(f"{checkpoint_dir} holds adapters trained on {saved['base']}, but {init_from_key} is "
                          f"{peft_meta['base']}, another model; resume with that base or use a new checkpoint.save_dir")
    for key in ("rank", "alpha", "target_modules"):
        if saved[key] != peft_meta[key]:
            raise ConfigError(f"{checkpoint_dir} holds adapters with peft.{key}={saved[key]}, this run sets "
                              f"peft.{key}={peft_meta[key]}; resume with the checkpoint's value")


def attach_grad_hooks(chunks: list[torch.nn.Module], optimizer) -> None:
    """Tell megatron's schedules how to reduce gradients and scale the loss."""
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config if hasattr(chunks[0], "config") else chunks[0].module.config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync


@dataclass
class DatasetEntry:
    path: str = "???"
    weight: float = 1.0


@dataclass
class ModelSection:
    """The `model:` section."""

    init_from: Optional[str] = None  # checkpoint, run dir, HF dir, .gguf (aligner.hf.sources); None: random init
    architecture: GPTConfig = field(default_factory=GPTConfig)  # used only for random init
    # none | selective | full: activations recomputed in backward (aligner.models.gpt.RECOMPUTE_SETTINGS)
    activation_recompute: str = one_of(ACTIVATION_RECOMPUTE, "none")


@dataclass
class TokenizerConfig:
    path: Optional[str] = None  # HF tokenizer directory; None: the one stored in model.init_from


@dataclass
class TrainingModel:
    """What `build_training_model` returns: the runtime, tokenizer and model ready to train."""

    model_cfg: GPTConfig
    chunks: list  # DDP-wrapped model chunks
    optimizer: object
    tokenizer: object
    tokenizer_dir: str
    data_parallel_size: int
    params_dtype: torch.dtype
    resume_checkpoint: Optional[object]  # newest intact checkpoint in checkpoint.save_dir, to resume from
    run_id: str  # this run's id in its checkpoints (a resumed run keeps its checkpoint's)
    peft_meta: Optional[dict] = None  # LoRA: its settings and the base checkpoint, recorded in every checkpoint
    init_from: Optional[Path] = None  # the checkpoint model.init_from resolved to (aligner.hf.sources); None: random


def build_training_model(*, parallel: ParallelConfig, precision: str, seed: int, model: ModelSection,
                         tokenizer: TokenizerConfig, optim: OptimConfig, save_dir: str, resume: bool,
                         sequence_lengths: Sequence[tuple[int, str]],
                         lock_wait_s: float = 0.0,
                         chunk_builder: Callable = build_gpt_model, skip_prefixes: tuple = (),
                         model_overrides: Optional[dict] = None,
                         init_from_key: str = "model.init_from",
                         peft: Optional[PEFTConfig] = None, train_whole_with_lora: tuple = ()) -> TrainingModel:
    """Distributed runtime, tokenizer, model (random init, `init_from`, or to be resumed), DDP, optimizer.

    chunk_builder builds one model chunk (GPT policy by default, a reward model for RM training);
    skip_prefixes names parameters that `init_from` does not provide (a fresh reward head);
    model_overrides: GPTConfig fields replaced whatever the checkpoint says (e.g. dropout off for PPO);
    sequence_lengths: the longest rows the run feeds the model, (tokens, the settings that make them), refused
    here above the model's positions before anything is built (`RunConfig.sequence_lengths`);
    lock_wait_s: seconds to wait for another run that holds save_dir to end (`checkpointing.start_run`);
    init_from_key: the config key of `model.init_from` in this entry point's yaml, for messages;
    model.init_from: any source `aligner.hf.sources` resolves (a checkpoint, a run directory, an HF directory or a
    GGUF file, imported into the cache), resolved before anything is built; `TrainingModel.init_from` is the
    checkpoint it resolved to;
    peft: LoRA adapters on the `init_from` weights, which stay frozen (checkpoints then hold the adapters only,
    so a resumed run loads the base from `init_from` again);
    train_whole_with_lora: parameter-name prefixes that still train whole under LoRA and are saved with the
    adapters (a reward model's or critic's head).
    """
    lora = peft is not None and peft.enabled
    if lora and not model.init_from:
        raise ConfigError(f"peft.scheme=lora trains adapters on a pretrained model: set {init_from_key}")
    if model.init_from:
        source_kind(model.init_from, init_from_key)  # a path that names no model fails before any work
    if tokenizer.path and not Path(tokenizer.path).is_dir():
        raise checkpointing.CheckpointError(f"tokenizer.path={tokenizer.path} is not a directory; expected an HF "
                                            "tokenizer directory (tokenizer.json / tokenizer_config.json)")
    if not tokenizer.path and not model.init_from:
        raise checkpointing.CheckpointError("set tokenizer.path "
                                            f"(or {init_from_key} to a model that holds a tokenizer)")
    init_from = resolve_model_source(model.init_from, init_from_key, get_logger().info) if model.init_from else None
    tokenizer_dir = tokenizer.path or str(init_from / checkpointing.TOKENIZER_DIR)
    if not Path(tokenizer_dir).is_dir():
        raise checkpointing.CheckpointError(f"{init_from_key}={init_from} holds no {checkpointing.TOKENIZER_DIR}/ "
                                            "directory; set tokenizer.path to the tokenizer to use")
    loaded_tokenizer = Tokenizer(tokenizer_dir)
    if init_from:
        model_cfg = GPTConfig.from_dict(checkpointing.read_meta(init_from)["model"])
        positions_key = f"{Path(init_from) / checkpointing.META_FILE}'s model.max_position_embeddings"
    else:
        model_cfg = GPTConfig.from_dict(model.architecture.to_dict())
        model_cfg.vocab_size = model_cfg.vocab_size or loaded_tokenizer.vocab_size
        positions_key = "model.architecture.max_position_embeddings"
    if model_overrides:
        model_cfg = dataclasses.replace(model_cfg, **model_overrides)
    model_cfg.check_sequence_lengths(sequence_lengths, positions_key)
    data_parallel_size = distributed.initialize(parallel)
    params_dtype = distributed.resolve_precision(precision)
    if loaded_tokenizer.vocab_size > model_cfg.vocab_size:
        raise checkpointing.CheckpointError(
            f"tokenizer {tokenizer_dir} has {loaded_tokenizer.vocab_size} tokens but the model's vocabulary is "
            f"{model_cfg.vocab_size}"
        )

    # Before the model is built: a used save_dir, an unwritable or full disk fail at once.
    stored_cfg = dataclasses.replace(model_cfg, vocab_size=padded_vocab_size(
        model_cfg.vocab_size, model_cfg.make_vocab_size_divisible_by, parallel.tensor_model_parallel_size))
    run = checkpointing.start_run(
        save_dir, resume=resume, lock_wait_s=lock_wait_s, log=get_logger().info,  # rank 0 prints
        estimated_bytes=checkpointing.estimated_checkpoint_bytes(num_parameters(stored_cfg), params_dtype))
    latest = run.resume_checkpoint
    seeds.set_seed(seed)
    chunks = build_model_chunks(model_cfg, parallel, params_dtype, chunk_builder,
                                activation_recompute=model.activation_recompute)
    if init_from and (latest is None or lora):  # a LoRA checkpoint holds the adapters only
        load_merged(init_from, chunks, skip_prefixes=skip_prefixes)  # (an adapter checkpoint: merged into its base)
        get_logger().info(f"initialised from {init_from}")
    peft_meta = None
    if lora:
        apply_lora(chunks, peft, seed, train_whole=train_whole_with_lora)
        peft_meta = lora_checkpoint_meta(peft, init_from, train_whole_with_lora)
        if latest is not None:
            check_resumed_adapters(latest, peft_meta, init_from_key)
        trained = sum(p.numel() for chunk in chunks for p in chunk.parameters() if p.requires_grad)
        get_logger().info(f"LoRA rank {peft.rank} on {', '.join(peft.target_modules)}: {trained / 1e6:.2f}M trained "
                          "parameters on this rank, the rest frozen")
    chunks = wrap_for_training(chunks)
    optimizer = build_optimizer(chunks, optim, params_dtype)
    attach_grad_hooks(chunks, optimizer)
    return TrainingModel(model_cfg, chunks, optimizer, loaded_tokenizer, tokenizer_dir, data_parallel_size,
                         params_dtype, latest, run.run_id, peft_meta, init_from)


def build_loader(dataset, *, trainer_cfg, data_parallel_size: int, seed: int, shuffle: bool, pad_id: int,
                 pad_to_multiple_of: Optional[int], collate_fn: Optional[Callable] = None,
                 packing=None):
    """Micro-batch loader for this data-parallel rank (packing: its token budget, if any, forms the micro batches)."""
    from megatron.core import parallel_state as ps

    return MicroBatchLoader(
        dataset, global_batch_size=trainer_cfg.global_batch_size, micro_batch_size=trainer_cfg.micro_batch_size,
        data_parallel_rank=ps.get_data_parallel_rank(), data_parallel_size=data_parallel_size, seed=seed,
        shuffle=shuffle, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, collate_fn=collate_fn,
        packing=packing,
    )


def build_datasets(*, train: list, validation: list, split: str, seed: int, trainer_cfg,
                   load_dataset: Callable) -> tuple:
    """Train and validation sets from `data.train` / `data.validation` entries (shared by trainers).

    Several train entries are blended by weight (DeepSpeed-Chat's data abstraction); without
    validation entries, `split` (e.g. "98,2") carves a validation part out of each train file.
    load_dataset(entry) -> a Dataset. Returns (train_set, val_set or None).
    """
    if not train:
        raise ConfigError("data.train is empty: give at least one {path, weight} entry")
    train_sets, val_sets = [], [load_dataset(entry) for entry in validation]
    for entry in train:
        dataset = load_dataset(entry)
        if validation:
            train_sets.append(dataset)
            continue
        train_idx, val_idx = split_indices(len(dataset), split, seed)
        train_sets.append(IndexedSubset(dataset, train_idx))
        if len(val_idx):
            val_sets.append(IndexedSubset(dataset, val_idx))
    if len(train_sets) == 1:
        train_set = train_sets[0]
    else:
        num_samples = max(sum(len(d) for d in train_sets), trainer_cfg.max_steps * trainer_cfg.global_batch_size)
        train_set = BlendedDataset(train_sets, [entry.weight for entry in train], num_samples, seed)
    val_set = None
    if val_sets:
        val_set = val_sets[0] if len(val_sets) == 1 else torch.utils.data.ConcatDataset(val_sets)
    return train_set, val_set


def build_loaders(train_set, val_set, *, trainer_cfg, data_parallel_size: int, seed: int, shuffle: bool,
                  pad_id: int, pad_to_multiple_of: Optional[int], collate_fn: Optional[Callable] = None,
                  packing=None) -> tuple:
    """(train loader, validation loader or None); validation smaller than one global batch is off."""

    def loader(dataset, shuffle_data):
        return build_loader(dataset, trainer_cfg=trainer_cfg, data_parallel_size=data_parallel_size, seed=seed,
                            shuffle=shuffle_data, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of,
                            collate_fn=collate_fn, packing=packing)

    val_loader = None
    if val_set is not None and len(val_set) >= trainer_cfg.global_batch_size:
        val_loader = loader(val_set, False)
    elif val_set is not None:
        get_logger().warning(f"validation set ({len(val_set)} samples) is smaller than one global batch: "
                             "validation is off")
    return loader(train_set, shuffle), val_loader


def entry_sources(key: str, entries: Sequence) -> list[tuple[str, str]]:
    """(setting, path) of each entry of a list of data files, e.g. ("data.train[0].path", "sft.parquet")."""
    return [(f"{key}[{index}].path", entry.path) for index, entry in enumerate(entries)]


@dataclass
class DataSection:
    """The fields every `data:` section has; algorithms add their own."""

    train: list[DatasetEntry] = field(default_factory=list)
    validation: list[DatasetEntry] = field(default_factory=list)  # empty: carve `split` out of train
    split: str = "98,2"
    max_seq_length: int = at_least(2, 512)
    shuffle: bool = True
    pad_to_multiple_of: Optional[int] = at_least(1, None, "null: 8 on GPU, 1 (the TP size at TP > 1) on CPU")
    # Render prompts and conversations with the tokenizer's chat template (a string prompt is one
    # user turn); false, or a tokenizer without one: the plain [bos] + prompt, response + [eos] layout.
    chat_template: bool = True

    def sources(self) -> list[tuple[str, str]]:
        """(setting, path) of each data file: the train entries, then the validation entries."""
        return entry_sources("data.train", self.train) + entry_sources("data.validation", self.validation)

    @property
    def sequence_length(self) -> tuple[int, str]:
        """(positions, the setting that makes them) of the longest row the model sees (`RunConfig.sequence_lengths`)."""
        return self.max_seq_length, f"data.max_seq_length={self.max_seq_length}"

    @property
    def longest_row(self) -> tuple[int, str]:
        """(tokens, what they are) of the longest padded row a collated batch can have."""
        multiple = distributed.pad_multiple(self.pad_to_multiple_of)
        padded = -(-self.max_seq_length // multiple) * multiple
        return padded, "data.max_seq_length rounded up to data.pad_to_multiple_of"


@dataclass
class RunConfig:
    """The sections every training entry point's config has; algorithms add theirs (and `data`)."""

    # The method's row in aligner/training/lr_ranges.py (sft | preference | rl) for the lr warning; None: no advice
    LR_METHOD: ClassVar[Optional[str]] = None

    name: str = "run"
    seed: int = 1234
    precision: str = one_of(PRECISIONS, "auto")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelSection = field(default_factory=ModelSection)
    peft: PEFTConfig = field(default_factory=PEFTConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        if self.logging.log_dir is None:  # a run's logs beside its checkpoints, wherever save_dir points
            self.logging.log_dir = self.checkpoint.save_dir

    def data_layouts(self) -> Optional[Layouts]:
        """The columns the records of `data`'s files need (each algorithm's reader says); None: not checked."""
        return None

    def data_sources(self) -> list[tuple[str, Optional[str], Optional[Layouts]]]:
        """(setting, path or None, the columns its records need) of every data file the run reads."""
        return [(key, path, self.data_layouts()) for key, path in self.data.sources()]

    def check_data_sources(self) -> None:
        """Refuse a missing, unreadable or unknown-format data file, or one without the columns its reader
        needs, in one line naming the setting and the file: called by `run_training` before the model is
        built, so a typo in a path costs seconds, not a model load."""
        for key, path, layouts in self.data_sources():
            check_data_source(key, path, layouts)

    def sequence_lengths(self) -> list[tuple[int, str]]:
        """The longest rows this run feeds its model, each (tokens, the settings that make them), which
        `build_training_model` refuses above the model's positions. The data section's rows by default;
        algorithms that generate override it (prompt + new tokens)."""
        return [self.data.sequence_length]
