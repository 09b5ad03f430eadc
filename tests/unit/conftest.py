"""Unit tests that need megatron's parallel state run in this one process (TP=PP=DP=1, gloo)."""
from __future__ import annotations

import pytest

from aligner.runtime import distributed, seeds


@pytest.fixture(scope="module")
def single_process():
    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    yield
    distributed.shutdown()
