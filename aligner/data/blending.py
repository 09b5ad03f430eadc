"""Train/validation splits and weighted blends of several data sets.

As in DeepSpeed-Chat, a data set can be split by a ratio spec ("95,5") and
several data sets can be mixed with weights into one of a fixed size.
Everything is a deterministic function of the seed, so all ranks agree.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from aligner.data.jsonl import DataError
from aligner.runtime.errors import ConfigError


def _parse_weights(spec: str | Sequence[float], what: str) -> list[float]:
    try:
        parts = spec.split(",") if isinstance(spec, str) else list(spec)
        weights = [float(part) for part in parts]
    except (TypeError, ValueError):
        weights = []
    if not weights or any(not weight >= 0 for weight in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"invalid {what} {spec!r}; expected non-negative numbers with a positive sum, "
            'e.g. "95,5" or [0.9, 0.1]'
        )
    return [weight / sum(weights) for weight in weights]


def _largest_remainder(total: int, fractions: list[float]) -> list[int]:
    """Integer counts summing to `total` that are as close as possible to total * fractions."""
    exact = [total * fraction for fraction in fractions]
    counts = [int(value) for value in exact]
    by_remainder = sorted(range(len(exact)), key=lambda index: (counts[index] - exact[index], index))
    for index in by_remainder[: total - sum(counts)]:
        counts[index] += 1
    return counts


def split_indices(num_items: int, split: str | Sequence[float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle range(num_items) by seed and cut it into (train, validation) by a two-part ratio: two int64
    arrays (a million Python ints would take 36 MB)."""
    fractions = _parse_weights(split, "split")
    if len(fractions) != 2:
        raise ConfigError(f"invalid split {split!r}; expected two weights (train, validation), e.g. \"95,5\"")
    train_count, _ = _largest_remainder(num_items, fractions)
    order = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed)).numpy()
    return order[:train_count], order[train_count:]


class IndexedSubset(Dataset):
    """The items of `dataset` at `indices`, in that order (kept as an int64 array)."""

    def __init__(self, dataset: Dataset, indices: Sequence[int]):
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.dataset[int(self.indices[index])]


class BlendedDataset(Dataset):
    """`num_samples` items drawn from several data sets in proportion to `weights`.

    Data set i contributes exactly its largest-remainder share of num_samples,
    cycling through a seeded permutation of its items (a new permutation per
    pass) when it needs more than it has. The contributions are then
    interleaved in a seeded random order.
    """

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], num_samples: int, seed: int):
        if len(datasets) != len(weights):
            raise ConfigError(f"got {len(datasets)} data sets but {len(weights)} weights; give one weight per data set")
        self.datasets = list(datasets)
        self.counts = _largest_remainder(num_samples, _parse_weights(weights, "blend weights"))
        generator = torch.Generator().manual_seed(seed)
        sources, items = [], []  # per sample: which data set, and the index in it
        for dataset_index, (dataset, count) in enumerate(zip(self.datasets, self.counts)):
            if count and not len(dataset):
                raise DataError(f"data set {dataset_index} is empty but its weight asks for {count} samples")
            chosen = [torch.empty(0, dtype=torch.long)]
            while sum(len(part) for part in chosen) < count:
                chosen.append(torch.randperm(len(dataset), generator=generator))
            items.append(torch.cat(chosen)[:count])
            sources.append(torch.full((count,), dataset_index, dtype=torch.long))
        order = torch.randperm(sum(self.counts), generator=generator)
        # int64 arrays [samples], not a list of tuples: 1M samples take 16 MB, not ~100 MB.
        self.sources = torch.cat(sources)[order].numpy()
        self.items = torch.cat(items)[order].numpy()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.datasets[int(self.sources[index])][int(self.items[index])]
