"""Knowledge distillation from a teacher's precomputed top-k logits (SFT-KD), megatron TP/PP/DP.

Reads top to bottom: the teacher pass (`compute_teacher_topk`: the teacher's top-k at every response
position of an SFT file, any TP/PP, written once by examples/nlp/data/compute_teacher_topk.py), the
student's config schema, the objective (KL to the teacher's top-k distribution plus the NLL of the
data, math in `aligner.rl.distillation_math`) and `build_kd_trainer`.

The student reads the same SFT files with the same tokenizer; each train and validation entry names its
teacher file (`data.train=[{path: sft.jsonl, teacher_topk: sft.topk.safetensors}]`), whose token digest
must match. Teacher and student may differ in size and architecture, not in tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from aligner import checkpointing
from aligner.algorithms.sft import SFTDataConfig, response_token_loss
from aligner.config import at_least, one_of
from aligner.data.jsonl import DataError
from aligner.data.records import Layouts, check_data_source
from aligner.data.sft import SFT_LAYOUTS, SFTDataset, collate_sft
from aligner.data.teacher_topk import (
    DistillationDataset,
    TeacherTopK,
    collate_distillation,
    examples_digest,
    loss_positions,
    write_teacher_topk,
)
from aligner.hf.sources import resolve_model_source, source_kind
from aligner.models import lora
from aligner.models.forward import forward_logits
from aligner.models.gpt import GPTConfig, build_model_chunks, mask_padded_vocab, num_parameters
from aligner.rl import distillation_math
from aligner.runtime import distributed
from aligner.runtime.distributed import PRECISIONS, ParallelConfig
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer
from aligner.training import setup
from aligner.training.metrics import get_logger
from aligner.training.setup import DatasetEntry, RunConfig
from aligner.training.trainer import Trainer


# ----------------------------------------------------------------------------- the teacher pass
@dataclass
class TeacherData:
    path: str = "???"  # an SFT data file (any format and layout train_gpt_sft.py reads)
    max_seq_length: int = at_least(2, 512)  # as the student's data.max_seq_length
    chat_template: bool = True  # as the student's data.chat_template


@dataclass
class TeacherTopKConfig:
    """aligner/conf/teacher_topk.yaml."""

    teacher: str = "???"  # checkpoint (adapters load onto their base), run dir, HF dir or .gguf (aligner.hf.sources)
    tokenizer_path: Optional[str] = None  # null: the teacher checkpoint's
    precision: str = one_of(PRECISIONS, "auto")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: TeacherData = field(default_factory=TeacherData)
    top_k: int = at_least(1, 16)
    micro_batch_size: int = at_least(1, 8)  # examples per forward
    output: str = "???"  # the safetensors file to write


def topk_at_loss_positions(logits: torch.Tensor, items: list[dict], k: int) -> list[tuple[torch.Tensor, ...]]:
    """Per example, the teacher's (ids, logits) [loss positions, k] from full-vocabulary logits [B, S, V]."""
    out = []
    for row, item in enumerate(items):
        values, ids = torch.topk(logits[row, loss_positions(item)].float(), k, dim=-1)
        out.append((ids, values))
    return out


@torch.no_grad()
def compute_teacher_topk(cfg: TeacherTopKConfig) -> Path:
    """Run the teacher over the SFT file and write its top-k file (every TP/PP rank takes part; rank 0 writes)."""
    import torch.distributed as dist

    source_kind(cfg.teacher, "teacher")  # first: a wrong path named (cheap)
    check_data_source("data.path", cfg.data.path, SFT_LAYOUTS)  # before the teacher is imported or built
    teacher = resolve_model_source(cfg.teacher, "teacher", get_logger().info)
    model_cfg = GPTConfig.from_dict(checkpointing.read_meta(teacher)["model"])
    tokenizer = Tokenizer(cfg.tokenizer_path or teacher / checkpointing.TOKENIZER_DIR)
    if distributed.initialize(cfg.parallel) != 1:
        raise ConfigError("the teacher pass runs one model replica: launch tensor_model_parallel_size x "
                          f"pipeline_model_parallel_size processes, not {dist.get_world_size()}")
    try:
        if cfg.top_k > model_cfg.vocab_size:
            raise ConfigError(f"top_k={cfg.top_k} exceeds the teacher's vocabulary ({model_cfg.vocab_size})")
        chunks = build_model_chunks(model_cfg, cfg.parallel, distributed.resolve_precision(cfg.precision))
        lora.load_for_inference(teacher, chunks)
        dataset = SFTDataset(cfg.data.path, tokenizer, cfg.data.max_seq_length, use_template=cfg.data.chat_template)
        ids, logits, offsets = [], [], [0]
        for start in range(0, len(dataset), cfg.micro_batch_size):
            items = [dataset[i] for i in range(start, min(start + cfg.micro_batch_size, len(dataset)))]
            batch = collate_sft(items, tokenizer.pad_id)
            full = forward_logits(chunks, batch["tokens"], model_cfg.vocab_size, batch["position_ids"])
            for example_ids, example_logits in topk_at_loss_positions(full, items, cfg.top_k):
                ids.append(example_ids)
                logits.append(example_logits)
                offsets.append(offsets[-1] + len(example_ids))
        meta = {"teacher": str(teacher.resolve()), "k": cfg.top_k, "examples": len(dataset),
                "digest": examples_digest(dataset), "vocab_size": model_cfg.vocab_size, "data": cfg.data.path}
        path = Path(cfg.output)
        if dist.get_rank() == 0:
            write_teacher_topk(path, torch.cat(ids), torch.cat(logits), torch.tensor(offsets), meta)
            get_logger().info(f"teacher top-{cfg.top_k} of {len(dataset)} examples ({offsets[-1]} positions) -> {path}")
        dist.barrier()
        return path
    finally:
        distributed.shutdown()


