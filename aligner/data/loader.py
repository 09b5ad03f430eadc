"""Steps of micro batches for megatron's schedules: sampler + collate, one list per global step."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from torch.utils.data import Dataset

from aligner.data.sampler import DistributedBatchSampler
from aligner.data.sft import collate_sft


class MicroBatchLoader:
    """Yields, per training step, this data-parallel rank's micro batches (collated dicts).

    All micro batches of a step are padded to one sequence length: the pipeline schedule sends
    activations of a fixed shape between stages.
    """

    def __init__(self, dataset: Dataset, *, global_batch_size: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int, shuffle: bool,
                 pad_id: int, pad_to_multiple_of: int = 8, collate_fn: Optional[Callable] = None):
        self.dataset = dataset
        self.sampler_args = dict(
            dataset_length=len(dataset), global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size, seed=seed, shuffle=shuffle,
        )
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        # collate_fn(examples, pad_id, pad_to_multiple_of) -> dict of [rows, ...] tensors; a dataset
        # item may become several rows (a preference pair is two), sliced micro batch by micro batch.
        self.collate_fn = collate_fn or collate_sft
        sampler = DistributedBatchSampler(**self.sampler_args)  # also validates the batch sizes now
        self.num_microbatches = sampler.num_microbatches
        self.steps_per_epoch = sampler.steps_per_epoch

    def total_steps(self, max_steps: int, max_epochs: Optional[int]) -> int:
        if max_epochs is None:
            return max_steps
        return min(max_steps, max_epochs * self.steps_per_epoch) if max_steps > 0 else max_epochs * self.steps_per_epoch

    def iterate(self, consumed_samples: int = 0, epochs: Optional[int] = None,
                limit_samples: Optional[int] = None) -> Iterator[list[dict]]:
        sampler = iter(DistributedBatchSampler(**self.sampler_args, consumed_samples=consumed_samples, epochs=epochs))
        max_steps = None if limit_samples is None else max(limit_samples // self.global_batch_size, 1)
        step = 0
        while max_steps is None or step < max_steps:
            indices = []
            try:
                for _ in range(self.num_microbatches):
                    indices.extend(next(sampler))
            except StopIteration:
                return
            # One collate over the whole step gives every micro batch the same padded length.
            batch = self.collate_fn([self.dataset[i] for i in indices], self.pad_id, self.pad_to_multiple_of)
            rows_per_item = batch["tokens"].shape[0] // len(indices)
            rows = self.micro_batch_size * rows_per_item
            yield [_slice_batch(batch, start, start + rows) for start in range(0, batch["tokens"].shape[0], rows)]
            step += 1


def _slice_batch(batch: dict, start: int, stop: int) -> dict:
    return {key: None if value is None else value[start:stop] for key, value in batch.items()}
