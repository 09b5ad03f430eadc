"""The record the native engine's parts share: model layout, bound weights, per-device constants.

The engine (`engine.NativeEngine`) owns it and writes it: the layout when it is built, the weights and
constants at every bind (each generate call), `single_sequence_on_blas` per call. The forward
(`forward.Forward`), the static decode step and the sampling state read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from aligner.models.gpt import GPTConfig


@dataclass
class EngineState:
    # -- layout: fixed when the engine is built
    cfg: GPTConfig
    tp_group: Optional[dist.ProcessGroup]
    tp_size: int
    tp_group_or_none: Optional[dist.ProcessGroup]  # the TP group when TP > 1, else None
    pp_size: int
    pp_rank: int
    pp_group: Optional[dist.ProcessGroup]  # PP > 1 only
    pp_ranks: Optional[list]  # global ranks of the pipeline group (PP > 1 only)
    heads: int  # attention heads on this TP rank
    groups: int  # query groups (key/value heads) on this TP rank
    head_dim: int
    scale: float  # softmax scale of the attention scores, as megatron's
    # -- per dtype and device of the bound weights (remade when they change)
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    no_input: Optional[torch.Tensor] = None  # baddbmm's input, ignored with beta=0 (megatron computes scores so)
    rope: Optional[tuple] = None  # (cos, sign-folded sin) [max_len, d] (d per RoPE base), None without rotary
    rope_columns: Optional[tuple] = None  # the rope tables transposed, [d, max_len]
    columns: Optional[torch.Tensor] = None  # [max_sequence_length] arange: cache columns and positions
    mean_row: Optional[torch.Tensor] = None  # [1, hidden] of 1 / hidden: feature means as one addmm
    norm_eps: Optional[torch.Tensor] = None  # [1, 1] the norm epsilon, addmm's input
    onednn_products: bool = False  # the decode products run on oneDNN (`cpu_products`)
    # -- the bound weights (every bind)
    segments: Optional[list] = None  # weights.Segment per model chunk, in this rank's order
    gated: bool = False  # megatron's gated linear unit (SwiGLU/GeGLU)
    activation: Optional[Callable] = None  # megatron's own activation function
    is_last_stage: bool = False  # this rank holds the output layer
    vocab_start: int = 0  # the first vocabulary id of this rank's output shard (last stage)
    vocab_padding: Optional[torch.Tensor] = None  # [vocab_shard] bool: padded rows, never sampled
    has_vocab_padding: bool = False
    cpu_decode: Optional[object] = None  # cpu_decode.CpuDecode: the C++ decode step, where it applies
    # -- per generate call
    single_sequence_on_blas: bool = False  # a call of one sequence runs its decode products on BLAS