# ----------------------------------------------------------------------------- config schema (student)
@dataclass
class KDDatasetEntry(DatasetEntry):
    teacher_topk: str = "???"  # the file compute_teacher_topk.py wrote for this data file


@dataclass
class KDDataConfig(SFTDataConfig):
    train: list[KDDatasetEntry] = field(default_factory=list)
    validation: list[KDDatasetEntry] = field(default_factory=list)  # empty: carve `split` out of train


@dataclass
class KDSection:
    """The `kd:` section: loss = kd_loss_weight x KL(teacher top-k || student) + sft_loss_weight x NLL, each a
    mean over the response tokens."""

    kd_loss_weight: float = 1.0
    sft_loss_weight: float = 0.0


@dataclass
class KDConfig(RunConfig):
    """aligner/conf/gpt_knowledge_distillation.yaml: the shared run sections plus `kd` and `data`."""

    LR_METHOD = "sft"  # its row in aligner/training/lr_ranges.py
    name: str = "gpt_knowledge_distillation"
    kd: KDSection = field(default_factory=KDSection)
    data: KDDataConfig = field(default_factory=KDDataConfig)

    def data_layouts(self) -> Layouts:
        return SFT_LAYOUTS


def check_kd_config(cfg: KDConfig) -> None:
    kd = cfg.kd
    if kd.kd_loss_weight < 0 or kd.sft_loss_weight < 0 or kd.kd_loss_weight + kd.sft_loss_weight == 0:
        raise ConfigError(f"kd.kd_loss_weight={kd.kd_loss_weight} and kd.sft_loss_weight={kd.sft_loss_weight}: "
                          "both must be >= 0 and one > 0")
    if cfg.data.pack_sequences:
        raise ConfigError("data.pack_sequences=true is not supported by knowledge distillation yet")
    if cfg.data.steerlm.enabled:
        raise ConfigError("data.steerlm is not supported by knowledge distillation")


