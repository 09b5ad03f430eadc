"""The native engine's forward: prefill and decode steps over the bound weights and the KV cache.

A lean re-implementation of megatron's local-spec layer math (the tests check it against megatron's own
forward). Prefill runs batch-major ([batch, seq, features]) as megatron does; a decode step runs
feature-major ([features, batch]: see `Forward.decode_forward`). Everything it reads besides its arguments
is in the engine's `EngineState`. `StaticDecodeStep` is the decode step on fixed buffers that a CUDA graph
captures (`aligner.generation.cuda_graphs`).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aligner.generation import cuda_graphs as graphs
from aligner.generation.native.state import EngineState
from aligner.generation.native.weights import Layer, Linear, Norm
from aligner.runtime import cpu_products


class DecodeInputs(NamedTuple):
    """What one decode step needs besides the tokens: where to write, what to attend to."""

    column: torch.Tensor  # [batch] (or [1]: shared) long: the cache column each row's new keys and values go to
    column_index: Optional[int]  # the column as a Python int when every row writes the same one, else None
    kv_len: int  # keys 0 .. kv_len - 1 are read (all the cache's columns on the static path)
    attention_bias: Optional[torch.Tensor]  # [batch * groups, 1, kv_len]: 0, or the dtype's minimum for
    # unseen keys; None when every key may be seen
    rope: Optional[tuple]  # (cos, sin) [d, batch] at each row's position, None without rotary embeddings
    key_index: Optional[torch.Tensor] = None  # column_index None: column as scatter indices [batch, groups, d, 1]
    value_index: Optional[torch.Tensor] = None  # and [batch, groups, 1, d]


class Continuation(NamedTuple):
    """A prefill that continues cached rows: where each real (not padding) token of [batch, seq] goes."""

    rows: torch.Tensor  # [tokens] long: the token's batch row
    steps: torch.Tensor  # [tokens] long: its index in the row's new tokens
    columns: torch.Tensor  # [tokens] long: its cache column
    kv_len: int  # key columns read: 0 .. kv_len - 1


class Forward:
    """The forward of the bound model on this rank (its segments), reading `state` at every call."""

    def __init__(self, state: EngineState):
        self.state = state

    def _layer_rope(self, rope: Optional[tuple], layer: Layer, dim: int) -> Optional[tuple]:
        """The layer's (cos, sin) of rope, whose axis `dim` holds both bases' tables when there are two."""
        if rope is None or layer.rope_half is None:
            return rope
        return tuple(table.narrow(dim, layer.rope_half * self.state.head_dim, self.state.head_dim) for table in rope)

    def decode_inputs(self, columns, column_index, kv_len, bias, rope) -> DecodeInputs:
        """DecodeInputs with the scatter indices of per-row cache columns [batch] (None: one shared column)."""
        key_index = value_index = None
        if column_index is None:
            batch, groups, head_dim = columns.shape[0], self.state.groups, self.state.head_dim
            column_per_row = columns.view(batch, 1, 1, 1)
            key_index = column_per_row.expand(batch, groups, head_dim, 1)
            value_index = column_per_row.expand(batch, groups, 1, head_dim)
        return DecodeInputs(columns, column_index, kv_len, bias, rope, key_index, value_index)

    def prefill_forward(self, tokens, positions, keys, values, key_masked,
                        last_columns: Optional[torch.Tensor] = None, continued: bool = False) -> Optional[torch.Tensor]:
        """The prompts [batch, seq] (cache columns 0..seq) through this rank's segments.

        Returns the logits [batch, vocab_shard] of each row's last column (last_columns [batch], None:
        column seq - 1) on the last pipeline stage, else None.
        continued: the rows continue sequences already in the cache (`generate_turns`): token j of row b
        goes to cache column positions[b, j] and sees the row's columns up to it; its right padding
        (j > last_columns[b], positions clamped to the last real token's) writes nothing.
        """
        state = self.state
        batch, seq = tokens.shape
        rope = None
        if state.rope is not None:
            cos, sin = state.rope  # gathered per position: [batch, seq, 1, 1, d]
            rope = (cos[positions].unsqueeze(2).unsqueeze(2), sin[positions].unsqueeze(2).unsqueeze(2))
        # Added to the scores: the dtype's minimum where a key must not be seen (the future, padding
        # columns), else 0. Built once for all layers, [batch * groups, per_group * seq, kv_len].
        continuation = None
        if continued:
            kv_len = int(positions.max()) + 1
            unseen = state.columns[:kv_len].view(1, 1, kv_len) > positions.unsqueeze(2)  # [batch, seq, kv_len]
            real = state.columns[:seq].unsqueeze(0) <= last_columns.unsqueeze(1)  # [batch, seq]
            rows, steps = real.nonzero(as_tuple=True)
            continuation = Continuation(rows, steps, positions[rows, steps], kv_len)
        else:
            kv_len = seq
            unseen = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)
            if key_masked is not None:
                unseen = key_masked[:, None, :seq] | unseen
        per_group = state.heads // state.groups
        unseen = unseen.view(-1, 1, 1, seq, kv_len).expand(batch, state.groups, per_group, seq, kv_len)
        mask = torch.zeros(unseen.shape, dtype=state.dtype, device=tokens.device).masked_fill_(
            unseen, torch.finfo(state.dtype).min).view(batch * state.groups, per_group * seq, kv_len)

        def run(segment, hidden):
            for index, layer in enumerate(segment.layers):
                cache_index = segment.cache_offset + index
                hidden = self._prefill_layer(layer, hidden, keys[cache_index], values[cache_index], rope, mask,
                                             continuation)
            return hidden

        def logits(segment, hidden):
            rows = torch.arange(batch, device=hidden.device)
            last = hidden[:, -1] if last_columns is None else hidden[rows, last_columns]
            return self._linear(self._norm(last, segment.final_norm), segment.output_product)

        return self._through_stages(run, logits, lambda segment: self._embed(segment, tokens, positions),
                                    (batch, seq, state.cfg.hidden_size))

    def decode_forward(self, tokens, positions, keys, values, inputs: DecodeInputs,
                       general: bool = False) -> Optional[torch.Tensor]:
        """One new token per row (tokens, positions [batch]) into cache column `inputs.column`.

        Returns logits [batch, vocab_shard] on the last pipeline stage, else None.
        Activations are feature-major, [features, batch]: the linear layers are then W @ x, a plain
        matrix product that BLAS runs much faster at small batch than the x @ W^T of F.linear
        (3.2x for the 512 -> 128 projection at batch 32 on the CPU, 1.6x over a whole decode
        step's matmuls), on the training weights as they are: no transposed copy. On a CPU the
        products run on oneDNN instead (`cpu_products`, faster still), whose outputs are token-major
        storage read feature-major. Where the C++ step applies (`cpu_decode`) it runs the whole step instead,
        unless `general` (the static step, whose torch operations are what a graph captures).
        """
        state = self.state
        batch = tokens.shape[0]
        cpu = state.cpu_decode
        if cpu is not None and not general and cpu.runs(batch) and cpu.available():
            return cpu.step(tokens, inputs, keys, values)  # on a CPU: the whole step in one C++ call (cpu_decode)

        def run(segment, hidden):
            for index, layer in enumerate(segment.layers):
                cache_index = segment.cache_offset + index
                hidden = self._decode_layer(layer, hidden, keys[cache_index], values[cache_index], inputs)
            return hidden

        def logits(segment, hidden):
            normed = self._norm_columns(hidden, segment.final_norm)
            return self._decode_product(segment.output_weight, segment.output_product, normed).t()

        def embed(segment):  # [hidden, batch]: a view on the oneDNN path (its products read x.t())
            hidden = self._embed(segment, tokens, positions).t()
            return hidden if state.onednn_products else hidden.contiguous()

        return self._through_stages(run, logits, embed, (state.cfg.hidden_size, batch))

    def _through_stages(self, run, logits, embed, hidden_shape):
        """Pipeline order: embed on the first segment, hidden states passed on between ranks."""
        state = self.state
        hidden = None
        for segment in state.segments:
            if segment.word_embeddings is not None:
                hidden = embed(segment)
            elif (segment.order - 1) % state.pp_size != state.pp_rank:
                hidden = torch.empty(hidden_shape, dtype=state.dtype, device=state.device)
                dist.recv(hidden, src=state.pp_ranks[(segment.order - 1) % state.pp_size])
            hidden = run(segment, hidden)
            if segment.output_weight is not None:
                return logits(segment, hidden)
            if (segment.order + 1) % state.pp_size != state.pp_rank:
                dist.send(hidden.contiguous(), dst=state.pp_ranks[(segment.order + 1) % state.pp_size])
        return None

    def _embed(self, segment, tokens, positions):
        state = self.state
        weight = segment.word_embeddings
        if state.tp_size == 1:
            hidden = F.embedding(tokens, weight)
        else:  # vocab-parallel lookup, as megatron's VocabParallelEmbedding
            start = dist.get_rank(state.tp_group) * weight.shape[0]
            local = tokens - start
            outside = (local < 0) | (local >= weight.shape[0])
            hidden = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
            dist.all_reduce(hidden, group=state.tp_group)
        if state.cfg.scale_embeddings:  # megatron's ScaledVocabParallelEmbedding: after the vocab-parallel sum
            hidden = hidden * torch.tensor(state.cfg.hidden_size ** 0.5).to(hidden.dtype)
        if segment.position_embeddings is not None:
            hidden = hidden + F.embedding(positions, segment.position_embeddings)
        return hidden

    def _softmax(self, scores):
        if scores.dtype == torch.float32:
            return torch.softmax(scores, dim=-1)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)  # megatron: softmax in fp32

    def _reduce(self, partial):
        """Sum the row-parallel partial products of the tensor-parallel ranks."""
        if self.state.tp_size > 1:
            dist.all_reduce(partial, group=self.state.tp_group)
        return partial

    # -- batch-major layers (prefill): [batch, seq, features], megatron's math step for step
    def _norm(self, x, norm: Norm):
        state = self.state
        if state.cfg.zero_centered_norm:  # megatron's ZeroCenteredRMSNorm op for op
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + state.cfg.norm_epsilon)
            return (normed * (1.0 + norm.weight.float())).type_as(x)
        if state.cfg.normalization == "LayerNorm":
            return F.layer_norm(x, norm.weight.shape, norm.weight, norm.bias, state.cfg.norm_epsilon)
        if x.dtype != torch.float32:
            return F.rms_norm(x, norm.weight.shape, norm.weight, state.cfg.norm_epsilon)
        # torch's rms_norm op sequence for fp32 (bit-identical), in fewer dispatches.
        return x * (x * x).mean(-1, keepdim=True).add_(state.cfg.norm_epsilon).rsqrt_() * norm.weight

    def _linear(self, x, weight, bias=None):
        return cpu_products.linear(x, weight, bias) if self.state.onednn_products else F.linear(x, weight, bias)

    def _adapted(self, out, x, linear: Linear, rows: slice = slice(None)):
        """out += scale * B[rows] (A x) for a live LoRA adapter (token-major x [..., in]), in place.
        Row-parallel: added to this rank's partial sum before the all-reduce (B is whole, so the sum of
        B (A_i x_i) over the ranks is B (A x), the training forward's update)."""
        if linear.lora_a is not None:
            out.add_(self._linear(self._linear(x, linear.lora_a), linear.lora_b[rows]), alpha=linear.lora_scale)
        return out

    def _row_parallel(self, x, linear: Linear):
        """megatron's row-parallel linear: matmul, all-reduce, then the bias."""
        out = self._reduce(self._adapted(self._linear(x, linear.product), x, linear))
        return out if linear.bias is None else out + linear.bias

    def _prefill_layer(self, layer: Layer, hidden, key_cache, value_cache, rope, mask,
                       continuation: Optional["Continuation"] = None):
        """hidden [batch, seq, hidden] from cache column 0 (continuation: from each row's own column);
        key_cache [batch, groups, d, len], value_cache [batch, groups, len, d]; mask [batch * groups,
        per_group * seq, kv_len] (additive)."""
        state = self.state
        batch, seq, _ = hidden.shape
        groups, per_group, head_dim = state.groups, state.heads // state.groups, state.head_dim
        # qkv per group: [q_1 .. q_per_group, k, v] (megatron's interleaved GQA layout).
        normed = self._norm(hidden, layer.input_norm)
        qkv = self._adapted(self._linear(normed, layer.qkv.product, layer.qkv.bias), normed, layer.qkv)
        qkv = qkv.view(batch, seq, groups, per_group + 2, head_dim)
        query_key = qkv[:, :, :, : per_group + 1]
        if layer.q_norm is not None:
            query_key = self._head_norm(query_key, layer, dim=4)
        if rope is not None:
            cos, sin = self._layer_rope(rope, layer, dim=-1)
            query_key = torch.addcmul(query_key * cos, torch.roll(query_key, head_dim // 2, dims=-1), sin)
        kv_len = seq
        if continuation is None:
            key_cache[:, :, :, :seq] = query_key[:, :, :, per_group].permute(0, 2, 3, 1)
            value_cache[:, :, :seq] = qkv[:, :, :, per_group + 1].transpose(1, 2)
        else:  # the real tokens only, each at its row's own column: [tokens, groups, d] through [batch, len, ...] views
            rows, steps, columns, kv_len = continuation
            key_cache.permute(0, 3, 1, 2)[rows, columns] = query_key[rows, steps, :, per_group]
            value_cache.permute(0, 2, 1, 3)[rows, columns] = qkv[rows, steps, :, per_group + 1]
        # [batch * groups, per_group * seq, d] x [batch * groups, d, kv_len]
        query = query_key[:, :, :, :per_group].permute(0, 2, 3, 1, 4).reshape(batch * groups, per_group * seq, head_dim)
        keys = key_cache[:, :, :, :kv_len].reshape(batch * groups, head_dim, kv_len)
        probs = self._softmax(torch.baddbmm(mask, query, keys, alpha=state.scale))
        context = torch.bmm(probs, value_cache[:, :, :kv_len].reshape(batch * groups, kv_len, head_dim))
        context = context.view(batch, groups, per_group, seq, head_dim).permute(0, 3, 1, 2, 4)
        attention = self._row_parallel(context.reshape(batch, seq, state.heads * head_dim), layer.proj)
        if layer.post_attention_norm is not None:
            attention = self._norm(attention, layer.post_attention_norm)
        hidden = hidden + attention

        normed = self._norm(hidden, layer.mlp_norm)
        if layer.moe is not None:  # megatron's MoE layer on [tokens, 1, hidden]: each token is routed alone
            routed, _ = layer.moe(normed.reshape(-1, 1, normed.shape[-1]))
            return routed.view(hidden.shape).add_(hidden)
        fc1 = layer.fc1
        if state.gated:
            # Gate and up projections from the weight's two row blocks (views): contiguous outputs,
            # on which the activation runs ~3x faster than on the strided halves of one product.
            half = fc1.weight.shape[0] // 2
            bias = (None, None) if fc1.bias is None else (fc1.bias[:half], fc1.bias[half:])
            gate = self._adapted(self._linear(normed, fc1.weight[:half], bias[0]), normed, fc1, slice(None, half))
            up = self._adapted(self._linear(normed, fc1.weight[half:], bias[1]), normed, fc1, slice(half, None))
            intermediate = state.activation(gate).mul_(up)
        else:
            intermediate = state.activation(self._adapted(self._linear(normed, fc1.product, fc1.bias), normed, fc1))
        output = self._row_parallel(intermediate, layer.fc2)
        if layer.post_mlp_norm is not None:
            output = self._norm(output, layer.post_mlp_norm)
        return output.add_(hidden)

    def _head_norm(self, query_key, layer: Layer, dim: int):
        """megatron's q/k norm: each query and key head normalised over its features (axis `dim`), before RoPE.

        query_key holds a group's [q_1 .. q_per_group, k] heads on axis dim - 1 (prefill: [batch, seq,
        groups, heads, d], dim 4; decode: [groups, heads, d, batch], dim 2). torch's norm op sequence
        (statistics in fp32), with the query weight on the query heads and the key weight on the key head.
        """
        state = self.state
        x = query_key if query_key.dtype == torch.float32 else query_key.float()
        if state.cfg.normalization == "LayerNorm":
            x = x - x.mean(dim, keepdim=True)
        normed = x * (x * x).mean(dim, keepdim=True).add_(state.cfg.norm_epsilon).rsqrt_()
        per_group = normed.shape[dim - 1] - 1
        weight_shape = (-1,) + (1,) * (normed.dim() - dim - 1)  # along `dim`, broadcast over the axes after it
        for heads, norm in ((normed.narrow(dim - 1, 0, per_group), layer.q_norm),
                            (normed.narrow(dim - 1, per_group, 1), layer.k_norm)):
            heads.mul_(self._norm_scale(norm.weight).view(weight_shape))
            if norm.bias is not None:
                heads.add_(norm.bias.view(weight_shape))
        return normed.to(query_key.dtype)

    # -- feature-major layers (decode): [features, batch]
    def _norm_columns(self, x, norm: Norm):
        """The norm over the features of each column of x [hidden, batch]."""
        state = self.state
        if x.dtype != torch.float32:  # statistics in fp32, as torch's norms compute them for half types
            return self._norm_columns(x.float(), norm).to(x.dtype)
        if state.cfg.normalization == "RMSNorm":
            inverse_rms = torch.addmm(state.norm_eps, state.mean_row, x * x).rsqrt_()  # [1, batch]
            return (x * self._norm_scale(norm.weight_column)).mul_(inverse_rms)
        centered = x - torch.mm(state.mean_row, x)
        inverse_std = torch.addmm(state.norm_eps, state.mean_row, centered * centered).rsqrt_()
        normalized = centered.mul_(inverse_std)
        if norm.bias_column is None:
            return normalized.mul_(norm.weight_column)
        return torch.addcmul(norm.bias_column, normalized, norm.weight_column)

    def _norm_scale(self, weight):
        """What a norm multiplies by: its weight, or (1 + weight) in fp32 for zero-centred norms (Gemma)."""
        return 1.0 + weight.float() if self.state.cfg.zero_centered_norm else weight

    # In-place adds below act on fresh matmul outputs only: fewer allocations in the hot loop.
    def _wx(self, weight, x):
        """weight [out, in] @ x [in, batch] -> [out, batch]: oneDNN on CPU (see `cpu_products`), else BLAS."""
        return cpu_products.weight_times_columns(weight, x) if self.state.onednn_products else torch.mm(weight, x)

    def _decode_product(self, weight, product, x):
        """A decode step's weight [out, in] @ x [in, batch]: BLAS on the weight itself in a call of one sequence
        where BLAS is the preferred library (`cpu_products`: 1.3x at batch 1 on an Intel Xeon), else `_wx`
        on what the products read (product: the weight or its packed copy)."""
        return torch.mm(weight, x) if self.state.single_sequence_on_blas else self._wx(product, x)

    def _adapted_columns(self, out, x, linear: Linear):
        """out [out, batch] += scale * B (A x) for a live LoRA adapter (feature-major x), in place."""
        if linear.lora_a is not None:
            out.add_(self._wx(linear.lora_b, self._wx(linear.lora_a, x)), alpha=linear.lora_scale)
        return out

    def _linear_columns(self, linear: Linear, x):
        out = self._adapted_columns(self._decode_product(linear.weight, linear.product, x), x, linear)
        return out if linear.bias is None else out.add_(linear.bias_column)

    def _row_parallel_columns(self, linear: Linear, x, residual, post_norm: Optional[Norm] = None):
        """megatron's row-parallel linear (matmul, all-reduce, bias), its output's norm (Gemma's post norms)
        where there is one, plus the residual stream."""
        state = self.state
        out = self._adapted_columns(self._decode_product(linear.weight, linear.product, x), x, linear)
        if state.tp_size > 1:  # all_reduce wants a contiguous tensor: the product's token-major storage
            dist.all_reduce(out.t() if out.t().is_contiguous() else out, group=state.tp_group)
        if linear.bias is not None:
            out.add_(linear.bias_column)
        if post_norm is not None:
            out = self._norm_columns(out, post_norm)
        return out.add_(residual)

    def _decode_layer(self, layer: Layer, hidden, key_cache, value_cache, inputs: DecodeInputs):
        """hidden [hidden, batch]; key_cache [batch, groups, d, len]; value_cache [batch, groups, len, d]."""
        state = self.state
        batch = hidden.shape[1]
        groups, per_group, head_dim, kv_len = state.groups, state.heads // state.groups, state.head_dim, inputs.kv_len
        qkv = self._linear_columns(layer.qkv, self._norm_columns(hidden, layer.input_norm))
        qkv = qkv.view(groups, per_group + 2, head_dim, batch)
        query_key = qkv[:, : per_group + 1]
        if layer.q_norm is not None:
            query_key = self._head_norm(query_key, layer, dim=2)
        if inputs.rope is not None:
            cos, sin = self._layer_rope(inputs.rope, layer, dim=0)  # [d, batch], over [groups, per_group + 1, d, batch]
            query_key = torch.addcmul(query_key * cos, torch.roll(query_key, head_dim // 2, dims=2), sin)
        new_keys, new_values = query_key[:, per_group].permute(2, 0, 1), qkv[:, per_group + 1].permute(2, 0, 1)
        if inputs.column_index is None:  # each row at its own column (tensors: capturable in a graph)
            key_cache.scatter_(3, inputs.key_index, new_keys.unsqueeze(3))
            value_cache.scatter_(2, inputs.value_index, new_values.unsqueeze(2))
        else:  # every row at the same column: a plain column copy
            key_cache.select(3, inputs.column_index).copy_(new_keys)
            value_cache.select(2, inputs.column_index).copy_(new_values)
        # All heads in one batched product: [batch * groups, per_group, d] x [batch * groups, d, kv_len]
        query = query_key[:, :per_group].permute(3, 0, 1, 2).reshape(batch * groups, per_group, head_dim)
        keys = key_cache.view(batch * groups, head_dim, -1)[:, :, :kv_len]
        scores = torch.baddbmm(state.no_input, query, keys, beta=0.0, alpha=state.scale)
        if inputs.attention_bias is not None:  # a separate add: baddbmm with a real input costs more
            scores.add_(inputs.attention_bias)
        probs = self._softmax(scores)
        context = torch.bmm(probs, value_cache.view(batch * groups, -1, head_dim)[:, :kv_len])
        # [batch, heads * d] read transposed by the product: no copy into feature-major order.
        hidden = self._row_parallel_columns(layer.proj, context.view(batch, state.heads * head_dim).t(), hidden,
                                            layer.post_attention_norm)

        if layer.moe is not None:  # megatron's MoE layer takes token-major [tokens, 1, hidden]
            routed, _ = layer.moe(self._norm_columns(hidden, layer.mlp_norm).t().reshape(batch, 1, -1))
            return torch.add(hidden, routed.view(batch, -1).t())
        intermediate = self._linear_columns(layer.fc1, self._norm_columns(hidden, layer.mlp_norm))
        if state.gated:
            gate, up = intermediate.chunk(2, dim=0)
            intermediate = state.activation(gate).mul_(up)
        else:
            intermediate = state.activation(intermediate)
        return self._row_parallel_columns(layer.fc2, intermediate, hidden, layer.post_mlp_norm)



class StaticDecodeStep:
    """The decode step on fixed buffers over the whole cache (all its columns): what a CUDA graph captures.

    Inputs (tokens, positions, each row's cache column, the padding bias) are copied into buffers
    that never move; the step derives everything else from them with tensor ops only (the mask of
    columns beyond each row's current one, the rotary rows), so a replay needs no Python-side values.
    """

    def __init__(self, state: EngineState, forward: Forward, batch: int, keys: torch.Tensor, values: torch.Tensor,
                 capture: bool):
        device = state.device
        self.state, self.forward_pass, self.keys, self.values, self.capture = state, forward, keys, values, capture
        self.columns = state.columns[:keys.shape[-1]]  # [len]
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.column = torch.zeros(batch, dtype=torch.long, device=device)
        self.key_bias = torch.zeros(batch * state.groups, 1, len(self.columns), dtype=state.dtype, device=device)
        self.graph: Optional[graphs.CapturedStep] = None

    def forward(self) -> Optional[torch.Tensor]:
        state = self.state
        unseen = torch.finfo(state.dtype).min
        batch, length = self.column.shape[0], len(self.columns)
        future = (self.columns.unsqueeze(0) > self.column.unsqueeze(1)).view(batch, 1, 1, length)
        bias = torch.where(future, unseen, self.key_bias.view(batch, -1, 1, length))  # the future, and padding
        rope = None
        if state.rope is not None:
            rope = tuple(table.index_select(1, self.positions) for table in state.rope_columns)
        inputs = self.forward_pass.decode_inputs(self.column, None, length, bias.view(-1, 1, length), rope)
        # general: the step a graph captures is torch's operations (the C++ step is not capturable)
        return self.forward_pass.decode_forward(self.tokens, self.positions, self.keys, self.values, inputs,
                                                general=True)

    def run(self) -> Optional[torch.Tensor]:
        """The step on the buffers' current contents (captured at the first call when capturing).

        Capture happens here, with the first step's inputs in place: the warm-up runs before
        capture write that step's keys and values, which the replay then writes again.
        """
        if self.capture and self.graph is None:
            self.graph = graphs.CapturedStep(self.forward)
        return self.forward() if self.graph is None else self.graph.replay()
