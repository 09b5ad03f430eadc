"""Hugging Face <-> megatron-core layout: the supported architectures and their configs, as pure functions.

Nothing here touches torch.distributed or builds a model: `gpt_config_from_hf` turns an HF config into
aligner's `GPTConfig` and `hf_config_from_gpt` is its inverse. The weights follow in `aligner.hf.weights`:
`hf_to_megatron` turns a full HF state dict into the full (TP=1, PP=1, EP=1) state dict of aligner's
megatron `GPTModel`, and `megatron_to_hf` is its exact inverse. Resharding to other TP/PP/EP layouts is
megatron's dist_checkpointing's job (see aligner/hf/convert.py).

Supported architectures (`arch` is the HF `model_type`):
- llama, mistral: RMSNorm, SwiGLU, RoPE (rotate-half), grouped-query attention, no biases;
  Llama 3.x `llama3` RoPE scaling through megatron's own RotaryEmbedding scaling.
- qwen2: the llama layout plus a bias on the q/k/v projections.
- qwen3: the llama layout plus an RMSNorm over each query and key head before RoPE
  (megatron's qk_layernorm), usually with head_dim != hidden/heads.
- mixtral, qwen3_moe: the llama (mixtral) or qwen3 (qwen3_moe) attention with megatron-core's
  MoE layer for every MLP: a router (no bias) and SwiGLU experts, stored per expert on disk.
- gpt2: LayerNorm, GELU, learned absolute positions, biases everywhere, Conv1D weights
  (stored [in, out], i.e. transposed relative to nn.Linear), q/k/v packed in `c_attn`.
- gemma3_text (Gemma 3): the qwen3 attention with norms x * (1 + w) (kept zero-centred: megatron's
  weights are HF's), norms also after attention and after the MLP, embeddings scaled by
  sqrt(hidden_size), a gated GELU (tanh) MLP, softmax scale query_pre_attn_scalar ** -0.5, and
  sliding-window layers (every sliding_window_pattern-th layer global) rotating at their own RoPE
  base; rows longer than the window are refused (GPTConfig.check_sliding_window).

Both HF Llama and megatron apply RoPE in the rotate-half (non-interleaved) convention, so q/k
rows map over unpermuted; the parity tests check this numerically against `transformers`.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional

from aligner.models.gpt import GPTConfig
from aligner.runtime.errors import ConfigError

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "gpt2", "gemma3_text")
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe")
GEMMA3 = "gemma3_text"
MOE_ARCHS = ("mixtral", "qwen3_moe")
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    GEMMA3: "Gemma3ForCausalLM",
}
# HF activation names -> GPTConfig.activation for GPT-2 (gelu_new is the tanh approximation).
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_GPT2_ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
# Class defaults of `tie_word_embeddings` when a config.json leaves it out.
_TIE_DEFAULT = {arch: False for arch in LLAMA_FAMILY} | {"gpt2": True, GEMMA3: True}
# Class defaults of `head_dim` when a config.json leaves it out (else hidden_size // num_attention_heads).
_HEAD_DIM_DEFAULT = {"qwen3": 128, GEMMA3: 256}
# The llama3 RoPE scaling parameters (HF's names) other than `factor` -> GPTConfig's fields.
LLAMA3_ROPE_FIELDS = {"low_freq_factor": "llama3_rope_low_freq_factor",
                      "high_freq_factor": "llama3_rope_high_freq_factor",
                      "original_max_position_embeddings": "llama3_rope_original_max_position_embeddings"}
# Gemma 3's layer types (HF `layer_types`)
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _as_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"expected a transformers config or a config.json dict, got {type(hf_config).__name__}")


def _unsupported(arch: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{arch} config: {field}={value!r} is not supported: {why}")


def _rope(arch: str, config: dict) -> tuple[float, dict]:
    """(RoPE base, GPTConfig's llama3 scaling fields: empty for plain RoPE) from either config generation.

    transformers 5 keeps everything in `rope_parameters`; older config.json files have
    `rope_theta` plus a `rope_scaling` dict (named in errors as the field the file has).
    """
    params = dict(config.get("rope_parameters") or {})
    field = "rope_parameters"
    if config.get("rope_scaling"):
        params.update(config["rope_scaling"])
        field = "rope_scaling"
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _unsupported(arch, "partial_rotary_factor", partial, "RoPE must rotate the whole head")
    params.pop("partial_rotary_factor", None)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if theta != int(theta):
        # megatron's GPTModel takes an integer rotary_base.
        raise _unsupported(arch, "rope_theta", theta, "megatron-core takes an integer rotary base")
    known = {"rope_type", "type", "rope_theta"}
    if rope_type == "default":
        llama3 = {}
    elif rope_type == "llama3":
        known |= {"factor"} | set(LLAMA3_ROPE_FIELDS)
        for key in ("factor", *LLAMA3_ROPE_FIELDS):
            if key not in params:
                raise ConfigError(f"{arch} config: {field}.{key} is missing (rope_type llama3 needs it)")
        llama3 = dict(llama3_rope_scaling_factor=float(params["factor"]),
                      llama3_rope_low_freq_factor=float(params["low_freq_factor"]),
                      llama3_rope_high_freq_factor=float(params["high_freq_factor"]),
                      llama3_rope_original_max_position_embeddings=int(params["original_max_position_embeddings"]))
        if llama3["llama3_rope_scaling_factor"] < 1.0:
            raise _unsupported(arch, f"{field}.factor", params["factor"], "llama3 scaling needs factor >= 1")
        if llama3["llama3_rope_high_freq_factor"] <= llama3["llama3_rope_low_freq_factor"]:
            raise _unsupported(arch, f"{field}.high_freq_factor", params["high_freq_factor"],
                               "it must be above low_freq_factor")
    else:
        raise _unsupported(arch, f"{field}.rope_type", rope_type,
                           "only plain RoPE and Llama 3.x (llama3) scaling are implemented")
    extra = sorted(set(params) - known)
    if extra:
        raise _unsupported(arch, field, params, f"keys {extra} change RoPE and are not mapped")
    return theta, llama3


def _sliding_window_active(arch: str, config: dict) -> Optional[str]:
    """A description of the sliding window if it changes attention within max_position_embeddings."""
    window = config.get("sliding_window")
    if window is None:
        return None
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not config.get("use_sliding_window", False):
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    max_positions = config["max_position_embeddings"]
    if window >= max_positions:
        return None  # no sequence the model accepts is longer than the window
    return f"sliding_window={window} < max_position_embeddings={max_positions}"


def gpt_config_from_hf(hf_config: Any, *, make_vocab_size_divisible_by: int = 128) -> tuple[GPTConfig, str]:
    """(GPTConfig, arch) for a transformers config (object or config.json dict).

    Raises ValueError naming the config field for anything the megatron model would compute
    differently (RoPE scaling, an active sliding window, biases the layout has no place for, ...).
    """
    config = _as_dict(hf_config)
    arch = config.get("model_type")
    if arch not in ARCHS:
        raise ConfigError(f"model_type={arch!r} is not supported; supported HF architectures: {list(ARCHS)}")
    if arch == "gpt2":
        cfg = _gpt2_config(config)
    elif arch == GEMMA3:
        cfg = _gemma3_config(config)
    else:
        cfg = _llama_family_config(arch, config)
    cfg.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    cfg.validate()
    return cfg, arch


def _llama_family_config(arch: str, config: dict) -> GPTConfig:
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise _unsupported(arch, "hidden_act", config["hidden_act"], "the MLP must be SwiGLU (silu gate)")
    if config.get("attention_bias", False):
        raise _unsupported(arch, "attention_bias", True, "megatron has a q/k/v bias only together with qwen2's layout")
    if config.get("mlp_bias", False):
        raise _unsupported(arch, "mlp_bias", True, "the Llama-style MLP here has no biases")
    window = _sliding_window_active(arch, config)
    if window:
        raise ConfigError(
            f"{arch} config: {window}: sliding-window attention is not implemented; full attention matches "
            "only for sequences no longer than the window (set max_position_embeddings <= sliding_window "
            "in config.json if you only use such sequences)"
        )
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or _HEAD_DIM_DEFAULT.get(arch)  # None: hidden / heads (kept, for export)
    if head_dim is None and hidden % heads:
        raise _unsupported(arch, "hidden_size", hidden, f"not divisible by num_attention_heads={heads}; set head_dim")
    rotary_base, llama3 = _rope(arch, config)
    return GPTConfig(
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        ffn_hidden_size=config["intermediate_size"],
        kv_channels=head_dim,
        vocab_size=config["vocab_size"],
        max_position_embeddings=config["max_position_embeddings"],
        normalization="RMSNorm",
        norm_epsilon=config.get("rms_norm_eps", 1e-6),
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=rotary_base,
        **llama3,
        qk_layernorm=arch in QK_NORM_ARCHS,
        add_bias_linear=False,
        add_qkv_bias=arch == "qwen2",
        tie_embeddings=bool(config.get("tie_word_embeddings", _TIE_DEFAULT[arch])),
        hidden_dropout=0.0,
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        init_method_std=config.get("initializer_range", 0.02),
        **(_moe_fields(arch, config) if arch in MOE_ARCHS else {}),
    )


def _gemma3_config(config: dict) -> GPTConfig:
    arch = GEMMA3
    activation = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
    if activation != "gelu_pytorch_tanh":
        raise _unsupported(arch, "hidden_activation", activation, "the MLP must be gated GELU (tanh approximation)")
    for field in ("attention_bias", "use_bidirectional_attention", "final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(field):
            raise _unsupported(arch, field, config[field], "not implemented")
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or [
        _SLIDING if (i + 1) % config.get("sliding_window_pattern", 6) else _FULL for i in range(num_layers)]
    window = config.get("sliding_window") if _SLIDING in layer_types else None
    pattern = None  # every layer slides, or the index (1-based) of the first full one, repeating
    if window is not None and _FULL in layer_types:
        pattern = layer_types.index(_FULL) + 1
    if window is not None and layer_types != [_SLIDING if pattern is None or (i + 1) % pattern else _FULL
                                              for i in range(num_layers)]:
        raise _unsupported(arch, "layer_types", layer_types,
                           "sliding-window layers must repeat with one full-attention layer every N layers")
    params = config.get("rope_parameters") or {}
    if _FULL in params:  # transformers 5: one RoPE per layer type
        full, local = params[_FULL], params.get(_SLIDING) or {}
    else:  # older config.json: rope_theta (+ rope_scaling) on full layers, rope_local_base_freq on sliding ones
        full = dict(params, rope_theta=config.get("rope_theta", 1_000_000.0), **(config.get("rope_scaling") or {}))
        local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    max_positions = config["max_position_embeddings"]
    rotary_base, llama3 = _rope(arch, {"rope_parameters": full, "max_position_embeddings": max_positions})
    local_base, local_scaling = _rope(arch, {"rope_parameters": {"rope_theta": 10_000.0, **local},
                                             "max_position_embeddings": max_positions})
    if local_scaling:
        raise _unsupported(arch, f"rope_parameters.{_SLIDING}", local, "the sliding-window layers' RoPE is not scaled")
    scalar = config.get("query_pre_attn_scalar", 256)
    return GPTConfig(
        num_layers=num_layers,
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config.get("num_key_value_heads") or config["num_attention_heads"],
        ffn_hidden_size=config["intermediate_size"],
        kv_channels=config.get("head_dim") or _HEAD_DIM_DEFAULT[arch],
        vocab_size=config["vocab_size"],
        max_position_embeddings=max_positions,
        normalization="RMSNorm",
        norm_epsilon=config.get("rms_norm_eps", 1e-6),
        activation="geglu_tanh",
        position_embedding_type="rope",
        rotary_base=rotary_base,
        **llama3,
        qk_layernorm=True,
        zero_centered_norm=True,
        post_layer_norms=True,
        scale_embeddings=True,
        query_pre_attn_scalar=float(scalar),
        sliding_window=window,
        sliding_window_pattern=pattern,
        local_rotary_base=local_base if window is not None else None,
        add_bias_linear=False,
        add_qkv_bias=False,
        tie_embeddings=bool(config.get("tie_word_embeddings", _TIE_DEFAULT[arch])),
        hidden_dropout=0.0,
        attention_dropout=float(config.get("attention_dropout") or 0.0),
        init_method_std=config.get("initializer_range", 0.02),
    )


def _moe_fields(arch: str, config: dict) -> dict:
    """GPTConfig's MoE fields: every layer an MoE layer with megatron's router computing HF's weights.

    HF mixtral (and qwen3_moe with norm_topk_prob) weight the top-k experts by the softmax over all
    experts renormalised over the top k, which equals megatron's default softmax over the top-k
    logits; qwen3_moe without norm_topk_prob keeps the unnormalised top-k of the full softmax,
    megatron's moe_router_pre_softmax. The load-balancing loss is off (moe_aux_loss_coeff 0):
    HF adds it only when output_router_logits is set, and with another normalisation.
    """
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    top_k = config["num_experts_per_tok"]
    if arch == "mixtral":
        expert_ffn = config["intermediate_size"]
        normalised = True
        jitter = config.get("router_jitter_noise", 0.0)
        if jitter:
            raise _unsupported(arch, "router_jitter_noise", jitter,
                               "HF scales the expert inputs by the noise; megatron jitters only the router input")
    else:
        expert_ffn = config["moe_intermediate_size"]
        normalised = bool(config.get("norm_topk_prob", False))
        num_layers = config["num_hidden_layers"]
        dense = sorted(set(config.get("mlp_only_layers") or []) & set(range(num_layers)))
        if dense:
            raise _unsupported(arch, "mlp_only_layers", config["mlp_only_layers"],
                               "every layer must be an MoE layer (dense layers are not mapped)")
        step = config.get("decoder_sparse_step", 1)
        if step != 1 and num_layers > 0:
            raise _unsupported(arch, "decoder_sparse_step", step,
                               "every layer must be an MoE layer (dense layers are not mapped)")
        for field in ("shared_expert_intermediate_size", "num_shared_experts", "n_shared_experts"):
            if config.get(field):
                raise _unsupported(arch, field, config[field], "shared experts are not mapped")
    if top_k == 1 and normalised:
        raise _unsupported(
            arch, "num_experts_per_tok", 1,
            "a renormalised top-1 weight is always 1, which megatron's router cannot express "
            "(top-1 needs the softmax before the top-k)",
        )
    return dict(
        num_moe_experts=num_experts,
        moe_ffn_hidden_size=expert_ffn,
        moe_router_topk=top_k,
        moe_router_pre_softmax=not normalised,
    )


def _gpt2_config(config: dict) -> GPTConfig:
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise _unsupported("gpt2", "activation_function", activation, f"supported: {sorted(_GPT2_ACTIVATIONS)}")
    for field, unsupported_value, why in (
        ("scale_attn_by_inverse_layer_idx", True, "megatron scales attention by 1/sqrt(head_dim) only"),
        ("scale_attn_weights", False, "megatron always scales attention scores by 1/sqrt(head_dim)"),
        ("add_cross_attention", True, "decoder-only models only"),
    ):
        if config.get(field, not unsupported_value) == unsupported_value:
            raise _unsupported("gpt2", field, unsupported_value, why)
    hidden, heads = config["n_embd"], config["n_head"]
    if hidden % heads:
        raise _unsupported("gpt2", "n_embd", hidden, f"not divisible by n_head={heads}")
    # resid_pdrop is megatron's hidden_dropout; megatron applies the same rate after the
    # embeddings, where GPT-2 uses embd_pdrop (equal in every released GPT-2; training-only).
    return GPTConfig(
        num_layers=config["n_layer"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=config.get("n_inner"),  # None: 4 * hidden in both
        kv_channels=hidden // heads,
        vocab_size=config["vocab_size"],
        max_position_embeddings=config["n_positions"],
        normalization="LayerNorm",
        norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
        activation=_GPT2_ACTIVATIONS[activation],
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        add_qkv_bias=True,
        tie_embeddings=bool(config.get("tie_word_embeddings", _TIE_DEFAULT["gpt2"])),
        hidden_dropout=float(config.get("resid_pdrop", 0.1)),
        attention_dropout=float(config.get("attn_pdrop", 0.1)),
        init_method_std=config.get("initializer_range", 0.02),
    )


def infer_arch(cfg: GPTConfig) -> str:
    """The HF architecture a GPTConfig most naturally exports to."""
    if cfg.position_embedding_type == "learned_absolute":
        return "gpt2"
    if cfg.zero_centered_norm:
        return GEMMA3
    if cfg.is_moe:
        return "qwen3_moe" if cfg.qk_layernorm else "mixtral"
    if cfg.qk_layernorm:
        return "qwen3"
    return "qwen2" if cfg.add_qkv_bias else "llama"


def check_exportable(cfg: GPTConfig, arch: str) -> None:
    """Raise ValueError (naming the model field) if `arch` cannot represent `cfg` exactly."""
    if arch not in ARCHS:
        raise ConfigError(f"arch={arch!r} is not supported; supported HF architectures: {list(ARCHS)}")
    if arch == "gpt2":
        expected = dict(
            normalization="LayerNorm",
            position_embedding_type="learned_absolute",
            add_bias_linear=True,
            add_qkv_bias=True,
            qk_layernorm=False,
            is_moe=False,
            scale_embeddings=False,
            query_pre_attn_scalar=None,
            sliding_window=None,
        )
        if cfg.activation not in _GPT2_ACTIVATION_NAMES:
            raise ConfigError(f"model.activation={cfg.activation!r} cannot be exported as gpt2")
        if cfg.query_groups != cfg.num_attention_heads:
            raise ConfigError(f"model.num_query_groups={cfg.query_groups} cannot be exported as gpt2 (no GQA)")
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise ConfigError(f"model.kv_channels={cfg.kv_channels} cannot be exported as gpt2 "
                              "(head_dim = n_embd/n_head)")
    elif arch == GEMMA3:
        expected = dict(normalization="RMSNorm", activation="geglu_tanh", position_embedding_type="rope",
                        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, is_moe=False,
                        zero_centered_norm=True, post_layer_norms=True, scale_embeddings=True)
    else:
        expected = dict(
            normalization="RMSNorm",
            activation="swiglu",
            position_embedding_type="rope",
            add_bias_linear=False,
            add_qkv_bias=arch == "qwen2",
            qk_layernorm=arch in QK_NORM_ARCHS,
            is_moe=arch in MOE_ARCHS,
            zero_centered_norm=False,
            post_layer_norms=False,
            scale_embeddings=False,
            query_pre_attn_scalar=None,
            sliding_window=None,
        )
        if arch == "mixtral":
            # mixtral always renormalises the top-k weights (qwen3_moe says so in norm_topk_prob).
            expected["moe_router_pre_softmax"] = False
    for field, value in expected.items():
        if getattr(cfg, field) != value:
            name = "num_moe_experts" if field == "is_moe" else field
            shown = getattr(cfg, name) if field == "is_moe" else getattr(cfg, field)
            needs = ("an MoE model" if value else "a dense model") if field == "is_moe" else repr(value)
            raise ConfigError(
                f"model.{name}={shown!r} cannot be exported as {arch} (which needs {needs}); "
                f"pick another --arch (inferred from the model it would be {infer_arch(cfg)!r})"
            )
    if arch != "gpt2" and cfg.rotary_base != int(cfg.rotary_base):
        raise ConfigError(f"model.rotary_base={cfg.rotary_base} is not an integer")
    scalar = cfg.query_pre_attn_scalar
    if arch == GEMMA3 and scalar is not None and scalar != int(scalar):
        raise ConfigError(f"model.query_pre_attn_scalar={scalar} cannot be exported as {arch} (HF takes an integer)")


def hf_config_from_gpt(
    cfg: GPTConfig,
    arch: str,
    *,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
    pad_token_id: Optional[int] = None,
    dtype: str = "float32",
):
    """The transformers config of `arch` describing the same model as `cfg`."""
    import transformers

    check_exportable(cfg, arch)
    special = dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if arch == "gpt2":
        kwargs: dict[str, Any] = dict(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_position_embeddings,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_attention_heads,
            n_inner=cfg.ffn_hidden_size,
            activation_function=_GPT2_ACTIVATION_NAMES[cfg.activation],
            resid_pdrop=cfg.hidden_dropout,
            embd_pdrop=cfg.hidden_dropout,
            attn_pdrop=cfg.attention_dropout,
            layer_norm_epsilon=cfg.norm_epsilon,
            initializer_range=cfg.init_method_std,
            tie_word_embeddings=cfg.tie_embeddings,
        )
        config_class = transformers.GPT2Config
    elif arch == GEMMA3:
        kwargs = _gemma3_hf_kwargs(cfg)
        config_class = transformers.Gemma3TextConfig
    else:
        config_class = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config,
            "mistral": transformers.MistralConfig,
            "mixtral": transformers.MixtralConfig,
            "qwen3_moe": transformers.Qwen3MoeConfig,
        }[arch]
        kwargs = dict(_rms_norm_family_kwargs(cfg), hidden_act="silu")
        if cfg.kv_channels is not None:  # else the class default, hidden / heads (None in a mixtral config)
            kwargs["head_dim"] = cfg.kv_channels
        rope = _hf_rope(cfg)
        if "rope_parameters" in inspect.signature(config_class.__init__).parameters:
            kwargs["rope_parameters"] = rope
        else:  # transformers 4.x
            kwargs["rope_theta"] = rope.pop("rope_theta")
            kwargs["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        if arch == "llama":
            kwargs.update(attention_bias=False, mlp_bias=False)
        elif arch in ("mistral", "mixtral"):
            kwargs.update(sliding_window=None)
        else:
            kwargs.update(use_sliding_window=False, sliding_window=None)
        if arch in ("qwen3", "qwen3_moe"):
            kwargs.update(attention_bias=False)
        if arch == "mixtral":
            kwargs.update(intermediate_size=cfg.expert_ffn_size, num_local_experts=cfg.num_moe_experts,
                          num_experts_per_tok=cfg.moe_router_topk, router_jitter_noise=0.0)
        elif arch == "qwen3_moe":
            kwargs.update(moe_intermediate_size=cfg.expert_ffn_size, num_experts=cfg.num_moe_experts,
                          num_experts_per_tok=cfg.moe_router_topk, norm_topk_prob=not cfg.moe_router_pre_softmax,
                          decoder_sparse_step=1, mlp_only_layers=[])
    config = config_class(**kwargs, **special)
    config.architectures = [HF_ARCHITECTURES[arch]]
    config.dtype = dtype
    return config


def _hf_rope(cfg: GPTConfig) -> dict:
    """HF `rope_parameters` of the full-attention layers."""
    rope = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    if cfg.llama3_rope_scaling_factor is not None:
        rope = dict(rope, rope_type="llama3", factor=float(cfg.llama3_rope_scaling_factor),
                    **{key: getattr(cfg, field) for key, field in LLAMA3_ROPE_FIELDS.items()})
    return rope


def _rms_norm_family_kwargs(cfg: GPTConfig) -> dict:
    """The HF config fields the Llama-style families and Gemma 3 name alike."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.query_groups,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        attention_dropout=cfg.attention_dropout,
        initializer_range=cfg.init_method_std,
        tie_word_embeddings=cfg.tie_embeddings,
    )


def _gemma3_hf_kwargs(cfg: GPTConfig) -> dict:
    layer_types = [_SLIDING if cfg.is_sliding_window_layer(i + 1) else _FULL for i in range(cfg.num_layers)]
    local_base = cfg.local_rotary_base if cfg.local_rotary_base is not None else cfg.rotary_base
    return dict(
        _rms_norm_family_kwargs(cfg),
        head_dim=cfg.head_dim,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim),
        sliding_window=cfg.sliding_window,
        layer_types=layer_types,
        rope_parameters={_FULL: _hf_rope(cfg), _SLIDING: {"rope_type": "default", "rope_theta": float(local_base)}},
        attention_bias=False,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
