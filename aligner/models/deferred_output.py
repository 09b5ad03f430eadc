"""The deferred output layer: a GPT chunk returns its final hidden states (`HiddenStates`), and a loss applies
the output layer (`layers.BatchMajorOutputLayer`) only at the positions it reads.

Apart from `aligner.models.layers`, which subclasses megatron-core's layers, so that the logprob kernels
and the micro-batch schedule import it at the top without importing megatron-core.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


class HiddenStates:
    """A GPT chunk's output inside `deferred_output_layer`: its final hidden states [b, s, h] (or packed
    rows [R, L, h]) and the output layer not yet applied. `logits_at` runs that layer (the same module,
    parameters and tensor-parallel function as the full product) on the rows a loss reads."""

    def __init__(self, tensor: torch.Tensor, layer: torch.nn.Module, weight: Optional[torch.Tensor]):
        # layer: the chunk's `layers.BatchMajorOutputLayer`
        self.tensor, self.layer, self.weight = tensor, layer, weight

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def new_zeros(self, *size, **kwargs) -> torch.Tensor:
        return self.tensor.new_zeros(*size, **kwargs)

    def product_operands(self, flat_positions: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(the hidden rows at positions of the flattened [b * s] grid [n, h], in the weight's dtype; the layer's
        weight [vocab_shard, h]) for a loss that runs the layer's product itself, piece by piece
        (`aligner.models.logprobs`): the layer is that product alone, with megatron's tensor-parallel
        gradient rule. None where it does more (a bias, fused or deferred weight-gradient accumulation, a
        gathered output): the loss then takes `logits_at`."""
        layer = self.layer
        if (layer.bias is not None or layer.gradient_accumulation_fusion or layer.gather_output
                or layer.config.defer_embedding_wgrad_compute):
            return None
        weight = layer.weight if self.weight is None else self.weight
        rows = self.tensor.reshape(-1, self.tensor.shape[-1]).index_select(0, flat_positions)
        return rows.to(weight.dtype), weight  # as `logits_at` hands them to the layer

    def logits_at(self, flat_positions: torch.Tensor) -> torch.Tensor:
        """[n, vocab_shard] logits at positions of the flattened [b * s] grid (differentiable)."""
        rows = self.tensor.reshape(-1, self.tensor.shape[-1]).index_select(0, flat_positions)
        weight = self.layer.weight if self.weight is None else self.weight
        # A bf16 model's wrapper hands its output over in fp32: the rows go back to the weights' dtype
        # (exactly: they were computed in it), as the layer would have received them.
        rows = rows.to(weight.dtype)
        logits, _ = self.layer.column_parallel_forward(rows.unsqueeze(1), weight=self.weight)
        return logits.squeeze(1)


def _output_layer(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    from megatron.core.utils import unwrap_model

    layer = getattr(unwrap_model(model), "output_layer", None)
    return layer if getattr(layer, "can_defer", False) and not layer.sequence_parallel else None


@contextlib.contextmanager
def deferred_output_layer(model: torch.nn.Module) -> Iterator[Optional[torch.nn.Module]]:
    """Within the block the chunk's forward skips its output layer and returns the hidden states;
    yields that layer (None where the chunk has none: an earlier pipeline stage, a reward model, or
    sequence parallelism, whose layer gathers the sequence first: there the logits come as before)."""
    layer = _output_layer(model)
    if layer is None:
        yield None
        return
    layer.deferred = True
    try:
        yield layer
    finally:
        layer.deferred = False


def forward_deferred(model: torch.nn.Module, forward, *args):
    """forward(model, *args) with the output layer deferred: `HiddenStates` where the chunk has the
    layer, else the chunk's own output."""
    with deferred_output_layer(model) as layer:
        output = forward(model, *args)
    return output if layer is None else HiddenStates(output, layer, layer.deferred_weight)
