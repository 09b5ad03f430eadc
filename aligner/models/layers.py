"""Faster drop-in replacements for two megatron-core layers of the GPT model (same parameters, same numbers),
and the layers Gemma 3 needs that megatron-core's local spec lacks.

`FusedDotProductAttention`, the attention core of the local layer spec: torch's fused scaled-dot-product attention.

megatron-core's local `DotProductAttention` materialises the scores and probabilities
[batch, heads, seq, seq], masks them with `masked_fill` and runs a separate softmax, then keeps the
probabilities for backward. `F.scaled_dot_product_attention` computes the same function blockwise
(flash attention on CPU, with a causal flag or a boolean mask), so neither the scores nor the
probabilities are written out: on SmolLM2's shapes its forward + backward took about half the time
of megatron's (benchmarks/README.md, "attention core"). Its outputs equal megatron's up to fp32
rounding of the softmax sums (~1e-6).

Where megatron's core does something SDPA does not (attention dropout while training, a softmax
variant, query-key layer scaling, sliding windows) the layer runs megatron's own forward.

`BatchMajorOutputLayer`, GPTModel's output layer computing its logits in [batch, seq] order (no transposed
copy of the logits and of their gradient), or, inside `deferred_output.deferred_output_layer`, none at all:
the model then returns its final hidden states (`deferred_output.HiddenStates`) and a loss computes the
logits only at the positions it reads (response tokens, loss positions), not at prompts and padding.

Gemma 3 (`GPTConfig.zero_centered_norm`, `post_layer_norms`, `scale_embeddings`, `local_rotary_base`):
`ZeroCenteredRMSNorm` (x * (1 + weight), HF's Gemma3RMSNorm op for op), `RowParallelLinearWithPostNorm`
(a row-parallel projection whose reduced output is normed: the post-attention and post-feedforward
norms, before the residual add), `ScaledVocabParallelEmbedding` (embeddings times sqrt(hidden_size)),
and `LocalGlobalRotaryEmbedding` with `LocalGlobalSelfAttention` (sliding-window layers rotate at
their own base: the model's rotary embedding carries both layers' angles, each attention takes its own).

Imported inside functions. This is the one module of the library that imports megatron-core at import time
(its classes subclass megatron-core's), so `aligner.models.gpt` imports it inside the functions that build a
model: an entry point prints --help or a config error without loading megatron-core, and megatron-core is
first imported after `aligner/__init__.py` has silenced its import-time notices. Every other import of the
library's own modules sits at the top of its file (tests/unit/test_layering.py counts them).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from aligner.runtime.errors import ConfigError


class FusedDotProductAttention(DotProductAttention):
    """megatron's `DotProductAttention` (same constructor, same [sq, b, heads, dim] -> [sq, b, hidden]
    forward, same boolean mask convention: True = masked) on `F.scaled_dot_product_attention`."""

    def _fused_applies(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        config = self.config
        return (not (self.training and self.attention_dropout.p > 0) and not config.apply_query_key_layer_scaling
                and getattr(config, "softmax_type", "vanilla") == "vanilla" and config.window_size is None
                and query.shape[0] > 0 and key.shape[0] == query.shape[0])

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None or not self._fused_applies(query, key):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, batch = query.shape[:2]
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # megatron's softmax: a given mask wins; without one, causal when the layer is causal (and sq > 1)
        is_causal = attention_mask is None and mask_type == AttnMaskType.causal and sq > 1
        allowed = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        # [s, b, heads, dim] -> [b, heads, s, dim] views; SDPA repeats the key/value groups itself
        query, key, value = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, is_causal=is_causal, scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)
        # [b, heads, sq, dim] -> [sq, b, heads * dim]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)


class BatchMajorOutputLayer(ColumnParallelLinear):
    """GPTModel's output layer, computing the logits of hidden states [s, b, h] in [b, s] order.

    GPTModel returns `logits.transpose(0, 1).contiguous()` ([b, s, vocab]): a transposed copy of the
    largest activation (SmolLM2, 4 x 256 tokens: 200 MB), and another of its gradient in backward.
    Transposing the hidden states instead (vocab / hidden = 85x fewer bytes there) gives logits that are
    already contiguous in [b, s] order, returned as the [s, b] view GPTModel expects, so its
    `.contiguous()` copies nothing. Sequence parallelism gathers the input's sequence dimension (dim 0),
    so there the layer keeps megatron's order, and so it does while `batch_major` is false: the logits
    are then a tensor of their own, not a view, which megatron's vocab-parallel cross entropy needs (it
    changes its input in place; GPTModel's `_postprocess` turns this off when given labels).
    """

    can_defer = True  # how `deferred_output` (which does not import megatron-core) recognises this layer
    batch_major = True
    deferred = False  # set by `deferred_output.deferred_output_layer`: return the hidden states, batch-major
    deferred_weight: Optional[torch.Tensor] = None  # the weight GPTModel passed (tied embeddings), for them

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.deferred:
            object.__setattr__(self, "deferred_weight", weight)  # a plain attribute, not a registered parameter
            # [s, b, h] -> contiguous [b, s, h], as the [s, b] view GPTModel transposes back without a copy
            return input_.transpose(0, 1).contiguous().transpose(0, 1), None
        if not self.batch_major or self.sequence_parallel or input_.dim() != 3:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        logits, bias = super().forward(input_.transpose(0, 1).contiguous(), weight=weight,
                                       runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1), bias

    def column_parallel_forward(self, input_, weight=None):
        """megatron's own ColumnParallelLinear forward ([s, b, h] -> [s, b, vocab_shard]): the product that
        `deferred_output.HiddenStates.logits_at` runs on the rows a loss reads."""
        return ColumnParallelLinear.forward(self, input_, weight=weight)


def make_output_layer_batch_major(model: torch.nn.Module) -> None:
    """Turn a GPTModel's output layer (megatron's ColumnParallelLinear, built by GPTModel itself) into a
    `BatchMajorOutputLayer`: the same module and parameters, only its forward differs."""
    if type(model.output_layer) is ColumnParallelLinear:
        model.output_layer.__class__ = BatchMajorOutputLayer


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaling by (1 + weight), the weight stored zero-centred (Gemma's norm, with megatron's norm
    constructor). Computed as HF's Gemma3RMSNorm: in fp32, scaled, then cast back to the input's dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # megatron all-reduces the gradients of norms marked so across sequence-parallel ranks
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class RowParallelLinearWithPostNorm:
    """megatron's RowParallelLinear whose (reduced) output is normed by its `post_layernorm`: Gemma's post-attention
    and post-feedforward norms, before the residual add.

    Constructing it gives a plain RowParallelLinear with the norm applied by a forward hook, so what wraps its
    forward in place (a LoRA adapter's update, `aligner.models.lora`) comes before the norm, as HF PEFT's adapter
    on o_proj / down_proj does. A class, not a function: megatron's build_module returns a spec's function
    uncalled."""

    def __new__(cls, input_size: int, output_size: int, *, config, **kwargs) -> RowParallelLinear:
        linear = RowParallelLinear(input_size, output_size, config=config, **kwargs)
        linear.post_layernorm = ZeroCenteredRMSNorm(config, output_size, eps=config.layernorm_epsilon)
        linear.register_forward_hook(_apply_post_norm)
        return linear


def _apply_post_norm(module, inputs, outputs):
    output, bias = outputs
    if bias is not None:  # a bias would have to be added before the norm (GPTConfig.validate refuses it)
        raise ValueError("a row-parallel linear with a post norm has no place for a bias")
    return module.post_layernorm(output), None


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """megatron's vocab-parallel embedding times sqrt(hidden_size), as HF's Gemma3TextScaledWordEmbedding
    (the factor an fp32 scalar cast to the weight's dtype). A tied output layer reads the unscaled weight."""

    def forward(self, input_):
        scale = torch.tensor(self.embedding_dim ** 0.5).to(self.weight.dtype)
        return super().forward(input_) * scale


class LocalGlobalRotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding (the full-attention layers' frequencies) plus `local`, the sliding-window
    layers' RotaryEmbedding: its embeddings are both layers' angles side by side, [..., 2 * dim]."""

    local: RotaryEmbedding

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.cat([super().forward(*args, **kwargs), self.local(*args, **kwargs)], dim=-1)


class LocalGlobalSelfAttention(SelfAttention):
    """megatron's SelfAttention for models with sliding-window layers (`sliding_window_pattern` as GPTConfig's;
    None: every layer in the window). Given a `LocalGlobalRotaryEmbedding`'s angles (twice the head width) it
    takes its own half: the second (local) on sliding-window layers. Attention is full attention, equal to the
    window's only up to `sliding_window` tokens: a longer causal row is refused here, the last guard behind the
    length checks of the entry points (GPTConfig.check_sliding_window)."""

    def __init__(self, *args, sliding_window: Optional[int] = None, sliding_window_pattern: Optional[int] = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        pattern = sliding_window_pattern
        self.is_local = pattern is None or self.layer_number % pattern != 0  # layer_number: 1-based, global
        self.sliding_window = sliding_window

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        config = self.config
        rows = hidden_states.shape[0] * (config.tensor_model_parallel_size if config.sequence_parallel else 1)
        # a mask or packed sequences: rows of several sequences, each checked where it was cut (the row is longer)
        mask = args[0] if args else kwargs.get("attention_mask")
        plain_rows = mask is None and kwargs.get("packed_seq_params") is None and not kwargs.get("inference_context")
        if self.is_local and plain_rows and rows > self.sliding_window:
            raise ConfigError(f"a row of {rows} tokens is longer than model.sliding_window={self.sliding_window}: "
                              "sliding-window attention is not implemented (rows up to the window are exact)")
        both_bases = 2 * self.hidden_size_per_attention_head  # a LocalGlobalRotaryEmbedding's width
        if isinstance(rotary_pos_emb, torch.Tensor) and rotary_pos_emb.shape[-1] == both_bases:
            rotary_pos_emb = rotary_pos_emb.chunk(2, dim=-1)[1 if self.is_local else 0]
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
