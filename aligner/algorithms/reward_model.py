"""Reward-model training: binary ranking (Bradley-Terry) or attribute regression (SteerLM).

Reads top to bottom: config schema, the losses (pure functions), the objective the shared
trainer runs, reward normalisation, and `build_reward_model_trainer`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from aligner import checkpointing
from aligner.config import one_of
from aligner.data.records import Layouts
from aligner.data.reward import (
    COMPARISON_LAYOUTS,
    REGRESSION_LAYOUTS,
    ComparisonDataset,
    RegressionDataset,
    collate_comparisons,
    collate_regression,
)
from aligner.models.gpt import num_parameters
from aligner.models.packing import PackingSection, forward_batch, packed_rows_of, token_scores_at, zero_loss
from aligner.models.reward import (
    HEAD_STATE_PREFIX,
    REWARD_TYPES,
    RewardInference,
    build_reward_model,
    scores_at_last_token,
)
from aligner.runtime.distributed import device
from aligner.training import setup
from aligner.training.metrics import get_logger
from aligner.training.setup import DataSection, DatasetEntry, RunConfig
from aligner.training.trainer import Trainer


# ----------------------------------------------------------------------------- config schema
@dataclass
class RewardSection:
    type: str = one_of(REWARD_TYPES, "binary_ranking")
    attributes: list = field(default_factory=lambda: ["reward"])  # regression: one output per attribute
    normalize: bool = True  # store mean/std of rewards on a reference set so served rewards are normalised
    normalization_samples: int = 1024  # reference-set size (from validation data, else training data)

    def check_fields(self) -> Optional[tuple[str, str]]:
        if self.type == "binary_ranking" and len(self.attributes) != 1:
            return "attributes", "reward.type=binary_ranking predicts one reward"
        return None


@dataclass
class RewardDataConfig(DataSection):
    append_eos: bool = True


@dataclass
class RewardModelConfig(RunConfig):
    """aligner/conf/training_rm.yaml: the shared run sections plus `reward` and `data`."""

    name: str = "reward_model"
    reward: RewardSection = field(default_factory=RewardSection)
    data: RewardDataConfig = field(default_factory=RewardDataConfig)
    packing: PackingSection = field(default_factory=PackingSection)

    def data_layouts(self) -> Layouts:
        return REGRESSION_LAYOUTS if self.reward.type == "regression" else COMPARISON_LAYOUTS


# ----------------------------------------------------------------------------- losses
def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair -log sigmoid(r_chosen - r_rejected): the negative log-likelihood that the
    chosen response is preferred under the Bradley-Terry model. chosen, rejected: [pairs]."""
    return -F.logsigmoid(chosen - rejected)


