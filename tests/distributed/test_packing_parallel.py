"""Packed batches at TP=2 (torchrun, gloo): logprobs, the RL policy loss and the DPO loss and their
gradients equal the padded layout's within 1e-6 (vocab-parallel logits and entropy). At PP > 1 the
trainers keep the padded layout (a pipeline schedule needs one activation shape); the local layer
spec has no sequence parallelism."""
from __future__ import annotations

import json

import pytest

from ..conftest import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "distributed" / "scripts" / "packing_parallel.py"
pytestmark = pytest.mark.distributed


def test_packed_equals_padded_at_tensor_parallel_two(tmp_path):
    output = tmp_path / "differences.json"
    run_torchrun(SCRIPT, 2, str(output), "2")
    differences = json.loads(output.read_text())
    assert set(differences) == {"logprobs", "dpo_loss", "dpo_gradients", "policy_loss", "policy_gradients"}
    assert all(value < 1e-6 for value in differences.values()), differences
