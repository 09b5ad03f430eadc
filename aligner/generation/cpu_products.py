"""The native engine's decode products on CPU: oneDNN's linear instead of BLAS's W @ x.

A decode step's products are weight [out, in] times a few columns x [in, batch]. MKL, torch's
CPU BLAS, runs that shape slowly on this project's CPUs (AMD EPYC, AVX-512: 2-5x below oneDNN at
batch 8-64 on SmolLM2's shapes, benchmarks/README.md). oneDNN's linear computes x^T W^T, i.e.
the transpose of the same product, on the weight as it is: no copy, so in-place weight updates
are seen at once. The engine keeps its activations feature-major ([features, batch]); here they
are the transposes of contiguous token-major tensors, so neither side moves data.
"""
from __future__ import annotations

import torch


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 weights on a CPU with a oneDNN build (half types already go through oneDNN in torch.mm)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def weight_times_columns(weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """weight [out, in] @ columns [in, batch] -> [out, batch], the transpose of a contiguous [batch, out]."""
    return torch.ops.mkldnn._linear_pointwise(columns.t(), weight, None, "none", [], "").t()
