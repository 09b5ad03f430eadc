"""The native engine's view of the weights: references to megatron's parameters, bound per generate call.

`layer_weights` reads a transformer layer's parameters by megatron's names (`aligner.models.parameter_names`)
into typed records (never copies); `pack_products` gives the linear layers oneDNN-packed copies to run
their products on (`cpu_products.pack`), remade only for weights that changed (`unpack_products` lets go of
them); `weight_pointers` says whether a captured CUDA graph still reads the bound storage; `rope_tables` are
megatron's rotary angles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from aligner.models import parameter_names as param_names
from aligner.models.gpt import GPTConfig
from aligner.runtime import cpu_products


class Linear(NamedTuple):
    """A linear layer's parameters (references to the training tensors, never copies)."""

    weight: torch.Tensor  # [out, in]
    bias: Optional[torch.Tensor]  # [out]
    bias_column: Optional[torch.Tensor]  # [out, 1] view of bias, for feature-major activations
    product: torch.Tensor  # what the products read: the weight, or its oneDNN-packed copy (see pack_products)
    # A live LoRA adapter (aligner.models.lora), read as the training forward reads it: out += scale * B (A x).
    lora_a: Optional[torch.Tensor] = None  # [rank, in] (row-parallel: this rank's input columns)
    lora_b: Optional[torch.Tensor] = None  # [out, rank] (column-parallel: this rank's output rows)
    lora_scale: float = 0.0


class Norm(NamedTuple):
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    weight_column: torch.Tensor  # [hidden, 1] views, for feature-major activations
    bias_column: Optional[torch.Tensor]


class Layer(NamedTuple):
    input_norm: Norm
    qkv: Linear
    proj: Linear
    mlp_norm: Norm
    fc1: Optional[Linear]  # dense MLP (None in an MoE layer)
    fc2: Optional[Linear]
    q_norm: Optional[Norm] = None  # megatron's qk_layernorm: per-head norms of queries and keys
    k_norm: Optional[Norm] = None
    moe: Optional[torch.nn.Module] = None  # megatron's own MoELayer (router, dispatcher, experts)
    post_attention_norm: Optional[Norm] = None  # Gemma: norms of the projections' outputs, before the residual
    post_mlp_norm: Optional[Norm] = None
    rope_half: Optional[int] = None  # with a second RoPE base: 0 the full-attention layers' angles, 1 the local


@dataclass
class Segment:
    """The part of the model one chunk (pipeline stage, virtual stage) holds."""

    order: int  # position in the model's global layer order (virtual stage x pipeline rank)
    layers: list
    cache_offset: int  # index of its first layer in this rank's KV cache
    word_embeddings: Optional[torch.Tensor] = None  # first segment only
    position_embeddings: Optional[torch.Tensor] = None
    final_norm: Optional[tuple] = None  # last segment only
    output_weight: Optional[torch.Tensor] = None
    output_product: Optional[torch.Tensor] = None  # output_weight or its packed copy, as Linear.product


class PackedWeight(NamedTuple):
    """A weight's oneDNN-packed copy and the state of the weight it was packed from."""

    weight: torch.Tensor
    data_ptr: int
    version: Optional[int]  # autograd's version counter: in-place updates bump it (None: an inference tensor)
    packed: torch.Tensor

    def is_current(self, weight: torch.Tensor) -> bool:
        return (self.weight is weight and self.data_ptr == weight.data_ptr()
                and self.version == version_counter(weight))


def version_counter(tensor: torch.Tensor) -> Optional[int]:
    return None if tensor.is_inference() else tensor._version


def linear_weights(module) -> Linear:
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    linear = Linear(module.weight, bias, None if bias is None else bias.view(-1, 1), module.weight)
    if getattr(module, "lora_enabled", False):  # bound per call, so rollouts read the adapters as trained now
        linear = linear._replace(lora_a=module.lora_a, lora_b=module.lora_b, lora_scale=module.lora_scale)
    return linear


