"""Native engine at TP=2, PP=2 and PP=2 with virtual stages against TP=1, from one TP=1 checkpoint
(Llama-style, GPT-2-style, and an MoE model with q/k norm and Llama 3.x RoPE scaling).

Greedy tokens must equal TP=1's; logprobs must stay within 1e-5 of TP=1's and of the training
forward (`sequence_logprobs`) at the same layout. Sampled rollouts draw from the same per-sample
streams, so they match TP=1 too, up to a draw landing within rounding of a CDF boundary (the
logits differ by float rounding between layouts): at least 7 of 8 rows must match. The static
decode step (static_decode=True, what CUDA graphs capture) is held to the same bounds against
TP=1's default step, and so is continuous batching with refills (8 prompts, two of them repeated and
prefilled once, 3 cache rows, early stops) against TP=1's static-batch loop. Models with live LoRA
adapters (base + adapter checkpoints) are held to the same bounds.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "native_engine_parallel.py"
LOGPROB_TOLERANCE = 1e-5


def test_tp2_pp2_vpp_generation_matches_tp1(tmp_path, torchrun):
    stdout = torchrun(SCRIPT, 2, tmp_path)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(result, indent=1))
    assert set(result) == {"llama/tp2", "gpt2/tp2", "moe/tp2", "gemma/tp2", "llama/pp2", "gpt2/pp2", "moe/pp2",
                           "gemma/pp2", "llama/pp2_vpp2", "llama_lora/tp2", "gpt2_lora/tp2", "llama_lora/pp2",
                           "sampling_helpers_tp2"}
    assert all(result.pop("sampling_helpers_tp2").values())
    for layout, cases in result.items():
        assert cases["greedy"]["same_rows"] == cases["greedy"]["rows"], layout
        assert cases["static_greedy"]["same_rows"] == cases["static_greedy"]["rows"], layout
        assert cases["refill_greedy"]["same_rows"] == cases["refill_greedy"]["rows"], layout
        for case, report in cases.items():
            assert report["same_rows"] >= report["rows"] - 1, (layout, case, report)
            assert report["logprob_vs_tp1"] < LOGPROB_TOLERANCE, (layout, case, report)
            assert report["logprob_vs_training"] < LOGPROB_TOLERANCE, (layout, case, report)
