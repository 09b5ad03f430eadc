"""megatron's linear layers at TP=2 on oneDNN (the CPU bridge) against megatron's own torch.matmul path:
losses and every rank's gradient shard, with tied embeddings, biases and frozen weights (the
column-parallel input-gradient all-reduce runs in both the trainable and the frozen function).
Rank 0 prints one `RESULT <json>` line: the largest scale-relative difference per case and the oneDNN calls."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from aligner.models.gpt import GPTConfig
from aligner.runtime import cpu_bridge, cpu_products
from aligner.runtime.distributed import ParallelConfig, initialize, shutdown
from tests.unit.test_cpu_bridge import VOCAB, _gpt_losses_and_grads


def main() -> None:
    from megatron.core.tensor_parallel import layers

    os.environ[cpu_products.PREFERENCE_VARIABLE] = "onednn"  # the path under test, whatever this CPU's choice
    initialize(ParallelConfig(tensor_model_parallel_size=2))
    assert cpu_bridge.is_applied()
    calls = {"count": 0}
    original_grad_weight = cpu_products.grad_weight

    def counted(*args):
        calls["count"] += 1
        return original_grad_weight(*args)

    cpu_products.grad_weight = counted
    bridged = {name: getattr(layers, name) for name in
               ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight")}
    result = {}
    for tie, frozen in ((False, ()), (True, ("decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.self_attention"))):
        cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, ffn_hidden_size=48,
                        make_vocab_size_divisible_by=8, max_position_embeddings=32,
                        tie_embeddings=tie, add_bias_linear=tie)
        calls["count"] = 0
        losses, grads = _gpt_losses_and_grads(cfg, frozen)
        onednn_calls = calls["count"]
        for name, function in bridged.items():
            setattr(layers, name, function.__wrapped__)
        expected_losses, expected_grads = _gpt_losses_and_grads(cfg, frozen)
        assert calls["count"] == onednn_calls, "megatron's own path called oneDNN"
        for name, function in bridged.items():
            setattr(layers, name, function)
        worst = float(((losses - expected_losses).abs() / expected_losses.abs()).max())
        for name, expected in expected_grads.items():
            if expected is None:
                assert grads[name] is None, name
                continue
            worst = max(worst, float((grads[name] - expected).abs().max() / expected.abs().max()))
        worst_all = torch.tensor(worst)
        dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
        result[f"tied={tie}"] = {"max_relative_difference": float(worst_all), "onednn_grad_weight_calls": onednn_calls}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
