"""A teacher's top-k logits for an SFT data file, for knowledge distillation (SFT-KD).

`python examples/nlp/data/compute_teacher_topk.py` runs the teacher over the SFT examples and writes,
for every response position (each token the SFT loss is on), the teacher's k most likely next tokens
and their logits, as one safetensors file:

  ids      [positions, k] int64   the token ids, most likely first
  logits   [positions, k] float32 the teacher's logits of those ids
  offsets  [examples + 1] int64   example i's positions are rows offsets[i]:offsets[i+1], in order

and in its metadata the teacher checkpoint, k, the example count and a digest of the examples' tokens and
loss masks. Training reads the same data file with the same tokenizer and settings and refuses a file
whose digest differs (other data, tokenizer, template or max_seq_length): the positions would not line up.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import Dataset

from aligner.data.jsonl import DataError
from aligner.data.sft import collate_sft


def examples_digest(dataset) -> str:
    """sha256 over every example's tokens and loss mask, in order (an SFTDataset's items)."""
    digest = hashlib.sha256()
    for index in range(len(dataset)):
        item = dataset[index]
        digest.update(item["tokens"].numpy().astype("int64").tobytes())
        digest.update(item["loss_mask"].numpy().astype("int8").tobytes())
    return digest.hexdigest()


def loss_positions(item: dict) -> torch.Tensor:
    """The input positions whose next token carries the SFT loss (collate_sft's loss_mask[1:])."""
    return item["loss_mask"][1:].nonzero().flatten()


def write_teacher_topk(path: str | Path, ids: torch.Tensor, logits: torch.Tensor, offsets: torch.Tensor,
                       meta: dict) -> Path:
    """Write the file (a temporary name first, renamed into place when whole)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file({"ids": ids.contiguous(), "logits": logits.float().contiguous(), "offsets": offsets.contiguous()},
              str(partial), metadata={"aligner_teacher_topk": json.dumps(meta, sort_keys=True)})
    partial.replace(path)
    return path


class TeacherTopK:
    """A teacher top-k file, read whole."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"teacher top-k file {self.path} does not exist; write it with "
                            "examples/nlp/data/compute_teacher_topk.py")
        try:
            with safe_open(str(self.path), framework="pt") as handle:
                self.meta = json.loads((handle.metadata() or {})["aligner_teacher_topk"])
                self.ids, self.logits, self.offsets = (handle.get_tensor(name) for name in ("ids", "logits", "offsets"))
        except (KeyError, ValueError, OSError) as error:
            raise DataError(f"{self.path}: not a teacher top-k file ({type(error).__name__}: {error})") from None

    @property
    def k(self) -> int:
        return int(self.meta["k"])

    def example(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.ids[start:end], self.logits[start:end]


class DistillationDataset(Dataset):
    """An SFT dataset whose items also carry the teacher's top-k at their loss positions
    ("teacher_ids", "teacher_logits": [loss positions, k])."""

    def __init__(self, sft_dataset, topk: TeacherTopK, data_path: str):
        self.dataset, self.topk = sft_dataset, topk
        expected = {"examples": len(sft_dataset), "digest": examples_digest(sft_dataset)}
        found = {"examples": topk.meta.get("examples"), "digest": topk.meta.get("digest")}
        if found != expected:
            raise DataError(f"{topk.path} was computed for other examples than {data_path} gives now "
                            f"({found['examples']} vs {expected['examples']} examples, token digests "
                            f"{'differ' if found['examples'] == expected['examples'] else 'too'}): same file, "
                            "tokenizer, chat_template and max_seq_length are needed; compute it again")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = dict(self.dataset[index])
        item["teacher_ids"], item["teacher_logits"] = self.topk.example(index)
        return item


def collate_distillation(items: list[dict], pad_id: int, pad_to_multiple_of: int = 1,
                         k: Optional[int] = None) -> dict:
    """`collate_sft` plus teacher_ids [B, S, k] long and teacher_logits [B, S, k] float at the loss positions
    (zeros elsewhere, where the loss mask is 0)."""
    batch = collate_sft([{key: item[key] for key in ("tokens", "loss_mask")} for item in items], pad_id,
                        pad_to_multiple_of)
    rows, seq_len = batch["tokens"].shape
    k = k or items[0]["teacher_ids"].shape[1]
    batch["teacher_ids"] = torch.zeros(rows, seq_len, k, dtype=torch.long)
    batch["teacher_logits"] = torch.zeros(rows, seq_len, k, dtype=torch.float32)
    for row, item in enumerate(items):
        positions = loss_positions(item)
        if len(positions) != len(item["teacher_ids"]):
            raise DataError(f"an example has {len(positions)} loss positions but {len(item['teacher_ids'])} "
                            "teacher top-k rows")
        keep = positions < seq_len
        batch["teacher_ids"][row, positions[keep]] = item["teacher_ids"][keep]
        batch["teacher_logits"][row, positions[keep]] = item["teacher_logits"][keep]
    return batch
