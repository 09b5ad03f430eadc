"""The native generation engine: KV-cached decoding on the actor's own megatron-core weights.

Hybrid-engine idea: the engine holds references to the training parameters of the megatron
`GPTModel` chunks, never a copy, so `refit` costs nothing and generation always sees the latest
weights. The forward is a lean re-implementation of megatron's local-spec layer math (the tests
check it against megatron's own forward) in one tight loop over preallocated state:

- KV cache [batch, groups, max_len, head_dim] per layer, allocated once for max_batch_size x
  max_sequence_length and reused by every generate call (free() drops it);
- prompts left-padded to the longest one, so every row writes the same cache column each step;
  position ids skip the padding (row b's first real token is position 0, as in OpenAI's
  original RLHF code) and padded key columns are masked, so a row's numbers do not depend on
  the other rows. This equals the training-side layout of `aligner.generation.logprobs`
  (each sequence from position 0, padding after it);
- one batched prefill over the prompts (logits only for the last column), then one
  single-token step per new token.

Parallelism: tensor parallel through megatron's TP group (all-reduce after the row-parallel
projections, vocab-parallel embedding, sampling on vocab shards, see `sampling`); pipeline
parallel (also virtual stages) by passing hidden states stage to stage with point-to-point
sends; the last stage samples and broadcasts tokens and logprobs to the other stages, so every
rank returns the same Rollout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aligner.generation import sampling as S
from aligner.generation.engine import Rollout, SamplingParams
from aligner.models.gpt import GPTConfig


@dataclass
class _Layer:
    """One transformer layer's weights: references to the training parameters (biases may be None)."""

    input_norm: tuple  # (weight, bias)
    qkv: tuple
    proj: tuple
    mlp_norm: tuple
    fc1: tuple
    fc2: tuple


@dataclass
class _Segment:
    """The part of the model one chunk (pipeline stage, virtual stage) holds."""

    order: int  # position in the model's global layer order (virtual stage x pipeline rank)
    layers: list
    cache_offset: int  # index of its first layer in this rank's KV cache
    word_embeddings: Optional[torch.Tensor] = None  # first segment only
    position_embeddings: Optional[torch.Tensor] = None
    final_norm: Optional[tuple] = None  # last segment only
    output_weight: Optional[torch.Tensor] = None


def _bias(module) -> Optional[torch.Tensor]:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def _norm_weights(norm) -> tuple:
    return (norm.weight, _bias(norm))