def optional_submodule(module: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    try:
        return module.get_submodule(path)
    except AttributeError:  # absent, or not a module (megatron leaves some optional parts None)
        return None


def norm_weights(module) -> Norm:
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    return Norm(module.weight, bias, module.weight.view(-1, 1), None if bias is None else bias.view(-1, 1))


def layer_weights(layer, cfg: GPTConfig) -> Layer:
    """The weights of one megatron transformer layer (references to its parameters)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    submodule = layer.get_submodule
    mlp = submodule(param_names.MLP)
    is_moe = isinstance(mlp, MoELayer)
    q_norm, k_norm = (optional_submodule(layer, name) for name in (param_names.Q_NORM, param_names.K_NORM))
    post_norms = [optional_submodule(layer, name)
                  for name in (param_names.POST_ATTENTION_NORM, param_names.POST_MLP_NORM)]
    is_local = getattr(submodule("self_attention"), "is_local", None)  # LocalGlobalSelfAttention's
    return Layer(
        input_norm=norm_weights(submodule(param_names.INPUT_NORM)),
        qkv=linear_weights(submodule(param_names.QKV)),
        proj=linear_weights(submodule(param_names.ATTENTION_OUT)),
        mlp_norm=norm_weights(submodule(param_names.PRE_MLP_NORM)),
        fc1=None if is_moe else linear_weights(submodule(param_names.FC1)),
        fc2=None if is_moe else linear_weights(submodule(param_names.FC2)),
        q_norm=norm_weights(q_norm) if isinstance(getattr(q_norm, "weight", None), torch.Tensor) else None,
        k_norm=norm_weights(k_norm) if isinstance(getattr(k_norm, "weight", None), torch.Tensor) else None,
        moe=mlp if is_moe else None,
        post_attention_norm=None if post_norms[0] is None else norm_weights(post_norms[0]),
        post_mlp_norm=None if post_norms[1] is None else norm_weights(post_norms[1]),
        rope_half=None if is_local is None or cfg.rotary_bases[1] is None else int(is_local),
    )


def pack_products(segments: list, previous: dict, packed_copies: dict) -> None:
    """Point the segments' products at oneDNN-packed copies of their weights, packing only the weights
    that are new or changed since they were last packed: packed_copies (id(weight) -> PackedWeight) is
    filled, taking the current entries out of previous (the copies of the last packing)."""

    def product(weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        entry = packed_copies.get(key)
        if entry is None:
            entry = previous.pop(key, None)
        if entry is None or not entry.is_current(weight):
            entry = None  # a stale copy is freed before the new one is made
            entry = PackedWeight(weight, weight.data_ptr(), version_counter(weight), cpu_products.pack(weight))
        packed_copies[key] = entry
        return entry.packed

    _set_products(segments, product)


def unpack_products(segments: list) -> None:
    """Point the segments' products back at the weights themselves, so that no packed copy stays referenced."""
    _set_products(segments, lambda weight: weight)


def _set_products(segments: list, product) -> None:
    """Each linear layer's (and the output layer's) product := product(its weight)."""

    def with_product(linear: Optional[Linear]) -> Optional[Linear]:
        return None if linear is None else linear._replace(product=product(linear.weight))

    for segment in segments:
        segment.layers = [layer._replace(qkv=with_product(layer.qkv), proj=with_product(layer.proj),
                                         fc1=with_product(layer.fc1), fc2=with_product(layer.fc2))
                          for layer in segment.layers]
        if segment.output_weight is not None:
            segment.output_product = product(segment.output_weight)


def weight_pointers(segments: list) -> tuple:
    """Storage addresses of every bound tensor: a captured graph is valid while they are unchanged."""
    pointers = []
    for segment in segments:
        for layer in segment.layers:
            for part in layer:
                if isinstance(part, tuple):
                    # (a packed copy has no storage pointer; its weight is in the tuple too)
                    pointers.extend(t.data_ptr() for t in part
                                    if isinstance(t, torch.Tensor) and t.layout == torch.strided)
                elif isinstance(part, torch.nn.Module):  # an MoE layer: its router's and experts' parameters
                    pointers.extend(p.data_ptr() for p in part.parameters())
        for tensor in (segment.word_embeddings, segment.position_embeddings, segment.output_weight):
            pointers.append(None if tensor is None else tensor.data_ptr())
        if segment.final_norm is not None:
            pointers.extend(t.data_ptr() for t in segment.final_norm if t is not None)
    return tuple(pointers)


def rope_tables(chunk, max_length: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """cos and sign-folded sin [max_len, head_dim] from megatron's own rotary frequencies.

    megatron applies x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; that is
    roll(x, d/2) * [-sin, sin], which needs one roll instead of a split, a negation and a cat.
    A second RotaryEmbedding (`local`: sliding-window layers at their own base) puts its tables beside
    the first's, [max_len, 2 * head_dim]; each layer reads its half (`Forward._layer_rope`).
    """
    rotary = chunk.rotary_pos_emb
    tables = [_cos_sin(rotary, max_length, dtype, device)] + (
        [_cos_sin(rotary.local, max_length, dtype, device)] if hasattr(rotary, "local") else [])
    return tuple(torch.cat(parts, dim=-1) for parts in zip(*tables))


def _cos_sin(rotary, max_length: int, dtype: torch.dtype, device: torch.device) -> tuple:
    freqs = rotary.get_freqs_non_repeated(max_length).to(device)  # [T, d/2]
    angles = torch.cat([freqs, freqs], dim=-1)
    sin = torch.sin(freqs)
    return torch.cos(angles).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def bind_segments(chunks: list, cfg: GPTConfig, pp_size: int, pp_rank: int) -> list:
    """A Segment per model chunk (virtual stage) of this rank, in order: the current parameter tensors of
    its layers, and its embeddings (first stage) or final norm and output weight (last stage)."""
    segments, cache_offset = [], 0
    for virtual_stage, chunk in enumerate(chunks):
        layers = [layer_weights(layer, cfg) for layer in chunk.get_submodule(param_names.LAYERS)]
        segment = Segment(order=virtual_stage * pp_size + pp_rank, layers=layers, cache_offset=cache_offset)
        cache_offset += len(layers)
        if chunk.pre_process:
            segment.word_embeddings = chunk.get_submodule(param_names.WORD_EMBEDDINGS).weight
            if cfg.position_embedding_type == "learned_absolute":
                segment.position_embeddings = chunk.get_submodule(param_names.POSITION_EMBEDDINGS).weight
        if chunk.post_process:
            segment.final_norm = norm_weights(chunk.get_submodule(param_names.FINAL_NORM))
            segment.output_weight = (chunk.shared_embedding_or_output_weight() if cfg.tie_embeddings
                                     else chunk.get_submodule(param_names.OUTPUT_LAYER).weight)
            segment.output_product = segment.output_weight
        segments.append(segment)
    return segments
