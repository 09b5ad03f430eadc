"""Supervised fine-tuning: next-token loss on response tokens, megatron TP/PP/DP.

Reads top to bottom: config schema, the loss, the objective the shared trainer runs, and
`build_sft_trainer`, which turns a config into a ready trainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aligner.data.records import Layouts
from aligner.data.sft import SFT_LAYOUTS, PackedSFTDataset, SFTDataset
from aligner.data.steerlm import ATTRIBUTES_KEY, CHECKPOINT_META_KEY, AttributeConditioning, SteerLMConfig
from aligner.models.gpt import num_parameters
from aligner.models.logprobs import selected_logprobs_and_entropy
from aligner.training import setup
from aligner.training.metrics import get_logger
from aligner.training.setup import DataSection, DatasetEntry, RunConfig
from aligner.training.trainer import Trainer


# ----------------------------------------------------------------------------- config schema
@dataclass
class SFTDataConfig(DataSection):
    pack_sequences: bool = False
    # SteerLM: attribute values of annotated records written into the prompt (aligner/data/steerlm.py)
    steerlm: SteerLMConfig = field(default_factory=SteerLMConfig)

    @property
    def sequence_length(self) -> tuple[int, str]:
        # A row's last token is only a label (collate_sft): max_seq_length tokens take one position less.
        positions = self.max_seq_length - 1
        return positions, f"data.max_seq_length={self.max_seq_length} ({positions} positions, the last token a label)"


@dataclass
class SFTConfig(RunConfig):
    """aligner/conf/gpt_sft.yaml: the shared run sections plus `data`."""

    LR_METHOD = "sft"  # its row in aligner/training/lr_ranges.py
    name: str = "gpt_sft"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)

    def data_layouts(self) -> Layouts:
        return SFT_LAYOUTS.with_columns(ATTRIBUTES_KEY) if self.data.steerlm.enabled else SFT_LAYOUTS


# ----------------------------------------------------------------------------- loss
def response_token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int):
    """Summed next-token cross entropy over response tokens, and their count.

    logits: [batch, seq, vocab_shard] (tensor-parallel shard) or the model's `HiddenStates`; labels,
    loss_mask: [batch, seq].
    Returned as (loss_sum, num_tokens) so megatron normalises by the token count of the whole
    global batch (across micro batches and data-parallel ranks): the loss is then the same
    whatever the parallel layout or micro-batch split.
    """
    # Only the positions that carry loss are computed (`selected_logprobs_and_entropy`: no full-size copies).
    rows, columns = loss_mask.nonzero(as_tuple=True)
    logprobs, _ = selected_logprobs_and_entropy(logits, rows, columns, labels[rows, columns], vocab_size=vocab_size,
                                                with_entropy=False)
    loss_sum = -(logprobs * loss_mask[rows, columns]).sum()
    return loss_sum, loss_mask.sum().to(torch.int)


class SFTObjective:
    """Mean next-token loss over the response tokens of the global batch."""

    reads_logits_at_positions = True  # the loss positions only: the output layer runs there

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def forward(self, model, batch):
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"])

    def loss(self, batch, logits):
        loss_sum, num_tokens = response_token_loss(logits, batch["labels"], batch["loss_mask"], self.vocab_size)
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach(), "tokens": num_tokens.detach().float()}

    def summarize(self, totals):
        return {"loss": totals["loss_sum"] / max(totals["tokens"], 1.0), "response_tokens": totals["tokens"]}


# ----------------------------------------------------------------------------- building a run
def build_sft_trainer(cfg: SFTConfig) -> Trainer:
    """Runtime, tokenizer, model, optimizer, data, metrics, resume: a trainer ready to `fit()`."""
    cfg.data.steerlm.validate()  # before the model is built: a typo in the format fails at once
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume,
        lock_wait_s=cfg.checkpoint.lock_wait_s, peft=cfg.peft,
        sequence_lengths=cfg.sequence_lengths(),
    )
    logger = get_logger()
    conditioning = AttributeConditioning(cfg.data.steerlm, built.tokenizer) if cfg.data.steerlm.enabled else None

    def load_dataset(entry: DatasetEntry) -> SFTDataset:
        dataset = SFTDataset(entry.path, built.tokenizer, cfg.data.max_seq_length, prepare_record=conditioning,
                             use_template=cfg.data.chat_template)
        stats = dataset.stats
        logger.info(f"{entry.path}: {stats.kept} examples ({stats.truncated} truncated to "
                    f"{cfg.data.max_seq_length} tokens, {stats.dropped} dropped: no response token left)")
        return dataset

    trainer_cfg = cfg.trainer
    train_set, val_set = setup.build_datasets(
        train=cfg.data.train, validation=cfg.data.validation, split=cfg.data.split, seed=cfg.seed,
        trainer_cfg=trainer_cfg, load_dataset=load_dataset,
    )
    if cfg.data.pack_sequences:
        train_set = PackedSFTDataset(train_set, cfg.data.max_seq_length, cfg.seed)
        val_set = PackedSFTDataset(val_set, cfg.data.max_seq_length, cfg.seed) if val_set is not None else None
    train_loader, val_loader = setup.build_loaders(
        train_set, val_set, trainer_cfg=trainer_cfg, data_parallel_size=built.data_parallel_size, seed=cfg.seed,
        shuffle=cfg.data.shuffle, pad_id=built.tokenizer.pad_id, pad_to_multiple_of=cfg.data.pad_to_multiple_of,
    )
    total_steps = train_loader.total_steps(trainer_cfg.max_steps, trainer_cfg.max_epochs)
    model_cfg = built.model_cfg
    checkpoint_meta = {}
    if conditioning is not None:  # generation must render the attribute values the same way
        checkpoint_meta[CHECKPOINT_META_KEY] = cfg.data.steerlm.to_dict()
    trainer = setup.build_trainer(cfg, built, SFTObjective(model_cfg.vocab_size), total_steps=total_steps,
                                  train_loader=train_loader, val_loader=val_loader, checkpoint_meta=checkpoint_meta)
    metrics = trainer.metrics
    if built.resume_checkpoint is not None:
        trainer.resume_from(built.resume_checkpoint)
    metrics.write(
        f"{cfg.name}: {num_parameters(model_cfg) / 1e6:.2f}M parameters, "
        f"layout TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
        f"DP={built.data_parallel_size}, {len(train_set)} train samples, "
        f"{total_steps} steps of {trainer_cfg.global_batch_size} "
        f"({train_loader.num_microbatches} micro batches per rank), "
        f"precision {built.params_dtype}"
    )
    return trainer
