"""Direct preference optimisation and its family (IPO, RPO, conservative DPO), megatron TP/PP/DP.

Reads top to bottom: config schema, the objective the shared trainer runs (per-sequence logprobs
-> implicit rewards -> preference loss, math in `aligner.rl.dpo_math`), the two ways to get the
reference model's logprobs, and `build_dpo_trainer`.

Reference logprobs (`dpo.reference_logprobs`):
  precompute  one forward pass over the data before training, with the initial weights; the sums
              are stored with the dataset rows (cheapest: no reference pass per step).
  swap        every step, the reference weights (kept in host memory, `HostWeights`) are swapped
              into the live model for a no-grad pass over the step's micro batches, then swapped
              out. Needed when the data is not known up front; costs one extra forward per step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from aligner.algorithms.reward_model import pair_report, summarize_pairs
from aligner.config import one_of
from aligner.data.jsonl import DataError
from aligner.data.preference import PREFERENCE_LAYOUTS, PreferenceDataset, collate_preferences
from aligner.data.records import Layouts
from aligner.models import logprobs, lora
from aligner.models.gpt import num_parameters
from aligner.models.logprobs import response_logprobs
from aligner.models.lora import load_merged
from aligner.models.packed_logprobs import packed_sequence_logprobs, response_logprobs_and_entropy
from aligner.models.packing import (
    PackingSection,
    SharedPromptPackingSection,
    forward_batch,
    packed_rows_of,
    shares_prompts_here,
    zero_loss,
)
from aligner.models.weight_swap import HostWeights
from aligner.rl import dpo_math
from aligner.runtime.distributed import device
from aligner.runtime.errors import ConfigError
from aligner.training import setup
from aligner.training.metrics import get_logger
from aligner.training.setup import DataSection, DatasetEntry, RunConfig
from aligner.training.trainer import Trainer

REFERENCE_MODES = ("precompute", "swap")


# ----------------------------------------------------------------------------- config schema
@dataclass
class DPOSection:
    """The `dpo:` section."""

    beta: float = 0.1  # KL coefficient: implicit reward = beta * (log pi - log pi_ref)
    preference_loss: str = one_of(dpo_math.PREFERENCE_LOSSES, "dpo")
    label_smoothing: float = 0.0  # dpo only: conservative DPO's label noise rate, in [0, 0.5)
    gt_reward_scale: float = 1.0  # rpo_*: eta, the target logit is eta * (r_chosen - r_rejected)
    sft_loss_weight: float = 0.0  # > 0: add weight * NLL of the chosen response
    preference_average_logprobs: bool = False  # preference loss on per-token mean logprobs (else sums)
    sft_average_logprobs: bool = True  # SFT term on per-token mean NLL (else summed)
    reference_logprobs: str = one_of(REFERENCE_MODES, "precompute")


@dataclass
class DPOConfig(RunConfig):
    """aligner/conf/gpt_dpo.yaml: the shared run sections plus `dpo` and `data`."""

    LR_METHOD = "preference"  # its row in aligner/training/lr_ranges.py
    name: str = "gpt_dpo"
    dpo: DPOSection = field(default_factory=DPOSection)
    data: DataSection = field(default_factory=DataSection)
    packing: SharedPromptPackingSection = field(default_factory=SharedPromptPackingSection)

    def data_layouts(self) -> Layouts:
        return PREFERENCE_LAYOUTS


def check_dpo_section(dpo: DPOSection) -> None:
    if dpo.beta <= 0:
        raise ConfigError(f"dpo.beta must be > 0, got {dpo.beta}")
    if not 0.0 <= dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {dpo.label_smoothing}")
    if dpo.label_smoothing and dpo.preference_loss != "dpo":
        raise ConfigError(f"dpo.label_smoothing applies to preference_loss=dpo only (got {dpo.preference_loss})")
    if dpo.sft_loss_weight < 0:
        raise ConfigError(f"dpo.sft_loss_weight must be >= 0, got {dpo.sft_loss_weight}")


# ----------------------------------------------------------------------------- objective
class DPOObjective:
    """Mean per-pair preference loss (+ weighted SFT loss) over the pairs of the global batch.

    Batches are `collate_preferences` rows (chosen, rejected interleaved) carrying
    `reference_logprobs` [rows] (summed over each response). `beta` may be changed between steps
    (SPIN sets one per iteration). packing: each micro batch's rows packed (`aligner.models.packing`)
    into rows of packing.row_length (default: the batch's padded length); None: padded rows.
    """

    reads_logits_at_positions = True  # the responses only: the output layer runs there

    def __init__(self, dpo: DPOSection, vocab_size: int, packing: Optional[PackingSection] = None, pad_id: int = 0):
        check_dpo_section(dpo)
        self.dpo = dpo
        self.beta = dpo.beta
        self.vocab_size = vocab_size
        self.packing, self.pad_id = packing, pad_id

    def packed_rows(self, batch: dict):
        return packed_rows(batch, self.packing, self.pad_id)

    def forward(self, model, batch):
        return forward_batch(model, batch, self.packed_rows(batch))

    def loss(self, batch, logits):
        dpo = self.dpo
        lengths = batch["response_lengths"]
        if not len(lengths):  # an empty micro batch of a token-budget plan
            return zero_loss(logits), torch.tensor(0, dtype=torch.int), {}
        packed = self.packed_rows(batch)
        if packed is not None:  # read in place from the packed rows
            token_logprobs, _ = response_logprobs_and_entropy(
                logits, packed, batch["prompt_lengths"], lengths, vocab_size=self.vocab_size,
                response_width=int(lengths.max()), with_entropy=False)  # [rows, width]
        else:
            token_logprobs = response_logprobs(logits, batch["tokens"], batch["prompt_lengths"], lengths,
                                               vocab_size=self.vocab_size)  # [rows, width]
        policy = dpo_math.sequence_logprobs(token_logprobs, lengths, dpo.preference_average_logprobs)
        reference = batch["reference_logprobs"].to(policy.dtype)  # sums over each response
        if dpo.preference_average_logprobs:
            reference = reference / lengths.to(policy.dtype)
        rewards = dpo_math.implicit_rewards(policy, reference, self.beta)
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = chosen - rejected
        target = None
        if dpo.preference_loss in dpo_math.RPO_LOSSES:
            if "rewards" not in batch:
                raise DataError(f"dpo.preference_loss={dpo.preference_loss} needs 'chosen_reward' and "
                                "'rejected_reward' in every data record")
            given = batch["rewards"].to(policy.dtype)
            target = dpo.gt_reward_scale * (given[0::2] - given[1::2])
        preference = dpo_math.preference_loss(margin, kind=dpo.preference_loss, beta=self.beta,
                                              label_smoothing=dpo.label_smoothing, target_margin=target)
        per_pair = preference
        sft = torch.zeros_like(preference)
        if dpo.sft_loss_weight > 0:
            chosen_logprobs = dpo_math.sequence_logprobs(token_logprobs[0::2], lengths[0::2], dpo.sft_average_logprobs)
            sft = dpo_math.sft_loss(chosen_logprobs)
            per_pair = preference + dpo.sft_loss_weight * sft
        loss_sum = per_pair.sum()
        pairs = torch.tensor(per_pair.numel(), dtype=torch.int)
        return loss_sum, pairs, pair_report(loss_sum, chosen, rejected, preference_loss=preference, sft_loss=sft)

    def summarize(self, totals):
        return summarize_pairs(totals)


def packed_rows(batch: dict, packing: Optional[PackingSection], pad_id: int):
    """The micro batch's packed rows (None: padded rows), built once and carried in the batch: the
    swapped-in reference pass, the training forward and the loss all read these rows."""
    return packed_rows_of(batch, batch["prompt_lengths"] + batch["response_lengths"], packing, pad_id,
                          prompt_lengths=batch["prompt_lengths"])


# ----------------------------------------------------------------------------- reference logprobs
def _summed_logprobs(chunks, batch: dict, vocab_size: int, packing: Optional[PackingSection] = None,
                     pad_id: int = 0) -> torch.Tensor:
    """Summed response logprobs [rows] of a collated preference batch under the chunks' current
    weights, one forward (no grad; collective over the model-parallel group); packed rows with `packing`."""
    packed = packed_rows(batch, packing, pad_id)
    width = int(batch["response_lengths"].max())
    if packed is None:
        token_logprobs = logprobs.sequence_logprobs(
            chunks, batch["tokens"], batch["prompt_lengths"], batch["response_lengths"], vocab_size=vocab_size,
            response_width=width, micro_batch_size=batch["tokens"].shape[0])
    else:
        target = device()
        token_logprobs = packed_sequence_logprobs(
            chunks[0], packed.to(target), batch["prompt_lengths"].to(target), batch["response_lengths"].to(target),
            vocab_size=vocab_size, response_width=width)
    return token_logprobs.sum(dim=1).float().cpu()  # zeros after each response's end


@torch.no_grad()
def precompute_reference_logprobs(dataset, chunks, *, vocab_size: int, pad_id: int, pairs_per_forward: int,
                                  packing: Optional[PackingSection] = None,
                                  collate_fn: Optional[Callable] = None) -> None:
    """Store the chunks' summed logprobs of every item's two responses in `dataset.reference_logprobs`
    ([items, 2]: chosen and rejected, or KTO's completion and mismatched completion, as `collate_fn`
    interleaves them; default collate_preferences). Every data-parallel rank computes the whole set."""
    collate = collate_fn or collate_preferences
    dataset.reference_logprobs = None  # items without them while computing
    sums = []
    for start in range(0, len(dataset), pairs_per_forward):
        batch = collate([dataset[i] for i in range(start, min(start + pairs_per_forward, len(dataset)))], pad_id)
        sums.append(_summed_logprobs(chunks, batch, vocab_size, packing, pad_id))
    dataset.reference_logprobs = torch.cat(sums).reshape(-1, 2)


class SwappedReferenceLoader:
    """A micro-batch loader whose batches gain `reference_logprobs`, computed each step with the
    reference weights swapped into the live chunks. Everything else is the wrapped loader's."""

    def __init__(self, loader, chunks, reference, vocab_size: int, packing: Optional[PackingSection] = None,
                 pad_id: int = 0):
        self.loader, self.chunks, self.reference, self.vocab_size = loader, chunks, reference, vocab_size
        self.packing, self.pad_id = packing, pad_id

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def iterate(self, *args, **kwargs) -> Iterator[list[dict]]:
        for microbatches in self.loader.iterate(*args, **kwargs):
            with torch.no_grad(), self.reference.swapped_in(self.chunks):
                for batch in microbatches:  # its packed rows, built here, go on to the training pass
                    rows = batch["tokens"].shape[0]
                    batch["reference_logprobs"] = torch.zeros(0) if rows == 0 else _summed_logprobs(
                        self.chunks, batch, self.vocab_size, self.packing, self.pad_id)
            yield microbatches


# ----------------------------------------------------------------------------- building a run
def _load_reference_weights(built, init_from: Optional[Path]) -> None:
    """Make the chunks hold the reference (initial) weights. A resumed run's chunks hold neither
    yet (the resume loads after this): load `init_from` so the reference is the run's start. With LoRA
    they hold the base already, the reference (their adapters are loaded by the resume)."""
    if built.resume_checkpoint is not None and init_from and built.peft_meta is None:
        load_merged(init_from, built.chunks)


def build_with_reference(cfg, *, reference_mode: str, read_dataset: Callable, collate_fn: Callable,
                         make_objective: Callable, packing: Optional[PackingSection] = None):
    """What the DPO family and KTO share: runtime, model, the reference (LoRA: the base with adapters off;
    else the initial weights, precomputed into the data or held in host memory and swapped in each step),
    data, loaders, trainer, resume. read_dataset(entry, tokenizer) loads one data file; make_objective(built)
    builds the objective. Returns (trainer, built, train_set, total_steps)."""
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume,
        lock_wait_s=cfg.checkpoint.lock_wait_s, peft=cfg.peft,
        sequence_lengths=cfg.sequence_lengths(),
    )
    logger = get_logger()
    model_cfg, trainer_cfg, pad_id = built.model_cfg, cfg.trainer, built.tokenizer.pad_id
    if getattr(packing, "share_prompts", False) and not shares_prompts_here(packing, built.chunks[0]):
        packing.share_prompts = False  # what runs: transformer-engine's THD packing cannot share a prompt
    _load_reference_weights(built, built.init_from)
    precompute = reference_mode == "precompute"
    # LoRA: the base model (adapters off) is the reference; otherwise the initial weights, held in host
    # memory for the swap (None: the chunks hold them now and precomputing reads them in place).
    reference = None
    if built.peft_meta is not None:
        reference = lora.BaseReference()
    elif not precompute:
        reference = HostWeights.snapshot(built.chunks)
        logger.info(f"reference weights in host memory: {reference.num_bytes / 2**20:.1f} MiB")

    def load_dataset(entry: DatasetEntry):
        dataset = read_dataset(entry, built.tokenizer)
        if precompute:
            with reference.swapped_in(built.chunks) if reference is not None else contextlib.nullcontext():
                precompute_reference_logprobs(dataset, built.chunks, vocab_size=model_cfg.vocab_size, pad_id=pad_id,
                                              pairs_per_forward=trainer_cfg.micro_batch_size, packing=packing,
                                              collate_fn=collate_fn)
        return dataset

    train_set, val_set = setup.build_datasets(
        train=cfg.data.train, validation=cfg.data.validation, split=cfg.data.split, seed=cfg.seed,
        trainer_cfg=trainer_cfg, load_dataset=load_dataset,
    )
    train_loader, val_loader = setup.build_loaders(
        train_set, val_set, trainer_cfg=trainer_cfg, data_parallel_size=built.data_parallel_size, seed=cfg.seed,
        shuffle=cfg.data.shuffle, pad_id=pad_id, pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        collate_fn=collate_fn, packing=packing,
    )
    if not precompute:
        train_loader = SwappedReferenceLoader(train_loader, built.chunks, reference, model_cfg.vocab_size, packing,
                                              pad_id)
        if val_loader is not None:
            val_loader = SwappedReferenceLoader(val_loader, built.chunks, reference, model_cfg.vocab_size, packing,
                                                pad_id)
    total_steps = train_loader.total_steps(trainer_cfg.max_steps, trainer_cfg.max_epochs)
    trainer = setup.build_trainer(cfg, built, make_objective(built), total_steps=total_steps,
                                  train_loader=train_loader, val_loader=val_loader)
    if built.resume_checkpoint is not None:
        trainer.resume_from(built.resume_checkpoint)
    return trainer, built, train_set, total_steps


