"""Which dataset indices each data-parallel rank reads, micro batch by micro batch.

The layout rule makes training independent of the parallel layout and
resumable: epoch e is a permutation of the data seeded by (seed, e); global
batch k is perm[k*G:(k+1)*G]; DP rank r takes the contiguous slice
[r*G/dp, (r+1)*G/dp) of it and cuts that into micro batches in order.
"""

from __future__ import annotations

from typing import Iterator

import torch

from aligner.runtime.errors import ConfigError
from aligner.runtime.seeds import epoch_seed


class DistributedBatchSampler:
    """Yields this rank's micro batches (lists of dataset indices), epoch after epoch.

    consumed_samples: samples (over all ranks and epochs) already trained on;
        iteration starts at the next global batch. Must be a multiple of G.
    epochs: stop after this many epochs; None = never stop (the trainer stops at max_steps).
    drop_last: only True is supported: a partial last global batch is skipped.
    """

    def __init__(
        self,
        dataset_length: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int = 0,
        shuffle: bool = True,
        consumed_samples: int = 0,
        drop_last: bool = True,
        epochs: int | None = None,
    ):
        samples_per_step = micro_batch_size * data_parallel_size
        if micro_batch_size < 1 or data_parallel_size < 1 or global_batch_size < 1:
            raise ConfigError(
                f"batch sizes must be positive (global_batch_size={global_batch_size}, "
                f"micro_batch_size={micro_batch_size}, data_parallel_size={data_parallel_size})"
            )
        if global_batch_size % samples_per_step:
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not divisible by micro_batch_size * data_parallel_size"
                f" = {micro_batch_size} * {data_parallel_size} = {samples_per_step}; change one of them"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(f"data_parallel_rank={data_parallel_rank} is outside [0, {data_parallel_size})")
        if not drop_last:
            raise ConfigError("drop_last=False is not supported: every step must see a full global batch")
        if dataset_length < global_batch_size:
            raise ConfigError(
                f"the dataset has {dataset_length} samples, fewer than one global batch "
                f"(global_batch_size={global_batch_size}); use a smaller global batch or more data"
            )
        if consumed_samples % global_batch_size:
            raise ConfigError(
                f"consumed_samples={consumed_samples} is not a multiple of global_batch_size={global_batch_size}; "
                "resume with the global batch size the checkpoint was trained with"
            )
        self.dataset_length = dataset_length
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = consumed_samples
        self.epochs = epochs

    @property
    def num_microbatches(self) -> int:
        """Micro batches per rank per global batch (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_length // self.global_batch_size

    def epoch_permutation(self, epoch: int) -> list[int]:
        return self._epoch_order(epoch).tolist()

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """The epoch's order of the items, [dataset_length] int64 (not a list: 1M Python ints take 36 MB)."""
        if not self.shuffle:
            return torch.arange(self.dataset_length)
        # One generator per epoch so an epoch's order does not depend on how we got there.
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.dataset_length, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.consumed_samples // self.global_batch_size
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        per_rank = self.global_batch_size // self.data_parallel_size
        while self.epochs is None or epoch < self.epochs:
            permutation = self._epoch_order(epoch)
            for global_step in range(step_in_epoch, self.steps_per_epoch):
                start = global_step * self.global_batch_size + self.data_parallel_rank * per_rank
                rank_slice = permutation[start : start + per_rank]
                for offset in range(0, per_rank, self.micro_batch_size):
                    yield rank_slice[offset : offset + self.micro_batch_size].tolist()
            epoch, step_in_epoch = epoch + 1, 0
