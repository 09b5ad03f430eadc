"""Steps of micro batches for megatron's schedules: sampler + collate, one list per global step."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import Dataset

from aligner.data.sampler import DistributedBatchSampler
from aligner.data.sft import collate_sft
from aligner.models.packing import plan_token_budget, prompt_keys
from aligner.runtime import distributed


class MicroBatchLoader:
    """Yields, per training step, this data-parallel rank's micro batches (collated dicts).

    All micro batches of a step are padded to one sequence length: the pipeline schedule sends
    activations of a fixed shape between stages.

    packing.micro_batch_tokens (an `aligner.models.packing.PackingSection`): instead of micro_batch_size
    items per micro batch, every rank reads the whole global batch and takes its share of
    `plan_token_budget` (items balanced across ranks by tokens, micro batches whose packed rows of
    packing.row_length, default the step's padded length, hold at most that many tokens, as many on
    every rank; an empty one has no rows).
    """

    def __init__(self, dataset: Dataset, *, global_batch_size: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int, shuffle: bool,
                 pad_id: int, pad_to_multiple_of: Optional[int] = None, collate_fn: Optional[Callable] = None,
                 packing=None):
        self.dataset = dataset
        self.sampler_args = dict(
            dataset_length=len(dataset), global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size, seed=seed, shuffle=shuffle,
        )
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.pad_id = pad_id
        self.pad_to_multiple_of = distributed.pad_multiple(pad_to_multiple_of)
        # collate_fn(examples, pad_id, pad_to_multiple_of) -> dict of [rows, ...] tensors; a dataset
        # item may become several rows (a preference pair is two), sliced micro batch by micro batch.
        self.collate_fn = collate_fn or collate_sft
        sampler = DistributedBatchSampler(**self.sampler_args)  # also validates the batch sizes now
        self.num_microbatches = sampler.num_microbatches
        self.steps_per_epoch = sampler.steps_per_epoch
        self.micro_batch_tokens = None if packing is None else packing.micro_batch_tokens
        self.row_length = None if packing is None else packing.row_length
        # Pairs that share their prompt in a packed row (the DPO family) are planned with it once.
        self.shares_prompts = getattr(packing, "share_prompts", False)
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size

    def total_steps(self, max_steps: int, max_epochs: Optional[int]) -> int:
        if max_epochs is None:
            return max_steps
        return min(max_steps, max_epochs * self.steps_per_epoch) if max_steps > 0 else max_epochs * self.steps_per_epoch

    def iterate(self, consumed_samples: int = 0, epochs: Optional[int] = None,
                limit_samples: Optional[int] = None) -> Iterator[list[dict]]:
        budget = self.micro_batch_tokens is not None
        # With token budgets every rank reads the whole global batch (one micro batch of G items).
        sampler_args = {**self.sampler_args, **(dict(micro_batch_size=self.global_batch_size, data_parallel_rank=0,
                                                     data_parallel_size=1) if budget else {})}
        sampler = iter(DistributedBatchSampler(**sampler_args, consumed_samples=consumed_samples, epochs=epochs))
        max_steps = None if limit_samples is None else max(limit_samples // self.global_batch_size, 1)
        step = 0
        while max_steps is None or step < max_steps:
            indices = []
            try:
                for _ in range(1 if budget else self.num_microbatches):
                    indices.extend(next(sampler))
            except StopIteration:
                return
            # One collate over the whole step gives every micro batch the same padded length.
            examples = [self.dataset[i] for i in indices]
            batch = self.collate_fn(examples, self.pad_id, self.pad_to_multiple_of)
            length = batch["tokens"].shape[1]
            longest = distributed.longest_across_expert_ranks(length)
            if longest != length:  # rounded up to a multiple of the longest: that length exactly
                batch = self.collate_fn(examples, self.pad_id, longest)
                if batch["tokens"].shape[1] != longest:
                    raise RuntimeError(f"collating to {longest} tokens gave {batch['tokens'].shape[1]}")
            rows_per_item = batch["tokens"].shape[0] // len(indices)
            if budget:
                yield self._token_budget_micro_batches(batch, rows_per_item)
            else:
                rows = self.micro_batch_size * rows_per_item
                yield [_slice_batch(batch, start, start + rows) for start in range(0, batch["tokens"].shape[0], rows)]
            step += 1

    def _token_budget_micro_batches(self, batch: dict, rows_per_item: int) -> list[dict]:
        """This rank's micro batches of a collated global batch (`plan_token_budget` over its items)."""
        items = row_lengths(batch).reshape(-1, rows_per_item).tolist()  # [items][rows per item]
        prompts = None
        if self.shares_prompts and "prompt_lengths" in batch:  # as `packing.packed_rows_of` lays them out
            prompt_lengths = batch["prompt_lengths"]
            per_row = list(zip(prompt_lengths.tolist(), prompt_keys(batch["tokens"], prompt_lengths)))
            prompts = [per_row[start:start + rows_per_item] for start in range(0, len(per_row), rows_per_item)]
        plan = plan_token_budget(items, self.data_parallel_size, self.micro_batch_tokens,
                                 self.row_length or batch["tokens"].shape[1], prompts)  # the packed rows' length
        micro_batches = []
        for members in plan[self.data_parallel_rank]:
            rows = torch.tensor([item * rows_per_item + row for item in members for row in range(rows_per_item)],
                                dtype=torch.long)
            micro_batches.append({key: None if value is None else value[rows] for key, value in batch.items()})
        return micro_batches


def row_lengths(batch: dict) -> torch.Tensor:
    """Real tokens of each row of a collated batch's `tokens` [rows], from the lengths it carries:
    lengths [rows] (SFT, reward models), or prompt_lengths + response_lengths [rows] (DPO, SPIN).
    Never by comparing tokens with the pad id: where pad == eos (SmolLM2, Qwen) that drops real eos tokens."""
    if "lengths" in batch:
        return batch["lengths"]
    if "prompt_lengths" in batch and "response_lengths" in batch:
        return batch["prompt_lengths"] + batch["response_lengths"]
    raise KeyError("a collated batch says how long its rows are in 'lengths' or 'prompt_lengths' + "
                   f"'response_lengths'; this one has {sorted(batch)}")


def _slice_batch(batch: dict, start: int, stop: int) -> dict:
    return {key: None if value is None else value[start:stop] for key, value in batch.items()}
