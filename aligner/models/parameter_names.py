"""Megatron GPTModel's module and parameter names (local layer spec), in one table.

The HF converter (`aligner.hf.weights`), the TensorRT-LLM export (`aligner.generation.trtllm`) and
the native engine (`aligner.generation.native`, through `get_submodule`) all name megatron's
tensors through these. Module paths have no ".weight"/".bias" suffix; `layer(i)` and `expert(e)`
are prefixes ending in ".".
"""
from __future__ import annotations

# Whole-model modules.
LAYERS = "decoder.layers"  # the ModuleList of this chunk's transformer layers
WORD_EMBEDDINGS = "embedding.word_embeddings"
POSITION_EMBEDDINGS = "embedding.position_embeddings"  # learned absolute positions (GPT-2)
FINAL_NORM = "decoder.final_layernorm"
OUTPUT_LAYER = "output_layer"  # the LM head (absent or a copy of the embedding when tied)

# Modules of one transformer layer, relative to `layer(i)`.
INPUT_NORM = "input_layernorm"
QKV = "self_attention.linear_qkv"  # grouped layout: per query group [q heads..., k, v]
Q_NORM, K_NORM = "self_attention.q_layernorm", "self_attention.k_layernorm"
ATTENTION_OUT = "self_attention.linear_proj"
PRE_MLP_NORM = "pre_mlp_layernorm"
MLP = "mlp"  # a dense layer's MLP, or an MoE layer (router and experts)
LINEAR_FC1, LINEAR_FC2 = "linear_fc1", "linear_fc2"  # relative to an MLP; SwiGLU's fc1 is [gate; up]
FC1, FC2 = f"{MLP}.{LINEAR_FC1}", f"{MLP}.{LINEAR_FC2}"
ROUTER = f"{MLP}.router"  # MoE layers
# Gemma's norms after attention and after the MLP (of the projections' outputs, before the residual add)
POST_ATTENTION_NORM = f"{ATTENTION_OUT}.post_layernorm"
POST_MLP_NORM = f"{FC2}.post_layernorm"

# Transformer-engine layer specs fuse the pre-attention / pre-MLP norms into the next linear layer:
# their parameter names -> the local spec's.
TE_FUSED_NORMS = {
    f"{QKV}.layer_norm_weight": f"{INPUT_NORM}.weight",
    f"{QKV}.layer_norm_bias": f"{INPUT_NORM}.bias",
    f"{FC1}.layer_norm_weight": f"{PRE_MLP_NORM}.weight",
    f"{FC1}.layer_norm_bias": f"{PRE_MLP_NORM}.bias",
}


def layer(index: int) -> str:
    """Prefix of transformer layer `index` (of this model chunk)."""
    return f"{LAYERS}.{index}."


def expert(index: int) -> str:
    """Prefix of local expert `index`'s MLP (LINEAR_FC1/LINEAR_FC2 relative to it), relative to `layer(i)`."""
    return f"{MLP}.experts.local_experts.{index}."


def weight(module: str) -> str:
    return f"{module}.weight"


def bias(module: str) -> str:
    return f"{module}.bias"
