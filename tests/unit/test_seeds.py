"""Seed derivation: `derive_seed` reproduces every stream's formula exactly (runs' recorded numbers depend on it)."""
from __future__ import annotations

import itertools

import pytest

from aligner.generation.engine import SamplingParams, turn_sampling
from aligner.runtime.seeds import SAMPLER_SEED_RANGE, TRTLLM_SEED_RANGE, derive_seed, epoch_seed

SEEDS = (0, 1, 1234, 2**31 - 1, 2**32 + 5)
COUNTERS = (0, 1, 7, 999, 123_456)


def test_each_stream_keeps_its_formula():
    # The formulas the streams were recorded with, written out by hand.
    for seed, a, b, c in itertools.product(SEEDS, COUNTERS, (0, 1), (0, 3)):
        assert epoch_seed(seed, a) == seed * 1_000_003 + a  # dataset and prompt shuffles
        assert derive_seed(seed, a, modulus=TRTLLM_SEED_RANGE) == (seed * 1_000_003 + a) % (2**63 - 1)  # TRT-LLM rows
        assert derive_seed(seed, a, modulus=SAMPLER_SEED_RANGE) == (seed * 1_000_003 + a) % 2**32  # REINFORCE steps
        assert derive_seed(seed, a, b, weights=(7_919, 1), modulus=SAMPLER_SEED_RANGE) == (
            (seed * 1_000_003 + a * 7_919 + b) % 2**32)  # PPO steps and critic warm-up rounds
        assert derive_seed(seed, a, b, c, weights=(131, 17, 1), seed_weight=7919) == (
            seed * 7919 + a * 131 + b * 17 + c)  # PPO minibatch order
        turn = turn_sampling(SamplingParams(seed=seed % 2**32, first_sample=c), episode=b, turn=a)
        assert (turn.seed, turn.first_sample) == ((seed % 2**32 + a * 1_000_003) % 2**32, c + b)  # episode turns


def test_streams_stay_in_their_range_and_apart():
    samples = {derive_seed(seed, step, modulus=SAMPLER_SEED_RANGE) for seed in range(20) for step in range(1000)}
    assert len(samples) == 20 * 1000
    assert all(0 <= value < 2**32 for value in samples)


def test_one_weight_per_counter():
    with pytest.raises(ValueError, match="2 counters but 1 weights"):
        derive_seed(1, 2, 3, weights=(5,))
