"""The native engine's products on CPU: oneDNN's linear instead of BLAS (MKL).

MKL, torch's CPU BLAS for fp32, runs the engine's product shapes slowly on this project's CPUs
(AMD EPYC, AVX-512): oneDNN's linear is 1.2-5x faster on SmolLM2's shapes, from a decode step's
few columns to a prefill's thousand rows (benchmarks/README.md). It reads the weight as it is:
no copy, so in-place weight updates are seen at once. The decode step keeps its activations
feature-major ([features, batch]); here they are the transposes of contiguous token-major
tensors, so neither side moves data.
"""
from __future__ import annotations

from typing import Optional

import torch


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 weights on a CPU with a oneDNN build (half types already go through oneDNN in torch.mm)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def weight_times_columns(weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """weight [out, in] @ columns [in, batch] -> [out, batch], the transpose of a contiguous [batch, out]."""
    return torch.ops.mkldnn._linear_pointwise(columns.t(), weight, None, "none", [], "").t()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., in]."""
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
