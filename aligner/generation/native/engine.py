"""`NativeEngine`: the generation loops (continuous batching, static batches), the KV cache and binding.

The forward is `forward.Forward`, the weights' records `weights`, sampling `sampling_state.SamplingState`;
what they share is the engine's `state.EngineState`. The design: the package docstring.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import math
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from aligner.generation import cuda_graphs as graphs
from aligner.generation.engine import GenerationEngine, OnTurn, Rollout, SamplingParams, answer_of, turn_sampling
from aligner.generation.native import cpu_decode
from aligner.generation.native.forward import DecodeInputs, Forward, StaticDecodeStep
from aligner.generation.native.sampling_state import SamplingState
from aligner.generation.native.state import EngineState
from aligner.generation.native.turns import EpisodeRows
from aligner.generation.native.weights import (
    bind_segments,
    pack_products,
    rope_tables,
    unpack_products,
    weight_pointers,
)
from aligner.models import parameter_names as param_names
from aligner.models.gpt import GPTConfig
from aligner.runtime import cpu_products
from aligner.runtime.errors import ConfigError


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
        cache row (see the package docstring); False runs the static-batch loop (chunks of
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
        self.pad_id, self.eos_id = pad_id, eos_id
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.decode = decode
        tp_group, tp_size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        pp_size = ps.get_pipeline_model_parallel_world_size()
        pp_group = ps.get_pipeline_model_parallel_group() if pp_size > 1 else None
        head_dim, scalar = model_cfg.head_dim, model_cfg.query_pre_attn_scalar
        self.state = EngineState(
            cfg=model_cfg, tp_group=tp_group, tp_size=tp_size, tp_group_or_none=tp_group if tp_size > 1 else None,
            pp_size=pp_size, pp_rank=ps.get_pipeline_model_parallel_rank(), pp_group=pp_group,
            pp_ranks=dist.get_process_group_ranks(pp_group) if pp_size > 1 else None,
            heads=model_cfg.num_attention_heads // tp_size, groups=model_cfg.query_groups // tp_size,
            head_dim=head_dim, scale=1.0 / math.sqrt(head_dim) if scalar is None else scalar ** -0.5,  # as megatron's
        )
        self.forward = Forward(self.state)
        self._kv_cache: Optional[tuple] = None  # (keys [L, B, G, d, T], values [L, B, G, T, d]), see _reserve_cache
        self._static_decode = static_decode or cuda_graphs
        self.continuous_batching = continuous_batching
        self.shared_prefill = shared_prefill
        self._cuda_graphs = cuda_graphs
        self._static_steps: dict = {}  # batch size -> StaticDecodeStep over the current cache
        self._pack_weights = pack_weights
        self._packed: dict = {}  # id(weight) -> PackedWeight, see weights.pack_products
        self._bound_weights: Optional[tuple] = None  # weights.weight_pointers of the bound tensors
        self.refit(model_chunks)
        if cuda_graphs:
            if self.state.pp_size > 1:
                raise ConfigError("cuda_graphs=True supports one pipeline stage only (the graph would have "
                                  "to span point-to-point sends); use PP=1 or cuda_graphs=False")
            graphs.check_supported(self.state.device)

    @property
    def cfg(self) -> GPTConfig:
        return self.state.cfg

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
        chunks, state = self._chunks, self.state
        segments = bind_segments(chunks, self.cfg, state.pp_size, state.pp_rank)
        state.segments = segments
        self._num_local_layers = sum(len(segment.layers) for segment in segments)
        self._moe_modules = [layer.moe for segment in segments for layer in segment.layers if layer.moe is not None]
        reference = segments[-1].output_weight if segments[-1].output_weight is not None else \
            chunks[0].get_submodule(param_names.layer(0) + param_names.QKV).weight
        dtype, device = reference.dtype, reference.device
        if (dtype, device) != (state.dtype, state.device):
            state.dtype, state.device = dtype, device
            self.free()
            # baddbmm's input, ignored with beta=0 (megatron computes scores the same way).
            state.no_input = torch.zeros(1, 1, 1, dtype=dtype, device=device)
            state.rope = (rope_tables(chunks[0], self.max_sequence_length, dtype, device)
                          if self.cfg.position_embedding_type == "rope" else None)
            # [d, max_len]: a step's [d, batch] rotary columns are one contiguous index_select
            state.rope_columns = None if state.rope is None else tuple(t.t().contiguous() for t in state.rope)
            state.columns = torch.arange(self.max_sequence_length, device=device)
            # Feature means of [hidden, batch] activations as one addmm (eps + mean_row @ x): one BLAS
            # call instead of mean's reduction and division, the costliest part of a small norm.
            hidden = self.cfg.hidden_size
            state.mean_row = torch.full((1, hidden), 1.0 / hidden, dtype=torch.float32, device=device)
            state.norm_eps = torch.full((1, 1), self.cfg.norm_epsilon, dtype=torch.float32, device=device)
            state.onednn_products = cpu_products.available(device, dtype)  # the decode products, see Forward._wx
        # Point the products at oneDNN-packed copies of the weights (pack_weights on the oneDNN path).
        previous, self._packed = self._packed, {}
        if self._pack_weights and state.onednn_products:
            pack_products(segments, previous, self._packed)
        del previous  # copies of weights that are gone
        pointers = weight_pointers(segments)
        if pointers != self._bound_weights:
            self._bound_weights = pointers
            self._static_steps = {}  # a captured graph reads the old storage: capture again
        # megatron's own activation (the exact function the training forward applies).
        state.gated = chunks[0].config.gated_linear_unit
        state.activation = chunks[0].config.activation_func
        last = segments[-1]
        state.is_last_stage = last.output_weight is not None
        if state.is_last_stage:
            shard = last.output_weight.shape[0]
            state.vocab_start = (dist.get_rank(state.tp_group) if state.tp_size > 1 else 0) * shard
            ids = torch.arange(state.vocab_start, state.vocab_start + shard, device=state.device)
            # Padded vocabulary rows exist only to even out shards: never sampled, not in the softmax.
            state.vocab_padding = ids >= self.cfg.vocab_size
            state.has_vocab_padding = bool(state.vocab_padding.any())
        state.cpu_decode = cpu_decode.bind(state, segments)

    def free(self) -> None:
        """Drop the KV cache, captured decode steps and packed weight copies (the weights are the training
        tensors; the copies are made again at the next generate call)."""
        self._drop_cache()
        self.release_for_update()

    def release_for_update(self) -> None:
        """Free the packed weight copies (the update makes them stale; the next generate call repacks),
        keeping the KV cache, which is small and reused by the next step."""
        self._packed = {}
        # the bound segments and the C++ decode step reference the copies too (both are made again by _bind)
        unpack_products(self.state.segments)
        self.state.cpu_decode = None

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

        Row i draws from the random stream of (sampling.seed, sampling.first_sample + i), step by step of its own
        response, so a row's result does not depend on the other prompts in the call nor on which cache row
        or batch it was decoded in (data-parallel ranks should pass different seeds).
        With fixed_length every row gets max_new_tokens tokens (stop tokens do not end it);
        ended_with_stop then says whether a stop token was generated anywhere in the row.
        """
        self._check_request(prompts, sampling)
        self._bind()
        self.state.single_sequence_on_blas = (len(prompts) == 1 and self.state.onednn_products
                                              and cpu_products.preferred_library() == "blas")
        self._reserve_cache(min(len(prompts), self.max_batch_size),
                            max(len(p) for p in prompts) + sampling.max_new_tokens)
        sampler = self._sampler(sampling)
        with self._moe_in_eval_mode():
            if self.continuous_batching:
                (_, rollout), = self._generate_continuous(sampler, (None, prompts, sampling), lambda: None)
                return rollout
            sampler.add(prompts, sampling.seed, sampling.first_sample)
            for start in range(0, len(prompts), self.max_batch_size):
                self._generate_batch(prompts[start:start + self.max_batch_size], sampler, start)
        return sampler.rollout(0, len(prompts), prompts)

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
                if dataclasses.replace(request_sampling, seed=sampling.seed, first_sample=sampling.first_sample) \
                        != sampling:
                    raise ValueError("generate_stream: every request's SamplingParams must equal the first's "
                                     f"but for the seed and first sample; got {request_sampling} after {sampling}")
                if max(len(p) for p in prompts) > longest_prompt:
                    raise ValueError(f"generate_stream: a prompt of request {key!r} is longer than "
                                     f"longest_prompt={longest_prompt}")
            return request

        checked(request)
        self._bind()
        self.state.single_sequence_on_blas = False  # requests keep coming: rows of many sequences
        self._reserve_cache(self.max_batch_size, longest_prompt + sampling.max_new_tokens)
        with self._moe_in_eval_mode():
            yield from self._generate_continuous(self._sampler(sampling), request,
                                                 lambda: checked(next_request()))

    @torch.inference_mode()
    def generate_turns(self, first_prompts: list[list[int]], sampling: SamplingParams, on_turn: OnTurn,
                       longest_prompt: int) -> None:
        """Multi-turn episodes on kept KV cache rows (the protocol's contract; see `_generate_turns`).

        Each episode holds one cache row from its first prefill until on_turn ends it: a continuation
        prefills only the reply's last token (sampled, not yet in the cache) and the appended tokens into
        that row, and joins the decode batch of the other episodes, whatever turn they are at. An answer
        given as a Future leaves the episode's row out of the decode batch until it is done; at most
        max_batch_size episodes are started (hold a row) at once. On a model-parallel group (TP or PP > 1)
        each answer is waited for when it is given, so that every rank admits the same rows at the same step
        (on_turn must answer alike on every rank). With continuous_batching=False: the protocol's default (each
        turn's whole history again, through the static-batch loop). Collective over the model-parallel group.
        """
        if not self.continuous_batching:
            super().generate_turns(first_prompts, sampling, on_turn, longest_prompt)
            return
        self._check_request(first_prompts, sampling)
        if max(len(p) for p in first_prompts) > longest_prompt:
            raise ValueError(f"generate_turns: a first prompt is longer than longest_prompt={longest_prompt}")
        self._bind()
        self.state.single_sequence_on_blas = False
        # as long as the longest turn can be (a longer continuation is refused when it comes, as `generate` would)
        self._reserve_cache(min(len(first_prompts), self.max_batch_size),
                            min(longest_prompt + sampling.max_new_tokens, self.max_sequence_length))
        with self._moe_in_eval_mode():
            self._generate_turns(self._sampler(sampling), first_prompts, sampling, on_turn, longest_prompt)

    def _generate_turns(self, sampler: SamplingState, first_prompts: list, sampling: SamplingParams,
                        on_turn: OnTurn, longest_prompt: int) -> None:
        """The continuous-batching loop of `_generate_continuous` over episodes that come back for more turns.

        Cache rows 0 .. live - 1 decode; each row after them holds the cache of an episode waiting for its
        answer or for that answer's prefill, or is free (`EpisodeRows`). Each step admits the episodes whose
        answer came (into their own row, moved to the end of the live block) and, while rows are free, new
        episodes; a row whose turn ends leaves the live block with its cache (swapped with a live row behind
        it), or is freed when its episode ends. Every turn is a sample of `sampler` with the turn's seed
        (`turn_sampling`); a finished turn's sample is started over for the next admitted turn, so there are
        never more samples than cache rows.
        """
        state = self.state
        capacity = min(self._kv_cache[0].shape[1], len(first_prompts))
        keys, values = self._cache(capacity)
        wait_each = state.tp_size * state.pp_size > 1  # every rank must admit the same rows at the same step
        unstarted = collections.deque(range(len(first_prompts)))
        ready: collections.deque = collections.deque()  # (episode, tokens to prefill) of answered episodes
        pending: dict = {}  # episode -> Future of its answer
        turns = [0] * len(first_prompts)
        rows = EpisodeRows(keys, values, capacity)
        last_token: dict = {}  # episode -> the last token of its reply (sampled, not in the cache)
        live: list[int] = []  # the episode of each live row
        held: list[int] = []  # the sample (turn) of each live row
        lengths: list[int] = []  # filled cache columns of each live row: where its next token goes
        steps: list[int] = []  # tokens each live row has generated in this turn
        spare_samples: list[int] = []  # samples of finished turns (read by on_turn), to start over
        tokens, logits = None, None

        def answered(episode: int, answer) -> None:
            appended = answer_of(answer)
            if appended is None:  # ended: its cache row is free
                rows.release(episode)
                return
            continuation = [last_token.pop(episode)] + appended
            self._check_continuation(episode, continuation, rows.filled[episode], longest_prompt, sampling)
            ready.append((episode, continuation))

        while True:
            for episode in [episode for episode, future in pending.items() if future.done()]:
                answered(episode, pending.pop(episode))
            free = rows.free
            if not live and not ready and not (unstarted and free):
                if not pending:
                    return
                concurrent.futures.wait(pending.values(), return_when=concurrent.futures.FIRST_COMPLETED)
                continue
            starting = [unstarted.popleft() for _ in range(min(free, len(unstarted)))]
            continuing = [ready.popleft() for _ in range(len(ready))]
            old_rows = len(live)
            if old_rows:
                logits = self._decode_rows(tokens, lengths, keys, values)
                lengths = [length + 1 for length in lengths]
            admitted = starting + [episode for episode, _ in continuing]
            for offset, episode in enumerate(admitted):
                rows.place(episode, old_rows + offset)
            parts = [] if not old_rows else [logits]
            if starting:
                parts.append(self._prefill_rows([first_prompts[e] for e in starting], old_rows, keys, values))
                lengths += [len(first_prompts[e]) for e in starting]
            if continuing:
                starts = [rows.rejoin(episode) for episode, _ in continuing]
                parts.append(self._prefill_rows([appended for _, appended in continuing], old_rows + len(starting),
                                                keys, values, starts=starts))
                lengths += [start + len(appended) for start, (_, appended) in zip(starts, continuing)]
            logits = None if any(part is None for part in parts) else torch.cat(parts) if len(parts) > 1 else parts[0]
            for episode in admitted:  # a finished turn's sample, started over, or a new one
                turn = turn_sampling(sampling, episode, turns[episode])
                if spare_samples:
                    held.append(spare_samples.pop())
                    sampler.restart(held[-1], turn.seed, turn.first_sample)
                else:
                    held.append(sampler.add([None], turn.seed, turn.first_sample))
            live += admitted
            steps += [0] * len(admitted)
            samples = torch.tensor(held, device=state.device)
            step_tensor = torch.tensor(steps, device=state.device)
            tokens, logprob = self._next_tokens(logits, sampler, samples, step_tensor, min(steps))
            done = sampler.record(samples, step_tensor, tokens, logprob).tolist()
            steps = [step + 1 for step in steps]
            if not any(done):
                continue
            for row in (row for row, finished in enumerate(done) if finished):
                episode, sample = live[row], held[row]
                length = int(sampler.lengths[sample])
                response = sampler.responses[sample, :length].tolist()
                rows.leave(episode, lengths[row])
                last_token[episode] = response[-1]
                spare_samples.append(sample)
                turns[episode] += 1
                answer = on_turn(episode, response, sampler.logprobs[sample, :length].tolist(),
                                 bool(sampler.ended[sample]))
                if isinstance(answer, concurrent.futures.Future) and not wait_each:
                    pending[episode] = answer
                else:
                    answered(episode, answer)
            order = rows.compact(done, lengths)
            tokens = tokens[torch.tensor(order, dtype=torch.long, device=state.device)]
            live, held, lengths, steps = ([row_values[row] for row in order]
                                          for row_values in (live, held, lengths, steps))

    def _check_continuation(self, episode: int, continuation: list, start: int, longest_prompt: int,
                            sampling: SamplingParams) -> None:
        """What `_check_request` checks of a prompt, for an episode's tokens before its next turn."""
        length = start + len(continuation)
        if length > longest_prompt:
            raise ValueError(f"generate_turns: episode {episode} would be {length} tokens before its next turn, "
                             f"more than longest_prompt={longest_prompt}")
        if min(continuation) < 0 or max(continuation) >= self.cfg.vocab_size:
            raise ValueError(f"generate_turns: episode {episode}'s appended tokens are outside "
                             f"[0, vocab_size={self.cfg.vocab_size})")
        what = f"episode {episode} ({length} tokens before its next turn) + max_new_tokens ({sampling.max_new_tokens})"
        self.cfg.check_sliding_window(length + sampling.max_new_tokens, what)
        if length + sampling.max_new_tokens > self.max_sequence_length:
            raise ConfigError(f"{what} exceeds the engine's max_sequence_length={self.max_sequence_length}; lower the "
                              "episode's token limit or build the engine with a larger max_sequence_length")

    # ------------------------------------------------------------------ setup
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

    def _reserve_cache(self, rows: int, length: int) -> None:
        """Make the KV cache hold at least `rows` rows of `length` columns (prompt + new tokens).

        A cache that is large enough in both is kept; otherwise it is replaced by one of exactly
        this size, the old one (and the static steps that point into it) dropped first, so memory
        never holds both. Zeros, not empty memory: the static step reads every column (masked),
        and a NaN in an unwritten column would survive the mask.
        Keys are stored transposed: a decode step's q @ K^T then reads contiguous [d, len] blocks,
        which BLAS's small batched products run about 1.5x faster than a transposed operand.
        """
        state = self.state
        if self._kv_cache is not None:
            cached_rows, cached_length = self._kv_cache[0].shape[1], self._kv_cache[0].shape[-1]
            if cached_rows >= rows and cached_length >= length:
                return
        self._drop_cache()
        shape = (self._num_local_layers, rows, state.groups)
        options = dict(dtype=state.dtype, device=state.device)
        self._kv_cache = (torch.zeros(*shape, state.head_dim, length, **options),
                          torch.zeros(*shape, length, state.head_dim, **options))

    def _cache(self, batch: int) -> tuple:
        """(keys [layers, batch, groups, d, len], values [layers, batch, groups, len, d]): views of the first rows."""
        keys, values = self._kv_cache
        return keys[:, :batch], values[:, :batch]

    def _sampler(self, sampling: SamplingParams) -> SamplingState:
        return SamplingState(self.state, sampling, pad_id=self.pad_id, eos_id=self.eos_id, decode=self.decode)

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
    def _generate_continuous(self, sampler: SamplingState, first_request: tuple,
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
        state = self.state
        capacity = self._kv_cache[0].shape[1]
        keys, values = self._cache(capacity)
        waiting: collections.deque = collections.deque()  # (sample, prompt) in arrival order
        requests: list = []  # [key, first sample, prompts, rows still running]
        request_of: dict = {}  # sample -> index in requests

        def take(request) -> None:
            key, prompts, sampling = request
            first = sampler.add(prompts, sampling.seed, sampling.first_sample)
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
            samples = torch.tensor(held, device=state.device)
            step_tensor = torch.tensor(steps, device=state.device)
            tokens, logprob = self._next_tokens(logits, sampler, samples, step_tensor, min(steps))
            done = sampler.record(samples, step_tensor, tokens, logprob).tolist()
            steps = [step + 1 for step in steps]
            if any(done):
                completed = []
                for sample in (sample for sample, finished in zip(held, done) if finished):
                    request = requests[request_of.pop(sample)]
                    request[3] -= 1
                    if request[3] == 0:
                        completed.append(request)
                order = self._compact(done, lengths, keys, values)
                tokens = tokens[torch.tensor(order, dtype=torch.long, device=state.device)]
                held, lengths, steps = ([row_values[row] for row in order] for row_values in (held, lengths, steps))
                for key, first, prompts, _ in completed:
                    yield key, sampler.rollout(first, len(prompts), prompts)

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

    def _prefill_rows(self, prompts: list, first_row: int, keys, values,
                      starts: Optional[list] = None) -> Optional[torch.Tensor]:
        """Prefill prompts into cache rows first_row ..: right-padded (the causal mask hides the padding
        from the real tokens; later decode steps mask and overwrite its columns). Returns each prompt's
        last-token logits [rows, vocab_shard] on the last pipeline stage.

        A prompt admitted more than once (the samples of one prompt: GRPO/RLOO groups) is run once, in
        the first of these rows, and its keys, values and logits copied to the others: a group of k
        samples costs one prefill instead of k (copying its cache rows costs far less than the forward).
        starts: the rows continue cached sequences (`generate_turns`): row b's tokens go to its columns
        starts[b] .. and see its cached columns before them (its padding writes nothing).
        """
        state = self.state
        shared = self.shared_prefill and starts is None
        distinct, source = _distinct(prompts) if shared else (prompts, list(range(len(prompts))))
        lengths = [len(p) for p in distinct]
        width = max(lengths)
        tokens = torch.tensor([list(p) + [self.pad_id] * (width - len(p)) for p in distinct], device=state.device)
        rows = slice(first_row, first_row + len(distinct))
        last = torch.tensor(lengths, device=state.device) - 1
        if starts is not None:  # a padding token sits at its row's last real position (it writes nothing)
            positions = torch.minimum(state.columns[:width].unsqueeze(0), last.unsqueeze(1))
            positions = positions + torch.tensor(starts, device=state.device).unsqueeze(1)
            return self.forward.prefill_forward(tokens, positions, keys[:, rows], values[:, rows], None,
                                                last_columns=last, continued=True)
        positions = state.columns[:width].expand(len(distinct), width)
        logits = self.forward.prefill_forward(tokens, positions, keys[:, rows], values[:, rows], None,
                                              last_columns=last)
        if len(distinct) == len(prompts):
            return logits
        index = torch.tensor(source, device=state.device)
        rows = slice(first_row, first_row + len(prompts))
        # the filled columns of each row's first copy (advanced indexing reads a copy: sources stay intact)
        keys[:, rows, :, :, :width] = keys[:, index + first_row, :, :, :width]
        values[:, rows, :, :width] = values[:, index + first_row, :, :width]
        return None if logits is None else logits[index]

    def _decode_rows(self, tokens, lengths: list, keys, values) -> Optional[torch.Tensor]:
        """One decode step of live rows 0 .. len(lengths) - 1, row b's token into its column lengths[b]."""
        state = self.state
        batch = len(lengths)
        keys, values = keys[:, :batch], values[:, :batch]
        columns = torch.tensor(lengths, device=state.device)  # also the new tokens' positions
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
            unseen = state.columns[:kv_len].unsqueeze(0) > columns.unsqueeze(1)
            bias = torch.zeros(unseen.shape, dtype=state.dtype, device=state.device).masked_fill_(
                unseen, torch.finfo(state.dtype).min)
            bias = bias.unsqueeze(1).expand(batch, state.groups, kv_len).reshape(batch * state.groups, 1, kv_len)
        rope = None
        if state.rope is not None:
            rope = tuple(table.index_select(1, columns) for table in state.rope_columns)
        inputs = self.forward.decode_inputs(columns, kv_len - 1 if same_column else None, kv_len, bias, rope)
        return self.forward.decode_forward(tokens, columns, keys, values, inputs)

    def _generate_batch(self, prompts: list, sampler: SamplingState, first_sample: int) -> None:
        """The static-batch loop: prompts left-padded to the longest, every row at one shared cache
        column until the longest row ends (finished rows are still computed, their tokens dropped)."""
        state = self.state
        device, batch, new_tokens = state.device, len(prompts), sampler.sampling.max_new_tokens
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        tokens = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        prompt_lengths = torch.tensor(lengths, device=device)
        padding = width - prompt_lengths  # [batch] left padding of each row
        keys, values = self._cache(batch)
        columns = state.columns[:keys.shape[-1]]  # [len]: the cache's columns
        # Padding columns of the cache, never attended to: [batch, len] (None: no padding at all).
        key_masked = (columns.unsqueeze(0) < padding.unsqueeze(1)) if min(lengths) < width else None

        positions = (state.columns[:width].unsqueeze(0) - padding.unsqueeze(1)).clamp(min=0)
        logits = self.forward.prefill_forward(tokens, positions, keys, values, key_masked)
        decode_step = self._decode_steps(batch, width, prompt_lengths, key_masked, new_tokens, keys, values)
        samples = torch.arange(first_sample, first_sample + batch, device=device)
        active = torch.ones(batch, dtype=torch.bool, device=device)
        for step in range(new_tokens):
            steps = torch.full((batch,), step, device=device)
            token, logprob = self._next_tokens(logits, sampler, samples, steps, step)
            rows = active.nonzero().squeeze(1)
            active[rows] = ~sampler.record(samples[rows], steps[rows], token[rows], logprob[rows])
            if not active.any():
                break
            logits = decode_step(token, step)

    def _decode_steps(self, batch, width, prompt_lengths, key_masked, new_tokens, keys, values):
        """step(tokens [batch], step) -> logits: the new tokens of `step` into cache column width + step.

        Everything that is the same for all steps of this call is prepared here, once: the
        attention bias of the padding columns, and (dynamic path) the rotary tables of every step.
        """
        state = self.state
        # 0 where a key may be seen, the dtype's minimum on padding columns: [batch * groups, 1, len]
        cache_length = keys.shape[-1]
        key_bias = torch.zeros(batch, state.groups, 1, cache_length, dtype=state.dtype, device=state.device)
        if key_masked is not None:
            key_bias.masked_fill_(key_masked.view(batch, 1, 1, -1), torch.finfo(state.dtype).min)
        key_bias = key_bias.view(batch * state.groups, 1, cache_length)

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
        if state.rope is not None:  # [steps, d, batch]: row b's token of step s sits at position length_b + s
            steps_positions = prompt_lengths.unsqueeze(0) + state.columns[:new_tokens].unsqueeze(1)
            rope_steps = tuple(table[steps_positions].transpose(1, 2).contiguous() for table in state.rope)

        def dynamic_step(tokens, step):
            column = width + step
            rope = None if rope_steps is None else (rope_steps[0][step], rope_steps[1][step])
            bias = None if key_masked is None else key_bias[:, :, :column + 1]
            inputs = DecodeInputs(state.columns[column:column + 1], column, column + 1, bias, rope)
            return self.forward.decode_forward(tokens, prompt_lengths + step, keys, values, inputs)
        return dynamic_step

    def _static_step(self, batch, keys, values) -> StaticDecodeStep:
        """The static decode step for this batch size over the current cache (built, and captured with
        cuda_graphs, once; _reserve_cache drops the steps when it replaces the cache)."""
        if batch not in self._static_steps:
            self._static_steps[batch] = StaticDecodeStep(self.state, self.forward, batch, keys, values,
                                                         capture=self._cuda_graphs)
        return self._static_steps[batch]

    def _next_tokens(self, logits, sampler: SamplingState, samples, steps, first_step: int):
        """Sample on the last stage and hand (tokens, logprobs) [batch] to every pipeline stage.

        samples, steps [batch]: the sample each row holds and the step of its response; first_step: their minimum.
        """
        state = self.state
        if state.is_last_stage:
            token, logprob = sampler.sample(logits, samples, steps, first_step)
            if state.pp_size == 1:
                return token, logprob
            packed = torch.stack([token.double(), logprob.double()])
        else:
            packed = torch.empty(2, samples.shape[0], dtype=torch.float64, device=state.device)
        dist.broadcast(packed, src=state.pp_ranks[-1], group=state.pp_group)
        return packed[0].long(), packed[1].float()


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
