"""Fixtures of the unit tests (`single_process`, megatron's parallel state in this process, is in tests/conftest.py)."""
from __future__ import annotations

import signal

import pytest
import torch.distributed as dist

from aligner.runtime import stopping


@pytest.fixture
def handlers():
    """aligner's stop handlers installed and reset; the previous signal handlers restored afterwards."""
    previous = {sig: signal.getsignal(sig) for sig in stopping.HANDLED_SIGNALS}
    stopping.install()
    stopping.reset()
    yield
    stopping.reset()
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def world_group():
    """A one-process gloo group: runs the all-reduce code paths (a reduction over one rank is the identity)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()