def build_dpo_trainer(cfg: DPOConfig) -> Trainer:
    """Runtime, tokenizer, model, reference logprobs, data, optimizer, metrics, resume: ready to `fit()`."""
    check_dpo_section(cfg.dpo)
    cfg.packing.check_layout(cfg.parallel.pipeline_model_parallel_size, *cfg.data.longest_row,
                             cfg.parallel.expert_model_parallel_size)
    row_length = cfg.packing.row_length
    if row_length is not None and row_length < cfg.data.max_seq_length:
        raise ConfigError(f"packing.row_length={row_length} must hold the longest pair's sequence: at least "
                          f"data.max_seq_length={cfg.data.max_seq_length}")

    def read_dataset(entry: DatasetEntry, tokenizer) -> PreferenceDataset:
        dataset = PreferenceDataset.from_jsonl(entry.path, tokenizer, cfg.data.max_seq_length,
                                               use_template=cfg.data.chat_template)
        stats = dataset.stats
        get_logger().info(f"{entry.path}: {stats.kept} pairs ({stats.dropped_too_long} dropped: longer than "
                          f"{cfg.data.max_seq_length} tokens; {stats.dropped_identical} dropped: chosen == rejected)")
        return dataset

    trainer, built, train_set, total_steps = build_with_reference(
        cfg, reference_mode=cfg.dpo.reference_logprobs, read_dataset=read_dataset, collate_fn=collate_preferences,
        make_objective=lambda built: DPOObjective(cfg.dpo, built.model_cfg.vocab_size, cfg.packing,
                                                  built.tokenizer.pad_id),
        packing=cfg.packing)
    trainer.metrics.write(
        f"{cfg.name}: {cfg.dpo.preference_loss} beta={cfg.dpo.beta}, reference logprobs {cfg.dpo.reference_logprobs}, "
        f"{num_parameters(built.model_cfg) / 1e6:.2f}M parameters, TP={cfg.parallel.tensor_model_parallel_size} "
        f"PP={cfg.parallel.pipeline_model_parallel_size} DP={built.data_parallel_size}, {len(train_set)} train pairs, "
        f"{total_steps} steps of {cfg.trainer.global_batch_size} pairs"
    )
    return trainer
