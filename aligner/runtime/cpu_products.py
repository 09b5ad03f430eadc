"""fp32 products on CPU through oneDNN's linear instead of BLAS (MKL), where that is the faster.

Which library is faster depends on the CPU and the shapes (benchmarks/README.md, "The Intel Xeon
machine"). On an AMD EPYC (AVX-512) MKL, torch's CPU BLAS for fp32, ran SmolLM2's shapes 1.2-5x slower
than oneDNN's linear, from a decode step's single column to training's backward products. On an Intel
Xeon (AVX-512, AMX) MKL was the faster for training (a SmolLM2 micro batch's forward and backward
products 2.55 s against 3.26 s) and for a decode step of one sequence (34.7 against 45.0 ms), while
oneDNN on packed weights stayed the faster for decode steps of 8 to 64 sequences. So
`preferred_library()` is BLAS on Intel's CPUs and oneDNN elsewhere (`ALIGNER_CPU_PRODUCTS=onednn|blas`
overrides): the CPU bridge sends training's products, and the native engine the decode products of a
single-sequence call, through the preferred library; the engine's other products use oneDNN wherever
it can run them (`available`).

oneDNN's linear reads the weight as it is, transposed views included: no copy, so in-place weight updates are
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

import functools
import os
from typing import Optional

import torch

from aligner.runtime.errors import ConfigError

PREFERENCE_VARIABLE = "ALIGNER_CPU_PRODUCTS"
LIBRARIES = ("auto", "onednn", "blas")


def cpu_info(field: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first value of `field` ("vendor_id", "flags", ...) in cpuinfo; "" where there is none (not Linux)."""
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def this_cpu(field: str) -> str:
    """`cpu_info(field)` of this machine, read once a process (decisions taken on every call read it)."""
    return cpu_info(field)


def choose_library(setting: str, vendor: str) -> str:
    """"onednn" or "blas" for a value of ALIGNER_CPU_PRODUCTS and the CPU's vendor_id: auto (or empty) is
    BLAS on Intel's CPUs, oneDNN on any other (see the module's docstring)."""
    wanted = setting.strip().lower() or "auto"
    if wanted not in LIBRARIES:
        raise ConfigError(f"{PREFERENCE_VARIABLE}={setting!r}: choose one of {', '.join(LIBRARIES)}")
    if wanted != "auto":
        return wanted
    return "blas" if vendor == "GenuineIntel" else "onednn"


def preferred_library() -> str:
    """"onednn" or "blas": the library for training's fp32 products and a single sequence's decode products."""
    return choose_library(os.environ.get(PREFERENCE_VARIABLE, "auto"), this_cpu("vendor_id"))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can run the product: fp32 on a CPU with a oneDNN build (half types already go
    through oneDNN in torch.mm)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def onednn_preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a product of this device and dtype goes through this module where both libraries can run it."""
    return available(device, dtype) and preferred_library() == "onednn"


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
