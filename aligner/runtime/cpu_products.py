"""fp32 products on CPU through oneDNN's linear instead of BLAS (MKL).

MKL, torch's CPU BLAS for fp32, runs this project's product shapes slowly on its CPUs (AMD EPYC,
AVX-512): oneDNN's linear is 1.2-5x faster on SmolLM2's shapes, from a decode step's few columns
to a prefill's thousand rows, and so are the backward products of training (benchmarks/README.md).
It reads the weight as it is, transposed views included: no copy, so in-place weight updates are
seen at once. The native engine's decode step keeps its activations feature-major
([features, batch]); here they are the transposes of contiguous token-major tensors, so neither
side moves data. The CPU bridge routes megatron's linear layers through `linear`, `grad_input`
and `grad_weight`.

Given a weight as it is, oneDNN rearranges it into its own blocked layout inside every call; `pack`
does that once (a copy, which goes stale when the weight changes), and every function here accepts
the packed copy in place of the weight. It pays where the weight is large next to the activations:
a decode step's products much more than a prefill's (benchmarks/README.md).
"""
from __future__ import annotations

from typing import Optional

import torch


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 weights on a CPU with a oneDNN build (half types already go through oneDNN in torch.mm)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


# The row count oneDNN picks the packed layout for: one copy serves every row count (8, 32 and 64
# gave the same layout speed at 1-64 rows; packed for 1 row it is the plain layout, slower at 8+).
PACKED_FOR_ROWS = 64


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same values in oneDNN's blocked layout for its linear (an opaque mkldnn
    tensor of shape [out, in]), for `linear` and `weight_times_columns`. Never a view: a copy."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


def packed_bytes(packed: torch.Tensor) -> int:
    """The memory a `pack`ed copy holds (its blocked layout may pad)."""
    return torch.ops.mkldnn._nbytes(packed)


def _onednn_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x2d [rows, in] @ weight[out, in]^T (+ bias) -> contiguous [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(x2d, weight, bias, "none", [], "")


def weight_times_columns(weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (or its `pack`ed copy) @ columns [in, batch] -> [out, batch], the transpose of a
    contiguous [batch, out]."""
    return _onednn_linear(columns.t(), weight).t()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., in]; weight may be its `pack`ed copy."""
    out = _onednn_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def grad_input(grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad_output [..., out] @ weight [out, in] -> [..., in]: a linear layer's input gradient."""
    out = _onednn_linear(grad_output.reshape(-1, grad_output.shape[-1]), weight.t())
    return out.view(*grad_output.shape[:-1], weight.shape[1])


# Elements of grad_output per weight-gradient product: oneDNN first copies its transposed operand
# into row-major order, which for an output layer is a copy of the whole logits' gradient (1 GB at
# 5648 tokens x 49152); summed over pieces of rows, each copy stays under 256 MB at the same speed.
WEIGHT_GRADIENT_PIECE_ELEMENTS = 2**26


def grad_weight(grad_output_2d: torch.Tensor, input_2d: torch.Tensor) -> torch.Tensor:
    """grad_output [rows, out]^T @ input [rows, in] -> contiguous [out, in]: a linear layer's weight gradient."""
    rows = grad_output_2d.shape[0]
    piece = max(1, WEIGHT_GRADIENT_PIECE_ELEMENTS // grad_output_2d.shape[1])
    result = _onednn_linear(grad_output_2d[:piece].t(), input_2d[:piece].t())
    for start in range(piece, rows, piece):
        result += _onednn_linear(grad_output_2d[start:start + piece].t(), input_2d[start:start + piece].t())
    return result
