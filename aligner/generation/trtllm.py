"""TensorRT-LLM generation engine for GPU clusters (optional extra: pip install 'aligner[trtllm]').

The engine is built once from the training weights, then refitted in place every step:

    engine = TensorRTLLMEngine(model_cfg, pad_id=..., eos_id=..., work_dir=...)   # no build yet
    engine.refit(model_chunks)     # first call: write a TRT-LLM checkpoint, build the engine (refittable)
    rollout = engine.generate(prompts, sampling)
    engine.free()                  # drop the engine and KV cache from GPU memory while training
    engine.refit(model_chunks)     # reload the built engine from disk, copy the new weights in: no rebuild

Layout. One TensorRT-LLM rank per training tensor-parallel rank (TRT-LLM tp_size = training TP,
pipeline parallelism 1), so each rank converts the weights it already holds: megatron's TP shard
of a column/row-parallel layer is exactly the TRT-LLM rank's shard (same heads, same rows), and
only the vocabulary tensors are gathered (TRT-LLM pads the vocabulary to a multiple of tp_size
where megatron pads to `make_vocab_size_divisible_by`).

Weight mapping (megatron GPTModel -> TRT-LLM checkpoint, per rank r of tp):
    embedding.word_embeddings              transformer.vocab_embedding.weight   [V, H], not split
    embedding.position_embeddings (gpt2)   transformer.position_embedding.weight
    input_layernorm                        transformer.layers.i.input_layernorm
    self_attention.linear_qkv (grouped)    transformer.layers.i.attention.qkv   cat(q_r, k_r, v_r): rank r's
                                           query heads, then its key heads, then its value heads
    self_attention.linear_proj             transformer.layers.i.attention.dense  row-parallel (split dim 1)
    pre_mlp_layernorm                      transformer.layers.i.post_layernorm
    mlp.linear_fc1 = [gate; up] (swiglu)   mlp.fc = gate (silu applied), mlp.gate = up   column-parallel
    mlp.linear_fc1 (gelu/relu)             mlp.fc
    mlp.linear_fc2                         mlp.proj                              row-parallel
    decoder.final_layernorm                transformer.ln_f
    output_layer (or the tied embedding)   lm_head.weight   [pad(V, tp)/tp, H]: always written, so
                                           tied embeddings need no sharing support in the engine
Row-parallel biases are not split (added once after the all-reduce); layer norms are replicated.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from aligner.config import MissingExtraError
from aligner.generation.engine import GenerationEngine, Rollout, SamplingParams
from aligner.generation.router_client import concat_rollouts
from aligner.hf.layout import check_exportable, infer_arch
from aligner.hf.weights import unpack_qkv
from aligner.models import lora
from aligner.models import parameter_names as param_names
from aligner.models.gpt import GPTConfig
from aligner.runtime import cpu_bridge
from aligner.runtime.errors import ConfigError
from aligner.runtime.seeds import TRTLLM_SEED_RANGE, derive_seed

INSTALL_HINT = (
    "the TensorRT-LLM generation engine needs the tensorrt_llm package: pip install 'aligner[trtllm]' on a CUDA "
    "machine with a TensorRT-LLM-compatible driver and CUDA toolkit (or use NVIDIA's TensorRT-LLM container); "
    "use generation.engine=native otherwise (it runs everywhere, CPU included)"
)
# aligner arch -> TRT-LLM `architecture`. Mistral checkpoints without a sliding window are Llamas.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "gpt2": "GPTForCausalLM"}
# GPTConfig.activation -> TRT-LLM hidden_act. TRT-LLM's "gelu" is the tanh approximation.
_HIDDEN_ACT = {"swiglu": "silu", "gelu_tanh": "gelu", "relu": "relu"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def require_tensorrt_llm():
    """The tensorrt_llm module, or ImportError saying how to install it and what to use instead."""
    try:
        import tensorrt_llm
    except ImportError as error:
        raise MissingExtraError(INSTALL_HINT) from error
    return tensorrt_llm


# ----------------------------------------------------------------------------- weights
def _check_supported(cfg: GPTConfig, arch: Optional[str]) -> str:
    arch = arch or infer_arch(cfg)
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"the TensorRT-LLM engine supports Llama-style (arch llama/mistral) and GPT-2-style (gpt2) models, got "
            f"arch={arch!r} (a q/k/v bias without other biases, as in qwen2, has no TensorRT-LLM Llama equivalent); "
            "use generation.engine=native for this model"
        )
    check_exportable(cfg, "gpt2" if arch == "gpt2" else "llama")
    if cfg.llama3_rope_scaling_factor is not None:
        raise ConfigError(
            f"model.llama3_rope_scaling_factor={cfg.llama3_rope_scaling_factor} (Llama 3.x RoPE scaling) is not "
            "mapped to TensorRT-LLM here; use generation.engine=native for this model"
        )
    if cfg.activation not in _HIDDEN_ACT:
        raise ConfigError(
            f"model.activation={cfg.activation!r} has no exact TensorRT-LLM equivalent (its gelu is the tanh "
            "approximation, i.e. gelu_tanh); use generation.engine=native for this model"
        )
    return "gpt2" if arch == "gpt2" else "llama"


def _normalize_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local-spec names for a transformer-engine state dict; `_extra_state` entries dropped."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("_extra_state") or tensor is None:
            continue
        for te_suffix, local_suffix in param_names.TE_FUSED_NORMS.items():
            if name.endswith(te_suffix):
                name = name[: -len(te_suffix)] + local_suffix
                break
        out[name] = tensor
    return out


_ROW_PARALLEL = (param_names.weight(param_names.ATTENTION_OUT), param_names.weight(param_names.FC2))
_FC1 = (param_names.weight(param_names.FC1), param_names.bias(param_names.FC1))
_COLUMN_PARALLEL = (param_names.weight(param_names.QKV), param_names.bias(param_names.QKV), *_FC1,
                    param_names.weight(param_names.WORD_EMBEDDINGS), param_names.weight(param_names.OUTPUT_LAYER))


def _is_row_parallel(name: str) -> bool:
    return name.endswith(_ROW_PARALLEL)


def _is_column_parallel(name: str) -> bool:
    return name.endswith(_COLUMN_PARALLEL)


def _is_glu_fc1(name: str, cfg: GPTConfig) -> bool:
    return cfg.activation == "swiglu" and name.endswith(_FC1)


def split_megatron_tp(full: Mapping[str, torch.Tensor], cfg: GPTConfig, tp_size: int) -> list[dict[str, torch.Tensor]]:
    """A full (TP=1) megatron state dict cut into the per-rank shards megatron holds at TP=tp_size.

    Column-parallel weights are split along rows (the grouped q/k/v layout keeps whole query
    groups together, so rank r holds groups [r*G/tp, (r+1)*G/tp)); a SwiGLU fc1 [gate; up] gives
    rank r [gate_r; up_r]; row-parallel weights are split along columns; the rest is replicated.
    """
    cfg.validate(tp_size)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for name, tensor in _normalize_names(full).items():
        if _is_glu_fc1(name, cfg):
            gate, up = tensor.chunk(2, dim=0)
            pieces = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp_size), up.chunk(tp_size))]
        elif _is_column_parallel(name):
            pieces = list(tensor.chunk(tp_size, dim=0))
        elif _is_row_parallel(name):
            pieces = list(tensor.chunk(tp_size, dim=1))
        else:
            pieces = [tensor] * tp_size
        for rank, piece in enumerate(pieces):
            shards[rank][name] = piece
    return shards


def _gather_vocab(shards: Sequence[Mapping[str, torch.Tensor]], name: str) -> Optional[torch.Tensor]:
    if name not in shards[0]:
        return None
    return torch.cat([shard[name] for shard in shards])


def _rank_weights(shard: Mapping[str, torch.Tensor], cfg: GPTConfig, arch: str, tp_rank: int, tp_size: int,
                  embedding: torch.Tensor, output_layer: Optional[torch.Tensor],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """TRT-LLM rank `tp_rank`'s weights from megatron's TP shard of the same rank (TP sizes equal).

    embedding / output_layer: the full (gathered) vocabulary tensors, megatron-padded.
    """
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    local = dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp_size,
        num_query_groups=cfg.query_groups // tp_size, kv_channels=cfg.head_dim,
    )
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        out[name] = tensor.detach().to(dtype=dtype, device="cpu").contiguous().clone()

    def take(name: str) -> torch.Tensor:
        if name not in shard:
            raise ValueError(f"megatron state dict has no tensor {name!r}; is it a GPT model of this architecture?")
        return shard[name]

    put("transformer.vocab_embedding.weight", embedding[:vocab])
    if arch == "gpt2":
        put("transformer.position_embedding.weight", take(param_names.weight(param_names.POSITION_EMBEDDINGS)))
    biases = arch == "gpt2"
    for i in range(cfg.num_layers):
        mg, trt = param_names.layer(i), f"transformer.layers.{i}."
        norms = ((param_names.INPUT_NORM, "input_layernorm"), (param_names.PRE_MLP_NORM, "post_layernorm"))
        for mg_norm, trt_norm in norms:
            put(f"{trt}{trt_norm}.weight", take(f"{mg}{mg_norm}.weight"))
            if biases:
                put(f"{trt}{trt_norm}.bias", take(f"{mg}{mg_norm}.bias"))
        # Rank r's shard of the grouped layout holds whole query groups: unpacking it with the
        # per-rank head counts gives exactly rank r's q, k and v heads.
        q, k, v = unpack_qkv(take(f"{mg}{param_names.QKV}.weight"), local)
        put(f"{trt}attention.qkv.weight", torch.cat([q, k, v]))
        if biases:
            q, k, v = unpack_qkv(take(f"{mg}{param_names.QKV}.bias"), local)
            put(f"{trt}attention.qkv.bias", torch.cat([q, k, v]))
        put(f"{trt}attention.dense.weight", take(f"{mg}{param_names.ATTENTION_OUT}.weight"))
        if biases:
            put(f"{trt}attention.dense.bias", take(f"{mg}{param_names.ATTENTION_OUT}.bias"))
        fc1 = take(f"{mg}{param_names.FC1}.weight")
        if cfg.activation == "swiglu":
            gate, up = fc1.chunk(2, dim=0)  # the activation is applied to TRT-LLM's `fc`, multiplied by `gate`
            put(f"{trt}mlp.fc.weight", gate)
            put(f"{trt}mlp.gate.weight", up)
        else:
            put(f"{trt}mlp.fc.weight", fc1)
            if biases:
                put(f"{trt}mlp.fc.bias", take(f"{mg}{param_names.FC1}.bias"))
        put(f"{trt}mlp.proj.weight", take(f"{mg}{param_names.FC2}.weight"))
        if biases:
            put(f"{trt}mlp.proj.bias", take(f"{mg}{param_names.FC2}.bias"))
    put("transformer.ln_f.weight", take(param_names.weight(param_names.FINAL_NORM)))
    if biases:
        put("transformer.ln_f.bias", take(param_names.bias(param_names.FINAL_NORM)))

    head = embedding if cfg.tie_embeddings or output_layer is None else output_layer
    if not cfg.tie_embeddings and output_layer is None:
        raise ValueError("megatron state dict has no output_layer.weight but model.tie_embeddings is false")
    trt_vocab = trtllm_padded_vocab(vocab, tp_size)
    head = head[:vocab]
    head = torch.cat([head, head.new_zeros(trt_vocab - vocab, hidden)])
    put("lm_head.weight", head.chunk(tp_size)[tp_rank])
    return out


def trtllm_padded_vocab(vocab_size: int, tp_size: int) -> int:
    """TRT-LLM's lm_head rows: the vocabulary rounded up to a multiple of tp_size (zero rows)."""
    return -(-vocab_size // tp_size) * tp_size


def trtllm_config(cfg: GPTConfig, tp_size: int, arch: Optional[str] = None, dtype: str = "bfloat16") -> dict:
    """The TRT-LLM checkpoint config.json for this model at TP=tp_size (pipeline parallel 1)."""
    arch = _check_supported(cfg, arch)
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    config: dict[str, Any] = {
        "architecture": ARCHITECTURES[arch],
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_size": cfg.head_dim,
        "intermediate_size": cfg.ffn_size,
        "hidden_act": _HIDDEN_ACT[cfg.activation],
        "norm_epsilon": cfg.norm_epsilon,
        "position_embedding_type": "learned_absolute" if arch == "gpt2" else "rope_gpt_neox",
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
    }
    if arch == "gpt2":
        config.update(gpt_variant="gpt2", bias=True, q_scaling=1.0, apply_query_key_layer_scaling=False)
    else:
        # rope_gpt_neox rotates halves of each head, as megatron and HF Llama do (not interleaved pairs).
        config.update(rotary_base=float(cfg.rotary_base), rotary_scaling=None, attn_bias=False, mlp_bias=False)
    return config


def megatron_to_trtllm_checkpoint(
    megatron_state: Union[Mapping[str, torch.Tensor], Sequence[Mapping[str, torch.Tensor]]],
    cfg: GPTConfig,
    tp_size: int,
    arch: Optional[str] = None,
    *,
    dtype: str = "float32",
) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """(TRT-LLM config.json dict, [rank0 weights, rank1 weights, ...]) for TRT-LLM TP=tp_size.

    megatron_state: a full (TP=1) GPTModel state dict, or the list of its TP shards (megatron's
    per-rank state dicts, rank order). Shards of a different TP size are merged and re-split.
    arch: llama | mistral | gpt2; None: inferred from the config. dtype: of the written weights.
    """
    config = trtllm_config(cfg, tp_size, arch, dtype)
    arch = "gpt2" if config["architecture"] == "GPTForCausalLM" else "llama"
    cfg.validate(tp_size)
    if isinstance(megatron_state, Mapping):
        shards = split_megatron_tp(megatron_state, cfg, tp_size)
    else:
        shards = [_normalize_names(shard) for shard in megatron_state]
        if len(shards) != tp_size:
            shards = split_megatron_tp(merge_megatron_tp_shards(shards, cfg), cfg, tp_size)
    embedding = _gather_vocab(shards, param_names.weight(param_names.WORD_EMBEDDINGS))
    if embedding is None:
        raise ValueError("megatron state dict has no embedding.word_embeddings.weight")
    output_layer = _gather_vocab(shards, param_names.weight(param_names.OUTPUT_LAYER))
    weights = [
        _rank_weights(shard, cfg, arch, rank, tp_size, embedding, output_layer, _DTYPES[dtype])
        for rank, shard in enumerate(shards)
    ]
    return config, weights


def merge_megatron_tp_shards(shards: Sequence[Mapping[str, torch.Tensor]], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The full (TP=1) state dict from megatron's per-rank TP shards (inverse of `split_megatron_tp`)."""
    shards = [_normalize_names(shard) for shard in shards]
    full: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        pieces = [shard[name] for shard in shards]
        if _is_glu_fc1(name, cfg):
            gates, ups = zip(*(piece.chunk(2, dim=0) for piece in pieces))
            full[name] = torch.cat([*gates, *ups])
        elif _is_column_parallel(name):
            full[name] = torch.cat(pieces, dim=0)
        elif _is_row_parallel(name):
            full[name] = torch.cat(pieces, dim=1)
        else:
            full[name] = pieces[0]
    return full


def save_trtllm_checkpoint(
    directory: Union[str, os.PathLike], config: Optional[dict],
    weights: Union[Sequence[Mapping[str, torch.Tensor]], Mapping[int, Mapping[str, torch.Tensor]]],
) -> Path:
    """Write TRT-LLM's checkpoint layout: config.json (unless config is None) and rank<r>.safetensors.

    weights: every rank's weights in rank order, or {rank: weights} for the ranks this process writes.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    items = weights.items() if isinstance(weights, Mapping) else enumerate(weights)
    for rank, rank_weights in items:
        save_file(dict(rank_weights), str(directory / f"rank{rank}.safetensors"))
    return directory


def local_rank_weights(model_chunks: Sequence[torch.nn.Module], cfg: GPTConfig, arch: Optional[str] = None, *,
                       dtype: str = "float32") -> dict[str, torch.Tensor]:
    """This rank's TRT-LLM weights (TRT-LLM TP = training TP) from the megatron shard it holds.

    Collective over the tensor-parallel group: only the vocabulary tensors are gathered. Needs
    pipeline_model_parallel_size=1 (every rank holds all layers). Runs on CPU/gloo too.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    arch = "gpt2" if trtllm_config(cfg, 1, arch, dtype)["architecture"] == "GPTForCausalLM" else "llama"
    chunks = unwrap_model(list(model_chunks))
    if len(chunks) != 1 or ps.get_pipeline_model_parallel_world_size() != 1:
        raise ConfigError("TensorRT-LLM weights are taken from one model chunk holding all layers "
                          "(pipeline parallel size 1)")
    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    shard = _normalize_names(chunks[0].state_dict())

    def gather(name: str) -> Optional[torch.Tensor]:
        if name not in shard:
            return None
        local = shard[name].detach().contiguous()
        if tp_size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(tp_size)]
        dist.all_gather(pieces, local, group=ps.get_tensor_model_parallel_group())
        return torch.cat(pieces)

    embedding = gather(param_names.weight(param_names.WORD_EMBEDDINGS))
    output_layer = None if cfg.tie_embeddings else gather(param_names.weight(param_names.OUTPUT_LAYER))
    return _rank_weights(shard, cfg, arch, tp_rank, tp_size, embedding, output_layer, _DTYPES[dtype])


# ----------------------------------------------------------------------------- sampling
def stop_words_array(stop_token_ids: Sequence[int], batch_size: int):
    """TRT-LLM's stop_words_list for single-token stops: int32 [batch, 2, n] (ids; end offsets)."""
    import numpy as np

    ids = np.asarray(list(stop_token_ids), dtype=np.int32)
    offsets = np.arange(1, len(ids) + 1, dtype=np.int32)
    return np.tile(np.stack([ids, offsets])[None], (batch_size, 1, 1))


def row_seed(seed: int, row: int) -> int:
    """The random seed of one prompt: a rollout row is reproducible whatever batch it is in."""
    return derive_seed(seed, row, modulus=TRTLLM_SEED_RANGE)


def sampling_to_trtllm(sampling: SamplingParams, *, eos_id: int, pad_id: int, rows: Sequence[int]) -> dict:
    """Keyword arguments for TRT-LLM's `ModelRunner.generate` doing what `sampling` asks.

    rows: the global row index of each prompt in the batch (for per-row seeds). Raises ValueError
    for options the TRT-LLM runtime cannot reproduce. TRT-LLM's own defaults are not relied on
    (its SamplingConfig defaults to top_k=1, i.e. greedy): every option is set explicitly.
    """
    if sampling.stop_strings:
        raise ConfigError(
            f"sampling.stop_strings={sampling.stop_strings!r} is not supported by the TensorRT-LLM engine: its runtime "
            "matches token sequences, not decoded text; use stop_token_ids, or generation.engine=native"
        )
    if sampling.fixed_length:
        raise ConfigError(
            "sampling.fixed_length=true (sampling on past a stop token) is not supported by the TensorRT-LLM engine: "
            "its runtime ends a sequence at end_id; use generation.engine=native"
        )
    if sampling.max_new_tokens < 1:
        raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if not 0 <= sampling.min_new_tokens <= sampling.max_new_tokens:
        raise ConfigError(
            f"sampling.min_new_tokens must be in 0..max_new_tokens={sampling.max_new_tokens}, "
            f"got {sampling.min_new_tokens}"
        )
    if sampling.temperature < 0:
        raise ConfigError(f"sampling.temperature must be >= 0, got {sampling.temperature}")
    if sampling.top_k < 0:
        raise ConfigError(f"sampling.top_k must be >= 0 (0: off), got {sampling.top_k}")
    if not 0 < sampling.top_p <= 1:
        raise ConfigError(f"sampling.top_p must be in (0, 1] (1: off), got {sampling.top_p}")
    stop_ids = list(sampling.stop_token_ids) or [eos_id]
    options: dict[str, Any] = {
        "end_id": stop_ids[0],
        "pad_id": pad_id,
        "max_new_tokens": sampling.max_new_tokens,
        # TRT-LLM counts min_length in generated tokens and keeps end_id out until then.
        "min_length": max(sampling.min_new_tokens, 1),
        "output_log_probs": True,
        "output_sequence_lengths": True,
        "return_dict": True,
    }
    if sampling.is_greedy:
        options.update(temperature=1.0, top_k=1, top_p=0.0)
    else:
        options.update(temperature=float(sampling.temperature), top_k=int(sampling.top_k), top_p=float(sampling.top_p))
        options["random_seed"] = torch.tensor([row_seed(sampling.seed, row) for row in rows], dtype=torch.int64)
    if len(stop_ids) > 1:
        options["stop_words_list"] = stop_words_array(stop_ids[1:], len(rows))
    return options


def rollout_from_outputs(prompts: Sequence[Sequence[int]], output_ids: torch.Tensor, sequence_lengths: torch.Tensor,
                          log_probs: Optional[torch.Tensor], *, max_new_tokens: int, stop_token_ids: Sequence[int],
                          pad_id: int) -> Rollout:
    """A `Rollout` from ModelRunner.generate's dict (beam 0).

    output_ids: [batch, beams, >= prompt + new] prompt then generated tokens; sequence_lengths:
    [batch, beams] prompt + generated length; log_probs: [batch, beams, >= new] per generated token
    (None: zeros). A response that stopped early without its stop token counted (TRT-LLM may end
    a sequence at end_id without including it) gets the stop token appended, so lengths and
    `ended_with_stop` mean what they mean for the native engine.
    """
    stop = set(int(t) for t in stop_token_ids)
    batch = len(prompts)
    response_tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long)
    logprobs = torch.zeros(batch, max_new_tokens)
    lengths = torch.zeros(batch, dtype=torch.long)
    ended = torch.zeros(batch, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        start = len(prompt)
        end = int(sequence_lengths[row, 0])
        tokens = [int(t) for t in output_ids[row, 0, start:end]][:max_new_tokens]
        if tokens and tokens[-1] in stop:
            ended[row] = True
        elif len(tokens) < max_new_tokens and end < output_ids.shape[2] and int(output_ids[row, 0, end]) in stop:
            tokens.append(int(output_ids[row, 0, end]))
            ended[row] = True
        for position, token in enumerate(tokens):
            if token in stop:  # a stop token inside the response: the response ends there
                tokens = tokens[: position + 1]
                ended[row] = True
                break
        lengths[row] = len(tokens)
        if tokens:
            response_tokens[row, : len(tokens)] = torch.tensor(tokens)
            if log_probs is not None:
                logprobs[row, : len(tokens)] = log_probs[row, 0, : len(tokens)].float().cpu()
    return Rollout(
        prompt_tokens=[list(p) for p in prompts],
        response_tokens=response_tokens,
        logprobs=logprobs,
        response_lengths=lengths,
        ended_with_stop=ended,
    )


# ----------------------------------------------------------------------------- the engine
class TensorRTLLMEngine(GenerationEngine):
    """`GenerationEngine` on TensorRT-LLM: build once, refit in place every step, free while training
    (`release_for_update` is the protocol's: `free`; generate_stream the protocol's: one generate per request).

    Collective over the model-parallel group: every rank of a replica calls refit/generate/free.
    work_dir: where this replica writes its TRT-LLM checkpoint and engine (one directory per
    data-parallel replica, on storage the replica's ranks share). dtype: engine precision.
    """

    def __init__(self, model_cfg: GPTConfig, *, pad_id: int, eos_id: int, work_dir: Union[str, os.PathLike],
                 max_batch_size: int = 64, max_input_len: int = 1024, max_sequence_length: int = 2048,
                 arch: Optional[str] = None, dtype: str = "bfloat16"):
        self._trtllm = require_tensorrt_llm()
        from megatron.core import parallel_state as ps

        if cpu_bridge.needed():
            raise ConfigError("the TensorRT-LLM engine needs a CUDA GPU; use generation.engine=native on CPU")
        if ps.get_pipeline_model_parallel_world_size() != 1:
            raise ConfigError(
                "the TensorRT-LLM engine runs at pipeline_model_parallel_size=1 (one TRT-LLM rank per tensor-parallel "
                "rank); use generation.engine=native with pipeline parallelism"
            )
        self.model_cfg = model_cfg
        self.pad_id, self.eos_id = pad_id, eos_id
        self.max_batch_size, self.max_input_len, self.max_sequence_length = (max_batch_size, max_input_len,
                                                                              max_sequence_length)
        self.dtype = dtype
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.config = trtllm_config(model_cfg, self.tp_size, arch, dtype)
        self.arch = "gpt2" if self.config["architecture"] == "GPTForCausalLM" else "llama"
        self.work_dir = Path(work_dir)
        self.checkpoint_dir = self.work_dir / "checkpoint"
        self.engine_dir = self.work_dir / "engine"
        self._runner = None
        self._built = False

    # -- GenerationEngine
    def refit(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        from megatron.core.utils import unwrap_model

        if lora.has_adapters(unwrap_model(list(model_chunks))):  # its engine holds the weights alone
            raise ConfigError("generation.engine=trtllm does not apply LoRA adapters; use generation.engine=native, "
                              "which generates with the live adapters")
        weights = local_rank_weights(model_chunks, self.model_cfg, self.arch, dtype=self.dtype)
        if not self._built:
            self._build(weights)  # first call: the engine is built with these weights
            return
        if self._runner is None:
            self._load()
        self._refit_in_place(weights)

    def _build(self, weights: dict[str, torch.Tensor]) -> None:
        import torch.distributed as dist
        from tensorrt_llm import BuildConfig, build
        from tensorrt_llm.models import MODEL_MAP, PretrainedConfig

        # Every rank writes its own weights; TP rank 0 also writes config.json.
        save_trtllm_checkpoint(self.checkpoint_dir, self.config if self.tp_rank == 0 else None, {self.tp_rank: weights})
        if dist.is_initialized():
            dist.barrier()
        rank_config = PretrainedConfig.from_dict(self.config)
        rank_config.set_rank(self.tp_rank)
        model = MODEL_MAP[self.config["architecture"]].from_checkpoint(str(self.checkpoint_dir), config=rank_config)
        build_config = BuildConfig(
            max_batch_size=self.max_batch_size, max_input_len=self.max_input_len, max_seq_len=self.max_sequence_length,
            max_beam_width=1, use_refit=True,  # refittable: later steps copy weights in instead of rebuilding
        )
        engine = build(model, build_config)
        engine.save(str(self.engine_dir))
        if dist.is_initialized():
            dist.barrier()
        self._built = True
        self._load()

    def _load(self) -> None:
        from tensorrt_llm.runtime import ModelRunner

        self._runner = ModelRunner.from_dir(str(self.engine_dir), rank=self.tp_rank)

    def _refit_in_place(self, weights: dict[str, torch.Tensor]) -> None:
        import tensorrt as trt

        engine = self._runner.session.runtime.engine
        refitter = trt.Refitter(engine, trt.Logger(trt.Logger.WARNING))
        refittable = set(refitter.get_all_weights())
        weights = dict(weights)
        for name in sorted(refittable):  # the build may have fused `gate` and `fc` into one GEMM
            if name.endswith("mlp.fused_fc.weight") and name not in weights:
                prefix = name[: -len("fused_fc.weight")]
                weights[name] = torch.cat([weights.pop(prefix + "gate.weight"), weights.pop(prefix + "fc.weight")])
        unknown = sorted(set(weights) - refittable)
        if unknown:
            raise RuntimeError(
                f"the TensorRT-LLM engine has no refittable weights {unknown[:8]}: was it built with use_refit=True "
                f"from this converter's checkpoint? (engine dir {self.engine_dir})"
            )
        trt_dtype = {torch.float32: trt.float32, torch.bfloat16: trt.bfloat16, torch.float16: trt.float16}
        device_weights = {name: tensor.cuda().contiguous() for name, tensor in weights.items()}  # alive until refit
        for name, tensor in device_weights.items():
            new = trt.Weights(trt_dtype[tensor.dtype], tensor.data_ptr(), tensor.numel())
            if not refitter.set_named_weights(name, new, trt.TensorLocation.DEVICE):
                raise RuntimeError(f"TensorRT refused new weights for {name!r} (shape {list(tensor.shape)})")
        missing = refitter.get_missing_weights()
        if missing:
            raise RuntimeError(f"TensorRT needs more weights to refit the engine: {list(missing)[:8]}")
        if not refitter.refit_cuda_engine():
            raise RuntimeError("TensorRT could not refit the engine in place")
        torch.cuda.synchronize()
        del device_weights

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollout:
        if self._runner is None:
            raise RuntimeError("the TensorRT-LLM engine has no weights loaded: "
                               "call refit(model_chunks) before generate")
        stop_ids = list(sampling.stop_token_ids) or [self.eos_id]
        parts = []
        for start in range(0, len(prompts), self.max_batch_size):
            batch = prompts[start:start + self.max_batch_size]
            options = sampling_to_trtllm(sampling, eos_id=self.eos_id, pad_id=self.pad_id,
                                         rows=range(sampling.first_sample + start,
                                                    sampling.first_sample + start + len(batch)))
            with torch.no_grad():
                outputs = self._runner.generate([torch.tensor(p, dtype=torch.int32) for p in batch], **options)
            torch.cuda.synchronize()
            parts.append(rollout_from_outputs(
                batch, outputs["output_ids"].cpu(), outputs["sequence_lengths"].cpu(),
                outputs.get("log_probs").cpu() if outputs.get("log_probs") is not None else None,
                max_new_tokens=sampling.max_new_tokens, stop_token_ids=stop_ids, pad_id=self.pad_id,
            ))
        return concat_rollouts(parts, self.pad_id)

    def free(self) -> None:
        """Drop the engine and its KV cache; the next refit reloads it from disk (no rebuild)."""
        self._runner = None
        torch.cuda.empty_cache()
