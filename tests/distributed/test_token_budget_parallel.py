"""Token-budget micro batches at DP=2 (torchrun, gloo): the RL policy loss, the DPO loss and their
gradients equal one process's fixed-size micro batches within 1e-6; the logprob pass equals the padded
one, and the first minibatch's training logprobs are bit-equal to it (ratio exactly 1)."""
from __future__ import annotations

import json

import pytest

from ..conftest import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "distributed" / "scripts" / "token_budget_parallel.py"
pytestmark = pytest.mark.distributed


def test_token_budgets_at_data_parallel_two_equal_fixed_micro_batches_in_one_process(tmp_path):
    output = tmp_path / "differences.json"
    run_torchrun(SCRIPT, 2, str(output))
    differences = json.loads(output.read_text())
    assert set(differences) == {"policy_loss", "policy_gradients", "logprobs", "first_minibatch_unequal_micro_batches",
                                "dpo_loss", "dpo_gradients"}
    assert differences.pop("first_minibatch_unequal_micro_batches") == 0
    assert all(value < 1e-6 for value in differences.values()), differences