def masked_regression_loss(predictions: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-entry squared error, zero where an attribute is unlabelled. All [batch, attributes]."""
    return (predictions - labels).pow(2) * mask


# ----------------------------------------------------------------------------- objectives
def pair_report(loss_sum: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, **extra_sums) -> dict:
    """Per-micro-batch sums for a pairwise objective (reward model ranking, DPO): chosen/rejected are
    the pairs' (implicit) rewards [pairs]; extra_sums are more `<name>_sum` tensors to report."""
    report = {
        "loss_sum": loss_sum.detach(), "pairs": torch.tensor(float(chosen.numel())),
        "correct": (chosen > rejected).float().sum().detach(), "margin_sum": (chosen - rejected).sum().detach(),
        "chosen_sum": chosen.sum().detach(), "rejected_sum": rejected.sum().detach(),
    }
    report.update({f"{name}_sum": value.sum().detach() for name, value in extra_sums.items()})
    return report


def summarize_pairs(totals: dict) -> dict:
    """Means per pair of `pair_report` sums (extra `<name>_sum` entries become `<name>`)."""
    pairs = max(totals["pairs"], 1.0)
    metrics = {"loss": totals["loss_sum"] / pairs}
    metrics.update({key[:-4]: value / pairs for key, value in totals.items()
                    if key.endswith("_sum") and key not in ("loss_sum", "margin_sum", "chosen_sum", "rejected_sum")})
    metrics.update({"accuracy": totals["correct"] / pairs, "margin": totals["margin_sum"] / pairs,
                    "chosen_reward": totals["chosen_sum"] / pairs, "rejected_reward": totals["rejected_sum"] / pairs,
                    "pairs": totals["pairs"]})
    return metrics


class SequenceScores:
    """forward / last-token scores of collated micro batches (tokens, position_ids, lengths), padded or
    packed (`aligner.models.packing`: each micro batch's sequences in rows of packing.row_length,
    default the batch's padded length; None: padded rows)."""

    def __init__(self, packing: Optional[PackingSection] = None):
        self.packing = packing

    def forward(self, model, batch):
        # pad id 0: a packed row's padding is never attended to nor read
        return forward_batch(model, batch, packed_rows_of(batch, batch["lengths"], self.packing, 0))

    @staticmethod
    def empty(batch) -> bool:
        """An empty micro batch of a token-budget plan: zero loss, zero count, nothing reported."""
        return len(batch["lengths"]) == 0

    def last_token_scores(self, batch, scores: torch.Tensor) -> torch.Tensor:
        """Each sequence's scores at its last token, [batch, attributes] (float32)."""
        packed = packed_rows_of(batch, batch["lengths"], self.packing, 0)
        if packed is not None:
            return token_scores_at(scores.float(), packed, batch["lengths"] - 1)
        return scores_at_last_token(scores.float(), batch["lengths"])


class RankingObjective(SequenceScores):
    """Rows come in (chosen, rejected) pairs; the loss is the mean Bradley-Terry loss per pair."""

    def loss(self, batch, scores):
        if self.empty(batch):
            return zero_loss(scores), torch.tensor(0, dtype=torch.int), {}
        rewards = self.last_token_scores(batch, scores)[:, 0]  # [2 * pairs]
        chosen, rejected = rewards[0::2], rewards[1::2]
        per_pair = bradley_terry_loss(chosen, rejected)
        loss_sum = per_pair.sum()
        pairs = torch.tensor(per_pair.numel(), dtype=torch.int)
        return loss_sum, pairs, pair_report(loss_sum, chosen, rejected)

    def summarize(self, totals):
        return summarize_pairs(totals)


class RegressionObjective(SequenceScores):
    """Mean squared error over the labelled (sequence, attribute) entries of the global batch."""

    def __init__(self, attributes: list[str], packing: Optional[PackingSection] = None):
        super().__init__(packing)
        self.attributes = list(attributes)

    def loss(self, batch, scores):
        if self.empty(batch):
            return zero_loss(scores), torch.tensor(0, dtype=torch.int), {}
        predictions = self.last_token_scores(batch, scores)  # [batch, attributes]
        squared = masked_regression_loss(predictions, batch["labels"], batch["label_mask"])
        loss_sum = squared.sum()
        labelled = batch["label_mask"].sum().to(torch.int)
        report = {"loss_sum": loss_sum.detach(), "labelled": labelled.float()}
        for index, name in enumerate(self.attributes):
            report[f"se_{name}"] = squared[:, index].sum().detach()
            report[f"n_{name}"] = batch["label_mask"][:, index].sum()
        return loss_sum, labelled, report

    def summarize(self, totals):
        metrics = {"loss": totals["loss_sum"] / max(totals["labelled"], 1.0)}
        for name in self.attributes:
            metrics[f"mse_{name}"] = totals[f"se_{name}"] / max(totals[f"n_{name}"], 1.0)
        return metrics


# ----------------------------------------------------------------------------- normalisation
def reward_normalization(inference, loader, max_samples: int) -> dict:
    """Mean and std of raw rewards per attribute over up to `max_samples` reference sequences.

    Collective: every rank iterates the same loader slice for its data-parallel rank; statistics
    are computed from the gathered rewards, so every rank returns the same numbers.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rewards = []
    seen = 0
    for microbatches in loader.iterate(0, epochs=1, limit_samples=max_samples):
        for batch in microbatches:
            if batch["tokens"].shape[0] == 0:  # an empty micro batch of a token-budget plan
                continue
            rewards.append(inference.infer_local(batch["tokens"], batch["lengths"]))
            seen += batch["tokens"].shape[0]
    local = torch.cat(rewards).double() if rewards else torch.zeros(0, inference.num_attributes, dtype=torch.float64)
    stats = torch.stack([local.sum(0), local.pow(2).sum(0), torch.full_like(local.sum(0), local.shape[0])]).to(device())
    dist.all_reduce(stats, group=ps.get_data_parallel_group())
    total, total_sq, count = stats.cpu()
    mean = total / count
    std = (total_sq / count - mean.pow(2)).clamp_min(1e-12).sqrt()
    return {"mean": mean.tolist(), "std": std.tolist()}


# ----------------------------------------------------------------------------- building a run
def build_reward_model_trainer(cfg: RewardModelConfig) -> Trainer:
    reward = cfg.reward
    num_attributes = len(reward.attributes)
    cfg.packing.check_layout(cfg.parallel.pipeline_model_parallel_size, *cfg.data.longest_row,
                             cfg.parallel.expert_model_parallel_size)

    def chunk_builder(model_cfg, config, **kwargs):
        return build_reward_model(model_cfg, config, num_attributes=num_attributes, head_seed=cfg.seed,
                                  train_bias=reward.type == "regression", **kwargs)

    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume,
        sequence_lengths=cfg.sequence_lengths(), lock_wait_s=cfg.checkpoint.lock_wait_s,
        chunk_builder=chunk_builder, skip_prefixes=(HEAD_STATE_PREFIX,),
        peft=cfg.peft, train_whole_with_lora=(HEAD_STATE_PREFIX,),  # the fresh head trains beside the adapters
    )
    logger = get_logger()

    def load_dataset(entry: DatasetEntry):
        if reward.type == "binary_ranking":
            dataset = ComparisonDataset(entry.path, built.tokenizer, cfg.data.max_seq_length, cfg.data.append_eos,
                                        use_template=cfg.data.chat_template)
        else:
            dataset = RegressionDataset(entry.path, built.tokenizer, cfg.data.max_seq_length, list(reward.attributes),
                                        cfg.data.append_eos, use_template=cfg.data.chat_template)
        logger.info(f"{entry.path}: {dataset.stats.kept} examples ({dataset.stats.dropped_too_long} dropped: "
                    f"longer than {cfg.data.max_seq_length} tokens)")
        return dataset

    trainer_cfg = cfg.trainer
    train_set, val_set = setup.build_datasets(
        train=cfg.data.train, validation=cfg.data.validation, split=cfg.data.split, seed=cfg.seed,
        trainer_cfg=trainer_cfg, load_dataset=load_dataset,
    )
    train_loader, val_loader = setup.build_loaders(
        train_set, val_set, trainer_cfg=trainer_cfg, data_parallel_size=built.data_parallel_size, seed=cfg.seed,
        shuffle=cfg.data.shuffle, pad_id=built.tokenizer.pad_id, pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        collate_fn=collate_comparisons if reward.type == "binary_ranking" else collate_regression,
        packing=cfg.packing,
    )
    total_steps = train_loader.total_steps(trainer_cfg.max_steps, trainer_cfg.max_epochs)
    model_cfg = built.model_cfg
    objective = (RankingObjective(cfg.packing) if reward.type == "binary_ranking"
                 else RegressionObjective(list(reward.attributes), cfg.packing))
    reward_meta = {"type": reward.type, "attributes": list(reward.attributes), "normalization": None}
    trainer = setup.build_trainer(cfg, built, objective, total_steps=total_steps, train_loader=train_loader,
                                  val_loader=val_loader, checkpoint_meta={"reward": reward_meta})
    metrics = trainer.metrics
    if built.resume_checkpoint is not None:
        trainer.resume_from(built.resume_checkpoint)
        trainer.checkpoint_meta["reward"] = checkpointing.read_meta(built.resume_checkpoint).get("reward", reward_meta)
    metrics.write(
        f"{cfg.name}: {reward.type} over {reward.attributes}, {num_parameters(model_cfg) / 1e6:.2f}M parameters, "
        f"TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
        f"DP={built.data_parallel_size}, {len(train_set)} train examples, "
        f"{total_steps} steps of {trainer_cfg.global_batch_size}"
    )
    return trainer


def serve_command(checkpoint: Path) -> list[str]:
    """The end-of-run summary's next command for a trained reward model: serve it."""
    return [f"python examples/nlp/gpt/serve_reward_model.py init_from={checkpoint}"]


def finish_reward_model(trainer: Trainer, cfg: RewardModelConfig) -> None:
    """After training: measure and store the reward normalisation, then save the final checkpoint."""
    if cfg.reward.normalize:
        inference = RewardInference(trainer.chunks, len(cfg.reward.attributes), cfg.trainer.micro_batch_size)
        # The reference set: validation data if any, else training data.
        reference = trainer.val_loader if trainer.val_loader is not None else trainer.train_loader
        normalization = reward_normalization(inference, reference, cfg.reward.normalization_samples)
        trainer.checkpoint_meta["reward"]["normalization"] = normalization
        trainer.metrics.write(f"reward normalisation on the reference set: mean {normalization['mean']}, "
                              f"std {normalization['std']}")
    trainer.save()
