"""Seeds: one shared seed for initialisation, per-rank derived seeds for sampling and dropout."""
from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker.

    megatron-core derives the tensor-parallel stream from the seed and the TP rank, so dropout in
    TP regions differs per shard while the default stream is shared across a model-parallel group.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if parallel_state.model_parallel_is_initialized():
        model_parallel_cuda_manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A distinct, reproducible seed per rank (for sampling, where ranks must not draw alike)."""
    return (seed * 1_000_003 + rank * 7919) % (2**31 - 1)


def rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
