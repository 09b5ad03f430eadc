"""megatron's linear layers on oneDNN (the CPU bridge) at TP=2: losses and gradient shards equal to
megatron's own torch.matmul path at the same layout (TP=2 against TP=1 on this path:
test_sft_parity.py's layouts)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.is_available(), reason="the bridge only applies without CUDA")]

SCRIPT = Path(__file__).parent / "scripts" / "onednn_linear_tp.py"


def test_tp2_onednn_linear_layers_equal_megatron_matmul(tmp_path, torchrun):
    stdout = torchrun(SCRIPT, 2, tmp_path)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(result, indent=1))
    assert result.keys() == {"tied=False", "tied=True"}
    # per micro batch (2): 2 layers x (qkv, proj, fc1, fc2) + output layer; 3 of them frozen in the tied case
    assert result["tied=False"]["onednn_grad_weight_calls"] == 18
    assert result["tied=True"]["onednn_grad_weight_calls"] == 12
    for case, values in result.items():
        assert values["max_relative_difference"] < 1e-5, case
