"""The GPT policy: megatron-core `GPTModel` built from the `model:` section of a config.

Two architecture families are covered by the same builder:
- Llama-style (Llama, Qwen2/3, Mistral, Mixtral, Qwen3-MoE): RMSNorm, SwiGLU, RoPE, grouped-query
  attention; variants are fields: a bias on the QKV projection only (Qwen2), a per-head norm of
  queries and keys (Qwen3), Llama 3.x RoPE frequency scaling, and megatron-core's MoE layer in
  place of the dense MLP (top-k routing over SwiGLU experts).
- GPT-2-style: LayerNorm, GELU (tanh approximation), learned absolute positions, biases
  everywhere, embeddings tied with the output layer.
The local (pure megatron-core) layer spec is used on CPU; the transformer-engine spec is used
when `transformer_impl: transformer_engine` is asked for and the package is installed.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from aligner.config import MissingExtraError, check_values, one_of
from aligner.models.packing import gpt_model_class
from aligner.runtime import cpu_bridge, distributed
from aligner.runtime.distributed import ParallelConfig
from aligner.runtime.errors import ConfigError

MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall")

_ACTIVATIONS = {
    "swiglu": F.silu,  # gated: silu(x W_gate) * (x W_up)
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # gated: gelu_tanh(x W_gate) * (x W_up) (Gemma)
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
GATED_ACTIVATIONS = ("swiglu", "geglu_tanh")  # fc1 holds [gate; up]
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# none: every layer keeps its activations for backward; selective: the attention core (scores and
# probabilities, [batch, heads, seq, seq]) is recomputed; full: only each layer's input is kept and
# the layer is run again in backward (about one more forward of compute).
RECOMPUTE_SETTINGS = {  # megatron's fields for each `activation_recompute`
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
ACTIVATION_RECOMPUTE = tuple(RECOMPUTE_SETTINGS)


@dataclass
class GPTConfig:
    """Architecture of a GPT model; field names match the `model:` section of the yaml configs."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: = num_attention_heads (no GQA)
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    kv_channels: Optional[int] = None  # head dim; None: hidden_size // num_attention_heads
    vocab_size: Optional[int] = None  # None: taken from the tokenizer
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 512
    normalization: str = one_of(NORMALIZATIONS, "RMSNorm")
    norm_epsilon: float = 1e-5
    activation: str = one_of(tuple(_ACTIVATIONS), "swiglu")
    position_embedding_type: str = one_of(POSITION_EMBEDDINGS, "rope")
    rotary_base: float = 10000.0
    # Llama 3.x RoPE scaling (HF rope_type "llama3") by this factor; None: plain RoPE. The three
    # fields after it are the formula's other parameters (HF's names; defaults: Llama 3.1's).
    llama3_rope_scaling_factor: Optional[float] = None
    llama3_rope_low_freq_factor: float = 1.0
    llama3_rope_high_freq_factor: float = 4.0
    llama3_rope_original_max_position_embeddings: int = 8192
    qk_layernorm: bool = False  # a norm over each query and key head before RoPE (Qwen3)
    # Gemma 3: every norm scales by (1 + weight) (weights stored zero-centred, as HF stores them);
    # norms also after attention and after the MLP, before each residual add ("sandwich" norms);
    # embeddings multiplied by sqrt(hidden_size) (the tied output layer uses the unscaled weight);
    # softmax scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    zero_centered_norm: bool = False
    post_layer_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: Optional[float] = None
    # Sliding-window attention on all but every sliding_window_pattern-th layer (1-based: layers N,
    # 2N, ... attend to every position; None: no layer does), those layers rotating with
    # local_rotary_base. Rows longer than the window are refused (check_sequence_lengths): up to it,
    # windowed attention is full attention, which is what is computed.
    sliding_window: Optional[int] = None
    sliding_window_pattern: Optional[int] = None
    local_rotary_base: Optional[float] = None  # RoPE base of the sliding-window layers; None: rotary_base
    # Mixture of experts (megatron-core's MoELayer in every layer): None is a dense MLP.
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None  # each expert's hidden size; None: ffn_hidden_size
    moe_router_topk: int = 2
    # True: softmax over all experts, then the top-k of those probabilities (they do not sum to 1).
    # False: softmax over the top-k logits (= top-k of the full softmax, renormalised).
    moe_router_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight; 0: no aux loss, training sees only the task loss
    moe_token_dispatcher_type: str = one_of(MOE_TOKEN_DISPATCHERS, "allgather")  # megatron's; alltoall needs CUDA
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    tie_embeddings: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    transformer_impl: str = one_of(TRANSFORMER_IMPLS, "local")

    @classmethod
    def llama(cls, **overrides: Any) -> "GPTConfig":
        return cls(**overrides)

    @classmethod
    def gpt2(cls, **overrides: Any) -> "GPTConfig":
        base = dict(
            normalization="LayerNorm",
            activation="gelu_tanh",
            position_embedding_type="learned_absolute",
            add_bias_linear=True,
            add_qkv_bias=True,
            tie_embeddings=True,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_dict(cls, values: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    def is_sliding_window_layer(self, layer_number: int) -> bool:
        """Whether 1-based layer `layer_number` (of the whole model) attends within the sliding window."""
        if self.sliding_window is None:
            return False
        return self.sliding_window_pattern is None or layer_number % self.sliding_window_pattern != 0

    @property
    def rotary_bases(self) -> tuple[float, Optional[float]]:
        """(RoPE base of full-attention layers, of sliding-window layers or None where it is the same)."""
        local = self.local_rotary_base
        return self.rotary_base, (None if local is None or self.sliding_window is None else local)

    def validate(self, tensor_parallel_size: int = 1, expert_parallel_size: int = 1) -> None:
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size is not set (it is normally taken from the tokenizer)")
        check_values(self, "model.")  # the choices again: a config from a checkpoint or an HF model skips load_config
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_query_groups ({self.query_groups})"
            )
        for name, value in (("num_attention_heads", self.num_attention_heads), ("num_query_groups", self.query_groups)):
            if value % tensor_parallel_size:
                raise ConfigError(
                    f"model.{name}={value} is not divisible by tensor_model_parallel_size={tensor_parallel_size}"
                )
        if self.ffn_size % tensor_parallel_size:
            raise ConfigError(f"model.ffn_hidden_size={self.ffn_size} is not divisible by TP={tensor_parallel_size}")
        if self.llama3_rope_scaling_factor is not None and self.position_embedding_type != "rope":
            raise ConfigError("model.llama3_rope_scaling_factor needs model.position_embedding_type=rope")
        if self.llama3_rope_high_freq_factor <= self.llama3_rope_low_freq_factor:
            raise ConfigError(f"model.llama3_rope_high_freq_factor={self.llama3_rope_high_freq_factor} must be above "
                              f"model.llama3_rope_low_freq_factor={self.llama3_rope_low_freq_factor}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"model.sliding_window must be >= 1, got {self.sliding_window}")
        if self.zero_centered_norm and self.normalization != "RMSNorm":
            raise ConfigError("model.zero_centered_norm needs model.normalization=RMSNorm")
        if self.post_layer_norms and not self.zero_centered_norm:
            raise ConfigError("model.post_layer_norms needs model.zero_centered_norm=true (Gemma's norms)")
        if self.post_layer_norms and self.add_bias_linear:
            raise ConfigError("model.post_layer_norms=true has no place for the projections' biases "
                              "(model.add_bias_linear=true)")
        if self.local_rotary_base is not None and self.position_embedding_type != "rope":
            raise ConfigError("model.local_rotary_base needs model.position_embedding_type=rope")
        if self.post_layer_norms and self.is_moe:
            raise ConfigError("model.post_layer_norms=true is implemented for dense MLPs (model.num_moe_experts=null)")
        gemma = [name for name in ("zero_centered_norm", "post_layer_norms", "sliding_window", "local_rotary_base")
                 if getattr(self, name)]
        if gemma and self.transformer_impl != "local":
            raise ConfigError(f"model.{gemma[0]} is implemented for model.transformer_impl=local only")
        self._validate_moe(tensor_parallel_size, expert_parallel_size)

    def check_sequence_lengths(self, lengths: Sequence[tuple[int, str]], limit_key: str) -> None:
        """Refuse rows longer than the model has positions: `lengths` holds (tokens, the settings that make
        them, e.g. "data.max_seq_length=512"); limit_key names where max_position_embeddings was set.

        The limit is max_position_embeddings whatever the position embedding, as the reward and critic
        servers and chat take it. Learned absolute positions (GPT-2) have that many rows in their table: a
        longer row fails with an IndexError deep in the forward pass. RoPE computes any position, but
        max_position_embeddings is the context the model was trained for (an HF import keeps HF's, which
        counts any RoPE scaling): past it the model trains and scores silently on positions it never saw.
        A model meant for longer rows says so in its config.
        """
        for tokens, setting in lengths:
            if tokens > self.max_position_embeddings:
                raise ConfigError(f"{setting} is above {limit_key}={self.max_position_embeddings}: the model was not "
                                  "trained on longer rows; lower the setting or start from a model with more positions")
            self.check_sliding_window(tokens, setting)

    def check_sliding_window(self, tokens: int, setting: str) -> None:
        """Refuse rows longer than the sliding window: attention here is full attention, which equals the
        model's windowed attention only up to the window."""
        if self.sliding_window is not None and tokens > self.sliding_window:
            raise ConfigError(f"{setting} is above model.sliding_window={self.sliding_window}: sliding-window "
                              "attention is not implemented (rows up to the window are exact); lower the setting")

    def _validate_moe(self, tensor_parallel_size: int, expert_parallel_size: int) -> None:
        if not self.is_moe:
            if expert_parallel_size > 1:
                raise ConfigError(f"expert_model_parallel_size={expert_parallel_size} needs an MoE model "
                                  "(model.num_moe_experts is not set)")
            return
        if self.num_moe_experts < 1:
            raise ConfigError(f"model.num_moe_experts must be >= 1, got {self.num_moe_experts}")
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ConfigError(f"model.moe_router_topk={self.moe_router_topk} must be in [1, num_moe_experts="
                              f"{self.num_moe_experts}]")
        if self.moe_router_topk == 1 and not self.moe_router_pre_softmax:
            # A softmax over one logit is always 1 (megatron refuses it: the router would get no gradient).
            raise ConfigError("model.moe_router_topk=1 needs model.moe_router_pre_softmax=true")
        if self.num_moe_experts % expert_parallel_size:
            raise ConfigError(f"model.num_moe_experts={self.num_moe_experts} is not divisible by "
                              f"expert_model_parallel_size={expert_parallel_size}")
        if self.expert_ffn_size % tensor_parallel_size:
            raise ConfigError(f"model.moe_ffn_hidden_size={self.expert_ffn_size} is not divisible by "
                              f"TP={tensor_parallel_size}")
        if self.add_bias_linear:
            raise ConfigError("model.add_bias_linear=true is not supported with MoE "
                              "(megatron's experts have no biases)")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"model.moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")



def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Vocabulary rounded up to a multiple of `divisible_by`, the same at every TP size.

    The padded size is part of the checkpoint's tensor shapes, so it must not depend on the
    layout the checkpoint is saved or loaded at (that is what makes resharding possible); the
    TP size only has to divide it.
    """
    padded = int(math.ceil(vocab_size / divisible_by) * divisible_by)
    if padded % tensor_parallel_size:
        raise ConfigError(
            f"padded vocabulary {padded} (vocab {vocab_size} rounded to model.make_vocab_size_divisible_by="
            f"{divisible_by}) is not divisible by tensor_model_parallel_size={tensor_parallel_size}; "
            f"set make_vocab_size_divisible_by to a multiple of {tensor_parallel_size}"
        )
    return padded


def transformer_config(
    cfg: GPTConfig,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    virtual_pipeline_parallel_size: Optional[int] = None,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    expert_parallel_size: int = 1,
    activation_recompute: str = "none",
):
    """The megatron-core `TransformerConfig` for this architecture and parallel layout;
    activation_recompute: a key of `RECOMPUTE_SETTINGS` (training memory against compute)."""
    from megatron.core.transformer import TransformerConfig

    cfg.validate(tensor_parallel_size, expert_parallel_size)
    bf16 = params_dtype == torch.bfloat16
    moe = {}
    if cfg.is_moe:
        cpu_bridge.check_moe_token_dispatcher(cfg.moe_token_dispatcher_type)
        moe = dict(
            num_moe_experts=cfg.num_moe_experts,
            moe_ffn_hidden_size=cfg.expert_ffn_size,
            moe_router_topk=cfg.moe_router_topk,
            moe_router_pre_softmax=cfg.moe_router_pre_softmax,
            moe_router_score_function="softmax",
            # Without a coefficient no balancing loss is computed at all (not a zero-weighted one).
            moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            expert_model_parallel_size=expert_parallel_size,
        )
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        ffn_hidden_size=cfg.ffn_size,
        kv_channels=cfg.head_dim,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=cfg.gated,
        activation_func=_ACTIVATIONS[cfg.activation],
        bias_activation_fusion=False,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_parallel_size,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        autocast_dtype=params_dtype,
        # The full weight is initialised on the CPU and then sliced, so a TP shard holds the same
        # numbers whatever the TP size (also the only way to initialise without CUDA).
        use_cpu_initialization=True,
        calculate_per_token_loss=True,
        qk_layernorm=cfg.qk_layernorm,
        layernorm_zero_centered_gamma=cfg.zero_centered_norm,
        softmax_scale=None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5,
        **moe,
        **RECOMPUTE_SETTINGS[activation_recompute],
        **cpu_bridge.transformer_config_overrides(),
    )



def layer_spec(cfg: GPTConfig):
    """The megatron-core module spec: local layers, or transformer-engine layers when asked for."""
    from megatron.core.models.gpt import gpt_layer_specs

    if cfg.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as error:
            raise MissingExtraError(
                "model.transformer_impl=transformer_engine needs the transformer-engine package "
                "(pip install 'aligner[gpu]' on a CUDA machine); use transformer_impl=local otherwise"
            ) from error
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_moe_experts, qk_layernorm=cfg.qk_layernorm
        )
    from aligner.models import layers  # imports megatron-core: see "Imported inside functions" in layers.py

    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts, qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization
    )
    attention = spec.submodules.self_attention
    attention.submodules.core_attention = layers.FusedDotProductAttention
    if cfg.zero_centered_norm:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = layers.ZeroCenteredRMSNorm
        if cfg.qk_layernorm:
            attention.submodules.q_layernorm = attention.submodules.k_layernorm = layers.ZeroCenteredRMSNorm
    if cfg.post_layer_norms:
        attention.submodules.linear_proj = layers.RowParallelLinearWithPostNorm
        spec.submodules.mlp.submodules.linear_fc2 = layers.RowParallelLinearWithPostNorm
    if cfg.sliding_window is not None:
        attention.module = layers.LocalGlobalSelfAttention
        attention.params = dict(attention.params, sliding_window=cfg.sliding_window,
                                sliding_window_pattern=cfg.sliding_window_pattern)
    return spec


def decoder_spec(cfg: GPTConfig, config, vp_stage: Optional[int] = None):
    """What GPTModel takes as its layer spec: `layer_spec`, or, with zero-centred norms, the block's
    submodules (its layers and a zero-centred final norm: megatron's block otherwise builds its default)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from aligner.models import layers  # imports megatron-core: see "Imported inside functions" in layers.py

    spec = layer_spec(cfg)
    if not cfg.zero_centered_norm:
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=layers.ZeroCenteredRMSNorm)


def configure_rotary_embedding(rotary, cfg: GPTConfig) -> None:
    """Set a GPTModel's rotary frequencies (megatron's RotaryEmbedding at cfg.rotary_base) to the model's: the
    one place they are made, read by training and by the native engine alike.

    Llama 3.x scaling is megatron's own formula (`_apply_scaling`, HF's `_compute_llama3_parameters`) with the
    config's four parameters; sliding-window layers with their own base get a second RotaryEmbedding
    (`layers.LocalGlobalRotaryEmbedding`)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from aligner.models import layers  # imports megatron-core: see "Imported inside functions" in layers.py

    if cfg.llama3_rope_scaling_factor is not None:
        rotary.inv_freq = rotary._apply_scaling(
            rotary.inv_freq, factor=cfg.llama3_rope_scaling_factor, low_freq_factor=cfg.llama3_rope_low_freq_factor,
            high_freq_factor=cfg.llama3_rope_high_freq_factor,
            original_max_position_embeddings=cfg.llama3_rope_original_max_position_embeddings)
    local_base = cfg.rotary_bases[1]
    if local_base is not None:
        local = RotaryEmbedding(kv_channels=cfg.head_dim, rotary_percent=1.0,
                                rotary_interleaved=rotary.rotary_interleaved, rotary_base=int(local_base),
                                use_cpu_initialization=True, cp_group=rotary.cp_group)
        rotary.__class__ = layers.LocalGlobalRotaryEmbedding
        rotary.local = local


def _patch_moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router reads `te_general_gemm`, which moe_utils defines only when
    transformer-engine imports: without it every MoE forward raises NameError. None selects the
    plain torch product megatron has for that case."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(
    cfg: GPTConfig,
    config,  # megatron TransformerConfig from transformer_config()
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
):
    """One model chunk for this pipeline stage (and virtual stage); parallel_state must be initialised."""
    from megatron.core import parallel_state

    from aligner.models import layers  # imports megatron-core: see "Imported inside functions" in layers.py

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    vocab = padded_vocab_size(
        cfg.vocab_size, cfg.make_vocab_size_divisible_by, parallel_state.get_tensor_model_parallel_world_size()
    )
    if cfg.is_moe:
        _patch_moe_without_transformer_engine()
    # megatron's GPTModel, with rotary embeddings at the position ids (packed rows restart them).
    model = gpt_model_class()(
        config=config,
        transformer_layer_spec=decoder_spec(cfg, config, vp_stage),
        vocab_size=vocab,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type=cfg.position_embedding_type,
        rotary_base=int(cfg.rotary_base),
        vp_stage=vp_stage,
    )
    if cfg.position_embedding_type == "rope":
        configure_rotary_embedding(model.rotary_pos_emb, cfg)
    if cfg.scale_embeddings and pre_process:
        model.embedding.word_embeddings.__class__ = layers.ScaledVocabParallelEmbedding
    if post_process:
        layers.make_output_layer_batch_major(model)
    return model


def build_model_chunks(
    model_cfg: GPTConfig,
    parallel: ParallelConfig,
    params_dtype: torch.dtype,
    chunk_builder: Callable = build_gpt_model,
    activation_recompute: str = "none",
) -> list[torch.nn.Module]:
    """This rank's model chunks (one, or one per virtual pipeline stage), before DDP wrapping.

    chunk_builder(model_cfg, config, **kwargs) builds one chunk: `build_gpt_model` (the policy) by
    default, e.g. `aligner.models.reward.build_reward_model` for a reward model or critic.
    """
    config = transformer_config(
        model_cfg,
        tensor_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        params_dtype=params_dtype,
        sequence_parallel=parallel.sequence_parallel,
        expert_parallel_size=parallel.expert_model_parallel_size,
        activation_recompute=activation_recompute,
    )
    vpp = parallel.virtual_pipeline_model_parallel_size
    if vpp:
        if model_cfg.num_layers % (parallel.pipeline_model_parallel_size * vpp):
            raise ConfigError(
                f"model.num_layers={model_cfg.num_layers} must divide evenly into pipeline stages x "
                f"virtual stages = {parallel.pipeline_model_parallel_size} x {vpp}"
            )
        chunks = [chunk_builder(model_cfg, config, vp_stage=stage) for stage in range(vpp)]
    else:
        if model_cfg.num_layers % parallel.pipeline_model_parallel_size:
            raise ConfigError(
                f"model.num_layers={model_cfg.num_layers} is not divisible by "
                f"pipeline_model_parallel_size={parallel.pipeline_model_parallel_size}"
            )
        chunks = [chunk_builder(model_cfg, config)]
    device = distributed.device()
    return [chunk.to(device) for chunk in chunks]


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of padding vocabulary entries to -inf on this tensor-parallel shard.

    The padded rows exist only so every TP shard has the same size; left in, they would take
    probability mass from real tokens and make logprobs differ from the HF model's.
    logits: [..., vocab_shard] for this rank's shard of the padded vocabulary.
    """
    from megatron.core import parallel_state

    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab_size:
        return logits
    first_padded = max(vocab_size - start, 0)
    logits = logits.clone()
    logits[..., first_padded:] = float("-inf")
    return logits


def num_parameters(cfg: GPTConfig) -> int:
    """Parameter count of the full (unsharded, unpadded-vocab) model, for FLOP estimates."""
    hidden, heads, groups, head_dim, ffn = (cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups,
                                            cfg.head_dim, cfg.ffn_size)
    norm = hidden * (2 if cfg.normalization == "LayerNorm" else 1)
    attention = hidden * (heads + 2 * groups) * head_dim + heads * head_dim * hidden
    mlp = hidden * ffn * (2 if cfg.gated else 1) + ffn * hidden
    if cfg.is_moe:  # every expert plus the router (all parameters, not the active ones)
        expert_ffn = cfg.expert_ffn_size
        mlp = cfg.num_moe_experts * (hidden * expert_ffn * (2 if cfg.gated else 1)
                                     + expert_ffn * hidden) + cfg.num_moe_experts * hidden
    if cfg.qk_layernorm:
        attention += 2 * head_dim * (2 if cfg.normalization == "LayerNorm" else 1)
    if cfg.add_bias_linear:
        attention += hidden
        mlp += ffn * (2 if cfg.gated else 1) + hidden
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        attention += (heads + 2 * groups) * head_dim
    per_layer = attention + mlp + 2 * norm
    embeddings = cfg.vocab_size * hidden * (1 if cfg.tie_embeddings else 2)
    if cfg.position_embedding_type == "learned_absolute":
        embeddings += cfg.max_position_embeddings * hidden
    return cfg.num_layers * per_layer + embeddings + norm