# ----------------------------------------------------------------------------- objective
def student_logprobs_at(logits: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, ids: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """The student's log-softmax over the real vocabulary at (rows, columns), at `ids` [n, k]: [n, k].

    logits: [batch, seq, vocab_shard], this rank's tensor-parallel shard; the normaliser is summed over the
    shards and each id's logit taken from the shard that holds it (megatron's reduce region: all-reduce
    forward, identity backward, so each shard gets its own part of the gradient)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    selected = mask_padded_vocab(logits[rows, columns].float(), vocab_size)  # [n, shard]
    shard = selected.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    peak = selected.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    total = reduce_from_tensor_model_parallel_region((selected - peak).exp().sum(dim=-1, keepdim=True))
    local = ids - start
    inside = (local >= 0) & (local < shard)
    picked = torch.where(inside, selected.gather(-1, local.clamp(0, shard - 1)), 0.0)
    picked = reduce_from_tensor_model_parallel_region(picked)
    return picked - peak - total.log()


class KDObjective:
    """Mean over the response tokens of the global batch of kd_loss_weight x top-k KL + sft_loss_weight x NLL."""

    def __init__(self, kd: KDSection, vocab_size: int):
        self.kd, self.vocab_size = kd, vocab_size

    def forward(self, model, batch):
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"])

    def loss(self, batch, logits):
        kd = self.kd
        loss_mask = batch["loss_mask"]
        rows, columns = loss_mask.nonzero(as_tuple=True)
        ids = batch["teacher_ids"].to(logits.device)[rows, columns]
        student = student_logprobs_at(logits, rows, columns, ids, self.vocab_size)
        kl = distillation_math.topk_kl(student, batch["teacher_logits"].to(logits.device)[rows, columns])
        kl_sum = kl.sum()
        nll_sum, tokens = response_token_loss(logits, batch["labels"], loss_mask, self.vocab_size)
        loss_sum = kd.kd_loss_weight * kl_sum + kd.sft_loss_weight * nll_sum
        return loss_sum, tokens, {"loss_sum": loss_sum.detach(), "kd_sum": kl_sum.detach(),
                                  "nll_sum": nll_sum.detach(), "tokens": tokens.detach().float()}

    def summarize(self, totals):
        tokens = max(totals["tokens"], 1.0)
        return {"loss": totals["loss_sum"] / tokens, "kd_loss": totals["kd_sum"] / tokens,
                "sft_loss": totals["nll_sum"] / tokens, "response_tokens": totals["tokens"]}


# ----------------------------------------------------------------------------- building a run
def build_kd_trainer(cfg: KDConfig) -> Trainer:
    """Runtime, tokenizer, student, data with the teacher's top-k, optimizer, metrics, resume."""
    import functools

    check_kd_config(cfg)
    built = setup.build_training_model(
        parallel=cfg.parallel, precision=cfg.precision, seed=cfg.seed, model=cfg.model, tokenizer=cfg.tokenizer,
        optim=cfg.optim, save_dir=cfg.checkpoint.save_dir, resume=cfg.checkpoint.resume,
        lock_wait_s=cfg.checkpoint.lock_wait_s, peft=cfg.peft,
        sequence_lengths=cfg.sequence_lengths(),
    )
    model_cfg = built.model_cfg
    top_ks = set()

    def load_dataset(entry: KDDatasetEntry) -> DistillationDataset:
        sft = SFTDataset(entry.path, built.tokenizer, cfg.data.max_seq_length, use_template=cfg.data.chat_template)
        topk = TeacherTopK(entry.teacher_topk)
        if topk.meta.get("vocab_size", 0) > model_cfg.vocab_size:
            raise DataError(f"{entry.teacher_topk}: the teacher's vocabulary ({topk.meta['vocab_size']}) is larger "
                            f"than the student's ({model_cfg.vocab_size}); teacher and student need one tokenizer")
        top_ks.add(topk.k)
        get_logger().info(f"{entry.path}: {len(sft)} examples, teacher top-{topk.k} from {topk.meta['teacher']}")
        return DistillationDataset(sft, topk, entry.path)

    trainer_cfg = cfg.trainer
    train_set, val_set = setup.build_datasets(
        train=cfg.data.train, validation=cfg.data.validation, split=cfg.data.split, seed=cfg.seed,
        trainer_cfg=trainer_cfg, load_dataset=load_dataset,
    )
    if len(top_ks) > 1:
        raise DataError(f"the teacher top-k files have different k ({sorted(top_ks)}); compute them with one top_k")
    train_loader, val_loader = setup.build_loaders(
        train_set, val_set, trainer_cfg=trainer_cfg, data_parallel_size=built.data_parallel_size, seed=cfg.seed,
        shuffle=cfg.data.shuffle, pad_id=built.tokenizer.pad_id, pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        collate_fn=functools.partial(collate_distillation, k=top_ks.pop()),
    )
    total_steps = train_loader.total_steps(trainer_cfg.max_steps, trainer_cfg.max_epochs)
    trainer = setup.build_trainer(cfg, built, KDObjective(cfg.kd, model_cfg.vocab_size), total_steps=total_steps,
                                  train_loader=train_loader, val_loader=val_loader)
    if built.resume_checkpoint is not None:
        trainer.resume_from(built.resume_checkpoint)
    trainer.metrics.write(
        f"{cfg.name}: {num_parameters(model_cfg) / 1e6:.2f}M-parameter student, loss {cfg.kd.kd_loss_weight} x top-k "
        f"KL + {cfg.kd.sft_loss_weight} x NLL, TP={cfg.parallel.tensor_model_parallel_size} "
        f"PP={cfg.parallel.pipeline_model_parallel_size} DP={built.data_parallel_size}, {len(train_set)} train "
        f"examples, {total_steps} steps of {trainer_cfg.global_batch_size}")
    return trainer
