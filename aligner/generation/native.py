"""The native generation engine: KV-cached decoding on the actor's own megatron-core weights.

Hybrid-engine idea: the engine holds references to the training parameters of the megatron
`GPTModel` chunks, so generation always sees the latest weights; the one copy is the products'
oneDNN-packed weights on CPU (`pack_weights`), remade for the weights that changed. The forward
is a lean re-implementation of megatron's local-spec layer math (the tests check it against
megatron's own forward) in one tight loop over preallocated state:

- KV cache per layer, keys [batch, groups, head_dim, len] (stored transposed: q @ K^T then
  reads contiguous blocks) and values [batch, groups, len, head_dim], sized by what a generate
  call needs (its rows, at most max_batch_size, x its longest prompt + max_new_tokens), kept and
  reused by later calls that fit, and replaced (the old one dropped first) by one that does not:
  max_sequence_length is a limit, not an allocation (free() drops the cache);
- continuous batching (`_generate_continuous`): each cache row holds one sequence from column 0
  (its first token at position 0, the training-side layout of `aligner.generation.logprobs`) at
  its own length; a decode step writes each row's new keys and values at the row's own column and
  masks the columns beyond it, so a row's numbers do not depend on the other rows. A row that
  stops leaves the decode batch at once and a waiting prompt takes its cache row (prefilled into
  it, right-padded with the other prompts admitted at that step); `generate_stream` keeps doing so
  across requests (rollout micro-batches), pulling the next one as rows free up. Sampling is keyed
  by (sample, step of its own response), so the schedule never changes a row's draws;
- continuous_batching=False keeps the static-batch loop as a reference (tests, benchmarks):
  chunks of max_batch_size prompts left-padded to the longest, every row at one shared column
  until the chunk's longest row ends;
- prefills compute logits only for each prompt's last token, and run a prompt admitted several times
  at once (a group's samples) only once, copying its cache rows; decode steps are single-token and
  run feature-major ([features, batch] activations, see `_decode_forward`) because small-batch
  BLAS products are much faster that way round; on CPU the products are oneDNN's (`cpu_products`),
  on packed copies of the weights by default, except a single sequence's decode products where BLAS
  is the preferred library (`cpu_products.preferred_library`).

The decode step is bound by per-op overhead, not arithmetic or memory, at small sizes, so it is
written to issue few, cheap torch calls: all heads of a layer in one baddbmm and one bmm (a
padding mask, when there is padding, as one in-place add); norms with one addmm for the feature
statistics; rotary embedding as mul + roll + addcmul; cache columns written with a plain column
copy when every row writes the same column (else one scatter per cache); the attention output read
transposed by the projection (no copy); the rows' masks and rotary columns built once per step for
all layers; a sampling path that draws and takes the logprob in one pass.

Speed against HF `generate` and the arithmetic floor: docs/results/benchmarks.md; how it is measured:
benchmarks/README.md (generation.py).

Static decode step (`static_decode=True`) and CUDA graphs (`cuda_graphs=True`, GPU only): the
step can instead attend over the whole cache with a mask (each row's future and padding
columns get the dtype's minimum) and read tokens, positions, the rows' cache columns and the padding
bias from fixed buffers. That step has no Python-side values and no shape changes, so a CUDA
graph can record it once per batch size and cache allocation and replay it (continuous batching
shrinks the decode batch as rows end: one graph per batch size it reaches) (`aligner.generation.cuda_graphs`, the
engine's only GPU-specific code). On CPU cuda_graphs=True is refused with a ValueError (no
silent fallback); static_decode=True runs the same static step eagerly, and the tests check it
gives the default step's tokens and logprobs (also at TP=2 and PP=2).

Sampling (temperature, top-k, top-p, greedy, min/max new tokens, stop ids and strings,
fixed length, per-sample seeds) is in `sampling`; the reported logprobs are those of
log_softmax(logits / temperature) over the real vocabulary (temperature 1 when greedy), before
top-k/top-p/min-new-tokens filtering: the quantity the training forward recomputes.

Parallelism: tensor parallel through megatron's TP group (all-reduce after the row-parallel
projections, vocab-parallel embedding, sampling on vocab shards, see `sampling`); pipeline
parallel (also virtual stages) by passing hidden states stage to stage with point-to-point
sends; the last stage samples and broadcasts tokens and logprobs to the other stages, so every
rank returns the same Rollout.

Model families: the rotary tables come from megatron's own RotaryEmbedding of the chunk (Llama 3.x
scaling included, one fact); queries and keys get the per-head norm of megatron's qk_layernorm
(Qwen3) before RoPE; Gemma 3's zero-centred norms (x * (1 + w)), norms after attention and after the
MLP, scaled embeddings, softmax scale and its sliding-window layers' own RoPE base (the tables hold
both bases' angles side by side, each layer reads its half), with requests longer than the sliding
window refused, as training refuses such rows; an MoE layer's MLP is megatron's own MoELayer module
(router, token dispatcher, experts), called token-major ([tokens, 1, hidden]) from both the prefill
and the feature-major decode step. Generation with expert_model_parallel_size > 1 is refused (each
data-parallel rank decodes its own prompts for its own number of steps, the MoE layer would need them
in lockstep), and so is cuda_graphs=True for MoE models (tokens per expert change every step).

Not supported: the transformer-engine layer spec (its fused norm+linear weights have other
names); CUDA graphs across pipeline stages (cuda_graphs needs PP=1).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aligner.generation import cuda_graphs as graphs
from aligner.generation import sampling as S
from aligner.generation.engine import GenerationEngine, Rollout, SamplingParams
from aligner.models import parameter_names as param_names
from aligner.models.gpt import GPTConfig
from aligner.runtime import cpu_products
from aligner.runtime.errors import ConfigError


class _Linear(NamedTuple):
    """A linear layer's parameters (references to the training tensors, never copies)."""

    weight: torch.Tensor  # [out, in]
    bias: Optional[torch.Tensor]  # [out]
    bias_column: Optional[torch.Tensor]  # [out, 1] view of bias, for feature-major activations
    product: torch.Tensor  # what the products read: the weight, or its oneDNN-packed copy (see _pack_products)
    # A live LoRA adapter (aligner.models.lora), read as the training forward reads it: out += scale * B (A x).
    lora_a: Optional[torch.Tensor] = None  # [rank, in] (row-parallel: this rank's input columns)
    lora_b: Optional[torch.Tensor] = None  # [out, rank] (column-parallel: this rank's output rows)
    lora_scale: float = 0.0


class _Norm(NamedTuple):
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    weight_column: torch.Tensor  # [hidden, 1] views, for feature-major activations
    bias_column: Optional[torch.Tensor]


class _Layer(NamedTuple):
    input_norm: _Norm
    qkv: _Linear
    proj: _Linear
    mlp_norm: _Norm
    fc1: Optional[_Linear]  # dense MLP (None in an MoE layer)
    fc2: Optional[_Linear]
    q_norm: Optional[_Norm] = None  # megatron's qk_layernorm: per-head norms of queries and keys
    k_norm: Optional[_Norm] = None
    moe: Optional[torch.nn.Module] = None  # megatron's own MoELayer (router, dispatcher, experts)
    post_attention_norm: Optional[_Norm] = None  # Gemma: norms of the projections' outputs, before the residual
    post_mlp_norm: Optional[_Norm] = None
    rope_half: Optional[int] = None  # with a second RoPE base: 0 the full-attention layers' angles, 1 the local


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
    output_product: Optional[torch.Tensor] = None  # output_weight or its packed copy, as _Linear.product


class _PackedWeight(NamedTuple):
    """A weight's oneDNN-packed copy and the state of the weight it was packed from."""

    weight: torch.Tensor
    data_ptr: int
    version: Optional[int]  # autograd's version counter: in-place updates bump it (None: an inference tensor)
    packed: torch.Tensor

    def is_current(self, weight: torch.Tensor) -> bool:
        return (self.weight is weight and self.data_ptr == weight.data_ptr()
                and self.version == _version_counter(weight))


def _version_counter(tensor: torch.Tensor) -> Optional[int]:
    return None if tensor.is_inference() else tensor._version


