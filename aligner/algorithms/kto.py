"""Kahneman-Tversky optimisation (KTO) on unpaired feedback, megatron TP/PP/DP.

Reads top to bottom: config schema, the objective the shared trainer runs (per-sequence logprobs ->
log-ratios -> the reference point from the mismatched completions -> per-example losses, math in
`aligner.rl.kto_math`), and `build_kto_trainer`. The reference model's logprobs come as in DPO
(`aligner.algorithms.dpo.build_with_reference`: precomputed or swapped in each step; with LoRA the
base with its adapters off), for the completions and the mismatched completions alike.

The reference point is estimated per micro batch from its examples' mismatched completions (TRL
estimates it per device batch). The pairs are fixed by the data (aligner/data/unpaired.py) and a
micro batch holds the same examples at any parallel layout, so the losses do not depend on TP, PP
or DP; they do depend on trainer.micro_batch_size, which sets how many pairs each estimate averages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aligner.config import one_of
from aligner.data.records import Layouts
from aligner.data.unpaired import UNPAIRED_LAYOUTS, UnpairedDataset, collate_unpaired
from aligner.models.gpt import num_parameters
from aligner.models.logprobs import response_logprobs
from aligner.models.packing import forward_batch
from aligner.rl import dpo_math, kto_math
from aligner.runtime.errors import ConfigError
from aligner.training.metrics import get_logger
from aligner.training.setup import DataSection, DatasetEntry, RunConfig
from aligner.training.trainer import Trainer

from .dpo import REFERENCE_MODES, build_with_reference


# ----------------------------------------------------------------------------- config schema
@dataclass
class KTOSection:
    """The `kto:` section."""

    beta: float = 0.1  # implicit reward = beta * (log pi - log pi_ref)
    desirable_weight: float = 1.0  # lambda_D: weight of a desirable example's loss
    undesirable_weight: float = 1.0  # lambda_U: weight of an undesirable example's loss
    sft_loss_weight: float = 0.0  # > 0: add weight * the per-token mean NLL of each desirable completion
    reference_logprobs: str = one_of(REFERENCE_MODES, "precompute")


@dataclass
class KTOConfig(RunConfig):
    """aligner/conf/gpt_kto.yaml: the shared run sections plus `kto` and `data`."""

    LR_METHOD = "preference"  # its row in aligner/training/lr_ranges.py
    name: str = "gpt_kto"
    kto: KTOSection = field(default_factory=KTOSection)
    data: DataSection = field(default_factory=DataSection)

    def data_layouts(self) -> Layouts:
        return UNPAIRED_LAYOUTS


def check_kto_section(kto: KTOSection) -> None:
    if kto.beta <= 0:
        raise ConfigError(f"kto.beta must be > 0, got {kto.beta}")
    for key in ("desirable_weight", "undesirable_weight"):
        if getattr(kto, key) <= 0:
            raise ConfigError(f"kto.{key} must be > 0, got {getattr(kto, key)}")
    if kto.sft_loss_weight < 0:
        raise ConfigError(f"kto.sft_loss_weight must be >= 0, got {kto.sft_loss_weight}")


# ----------------------------------------------------------------------------- objective
class KTOObjective:
    """Mean per-example KTO loss over the examples of the global batch.

    Batches are `collate_unpaired` rows (completion, mismatched completion interleaved) carrying
    `reference_logprobs` [rows] (summed over each response) and the labels `desirable` [rows].
    """

    reads_logits_at_positions = True  # the responses only: the output layer runs there

    def __init__(self, kto: KTOSection, vocab_size: int):
        check_kto_section(kto)
        self.kto = kto
        self.vocab_size = vocab_size

    def forward(self, model, batch):
        return forward_batch(model, batch, None)

    def loss(self, batch, logits):
        kto = self.kto
        lengths = batch["response_lengths"]
        token_logprobs = response_logprobs(logits, batch["tokens"], batch["prompt_lengths"], lengths,
                                           vocab_size=self.vocab_size)  # [rows, width]
        policy = dpo_math.sequence_logprobs(token_logprobs, lengths, average=False)
        log_ratios = policy - batch["reference_logprobs"].to(policy.device, policy.dtype)
        kl = kto_math.kl_estimate(log_ratios[1::2])
        desirable = batch["desirable"][0::2].to(policy.device)
        losses = kto_math.kto_loss(log_ratios[0::2], desirable, kl, beta=kto.beta,
                                   desirable_weight=kto.desirable_weight, undesirable_weight=kto.undesirable_weight)
        sft = torch.zeros_like(losses)
        if kto.sft_loss_weight > 0:  # as DPO's sft term: the desirable completions' likelihood kept up
            mean_logprobs = dpo_math.sequence_logprobs(token_logprobs[0::2], lengths[0::2], average=True)
            sft = torch.where(desirable, dpo_math.sft_loss(mean_logprobs), 0.0)
        loss_sum = (losses + kto.sft_loss_weight * sft).sum()
        rewards = kto.beta * log_ratios[0::2].detach()
        examples = losses.numel()
        report = {
            "loss_sum": loss_sum.detach(), "examples": torch.tensor(float(examples)), "kl_sum": kl * examples,
            "kto_loss_sum": losses.detach().sum(), "sft_loss_sum": sft.detach().sum(),
            # the reference point before its clamp at 0 (how far below 0 the mismatched log-ratios went)
            "mismatched_log_ratio_sum": log_ratios[1::2].detach().mean() * examples,
            "desirable": desirable.sum().float(), "undesirable": (~desirable).sum().float(),
            "desirable_reward_sum": torch.where(desirable, rewards, 0.0).sum(),
            "undesirable_reward_sum": torch.where(desirable, 0.0, rewards).sum(),
        }
        return loss_sum, torch.tensor(examples, dtype=torch.int), report

    def summarize(self, totals):
        examples = max(totals["examples"], 1.0)
        desirable, undesirable = totals["desirable"], totals["undesirable"]
        metrics = {"loss": totals["loss_sum"] / examples, "kto_loss": totals["kto_loss_sum"] / examples,
                   "kl": totals["kl_sum"] / examples, "examples": examples,
                   "mismatched_log_ratio": totals["mismatched_log_ratio_sum"] / examples,
                   "desirable_fraction": desirable / examples}
        if desirable:
            metrics["desirable_reward"] = totals["desirable_reward_sum"] / desirable
            metrics["sft_loss"] = totals["sft_loss_sum"] / desirable
        if undesirable:
            metrics["undesirable_reward"] = totals["undesirable_reward_sum"] / undesirable
        if desirable and undesirable:
            metrics["reward_margin"] = metrics["desirable_reward"] - metrics["undesirable_reward"]
        return metrics


# ----------------------------------------------------------------------------- building a run
def build_kto_trainer(cfg: KTOConfig) -> Trainer:
    """Runtime, tokenizer, model, reference logprobs, data, optimizer, metrics, resume: ready to `fit()`."""
    check_kto_section(cfg.kto)
    kto = cfg.kto

    def read_dataset(entry: DatasetEntry, tokenizer) -> UnpairedDataset:
        dataset = UnpairedDataset.from_jsonl(entry.path, tokenizer, cfg.data.max_seq_length,
                                             use_template=cfg.data.chat_template)
        stats = dataset.stats
        get_logger().info(f"{entry.path}: {stats.kept} examples, {stats.desirable} desirable and {stats.undesirable} "
                          f"undesirable ({stats.dropped_too_long} dropped: longer than {cfg.data.max_seq_length} "
                          "tokens)")
        # The KTO paper's advice: weigh the labels so that w_D n_D / (w_U n_U) lies in [1, 4/3].
        if stats.desirable and stats.undesirable:
            ratio = kto.desirable_weight * stats.desirable / (kto.undesirable_weight * stats.undesirable)
            if not 1.0 <= ratio <= 4.0 / 3.0:
                get_logger().info(f"{entry.path}: desirable_weight x desirable / (undesirable_weight x undesirable) "
                                  f"= {ratio:.2f}; the KTO paper recommends 1 to 4/3 (set kto.desirable_weight / "
                                  "kto.undesirable_weight)")
        return dataset

    trainer, built, train_set, total_steps = build_with_reference(
        cfg, reference_mode=kto.reference_logprobs, read_dataset=read_dataset, collate_fn=collate_unpaired,
        make_objective=lambda built: KTOObjective(kto, built.model_cfg.vocab_size))
    trainer.metrics.write(
        f"{cfg.name}: beta={kto.beta}, weights desirable {kto.desirable_weight} / undesirable "
        f"{kto.undesirable_weight}, reference logprobs {kto.reference_logprobs}, "
        f"{num_parameters(built.model_cfg) / 1e6:.2f}M parameters, TP={cfg.parallel.tensor_model_parallel_size} "
        f"PP={cfg.parallel.pipeline_model_parallel_size} DP={built.data_parallel_size}, {len(train_set)} train "
        f"examples, {total_steps} steps of {cfg.trainer.global_batch_size} examples"
    )
    return trainer
