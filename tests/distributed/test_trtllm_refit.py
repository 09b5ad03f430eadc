"""The TensorRT-LLM refit path at TP=2 (torchrun, gloo): each rank's weights from its own megatron
shard equal that rank's part of the full conversion (tests/unit/test_trtllm_conversion.py checks the rest)."""
from __future__ import annotations

import json

import pytest

from ..conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "tests" / "distributed" / "scripts" / "trtllm_refit.py"
pytestmark = pytest.mark.distributed


def test_local_rank_weights_from_megatron_tp_shards(torchrun, tmp_path):
    output = torchrun(SCRIPT, 2, str(tmp_path), timeout=600)
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for arch in ("llama", "gpt2"):
        assert result[arch]["names_equal"] == [True, True], result
        assert result[arch]["max_diff"] == [0.0, 0.0], result
