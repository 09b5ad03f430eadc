"""The trainers' optimizer (aligner.training.setup.build_optimizer) runs torch's fused Adam on CPU parameters,
with the same updates as torch's single-tensor loop (megatron's choice there) to fp32 rounding."""
from __future__ import annotations

import pytest
import torch

from aligner.models.gpt import GPTConfig, build_model_chunks
from aligner.runtime import seeds
from aligner.runtime.distributed import ParallelConfig
from aligner.training import setup

pytestmark = pytest.mark.usefixtures("single_process")


def _params_after_steps(fused: bool, steps: int = 3) -> list[torch.Tensor]:
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, make_vocab_size_divisible_by=8,
                    max_position_embeddings=16)
    seeds.set_seed(0)
    chunks = setup.wrap_for_training(build_model_chunks(cfg, ParallelConfig(), torch.float32))
    optimizer = setup.build_optimizer(chunks, setup.OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5),
                                      torch.float32)
    groups = [group for wrapper in getattr(optimizer, "chained_optimizers", [optimizer])
              for group in wrapper.optimizer.param_groups]
    assert groups and all(group["fused"] for group in groups)  # what build_optimizer chose on CPU
    for group in groups:
        group["fused"] = fused
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        tokens = torch.randint(0, 64, (2, 12), generator=generator)
        logits = chunks[0](tokens, torch.arange(12).expand(2, -1), None)
        (logits.float().logsumexp(-1) - logits[..., 0]).mean().backward()
        chunks[0].finish_grad_sync()
        update_ok, _, _ = optimizer.step()
        assert update_ok
    return [param.detach().clone() for param in chunks[0].parameters()]


def test_fused_adam_updates_equal_the_single_tensor_loop():
    fused, looped = _params_after_steps(fused=True), _params_after_steps(fused=False)
    assert len(fused) == len(looped)
    for got, want in zip(fused, looped):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the steps did change the weights (lr 1e-2), so equality is not that of untouched parameters
    initial = _params_after_steps(fused=True, steps=0)
    moved = sum(not torch.equal(a, b) for a, b in zip(fused, initial))
    assert moved == len(fused)