class NativeEngine:
    """KV-cached generation on megatron-core model chunks (local layer spec), any TP/PP, CPU or GPU.

    model_chunks: this rank's model chunks (one per virtual pipeline stage), DDP/Float16 wrappers
        allowed. model_cfg: their architecture. pad_id fills prompts' left padding and responses
        after their end; eos_id is the stop token when SamplingParams.stop_token_ids is empty.
    max_batch_size, max_sequence_length: the KV cache's size (prompt + new tokens per row);
        generate() splits larger batches into chunks of max_batch_size.
    decode: token ids -> text, needed only for SamplingParams.stop_strings.
    """

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        model_cfg: GPTConfig,
        *,
        pad_id: int,
        eos_id: int,
        max_batch_size: int,
        max_sequence_length: int,
        decode: Optional[Callable[[list], str]] = None,
    ):
        from megatron.core import parallel_state as ps

        if model_cfg.transformer_impl != "local":
            raise NotImplementedError(
                "NativeEngine reads the weights of megatron's local layer spec; model.transformer_impl="
                f"{model_cfg.transformer_impl!r} is not supported yet (build the model with transformer_impl=local)"
            )
        if max_batch_size < 1 or max_sequence_length < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_sequence_length >= 2, got "
                             f"{max_batch_size} and {max_sequence_length}")
        if model_cfg.position_embedding_type == "learned_absolute" and max_sequence_length > model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_sequence_length={max_sequence_length} exceeds the model's learned positions "
                f"(model.max_position_embeddings={model_cfg.max_position_embeddings})"
            )
        self.cfg = model_cfg
        self.pad_id, self.eos_id = pad_id, eos_id
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.decode = decode
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._tp_size = ps.get_tensor_model_parallel_world_size()
        self._tp_group_or_none = self._tp_group if self._tp_size > 1 else None
        self._pp_size = ps.get_pipeline_model_parallel_world_size()
        self._pp_rank = ps.get_pipeline_model_parallel_rank()
        if self._pp_size > 1:
            self._pp_group = ps.get_pipeline_model_parallel_group()
            self._pp_ranks = dist.get_process_group_ranks(self._pp_group)
        self._heads = model_cfg.num_attention_heads // self._tp_size
        self._groups = model_cfg.query_groups // self._tp_size
        self._head_dim = model_cfg.head_dim
        self._scale = 1.0 / math.sqrt(self._head_dim)
        self._kv_cache: Optional[torch.Tensor] = None
        self.refit(model_chunks)

    # ------------------------------------------------------------------ GenerationEngine
    def refit(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        """Point the engine at these chunks' parameters (references: no copy, no rebuild).

        In-place weight updates (optimizer steps) are seen without calling refit; call it when the
        parameter tensors themselves were replaced (new model object, reloaded module).
        """
        from megatron.core.utils import unwrap_model

        chunks = unwrap_model(list(model_chunks))
        num_virtual = len(chunks)
        segments, cache_offset = [], 0
        for virtual_stage, chunk in enumerate(chunks):
            layers = [self._layer_weights(layer) for layer in chunk.decoder.layers]
            segment = _Segment(order=virtual_stage * self._pp_size + self._pp_rank, layers=layers,
                               cache_offset=cache_offset)
            cache_offset += len(layers)
            if chunk.pre_process:
                segment.word_embeddings = chunk.embedding.word_embeddings.weight
                if self.cfg.position_embedding_type == "learned_absolute":
                    segment.position_embeddings = chunk.embedding.position_embeddings.weight
            if chunk.post_process:
                segment.final_norm = _norm_weights(chunk.decoder.final_layernorm)
                segment.output_weight = (chunk.shared_embedding_or_output_weight() if self.cfg.tie_embeddings
                                         else chunk.output_layer.weight)
            segments.append(segment)
        self._segments = segments
        self._num_segments = num_virtual * self._pp_size
        self._num_local_layers = cache_offset
        reference = chunks[0].decoder.layers[0].self_attention.linear_qkv.weight if cache_offset else \
            next(chunks[0].parameters())
        self._dtype, self._device = reference.dtype, reference.device
        self._rope = self._rope_tables(chunks[0]) if self.cfg.position_embedding_type == "rope" else None
        last = segments[-1]
        self._is_last_stage = last.output_weight is not None
        if self._is_last_stage:
            shard = last.output_weight.shape[0]
            self._vocab_start = (dist.get_rank(self._tp_group) if self._tp_size > 1 else 0) * shard
            ids = torch.arange(self._vocab_start, self._vocab_start + shard, device=self._device)
            self._token_hash = S.token_hashes(ids)
            # Padded vocabulary rows exist only to even out shards: never sampled, not in the softmax.
            self._vocab_padding = ids >= self.cfg.vocab_size
            self._has_vocab_padding = bool(self._vocab_padding.any())
        if self._kv_cache is not None and self._kv_cache.dtype != self._dtype:
            self._kv_cache = None

    def free(self) -> None:
        """Drop the KV cache (the weights are the training tensors: nothing else to release)."""
        self._kv_cache = None

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollout:
        """Continue every prompt; collective over the model-parallel group (every TP/PP rank calls it).

        Row i samples from the noise stream of (sampling.seed, i), so a row's result does not depend
        on the other prompts in the call nor on how they are split into chunks of max_batch_size.
        With fixed_length every row gets max_new_tokens tokens (stop tokens do not end it);
        ended_with_stop then says whether a stop token was generated anywhere in the row.
        """
        self._check_request(prompts, sampling)
        parts = []
        for start in range(0, len(prompts), self.max_batch_size):
            parts.append(self._generate_batch(prompts[start:start + self.max_batch_size], sampling, start))
        return Rollout(
            prompt_tokens=[list(p) for p in prompts],
            response_tokens=torch.cat([p[0] for p in parts]),
            logprobs=torch.cat([p[1] for p in parts]),
            response_lengths=torch.cat([p[2] for p in parts]),
            ended_with_stop=torch.cat([p[3] for p in parts]),
        )

    # ------------------------------------------------------------------ setup
    def _layer_weights(self, layer) -> _Layer:
        attention, mlp = layer.self_attention, layer.mlp
        return _Layer(
            input_norm=_norm_weights(layer.input_layernorm),
            qkv=(attention.linear_qkv.weight, _bias(attention.linear_qkv)),
            proj=(attention.linear_proj.weight, _bias(attention.linear_proj)),
            mlp_norm=_norm_weights(layer.pre_mlp_layernorm),
            fc1=(mlp.linear_fc1.weight, _bias(mlp.linear_fc1)),
            fc2=(mlp.linear_fc2.weight, _bias(mlp.linear_fc2)),
        )

    def _rope_tables(self, chunk) -> tuple:
        """cos and sign-folded sin [max_len, head_dim] from megatron's own rotary frequencies.

        megatron applies x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; that is
        roll(x, d/2) * [-sin, sin], which needs one roll instead of a split, a negation and a cat.
        """
        freqs = chunk.rotary_pos_emb.get_freqs_non_repeated(self.max_sequence_length).to(self._device)  # [T, d/2]
        angles = torch.cat([freqs, freqs], dim=-1)
        sin = torch.sin(freqs)
        return torch.cos(angles).to(self._dtype), torch.cat([-sin, sin], dim=-1).to(self._dtype)

    def _cache(self, batch: int) -> torch.Tensor:
        """KV cache [2, layers, batch, groups, max_len, head_dim] (a view of the preallocated one)."""
        if self._kv_cache is None:
            self._kv_cache = torch.zeros(
                2, self._num_local_layers, self.max_batch_size, self._groups, self.max_sequence_length,
                self._head_dim, dtype=self._dtype, device=self._device,
            )
        return self._kv_cache[:, :, :batch]

    def _check_request(self, prompts: list, sampling: SamplingParams) -> None:
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
            if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
                raise ValueError(f"prompt {index} has token ids outside [0, vocab_size={self.cfg.vocab_size})")
        longest = max(len(p) for p in prompts)
        if longest + sampling.max_new_tokens > self.max_sequence_length:
            raise ValueError(
                f"longest prompt ({longest} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"engine's max_sequence_length={self.max_sequence_length}; shorten prompts or build the engine "
                f"with a larger max_sequence_length"
            )
        if sampling.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if not sampling.is_greedy and sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
        if not 0.0 < sampling.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.stop_strings and self.decode is None:
            raise ValueError("stop_strings need a tokenizer: build NativeEngine(..., decode=tokenizer.decode)")

    # ------------------------------------------------------------------ generation loop
    def _generate_batch(self, prompts: list, sampling: SamplingParams, first_sample: int):
        device, batch, new_tokens = self._device, len(prompts), sampling.max_new_tokens
        prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
        width = int(prompt_lengths.max())
        padding = width - prompt_lengths  # [batch] left padding of each row
        tokens = torch.full((batch, width), self.pad_id, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt):] = torch.tensor(prompt, device=device)
        columns = torch.arange(self.max_sequence_length, device=device)
        key_masked = (columns.unsqueeze(0) < padding.unsqueeze(1))  # [batch, max_len]: padding columns
        positions = (columns[:width].unsqueeze(0) - padding.unsqueeze(1)).clamp(min=0)
        cache = self._cache(batch)

        greedy = sampling.is_greedy
        temperature = 1.0 if greedy else sampling.temperature
        stop_ids = torch.tensor(sampling.stop_token_ids or [self.eos_id], dtype=torch.long, device=device)
        keys = None if greedy else S.sample_keys(sampling.seed, torch.arange(batch, device=device) + first_sample)

        responses = torch.full((batch, new_tokens), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(batch, new_tokens, dtype=torch.float32, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        ended = torch.zeros(batch, dtype=torch.bool, device=device)
        texts_done = [False] * batch

        logits = self._forward(tokens, positions, cache, key_masked, start=0)
        for step in range(new_tokens):
            token, logprob = self._next_tokens(logits, step, sampling, greedy, temperature, stop_ids, keys)
            is_stop = torch.isin(token, stop_ids)
            if sampling.fixed_length:
                responses[:, step] = token
                logprobs[:, step] = logprob
                lengths += 1
                ended |= is_stop
            else:
                active = ~finished
                responses[:, step] = torch.where(active, token, self.pad_id)
                logprobs[:, step] = torch.where(active, logprob, 0.0)
                lengths += active.long()
                stopped = active & is_stop
                if sampling.stop_strings:
                    stopped = stopped | self._stop_string_hits(responses, lengths, active, sampling.stop_strings)
                finished |= stopped
                ended |= stopped
                if bool(finished.all()):
                    break
            if step + 1 == new_tokens:
                break
            column = width + step
            logits = self._forward(token.unsqueeze(1), (prompt_lengths + step).unsqueeze(1), cache, key_masked,
                                   start=column)
        return responses.cpu(), logprobs.cpu(), lengths.cpu(), ended.cpu()

    def _stop_string_hits(self, responses, lengths, active, stop_strings) -> torch.Tensor:
        """Rows whose decoded response now contains a stop string (decoded on every rank alike)."""
        hits = torch.zeros_like(active)
        rows = active.nonzero().flatten().tolist()
        lengths_cpu = lengths.tolist()
        responses_cpu = responses.cpu()
        for row in rows:
            text = self.decode(responses_cpu[row, :lengths_cpu[row]].tolist())
            if any(stop in text for stop in stop_strings):
                hits[row] = True
        return hits

    def _next_tokens(self, logits, step, sampling, greedy, temperature, stop_ids, keys):
        """Sample on the last stage and hand (tokens, logprobs) [batch] to every pipeline stage."""
        if self._is_last_stage:
            logits = logits.float()
            if self._has_vocab_padding:
                logits = logits.masked_fill(self._vocab_padding, float("-inf"))
            scaled = S.apply_temperature(logits, temperature)
            candidates = scaled
            if step < sampling.min_new_tokens:
                local = stop_ids - self._vocab_start
                local = local[(local >= 0) & (local < scaled.shape[-1])]
                candidates = scaled.index_fill(-1, local, float("-inf"))
            token = S.select_tokens(
                candidates, greedy=greedy, top_k=sampling.top_k, top_p=sampling.top_p,
                step_key=None if greedy else S.step_keys(keys, step), token_hash=self._token_hash,
                vocab_start=self._vocab_start, group=self._tp_group_or_none,
            )
            # The logprob of the unfiltered distribution: what the training forward recomputes.
            logprob = S.vocab_parallel_token_logprobs(scaled, token, self._vocab_start, self._tp_group_or_none)
        if self._pp_size == 1:
            return token, logprob
        packed = (torch.stack([token.double(), logprob.double()]) if self._is_last_stage
                  else torch.empty(2, logits.shape[0] if logits is not None else self._batch, dtype=torch.float64,
                                   device=self._device))
        dist.broadcast(packed, src=self._pp_ranks[-1], group=self._pp_group)
        return packed[0].long(), packed[1].float()

    # ------------------------------------------------------------------ the forward
    def _forward(self, tokens, positions, cache, key_masked, *, start: int) -> Optional[torch.Tensor]:
        """Run tokens [batch, seq] (cache columns start..start+seq) through this rank's segments.

        Returns the last column's logits [batch, vocab_shard] on the last pipeline stage, else None.
        """
        batch, seq = tokens.shape
        self._batch = batch
        kv_len = start + seq
        rope = None
        if self._rope is not None:
            cos, sin = self._rope
            rope = (cos[positions].unsqueeze(2).unsqueeze(2), sin[positions].unsqueeze(2).unsqueeze(2))  # [b, s, 1, 1, d]
        # Masked keys: padding columns, and (prefill) the future: [batch, 1, 1, seq, kv_len].
        mask = key_masked[:, :kv_len].unsqueeze(1)
        if seq > 1:
            causal = torch.ones(seq, kv_len, dtype=torch.bool, device=tokens.device).triu(start + 1)
            mask = mask | causal
        mask = mask.view(batch, 1, 1, seq if seq > 1 else 1, kv_len)
        hidden = None
        for segment in self._segments:
            if segment.word_embeddings is not None:
                hidden = self._embed(segment, tokens, positions)
            elif segment.order > 0 and (segment.order - 1) % self._pp_size != self._pp_rank:
                hidden = torch.empty(batch, seq, self.cfg.hidden_size, dtype=self._dtype, device=self._device)
                dist.recv(hidden, src=self._pp_ranks[(segment.order - 1) % self._pp_size])
            for index, layer in enumerate(segment.layers):
                hidden = self._layer(layer, hidden, cache[0, segment.cache_offset + index],
                                     cache[1, segment.cache_offset + index], rope, mask, start, kv_len)
            if segment.output_weight is not None:
                last = hidden[:, -1]
                return F.linear(self._norm(last, segment.final_norm), segment.output_weight)
            if (segment.order + 1) % self._pp_size != self._pp_rank:
                dist.send(hidden.contiguous(), dst=self._pp_ranks[(segment.order + 1) % self._pp_size])
        return None

    def _embed(self, segment, tokens, positions):
        weight = segment.word_embeddings
        if self._tp_size == 1:
            hidden = F.embedding(tokens, weight)
        else:  # vocab-parallel lookup, as megatron's VocabParallelEmbedding
            start = dist.get_rank(self._tp_group) * weight.shape[0]
            local = tokens - start
            outside = (local < 0) | (local >= weight.shape[0])
            hidden = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
            dist.all_reduce(hidden, group=self._tp_group)
        if segment.position_embeddings is not None:
            hidden = hidden + F.embedding(positions, segment.position_embeddings)
        return hidden

    def _norm(self, x, weights):
        weight, bias = weights
        if self.cfg.normalization == "RMSNorm":
            return F.rms_norm(x, weight.shape, weight, self.cfg.norm_epsilon)
        return F.layer_norm(x, weight.shape, weight, bias, self.cfg.norm_epsilon)

    def _row_parallel(self, x, weights):
        """Row-parallel linear as megatron does it: matmul, all-reduce, then the bias."""
        weight, bias = weights
        out = F.linear(x, weight)
        if self._tp_size > 1:
            dist.all_reduce(out, group=self._tp_group)
        return out + bias if bias is not None else out

    def _layer(self, layer: _Layer, hidden, key_cache, value_cache, rope, mask, start, kv_len):
        batch, seq, _ = hidden.shape
        groups, head_dim = self._groups, self._head_dim
        per_group = self._heads // groups
        # qkv per group: [q_1 .. q_per_group, k, v] (megatron's interleaved GQA layout).
        qkv = F.linear(self._norm(hidden, layer.input_norm), *layer.qkv).view(batch, seq, groups, per_group + 2, head_dim)
        query_key = qkv[:, :, :, : per_group + 1]
        if rope is not None:
            cos, sin = rope
            query_key = query_key * cos + torch.roll(query_key, head_dim // 2, dims=-1) * sin
        key_cache[:, :, start:kv_len] = query_key[:, :, :, per_group].transpose(1, 2)
        value_cache[:, :, start:kv_len] = qkv[:, :, :, per_group + 1].transpose(1, 2)
        # [batch * groups, per_group * seq, head_dim] x [batch * groups, head_dim, kv_len]
        query = query_key[:, :, :, :per_group].permute(0, 2, 3, 1, 4).reshape(batch * groups, per_group * seq, head_dim)
        keys = key_cache[:, :, :kv_len].reshape(batch * groups, kv_len, head_dim)
        values = value_cache[:, :, :kv_len].reshape(batch * groups, kv_len, head_dim)
        scores = torch.bmm(query, keys.transpose(1, 2)).mul_(self._scale)
        scores = scores.view(batch, groups, per_group, seq, kv_len).float()
        scores = scores.masked_fill(mask, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(self._dtype).view(batch * groups, per_group * seq, kv_len)
        context = torch.bmm(probs, values).view(batch, groups, per_group, seq, head_dim)
        context = context.permute(0, 3, 1, 2, 4).reshape(batch, seq, self._heads * head_dim)
        hidden = hidden + self._row_parallel(context, layer.proj)

        intermediate = F.linear(self._norm(hidden, layer.mlp_norm), *layer.fc1)
        if self.cfg.activation == "swiglu":
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = F.silu(gate) * up
        elif self.cfg.activation == "gelu_tanh":
            intermediate = F.gelu(intermediate, approximate="tanh")
        elif self.cfg.activation == "gelu":
            intermediate = F.gelu(intermediate)
        else:
            intermediate = F.relu(intermediate)
        return hidden + self._row_parallel(intermediate, layer.fc2)