def _linear(module) -> _Linear:
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    linear = _Linear(module.weight, bias, None if bias is None else bias.view(-1, 1), module.weight)
    if getattr(module, "lora_enabled", False):  # bound per call, so rollouts read the adapters as trained now
        linear = linear._replace(lora_a=module.lora_a, lora_b=module.lora_b, lora_scale=module.lora_scale)
    return linear


def _optional_submodule(module: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    try:
        return module.get_submodule(path)
    except AttributeError:  # absent, or not a module (megatron leaves some optional parts None)
        return None


def _norm(module) -> _Norm:
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    return _Norm(module.weight, bias, module.weight.view(-1, 1), None if bias is None else bias.view(-1, 1))


class NativeEngine(GenerationEngine):
    """KV-cached generation on megatron-core model chunks (local layer spec), any TP/PP, CPU or GPU.

    model_chunks: this rank's model chunks (one per virtual pipeline stage), DDP/Float16 wrappers
        allowed. model_cfg: their architecture. pad_id fills prompt padding and responses
        after their end; eos_id is the stop token when SamplingParams.stop_token_ids is empty.
    max_batch_size, max_sequence_length: limits, not allocations. At most max_batch_size rows
        decode at once (more prompts wait for a free row); prompt + new tokens longer than
        max_sequence_length are refused; the KV cache holds what the call needs (see `kv_cache_bytes`).
    decode: token ids -> text, needed only for SamplingParams.stop_strings.
    static_decode: every decode step attends over the whole KV cache with a mask and
        reads its inputs from fixed buffers (same math, same results; slower on CPU, where the
        short dynamic step wins). It is the step that cuda_graphs captures.
    cuda_graphs: capture the static decode step once per batch size in a CUDA graph and replay
        it (GPU only, one pipeline stage; see `aligner.generation.cuda_graphs`), captured again
        when the cache is reallocated. On a CPU model
        it raises ValueError rather than silently running something else.
    continuous_batching: a row that stops leaves the decode batch and a waiting prompt takes its
        cache row (see the module docstring); False runs the static-batch loop (chunks of
        max_batch_size rows, each decoded until its longest row ends), kept as the reference the
        tests and benchmarks/continuous_batching.py compare with: same tokens, logprobs within rounding.
    shared_prefill: (continuous batching) a prompt admitted several times at once, as a group's samples
        are, is prefilled once and its cache rows copied (`_prefill_rows`); False prefills every row,
        the reference of the tests and benchmarks/shared_prefill.py.
    pack_weights: on the oneDNN path (fp32 on CPU) the products read copies of the weights in
        oneDNN's own blocked layout (`cpu_products.pack`) instead of the weights as they are: a
        faster decode step, for a second copy of the linear layers' weights in memory and a repack
        of each weight that changed (new storage, or an in-place update that bumped its version
        counter: optimizer steps, `param.copy_`) at the next generate call. Writes that bypass the
        version counter (`param.data.copy_(...)`) need refit(), which repacks everything. Elsewhere
        it changes nothing. Cost and gain: benchmarks/README.md (generation.py).
    A model with LoRA adapters (`aligner.models.lora`) generates with them: each adapted product gains its
    low-rank update, read from the live adapters at every call (switched-off adapters are left out).
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
        static_decode: bool = False,
        cuda_graphs: bool = False,
        continuous_batching: bool = True,
        shared_prefill: bool = True,
        pack_weights: bool = True,
    ):
        from megatron.core import parallel_state as ps

        if model_cfg.transformer_impl != "local":
            raise ConfigError(
                "NativeEngine reads the weights of megatron's local layer spec; model.transformer_impl="
                f"{model_cfg.transformer_impl!r} is not supported yet (build the model with transformer_impl=local)"
            )
        if max_batch_size < 1 or max_sequence_length < 2:
            raise ConfigError(f"need max_batch_size >= 1 and max_sequence_length >= 2, got "
                              f"{max_batch_size} and {max_sequence_length}")
        learned_positions = model_cfg.position_embedding_type == "learned_absolute"
        if learned_positions and max_sequence_length > model_cfg.max_position_embeddings:
            raise ConfigError(
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
        scalar = model_cfg.query_pre_attn_scalar
        self._scale = 1.0 / math.sqrt(self._head_dim) if scalar is None else scalar ** -0.5  # as megatron's
        self._kv_cache: Optional[tuple] = None  # (keys [L, B, G, d, T], values [L, B, G, T, d]), see _reserve_cache
        self._static_decode = static_decode or cuda_graphs
        self.continuous_batching = continuous_batching
        self.shared_prefill = shared_prefill
        self._cuda_graphs = cuda_graphs
        self._static_steps: dict = {}  # batch size -> _StaticDecodeStep over the current cache
        self._pack_weights = pack_weights
        self._single_sequence_on_blas = False  # set per call (_decode_product)
        self._packed: dict = {}  # id(weight) -> _PackedWeight, see _pack_products
        self.refit(model_chunks)
        if cuda_graphs:
            if self._pp_size > 1:
                raise ConfigError("cuda_graphs=True supports one pipeline stage only (the graph would have "
                                  "to span point-to-point sends); use PP=1 or cuda_graphs=False")
            graphs.check_supported(self._device)

    # ------------------------------------------------------------------ GenerationEngine
    def refit(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        """Serve these chunks' parameters: references, no rebuild (on the oneDNN path with pack_weights,
        their packed copies are made again here).

        In-place weight updates (optimizer steps) are seen without calling refit, and so are
        parameters whose storage was swapped (`param.data = ...`, e.g. offloading): every generate
        call reads the parameters afresh. Call it to switch to other module objects, or after writes
        that bypass the parameters' version counters (`param.data.copy_(...)`): packed weight copies
        (pack_weights) are rebuilt here.
        """
        from megatron.core.utils import unwrap_model

        self._chunks = unwrap_model(list(model_chunks))
        self._packed = {}
        self._bind()
        if self._moe_modules:
            self._check_moe_supported()

    def _check_moe_supported(self) -> None:
        from megatron.core import parallel_state as ps

        expert_parallel = ps.get_expert_model_parallel_world_size()
        if expert_parallel > 1:
            # The MoE layer exchanges tokens with the other expert-parallel (data-parallel) ranks at
            # every step, but each data-parallel rank generates its own prompts for its own number of steps.
            raise ConfigError(
                f"NativeEngine does not generate with expert_model_parallel_size={expert_parallel}: every MoE "
                "step would need the other data-parallel ranks in lockstep; use expert_model_parallel_size=1"
            )
        if self._cuda_graphs:
            raise ConfigError("cuda_graphs=True cannot capture an MoE model's decode step (tokens per expert change "
                              "from step to step); use cuda_graphs=False")

    def _bind(self) -> None:
        """Collect the current parameter tensors of the chunks (cheap: no data is touched)."""
        chunks = self._chunks
        segments, cache_offset = [], 0
        for virtual_stage, chunk in enumerate(chunks):
            layers = [self._layer_weights(layer) for layer in chunk.get_submodule(param_names.LAYERS)]
            segment = _Segment(order=virtual_stage * self._pp_size + self._pp_rank, layers=layers,
                               cache_offset=cache_offset)
            cache_offset += len(layers)
            if chunk.pre_process:
                segment.word_embeddings = chunk.get_submodule(param_names.WORD_EMBEDDINGS).weight
                if self.cfg.position_embedding_type == "learned_absolute":
                    segment.position_embeddings = chunk.get_submodule(param_names.POSITION_EMBEDDINGS).weight
            if chunk.post_process:
                segment.final_norm = _norm(chunk.get_submodule(param_names.FINAL_NORM))
                segment.output_weight = (chunk.shared_embedding_or_output_weight() if self.cfg.tie_embeddings
                                         else chunk.get_submodule(param_names.OUTPUT_LAYER).weight)
                segment.output_product = segment.output_weight
            segments.append(segment)
        self._segments = segments
        self._num_local_layers = cache_offset
        self._moe_modules = [layer.moe for segment in segments for layer in segment.layers if layer.moe is not None]
        reference = segments[-1].output_weight if segments[-1].output_weight is not None else \
            chunks[0].get_submodule(param_names.layer(0) + param_names.QKV).weight
        dtype, device = reference.dtype, reference.device
        if (dtype, device) != (getattr(self, "_dtype", None), getattr(self, "_device", None)):
            self._dtype, self._device = dtype, device
            self.free()
            # baddbmm's input, ignored with beta=0 (megatron computes scores the same way).
            self._no_input = torch.zeros(1, 1, 1, dtype=dtype, device=device)
            self._rope = self._rope_tables(chunks[0]) if self.cfg.position_embedding_type == "rope" else None
            # [d, max_len]: a step's [d, batch] rotary columns are one contiguous index_select
            self._rope_columns = None if self._rope is None else tuple(t.t().contiguous() for t in self._rope)
            self._columns = torch.arange(self.max_sequence_length, device=device)
            # Feature means of [hidden, batch] activations as one addmm (eps + mean_row @ x): one BLAS
            # call instead of mean's reduction and division, the costliest part of a small norm.
            hidden = self.cfg.hidden_size
            self._mean_row = torch.full((1, hidden), 1.0 / hidden, dtype=torch.float32, device=device)
            self._norm_eps = torch.full((1, 1), self.cfg.norm_epsilon, dtype=torch.float32, device=device)
            self._zero = torch.zeros(1, 1, dtype=torch.float32, device=device)
            self._onednn_products = cpu_products.available(device, dtype)  # the decode products, see _wx
        self._pack_products()
        weights = self._weight_pointers()
        if weights != getattr(self, "_bound_weights", None):
            self._bound_weights = weights
            self._static_steps = {}  # a captured graph reads the old storage: capture again
        # megatron's own activation (the exact function the training forward applies).
        self._gated = chunks[0].config.gated_linear_unit
        self._activation = chunks[0].config.activation_func
        last = segments[-1]
        self._is_last_stage = last.output_weight is not None
        if self._is_last_stage:
            shard = last.output_weight.shape[0]
            self._vocab_start = (dist.get_rank(self._tp_group) if self._tp_size > 1 else 0) * shard
            ids = torch.arange(self._vocab_start, self._vocab_start + shard, device=self._device)
            # Padded vocabulary rows exist only to even out shards: never sampled, not in the softmax.
            self._vocab_padding = ids >= self.cfg.vocab_size
            self._has_vocab_padding = bool(self._vocab_padding.any())

    def _pack_products(self) -> None:
        """Point the bound layers' products at oneDNN-packed copies of their weights (pack_weights on the
        oneDNN path), packing only the weights that are new or changed since they were last packed."""
        previous, self._packed = self._packed, {}
        if not (self._pack_weights and self._onednn_products):
            return

        def product(weight: torch.Tensor) -> torch.Tensor:
            key = id(weight)
            entry = self._packed.get(key)
            if entry is None:
                entry = previous.pop(key, None)
            if entry is None or not entry.is_current(weight):
                entry = None  # a stale copy is freed before the new one is made
                entry = _PackedWeight(weight, weight.data_ptr(), _version_counter(weight), cpu_products.pack(weight))
            self._packed[key] = entry
            return entry.packed

        def packed(linear: Optional[_Linear]) -> Optional[_Linear]:
            return None if linear is None else linear._replace(product=product(linear.weight))

        for segment in self._segments:
            segment.layers = [layer._replace(qkv=packed(layer.qkv), proj=packed(layer.proj), fc1=packed(layer.fc1),
                                             fc2=packed(layer.fc2)) for layer in segment.layers]
            if segment.output_weight is not None:
                segment.output_product = product(segment.output_weight)

    def free(self) -> None:
        """Drop the KV cache, captured decode steps and packed weight copies (the weights are the training
        tensors; the copies are made again at the next generate call)."""
        self._drop_cache()
        self.release_for_update()

    def release_for_update(self) -> None:
        """Free the packed weight copies (the update makes them stale; the next generate call repacks),
        keeping the KV cache, which is small and reused by the next step."""
        self._packed = {}

    @property
    def packed_weight_bytes(self) -> int:
        """Bytes of this rank's packed weight copies now (pack_weights; 0 when the products read the weights)."""
        return sum(cpu_products.packed_bytes(entry.packed) for entry in self._packed.values())

    def _drop_cache(self) -> None:
        self._kv_cache = None
        self._static_steps = {}

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache now (0 before the first generate call or after free())."""
        if self._kv_cache is None:
            return 0
        return sum(part.numel() * part.element_size() for part in self._kv_cache)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollout:
        """Continue every prompt; collective over the model-parallel group (every TP/PP rank calls it).

        Row i draws from the random stream of (sampling.seed, i), step by step of its own response,
        so a row's result does not depend on the other prompts in the call nor on which cache row
        or batch it was decoded in (data-parallel ranks should pass different seeds).
        With fixed_length every row gets max_new_tokens tokens (stop tokens do not end it);
        ended_with_stop then says whether a stop token was generated anywhere in the row.
        """
        self._check_request(prompts, sampling)
        self._bind()
        self._single_sequence_on_blas = (len(prompts) == 1 and self._onednn_products
                                         and cpu_products.preferred_library() == "blas")
        self._reserve_cache(min(len(prompts), self.max_batch_size),
                            max(len(p) for p in prompts) + sampling.max_new_tokens)
        state = _SamplingState(self, sampling)
        with self._moe_in_eval_mode():
            if self.continuous_batching:
                (_, rollout), = self._generate_continuous(state, (None, prompts, sampling), lambda: None)
                return rollout
            state.add(prompts, sampling.seed)
            for start in range(0, len(prompts), self.max_batch_size):
                self._generate_batch(prompts[start:start + self.max_batch_size], state, start)
        return state.rollout(0, len(prompts), prompts)

    @torch.inference_mode()
    def generate_stream(self, next_request: Callable[[], Optional[tuple]], longest_prompt: int) -> Iterator[tuple]:
        """Continuous batching across requests: yields (key, Rollout) of each request as its last row ends.

        next_request() -> (key, prompts, sampling), or None when there are no more; it is called
        whenever the cache has more free rows than prompts wait for one (so a router hands a replica
        work only when it can start it), at the same point on every rank of the model-parallel
        group. Requests must differ in their seed only, and no prompt may be longer than
        longest_prompt (the cache is sized for it). Each request's rollout equals `generate`'s on its
        prompts and sampling alone (its rows draw from (its seed, row)). With continuous_batching=False
        each request is one `generate` call. Collective over the model-parallel group.
        """
        if not self.continuous_batching:
            yield from super().generate_stream(next_request, longest_prompt)
            return
        request = next_request()
        if request is None:
            return
        sampling = request[2]

        def checked(request):
            if request is not None:
                key, prompts, request_sampling = request
                self._check_request(prompts, request_sampling)
                if dataclasses.replace(request_sampling, seed=sampling.seed) != sampling:
                    raise ValueError("generate_stream: every request's SamplingParams must equal the first's "
                                     f"but for the seed; got {request_sampling} after {sampling}")
                if max(len(p) for p in prompts) > longest_prompt:
                    raise ValueError(f"generate_stream: a prompt of request {key!r} is longer than "
                                     f"longest_prompt={longest_prompt}")
            return request

        checked(request)
        self._bind()
        self._single_sequence_on_blas = False  # requests keep coming: rows of many sequences
        self._reserve_cache(self.max_batch_size, longest_prompt + sampling.max_new_tokens)
        with self._moe_in_eval_mode():
            yield from self._generate_continuous(_SamplingState(self, sampling), request,
                                                 lambda: checked(next_request()))

    # ------------------------------------------------------------------ setup
    def _layer_weights(self, layer) -> _Layer:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        submodule = layer.get_submodule
        mlp = submodule(param_names.MLP)
        is_moe = isinstance(mlp, MoELayer)
        q_norm, k_norm = (_optional_submodule(layer, name) for name in (param_names.Q_NORM, param_names.K_NORM))
        post_norms = [_optional_submodule(layer, name)
                      for name in (param_names.POST_ATTENTION_NORM, param_names.POST_MLP_NORM)]
        is_local = getattr(submodule("self_attention"), "is_local", None)  # LocalGlobalSelfAttention's
        return _Layer(
            input_norm=_norm(submodule(param_names.INPUT_NORM)),
            qkv=_linear(submodule(param_names.QKV)),
            proj=_linear(submodule(param_names.ATTENTION_OUT)),
            mlp_norm=_norm(submodule(param_names.PRE_MLP_NORM)),
            fc1=None if is_moe else _linear(submodule(param_names.FC1)),
            fc2=None if is_moe else _linear(submodule(param_names.FC2)),
            q_norm=_norm(q_norm) if isinstance(getattr(q_norm, "weight", None), torch.Tensor) else None,
            k_norm=_norm(k_norm) if isinstance(getattr(k_norm, "weight", None), torch.Tensor) else None,
            moe=mlp if is_moe else None,
            post_attention_norm=None if post_norms[0] is None else _norm(post_norms[0]),
            post_mlp_norm=None if post_norms[1] is None else _norm(post_norms[1]),
            rope_half=None if is_local is None or self.cfg.rotary_bases[1] is None else int(is_local),
        )

    @contextlib.contextmanager
    def _moe_in_eval_mode(self):
        """MoE layers in eval mode while generating: megatron refuses an MoE forward in training mode
        at TP>1 without sequence parallelism (a training-speed rule; the numbers are the same)."""
        modes = [(module, module.training) for module in self._moe_modules]
        for module, _ in modes:
            module.train(False)
        try:
            yield
        finally:
            for module, training in modes:
                module.train(training)

    def _weight_pointers(self) -> tuple:
        """Storage addresses of every bound tensor: a captured graph is valid while they are unchanged."""
        pointers = []
        for segment in self._segments:
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

    def _rope_tables(self, chunk) -> tuple:
        """cos and sign-folded sin [max_len, head_dim] from megatron's own rotary frequencies.

        megatron applies x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; that is
        roll(x, d/2) * [-sin, sin], which needs one roll instead of a split, a negation and a cat.
        A second RotaryEmbedding (`local`: sliding-window layers at their own base) puts its tables beside
        the first's, [max_len, 2 * head_dim]; each layer reads its half (`_layer_rope`).
        """
        rotary = chunk.rotary_pos_emb
        tables = [self._cos_sin(rotary)] + ([self._cos_sin(rotary.local)] if hasattr(rotary, "local") else [])
        return tuple(torch.cat(parts, dim=-1) for parts in zip(*tables))

    def _cos_sin(self, rotary) -> tuple:
        freqs = rotary.get_freqs_non_repeated(self.max_sequence_length).to(self._device)  # [T, d/2]
        angles = torch.cat([freqs, freqs], dim=-1)
        sin = torch.sin(freqs)
        return torch.cos(angles).to(self._dtype), torch.cat([-sin, sin], dim=-1).to(self._dtype)

    def _layer_rope(self, rope: Optional[tuple], layer: _Layer, dim: int) -> Optional[tuple]:
        """The layer's (cos, sin) of rope, whose axis `dim` holds both bases' tables when there are two."""
        if rope is None or layer.rope_half is None:
            return rope
        return tuple(table.narrow(dim, layer.rope_half * self._head_dim, self._head_dim) for table in rope)

    def _reserve_cache(self, rows: int, length: int) -> None:
        """Make the KV cache hold at least `rows` rows of `length` columns (prompt + new tokens).

        A cache that is large enough in both is kept; otherwise it is replaced by one of exactly
        this size, the old one (and the static steps that point into it) dropped first, so memory
        never holds both. Zeros, not empty memory: the static step reads every column (masked),
        and a NaN in an unwritten column would survive the mask.
        Keys are stored transposed: a decode step's q @ K^T then reads contiguous [d, len] blocks,
        which BLAS's small batched products run about 1.5x faster than a transposed operand.
        """
        if self._kv_cache is not None:
            cached_rows, cached_length = self._kv_cache[0].shape[1], self._kv_cache[0].shape[-1]
            if cached_rows >= rows and cached_length >= length:
                return
        self._drop_cache()
        shape = (self._num_local_layers, rows, self._groups)
        options = dict(dtype=self._dtype, device=self._device)
        self._kv_cache = (torch.zeros(*shape, self._head_dim, length, **options),
                          torch.zeros(*shape, length, self._head_dim, **options))

    def _cache(self, batch: int) -> tuple:
        """(keys [layers, batch, groups, d, len], values [layers, batch, groups, len, d]): views of the first rows."""
        keys, values = self._kv_cache
        return keys[:, :batch], values[:, :batch]

    def _check_request(self, prompts: list, sampling: SamplingParams) -> None:
        if sampling.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if not sampling.is_greedy and sampling.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {sampling.temperature}")
        if sampling.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0: off), got {sampling.top_k}")
        if not 0.0 < sampling.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.stop_strings and self.decode is None:
            raise ValueError("stop_strings need a tokenizer: build NativeEngine(..., decode=tokenizer.decode)")
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
            if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
                raise ValueError(f"prompt {index} has token ids outside [0, vocab_size={self.cfg.vocab_size})")
        longest = max(len(p) for p in prompts)
        self.cfg.check_sliding_window(longest + sampling.max_new_tokens,
                                      f"longest prompt ({longest} tokens) + max_new_tokens ({sampling.max_new_tokens})")
        if longest + sampling.max_new_tokens > self.max_sequence_length:
            raise ConfigError(
                f"longest prompt ({longest} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"engine's max_sequence_length={self.max_sequence_length}; shorten prompts or build the engine "
                f"with a larger max_sequence_length"
            )

    # ------------------------------------------------------------------ generation loop
    def _generate_continuous(self, state: "_SamplingState", first_request: tuple,
                             next_request: Callable[[], Optional[tuple]]) -> Iterator[tuple]:
        """Continuous batching: each cache row holds one prompt's sequence at its own length.

        Live rows sit at the front of the cache, rows 0 .. live - 1, and decode together, each writing
        its new keys and values at its own column (its length). A row that stops leaves at once (the
        last live row's cache moves into its place, so finished rows cost no more FLOPs) and the
        next waiting prompt takes the freed row: its prefill runs into that row (one right-padded
        prefill for all prompts admitted at the same step) and its first token is sampled with the
        decode batch's. Requests (key, prompts, sampling) are pulled while free rows outnumber the
        waiting prompts; yields (key, Rollout) per request as its last row ends.
        """
        capacity = self._kv_cache[0].shape[1]
        keys, values = self._cache(capacity)
        waiting: collections.deque = collections.deque()  # (sample, prompt) in arrival order
        requests: list = []  # [key, first sample, prompts, rows still running]
        request_of: dict = {}  # sample -> index in requests

        def take(request) -> None:
            key, prompts, sampling = request
            first = state.add(prompts, sampling.seed)
            request_of.update((first + row, len(requests)) for row in range(len(prompts)))
            requests.append([key, first, prompts, len(prompts)])
            waiting.extend((first + row, prompt) for row, prompt in enumerate(prompts))

        take(first_request)
        exhausted = False
        held: list[int] = []  # the sample of each live row
        lengths: list[int] = []  # filled cache columns of each live row: where its next token goes
        steps: list[int] = []  # tokens each live row has generated
        tokens, logits = None, None
        while True:
            while not exhausted and len(waiting) < capacity - len(held):
                request = next_request()
                exhausted = request is None
                if not exhausted:
                    take(request)
            admitted = [waiting.popleft() for _ in range(min(capacity - len(held), len(waiting)))]
            old_rows = len(held)
            if old_rows:
                logits = self._decode_rows(tokens, lengths, keys, values)
                lengths = [length + 1 for length in lengths]
            if admitted:
                first = self._prefill_rows([prompt for _, prompt in admitted], old_rows, keys, values)
                logits = first if not old_rows or first is None else torch.cat([logits, first])
                held += [sample for sample, _ in admitted]
                lengths += [len(prompt) for _, prompt in admitted]
                steps += [0] * len(admitted)
            if not held:
                return
            samples = torch.tensor(held, device=self._device)
            step_tensor = torch.tensor(steps, device=self._device)
            tokens, logprob = self._next_tokens(logits, state, samples, step_tensor, min(steps))
            done = state.record(samples, step_tensor, tokens, logprob).tolist()
            steps = [step + 1 for step in steps]
            if any(done):
                completed = []
                for sample in (sample for sample, finished in zip(held, done) if finished):
                    request = requests[request_of.pop(sample)]
                    request[3] -= 1
                    if request[3] == 0:
                        completed.append(request)
                order = self._compact(done, lengths, keys, values)
                tokens = tokens[torch.tensor(order, dtype=torch.long, device=self._device)]
                held, lengths, steps = ([row_values[row] for row in order] for row_values in (held, lengths, steps))
                for key, first, prompts, _ in completed:
                    yield key, state.rollout(first, len(prompts), prompts)

    def _compact(self, done: list, lengths: list, keys, values) -> list:
        """Move live rows into the cache rows of finished ones so that they stay rows 0 .. live - 1.

        Returns, for each new row, the old row it holds now. Each row beyond the new live count
        moves into a hole before it (only its filled columns are copied).
        """
        live = [row for row, finished in enumerate(done) if not finished]
        count = len(live)
        movers = [row for row in live if row >= count]
        order = list(range(count))
        for hole, mover in zip((row for row in range(count) if done[row]), movers):
            filled = lengths[mover]
            keys[:, hole, :, :, :filled].copy_(keys[:, mover, :, :, :filled])
            values[:, hole, :, :filled].copy_(values[:, mover, :, :filled])
            order[hole] = mover
        return order

    def _prefill_rows(self, prompts: list, first_row: int, keys, values) -> Optional[torch.Tensor]:
        """Prefill prompts into cache rows first_row ..: right-padded (the causal mask hides the padding
        from the real tokens; later decode steps mask and overwrite its columns). Returns each prompt's
        last-token logits [rows, vocab_shard] on the last pipeline stage.

        A prompt admitted more than once (the samples of one prompt: GRPO/RLOO groups) is run once, in
        the first of these rows, and its keys, values and logits copied to the others: a group of k
        samples costs one prefill instead of k (copying its cache rows costs far less than the forward).
        """
        distinct, source = _distinct(prompts) if self.shared_prefill else (prompts, list(range(len(prompts))))
        lengths = [len(p) for p in distinct]
        width = max(lengths)
        tokens = torch.tensor([list(p) + [self.pad_id] * (width - len(p)) for p in distinct], device=self._device)
        positions = self._columns[:width].expand(len(distinct), width)
        rows = slice(first_row, first_row + len(distinct))
        last = torch.tensor(lengths, device=self._device) - 1
        logits = self._prefill_forward(tokens, positions, keys[:, rows], values[:, rows], None, last_columns=last)
        if len(distinct) == len(prompts):
            return logits
        index = torch.tensor(source, device=self._device)
        rows = slice(first_row, first_row + len(prompts))
        # the filled columns of each row's first copy (advanced indexing reads a copy: sources stay intact)
        keys[:, rows, :, :, :width] = keys[:, index + first_row, :, :, :width]
        values[:, rows, :, :width] = values[:, index + first_row, :, :width]
        return None if logits is None else logits[index]

    def _decode_rows(self, tokens, lengths: list, keys, values) -> Optional[torch.Tensor]:
        """One decode step of live rows 0 .. len(lengths) - 1, row b's token into its column lengths[b]."""
        batch = len(lengths)
        keys, values = keys[:, :batch], values[:, :batch]
        columns = torch.tensor(lengths, device=self._device)  # also the new tokens' positions
        if self._static_decode:
            static = self._static_step(batch, keys, values)
            static.key_bias.zero_()
            static.tokens.copy_(tokens)
            static.positions.copy_(columns)
            static.column.copy_(columns)
            return static.run()
        kv_len = max(lengths) + 1
        same_column = min(lengths) == kv_len - 1
        bias = None
        if not same_column:  # each row sees its own columns 0 .. length: [batch * groups, 1, kv_len]
            unseen = self._columns[:kv_len].unsqueeze(0) > columns.unsqueeze(1)
            bias = torch.zeros(unseen.shape, dtype=self._dtype, device=self._device).masked_fill_(
                unseen, torch.finfo(self._dtype).min)
            bias = bias.unsqueeze(1).expand(batch, self._groups, kv_len).reshape(batch * self._groups, 1, kv_len)
        rope = None
        if self._rope is not None:
            rope = tuple(table.index_select(1, columns) for table in self._rope_columns)
        inputs = self._decode_inputs(columns, kv_len - 1 if same_column else None, kv_len, bias, rope)
        return self._decode_forward(tokens, columns, keys, values, inputs)

    def _decode_inputs(self, columns, column_index, kv_len, bias, rope) -> "_DecodeInputs":
        """_DecodeInputs with the scatter indices of per-row cache columns [batch] (None: one shared column)."""
        key_index = value_index = None
        if column_index is None:
            batch, groups, head_dim = columns.shape[0], self._groups, self._head_dim
            column_per_row = columns.view(batch, 1, 1, 1)
            key_index = column_per_row.expand(batch, groups, head_dim, 1)
            value_index = column_per_row.expand(batch, groups, 1, head_dim)
        return _DecodeInputs(columns, column_index, kv_len, bias, rope, key_index, value_index)

    def _generate_batch(self, prompts: list, state: "_SamplingState", first_sample: int) -> None:
        """The static-batch loop: prompts left-padded to the longest, every row at one shared cache
        column until the longest row ends (finished rows are still computed, their tokens dropped)."""
        device, batch, new_tokens = self._device, len(prompts), state.sampling.max_new_tokens
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        tokens = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        prompt_lengths = torch.tensor(lengths, device=device)
        padding = width - prompt_lengths  # [batch] left padding of each row
        keys, values = self._cache(batch)
        columns = self._columns[:keys.shape[-1]]  # [len]: the cache's columns
        # Padding columns of the cache, never attended to: [batch, len] (None: no padding at all).
        key_masked = (columns.unsqueeze(0) < padding.unsqueeze(1)) if min(lengths) < width else None

        positions = (self._columns[:width].unsqueeze(0) - padding.unsqueeze(1)).clamp(min=0)
        logits = self._prefill_forward(tokens, positions, keys, values, key_masked)
        decode_step = self._decode_steps(batch, width, prompt_lengths, key_masked, new_tokens, keys, values)
        samples = torch.arange(first_sample, first_sample + batch, device=device)
        active = torch.ones(batch, dtype=torch.bool, device=device)
        for step in range(new_tokens):
            steps = torch.full((batch,), step, device=device)
            token, logprob = self._next_tokens(logits, state, samples, steps, step)
            rows = active.nonzero().squeeze(1)
            active[rows] = ~state.record(samples[rows], steps[rows], token[rows], logprob[rows])
            if not active.any():
                break
            logits = decode_step(token, step)

    def _decode_steps(self, batch, width, prompt_lengths, key_masked, new_tokens, keys, values):
        """step(tokens [batch], step) -> logits: the new tokens of `step` into cache column width + step.

        Everything that is the same for all steps of this call is prepared here, once: the
        attention bias of the padding columns, and (dynamic path) the rotary tables of every step.
        """
        # 0 where a key may be seen, the dtype's minimum on padding columns: [batch * groups, 1, len]
        cache_length = keys.shape[-1]
        key_bias = torch.zeros(batch, self._groups, 1, cache_length, dtype=self._dtype, device=self._device)
        if key_masked is not None:
            key_bias.masked_fill_(key_masked.view(batch, 1, 1, -1), torch.finfo(self._dtype).min)
        key_bias = key_bias.view(batch * self._groups, 1, cache_length)

        if self._static_decode:
            static = self._static_step(batch, keys, values)
            static.key_bias.copy_(key_bias)

            def static_step(tokens, step):
                static.tokens.copy_(tokens)
                torch.add(prompt_lengths, step, out=static.positions)
                static.column.fill_(width + step)
                return static.run()
            return static_step

        rope_steps = None
        if self._rope is not None:  # [steps, d, batch]: row b's token of step s sits at position length_b + s
            steps_positions = prompt_lengths.unsqueeze(0) + self._columns[:new_tokens].unsqueeze(1)
            rope_steps = tuple(table[steps_positions].transpose(1, 2).contiguous() for table in self._rope)

        def dynamic_step(tokens, step):
            column = width + step
            rope = None if rope_steps is None else (rope_steps[0][step], rope_steps[1][step])
            bias = None if key_masked is None else key_bias[:, :, :column + 1]
            inputs = _DecodeInputs(self._columns[column:column + 1], column, column + 1, bias, rope)
            return self._decode_forward(tokens, prompt_lengths + step, keys, values, inputs)
        return dynamic_step

    def _static_step(self, batch, keys, values) -> "_StaticDecodeStep":
        """The static decode step for this batch size over the current cache (built, and captured with
        cuda_graphs, once; _reserve_cache drops the steps when it replaces the cache)."""
        if batch not in self._static_steps:
            self._static_steps[batch] = _StaticDecodeStep(self, batch, keys, values, capture=self._cuda_graphs)
        return self._static_steps[batch]

    def _next_tokens(self, logits, state: "_SamplingState", samples, steps, first_step: int):
        """Sample on the last stage and hand (tokens, logprobs) [batch] to every pipeline stage.

        samples, steps [batch]: the sample each row holds and the step of its response; first_step: their minimum.
        """
        if self._is_last_stage:
            token, logprob = state.sample(logits, samples, steps, first_step)
            if self._pp_size == 1:
                return token, logprob
            packed = torch.stack([token.double(), logprob.double()])
        else:
            packed = torch.empty(2, samples.shape[0], dtype=torch.float64, device=self._device)
        dist.broadcast(packed, src=self._pp_ranks[-1], group=self._pp_group)
        return packed[0].long(), packed[1].float()

    # ------------------------------------------------------------------ the forward
    def _prefill_forward(self, tokens, positions, keys, values, key_masked,
                         last_columns: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The prompts [batch, seq] (cache columns 0..seq) through this rank's segments.

        Returns the logits [batch, vocab_shard] of each row's last column (last_columns [batch], None:
        column seq - 1) on the last pipeline stage, else None.
        """
        batch, seq = tokens.shape
        rope = None
        if self._rope is not None:
            cos, sin = self._rope  # gathered per position: [batch, seq, 1, 1, d]
            rope = (cos[positions].unsqueeze(2).unsqueeze(2), sin[positions].unsqueeze(2).unsqueeze(2))
        # Added to the scores: the dtype's minimum where a key must not be seen (the future, padding
        # columns), else 0. Built once for all layers, [batch * groups, per_group * seq, seq].
        unseen = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)
        if key_masked is not None:
            unseen = key_masked[:, None, :seq] | unseen
        per_group = self._heads // self._groups
        unseen = unseen.view(-1, 1, 1, seq, seq).expand(batch, self._groups, per_group, seq, seq)
        mask = torch.zeros(unseen.shape, dtype=self._dtype, device=tokens.device).masked_fill_(
            unseen, torch.finfo(self._dtype).min).view(batch * self._groups, per_group * seq, seq)

        def run(segment, hidden):
            for index, layer in enumerate(segment.layers):
                cache_index = segment.cache_offset + index
                hidden = self._prefill_layer(layer, hidden, keys[cache_index], values[cache_index], rope, mask)
            return hidden

        def logits(segment, hidden):
            rows = torch.arange(batch, device=hidden.device)
            last = hidden[:, -1] if last_columns is None else hidden[rows, last_columns]
            return self._linear(self._norm(last, segment.final_norm), segment.output_product)

        return self._through_stages(run, logits, lambda segment: self._embed(segment, tokens, positions),
                                    (batch, seq, self.cfg.hidden_size))

    def _decode_forward(self, tokens, positions, keys, values, inputs: "_DecodeInputs") -> Optional[torch.Tensor]:
        """One new token per row (tokens, positions [batch]) into cache column `inputs.column`.

        Returns logits [batch, vocab_shard] on the last pipeline stage, else None.
        Activations are feature-major, [features, batch]: the linear layers are then W @ x, a plain
        matrix product that BLAS runs much faster at small batch than the x @ W^T of F.linear
        (3.2x for the 512 -> 128 projection at batch 32 on the CPU, 1.6x over a whole decode
        step's matmuls), on the training weights as they are: no transposed copy. On a CPU the
        products run on oneDNN instead (`cpu_products`, faster still), whose outputs are token-major
        storage read feature-major.
        """
        batch = tokens.shape[0]

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
            return hidden if self._onednn_products else hidden.contiguous()

        return self._through_stages(run, logits, embed, (self.cfg.hidden_size, batch))

    def _through_stages(self, run, logits, embed, hidden_shape):
        """Pipeline order: embed on the first segment, hidden states passed on between ranks."""
        hidden = None
        for segment in self._segments:
            if segment.word_embeddings is not None:
                hidden = embed(segment)
            elif (segment.order - 1) % self._pp_size != self._pp_rank:
                hidden = torch.empty(hidden_shape, dtype=self._dtype, device=self._device)
                dist.recv(hidden, src=self._pp_ranks[(segment.order - 1) % self._pp_size])
            hidden = run(segment, hidden)
            if segment.output_weight is not None:
                return logits(segment, hidden)
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
        if self.cfg.scale_embeddings:  # megatron's ScaledVocabParallelEmbedding: after the vocab-parallel sum
            hidden = hidden * torch.tensor(self.cfg.hidden_size ** 0.5).to(hidden.dtype)
        if segment.position_embeddings is not None:
            hidden = hidden + F.embedding(positions, segment.position_embeddings)
        return hidden

    def _softmax(self, scores):
        if scores.dtype == torch.float32:
            return torch.softmax(scores, dim=-1)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)  # megatron: softmax in fp32

    def _reduce(self, partial):
        """Sum the row-parallel partial products of the tensor-parallel ranks."""
        if self._tp_size > 1:
            dist.all_reduce(partial, group=self._tp_group)
        return partial

    # -- batch-major layers (prefill): [batch, seq, features], megatron's math step for step
    def _norm(self, x, norm: _Norm):
        if self.cfg.zero_centered_norm:  # megatron's ZeroCenteredRMSNorm op for op
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.norm_epsilon)
            return (normed * (1.0 + norm.weight.float())).type_as(x)
        if self.cfg.normalization == "LayerNorm":
            return F.layer_norm(x, norm.weight.shape, norm.weight, norm.bias, self.cfg.norm_epsilon)
        if x.dtype != torch.float32:
            return F.rms_norm(x, norm.weight.shape, norm.weight, self.cfg.norm_epsilon)
        # torch's rms_norm op sequence for fp32 (bit-identical), in fewer dispatches.
        return x * (x * x).mean(-1, keepdim=True).add_(self.cfg.norm_epsilon).rsqrt_() * norm.weight

    def _linear(self, x, weight, bias=None):
        return cpu_products.linear(x, weight, bias) if self._onednn_products else F.linear(x, weight, bias)

    def _adapted(self, out, x, linear: _Linear, rows: slice = slice(None)):
        """out += scale * B[rows] (A x) for a live LoRA adapter (token-major x [..., in]), in place.
        Row-parallel: added to this rank's partial sum before the all-reduce (B is whole, so the sum of
        B (A_i x_i) over the ranks is B (A x), the training forward's update)."""
        if linear.lora_a is not None:
            out.add_(self._linear(self._linear(x, linear.lora_a), linear.lora_b[rows]), alpha=linear.lora_scale)
        return out

    def _row_parallel(self, x, linear: _Linear):
        """megatron's row-parallel linear: matmul, all-reduce, then the bias."""
        out = self._reduce(self._adapted(self._linear(x, linear.product), x, linear))
        return out if linear.bias is None else out + linear.bias

    def _prefill_layer(self, layer: _Layer, hidden, key_cache, value_cache, rope, mask):
        """hidden [batch, seq, hidden] from cache column 0; key_cache [batch, groups, d, len],
        value_cache [batch, groups, len, d]; mask [batch * groups, per_group * seq, seq] (additive)."""
        batch, seq, _ = hidden.shape
        groups, per_group, head_dim = self._groups, self._heads // self._groups, self._head_dim
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
        key_cache[:, :, :, :seq] = query_key[:, :, :, per_group].permute(0, 2, 3, 1)
        value_cache[:, :, :seq] = qkv[:, :, :, per_group + 1].transpose(1, 2)
        # [batch * groups, per_group * seq, d] x [batch * groups, d, seq]
        query = query_key[:, :, :, :per_group].permute(0, 2, 3, 1, 4).reshape(batch * groups, per_group * seq, head_dim)
        keys = key_cache[:, :, :, :seq].reshape(batch * groups, head_dim, seq)
        probs = self._softmax(torch.baddbmm(mask, query, keys, alpha=self._scale))
        context = torch.bmm(probs, value_cache[:, :, :seq].reshape(batch * groups, seq, head_dim))
        context = context.view(batch, groups, per_group, seq, head_dim).permute(0, 3, 1, 2, 4)
        attention = self._row_parallel(context.reshape(batch, seq, self._heads * head_dim), layer.proj)
        if layer.post_attention_norm is not None:
            attention = self._norm(attention, layer.post_attention_norm)
        hidden = hidden + attention

        normed = self._norm(hidden, layer.mlp_norm)
        if layer.moe is not None:  # megatron's MoE layer on [tokens, 1, hidden]: each token is routed alone
            routed, _ = layer.moe(normed.reshape(-1, 1, normed.shape[-1]))
            return routed.view(hidden.shape).add_(hidden)
        fc1 = layer.fc1
        if self._gated:
            # Gate and up projections from the weight's two row blocks (views): contiguous outputs,
            # on which the activation runs ~3x faster than on the strided halves of one product.
            half = fc1.weight.shape[0] // 2
            bias = (None, None) if fc1.bias is None else (fc1.bias[:half], fc1.bias[half:])
            gate = self._adapted(self._linear(normed, fc1.weight[:half], bias[0]), normed, fc1, slice(None, half))
            up = self._adapted(self._linear(normed, fc1.weight[half:], bias[1]), normed, fc1, slice(half, None))
            intermediate = self._activation(gate).mul_(up)
        else:
            intermediate = self._activation(self._adapted(self._linear(normed, fc1.product, fc1.bias), normed, fc1))
        output = self._row_parallel(intermediate, layer.fc2)
        if layer.post_mlp_norm is not None:
            output = self._norm(output, layer.post_mlp_norm)
        return output.add_(hidden)

    def _head_norm(self, query_key, layer: _Layer, dim: int):
        """megatron's q/k norm: each query and key head normalised over its features (axis `dim`), before RoPE.

        query_key holds a group's [q_1 .. q_per_group, k] heads on axis dim - 1 (prefill: [batch, seq,
        groups, heads, d], dim 4; decode: [groups, heads, d, batch], dim 2). torch's norm op sequence
        (statistics in fp32), with the query weight on the query heads and the key weight on the key head.
        """
        x = query_key if query_key.dtype == torch.float32 else query_key.float()
        if self.cfg.normalization == "LayerNorm":
            x = x - x.mean(dim, keepdim=True)
        normed = x * (x * x).mean(dim, keepdim=True).add_(self.cfg.norm_epsilon).rsqrt_()
        per_group = normed.shape[dim - 1] - 1
        weight_shape = (-1,) + (1,) * (normed.dim() - dim - 1)  # along `dim`, broadcast over the axes after it
        for heads, norm in ((normed.narrow(dim - 1, 0, per_group), layer.q_norm),
                            (normed.narrow(dim - 1, per_group, 1), layer.k_norm)):
            heads.mul_(self._norm_scale(norm.weight).view(weight_shape))
            if norm.bias is not None:
                heads.add_(norm.bias.view(weight_shape))
        return normed.to(query_key.dtype)

    # -- feature-major layers (decode): [features, batch]
    def _norm_columns(self, x, norm: _Norm):
        """The norm over the features of each column of x [hidden, batch]."""
        if x.dtype != torch.float32:  # statistics in fp32, as torch's norms compute them for half types
            return self._norm_columns(x.float(), norm).to(x.dtype)
        if self.cfg.normalization == "RMSNorm":
            inverse_rms = torch.addmm(self._norm_eps, self._mean_row, x * x).rsqrt_()  # [1, batch]
            return (x * self._norm_scale(norm.weight_column)).mul_(inverse_rms)
        centered = x - torch.mm(self._mean_row, x)
        inverse_std = torch.addmm(self._norm_eps, self._mean_row, centered * centered).rsqrt_()
        normalized = centered.mul_(inverse_std)
        if norm.bias_column is None:
            return normalized.mul_(norm.weight_column)
        return torch.addcmul(norm.bias_column, normalized, norm.weight_column)

    def _norm_scale(self, weight):
        """What a norm multiplies by: its weight, or (1 + weight) in fp32 for zero-centred norms (Gemma)."""
        return 1.0 + weight.float() if self.cfg.zero_centered_norm else weight

    # In-place adds below act on fresh matmul outputs only: fewer allocations in the hot loop.
    def _wx(self, weight, x):
        """weight [out, in] @ x [in, batch] -> [out, batch]: oneDNN on CPU (see `cpu_products`), else BLAS."""
        return cpu_products.weight_times_columns(weight, x) if self._onednn_products else torch.mm(weight, x)

    def _decode_product(self, weight, product, x):
        """A decode step's weight [out, in] @ x [in, batch]: BLAS on the weight itself in a call of one sequence
        where BLAS is the preferred library (`cpu_products`: 1.3x at batch 1 on an Intel Xeon), else `_wx`
        on what the products read (product: the weight or its packed copy)."""
        return torch.mm(weight, x) if self._single_sequence_on_blas else self._wx(product, x)

    def _adapted_columns(self, out, x, linear: _Linear):
        """out [out, batch] += scale * B (A x) for a live LoRA adapter (feature-major x), in place."""
        if linear.lora_a is not None:
            out.add_(self._wx(linear.lora_b, self._wx(linear.lora_a, x)), alpha=linear.lora_scale)
        return out

    def _linear_columns(self, linear: _Linear, x):
        out = self._adapted_columns(self._decode_product(linear.weight, linear.product, x), x, linear)
        return out if linear.bias is None else out.add_(linear.bias_column)

    def _row_parallel_columns(self, linear: _Linear, x, residual, post_norm: Optional[_Norm] = None):
        """megatron's row-parallel linear (matmul, all-reduce, bias), its output's norm (Gemma's post norms)
        where there is one, plus the residual stream."""
        out = self._adapted_columns(self._decode_product(linear.weight, linear.product, x), x, linear)
        if self._tp_size > 1:  # all_reduce wants a contiguous tensor: the product's token-major storage
            dist.all_reduce(out.t() if out.t().is_contiguous() else out, group=self._tp_group)
        if linear.bias is not None:
            out.add_(linear.bias_column)
        if post_norm is not None:
            out = self._norm_columns(out, post_norm)
        return out.add_(residual)

    def _decode_layer(self, layer: _Layer, hidden, key_cache, value_cache, inputs: "_DecodeInputs"):
        """hidden [hidden, batch]; key_cache [batch, groups, d, len]; value_cache [batch, groups, len, d]."""
        batch = hidden.shape[1]
        groups, per_group, head_dim, kv_len = self._groups, self._heads // self._groups, self._head_dim, inputs.kv_len
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
        scores = torch.baddbmm(self._no_input, query, keys, beta=0.0, alpha=self._scale)
        if inputs.attention_bias is not None:  # a separate add: baddbmm with a real input costs more
            scores.add_(inputs.attention_bias)
        probs = self._softmax(scores)
        context = torch.bmm(probs, value_cache.view(batch * groups, -1, head_dim)[:, :kv_len])
        # [batch, heads * d] read transposed by the product: no copy into feature-major order.
        hidden = self._row_parallel_columns(layer.proj, context.view(batch, self._heads * head_dim).t(), hidden,
                                            layer.post_attention_norm)

        if layer.moe is not None:  # megatron's MoE layer takes token-major [tokens, 1, hidden]
            routed, _ = layer.moe(self._norm_columns(hidden, layer.mlp_norm).t().reshape(batch, 1, -1))
            return torch.add(hidden, routed.view(batch, -1).t())
        intermediate = self._linear_columns(layer.fc1, self._norm_columns(hidden, layer.mlp_norm))
        if self._gated:
            gate, up = intermediate.chunk(2, dim=0)
            intermediate = self._activation(gate).mul_(up)
        else:
            intermediate = self._activation(intermediate)
        return self._row_parallel_columns(layer.fc2, intermediate, hidden, layer.post_mlp_norm)


def _distinct(prompts: list) -> tuple[list, list[int]]:
    """(the distinct prompts in order of first occurrence, for each prompt the index of its distinct one)."""
    first_of: dict = {}
    distinct, source = [], []
    for prompt in prompts:
        index = first_of.setdefault(tuple(prompt), len(distinct))
        if index == len(distinct):
            distinct.append(prompt)
        source.append(index)
    return distinct, source


class _DecodeInputs(NamedTuple):
    """What one decode step needs besides the tokens: where to write, what to attend to."""

    column: torch.Tensor  # [batch] (or [1]: shared) long: the cache column each row's new keys and values go to
    column_index: Optional[int]  # the column as a Python int when every row writes the same one, else None
    kv_len: int  # keys 0 .. kv_len - 1 are read (all the cache's columns on the static path)
    attention_bias: Optional[torch.Tensor]  # [batch * groups, 1, kv_len]: 0, or the dtype's minimum for
    # unseen keys; None when every key may be seen
    rope: Optional[tuple]  # (cos, sin) [d, batch] at each row's position, None without rotary embeddings
    key_index: Optional[torch.Tensor] = None  # column_index None: column as scatter indices [batch, groups, d, 1]
    value_index: Optional[torch.Tensor] = None  # and [batch, groups, 1, d]


class _StaticDecodeStep:
    """The decode step on fixed buffers over the whole cache (all its columns): what a CUDA graph captures.

    Inputs (tokens, positions, each row's cache column, the padding bias) are copied into buffers
    that never move; the step derives everything else from them with tensor ops only (the mask of
    columns beyond each row's current one, the rotary rows), so a replay needs no Python-side values.
    """

    def __init__(self, engine: NativeEngine, batch: int, keys: torch.Tensor, values: torch.Tensor, capture: bool):
        device = engine._device
        self.engine, self.keys, self.values, self.capture = engine, keys, values, capture
        self.columns = engine._columns[:keys.shape[-1]]  # [len]
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.column = torch.zeros(batch, dtype=torch.long, device=device)
        self.key_bias = torch.zeros(batch * engine._groups, 1, len(self.columns), dtype=engine._dtype,
                                    device=device)
        self.graph: Optional[graphs.CapturedStep] = None

    def forward(self) -> Optional[torch.Tensor]:
        engine = self.engine
        unseen = torch.finfo(engine._dtype).min
        batch, length = self.column.shape[0], len(self.columns)
        future = (self.columns.unsqueeze(0) > self.column.unsqueeze(1)).view(batch, 1, 1, length)
        bias = torch.where(future, unseen, self.key_bias.view(batch, -1, 1, length))  # the future, and padding
        rope = None
        if engine._rope is not None:
            rope = tuple(table.index_select(1, self.positions) for table in engine._rope_columns)
        inputs = engine._decode_inputs(self.column, None, length, bias.view(-1, 1, length), rope)
        return engine._decode_forward(self.tokens, self.positions, self.keys, self.values, inputs)

    def run(self) -> Optional[torch.Tensor]:
        """The step on the buffers' current contents (captured at the first call when capturing).

        Capture happens here, with the first step's inputs in place: the warm-up runs before
        capture write that step's keys and values, which the replay then writes again.
        """
        if self.capture and self.graph is None:
            self.graph = graphs.CapturedStep(self.forward)
        return self.forward() if self.graph is None else self.graph.replay()


class _SamplingState:
    """Sampling for one generate call or stream: the samples' random streams, stop rules and rollout tensors.

    Everything is per sample (a prompt of a request, numbered in arrival order): a batch row says
    which sample it holds and which step of that sample's response it is at, so any assignment of
    samples to rows and steps gives the same draws.
    """

    def __init__(self, engine: NativeEngine, sampling: SamplingParams):
        device = engine._device
        self.engine, self.sampling = engine, sampling
        self.greedy = sampling.is_greedy
        self.temperature = 1.0 if self.greedy else sampling.temperature
        # A draw from the whole unfiltered distribution on one shard: its logprob comes with it.
        self.plain_draw = (not self.greedy and sampling.top_k == 0 and sampling.top_p >= 1.0
                           and engine._tp_group_or_none is None)
        self.stop_ids = torch.tensor(sampling.stop_token_ids or [engine.eos_id], dtype=torch.long, device=device)
        new_tokens = sampling.max_new_tokens
        # [samples, new_tokens]: sample i of a request draws from the stream of (its seed, i)
        self.uniforms = torch.zeros(0, new_tokens, dtype=torch.float32, device=device)
        self.responses = torch.zeros(0, new_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(0, new_tokens, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.ended = torch.zeros(0, dtype=torch.bool, device=device)
        self._stop_columns = None  # [vocab_shard] bool: this shard's stop tokens (min_new_tokens), built once

    def add(self, prompts: list, seed: int) -> int:
        """Room for a request's samples, drawing from (seed, row); returns the number of its first sample."""
        first, count, device = self.lengths.shape[0], len(prompts), self.lengths.device
        new_tokens = self.sampling.max_new_tokens
        if not self.greedy:
            keys = S.sample_keys(seed, torch.arange(count, device=device))
            self.uniforms = torch.cat([self.uniforms, S.uniforms(keys, torch.arange(new_tokens, device=device))])
        self.responses = torch.cat([self.responses, torch.full((count, new_tokens), self.engine.pad_id,
                                                               dtype=torch.long, device=device)])
        self.logprobs = torch.cat([self.logprobs, self.logprobs.new_zeros(count, new_tokens)])
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(count)])
        self.ended = torch.cat([self.ended, self.ended.new_zeros(count)])
        return first

    def sample(self, logits, samples, steps, first_step: int):
        """(tokens, logprobs) [batch] from the last stage's logits [batch, vocab_shard]; row b holds sample
        samples[b] at step steps[b] of its response; first_step = min(steps)."""
        engine, sampling = self.engine, self.sampling
        logits = logits.float()
        if engine._has_vocab_padding:
            logits = logits.masked_fill(engine._vocab_padding, float("-inf"))
        scaled = S.apply_temperature(logits, self.temperature)
        uniform = None if self.greedy else self.uniforms[samples, steps]
        if self.plain_draw and first_step >= sampling.min_new_tokens:  # one pass for the draw and its logprob
            return S.sample_with_logprobs(scaled, uniform)
        candidates = scaled
        if first_step < sampling.min_new_tokens:  # stop tokens masked on the rows still short of it
            if self._stop_columns is None:
                local = self.stop_ids - engine._vocab_start
                local = local[(local >= 0) & (local < scaled.shape[-1])]
                self._stop_columns = torch.zeros(scaled.shape[-1], dtype=torch.bool, device=scaled.device)
                self._stop_columns[local] = True
            early = (steps < sampling.min_new_tokens).unsqueeze(1)
            candidates = scaled.masked_fill(early & self._stop_columns, float("-inf"))
        token = S.select_tokens(
            candidates, greedy=self.greedy, top_k=sampling.top_k, top_p=sampling.top_p, uniform=uniform,
            vocab_start=engine._vocab_start, group=engine._tp_group_or_none,
        )
        # The logprob of the unfiltered distribution: what the training forward recomputes.
        logprob = S.vocab_parallel_token_logprobs(scaled, token, engine._vocab_start, engine._tp_group_or_none)
        return token, logprob

    def record(self, samples, steps, token, logprob) -> torch.Tensor:
        """Store the rows' tokens; returns [batch] bool: the rows whose response is complete."""
        sampling = self.sampling
        is_stop = torch.isin(token, self.stop_ids)
        self.responses[samples, steps] = token
        self.logprobs[samples, steps] = logprob
        self.lengths[samples] = steps + 1
        last = steps + 1 >= sampling.max_new_tokens
        if sampling.fixed_length:
            self.ended[samples] |= is_stop
            return last
        if sampling.stop_strings:
            is_stop = is_stop | self._stop_string_hits(samples)
        self.ended[samples] = is_stop
        return is_stop | last

    def _stop_string_hits(self, samples) -> torch.Tensor:
        """Rows whose decoded response now contains a stop string (every rank decodes alike)."""
        responses, lengths = self.responses[samples].cpu(), self.lengths[samples].tolist()
        hits = [any(stop in self.engine.decode(responses[row, :length].tolist()) for stop in self.sampling.stop_strings)
                for row, length in enumerate(lengths)]
        return torch.tensor(hits, dtype=torch.bool, device=samples.device)

    def rollout(self, first: int, count: int, prompts: list) -> Rollout:
        """The Rollout of samples first .. first + count - 1 (one request's prompts)."""
        rows = slice(first, first + count)
        return Rollout(prompt_tokens=[list(p) for p in prompts], response_tokens=self.responses[rows].cpu(),
                       logprobs=self.logprobs[rows].cpu(), response_lengths=self.lengths[rows].cpu(),
                       ended_with_stop=self.ended[rows].cpu())
