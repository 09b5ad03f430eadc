"""Seeds: one shared seed for initialisation, and every seed derived from it (`derive_seed`)."""
from __future__ import annotations

import random
from typing import Optional, Sequence

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


SEED_WEIGHT = 1_000_003  # a prime larger than any counter: (seed, counter) pairs give distinct seeds
SAMPLER_SEED_RANGE = 2**32  # the samplers' seeds are 32-bit
TRTLLM_SEED_RANGE = 2**63 - 1  # TensorRT-LLM's random_seed is a positive int64


def derive_seed(seed: int, *counters: int, weights: Optional[Sequence[int]] = None, seed_weight: int = SEED_WEIGHT,
                modulus: Optional[int] = None) -> int:
    """The seed of one random stream of a run: seed * seed_weight + sum(counter_i * weight_i), mod modulus.

    counters: what tells the stream apart (epoch, step, row, rank...); weights: one per counter
    (default 1 each). A stream's constants are part of its recorded results: changing them changes
    every number a run with that seed produces.
    """
    weights = (1,) * len(counters) if weights is None else tuple(weights)
    if len(weights) != len(counters):
        raise ValueError(f"derive_seed: {len(counters)} counters but {len(weights)} weights")
    value = seed * seed_weight + sum(counter * weight for counter, weight in zip(counters, weights))
    return value % modulus if modulus is not None else value


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle of one epoch of a dataset (training samples, RL prompts)."""
    return derive_seed(seed, epoch)


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
