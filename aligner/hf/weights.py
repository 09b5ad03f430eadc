"""Hugging Face <-> megatron-core weights: one table of every weight's names and shapes per architecture,
read by both directions (`hf_to_megatron`, `megatron_to_hf`, `lora_to_hf`), as pure functions.

The configs and the supported architectures are in `aligner.hf.layout`; this module maps the tensors of a
model whose config that module has made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from aligner.hf.layout import ARCHS, GEMMA3, LLAMA_FAMILY, check_exportable
from aligner.models import parameter_names as param_names
from aligner.models.gpt import GPTConfig, padded_vocab_size
from aligner.runtime.errors import ConfigError, DataError

# Non-parameter tensors some HF checkpoints carry (buffers recomputed by the model).
_IGNORED_SUFFIXES = {arch: (".rotary_emb.inv_freq",) for arch in (*LLAMA_FAMILY, GEMMA3)} | {
    "gpt2": (".attn.bias", ".attn.masked_bias"),
}


# HF names (relative to model.layers.{i}.) of an MoE layer's router and of expert e's
# (gate, up, down) projections, as real checkpoints and save_pretrained store them.
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj")),
}
_DENSE_MLP_NAMES = ("mlp.", ("gate_proj", "up_proj", "down_proj"))


def _mlp_name_pairs(cfg: GPTConfig, arch: str, layer: int) -> list[tuple[str, str, str, str]]:
    """(HF prefix, megatron prefix, ...) per SwiGLU block of a layer: (hf, mg, gate, up, down) names."""
    hf, mg = f"model.layers.{layer}.", param_names.layer(layer)
    if not cfg.is_moe:
        prefix, (gate, up, down) = _DENSE_MLP_NAMES
        return [(hf + prefix, f"{mg}{param_names.MLP}.", gate, up, down)]
    _, expert, (gate, up, down) = _MOE_NAMES[arch]
    return [(hf + expert.format(e), mg + param_names.expert(e), gate, up, down)
            for e in range(cfg.num_moe_experts)]


class _Tensors:
    """A state dict consumed name by name, so leftovers and shape mismatches are reported."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], what: str):
        self.tensors = dict(state_dict)
        self.what = what

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise DataError(f"{self.what} has no tensor {name!r} (expected shape {list(shape)})")
        tensor = self.tensors.pop(name)
        if tuple(tensor.shape) != tuple(shape):
            raise DataError(f"{self.what}: {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor

    def pop_if_present(self, name: str) -> Optional[torch.Tensor]:
        return self.tensors.pop(name, None)

    def finish(self) -> None:
        if self.tensors:
            names = sorted(self.tensors)
            raise DataError(
                f"{self.what} has {len(names)} tensors the converter does not map, e.g. {names[:8]}; "
                "the checkpoint has parts this architecture does not (wrong model_type or an unsupported variant)"
            )


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """HF q [nq*hd, ...], k/v [ng*hd, ...] -> megatron's grouped [ng * (nq/ng + 2) * hd, ...]."""
    groups, head_dim = cfg.query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    packed = torch.cat(
        [
            q.reshape(groups, per_group * head_dim, *rest),
            k.reshape(groups, head_dim, *rest),
            v.reshape(groups, head_dim, *rest),
        ],
        dim=1,
    )
    return packed.reshape(groups * (per_group + 2) * head_dim, *rest)


def unpack_qkv(qkv: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, head_dim = cfg.query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * head_dim, *rest).split(
        [per_group * head_dim, head_dim, head_dim], dim=1
    )
    return (
        q.reshape(groups * per_group * head_dim, *rest),
        k.reshape(groups * head_dim, *rest),
        v.reshape(groups * head_dim, *rest),
    )


def _pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    # Padding rows are zeros: their logits are masked anyway, and zeros keep them inert.
    return torch.cat([weight, weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])])


def _strip_prefix(state_dict: Mapping[str, torch.Tensor], arch: str) -> dict:
    """Accept base-model checkpoints (LlamaModel / GPT2Model) whose names lack the model prefix."""
    prefix = "transformer." if arch == "gpt2" else "model."
    first = "wte.weight" if arch == "gpt2" else "embed_tokens.weight"
    if first in state_dict:
        return {(name if name == "lm_head.weight" else prefix + name): t for name, t in state_dict.items()}
    return dict(state_dict)


@dataclass(frozen=True)
class _WeightPair:
    """One megatron tensor and the HF tensor(s) it is made of; `kind` says how (both directions)."""

    megatron: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    kind: str = "copy"  # a key of _TO_MEGATRON / _TO_HF


def _weight_table(cfg: GPTConfig, arch: str) -> list[_WeightPair]:
    """Every weight of `arch` as (megatron name, HF names, HF shapes, kind): the one table import and export
    both read. A tied output layer is not in it (HF stores none, or a copy of the embedding)."""
    hidden, vocab, ffn = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.query_groups * cfg.head_dim
    weight, bias = param_names.weight, param_names.bias
    pairs: list[_WeightPair] = []

    def pair(megatron: str, hf: str | tuple[str, ...], *shapes: tuple[int, ...], kind: str = "copy") -> None:
        pairs.append(_WeightPair(megatron, (hf,) if isinstance(hf, str) else hf, shapes, kind))

    if arch == "gpt2":
        pair(weight(param_names.WORD_EMBEDDINGS), "transformer.wte.weight", (vocab, hidden), kind="vocab")
        pair(weight(param_names.POSITION_EMBEDDINGS), "transformer.wpe.weight", (cfg.max_position_embeddings, hidden))
        for i in range(cfg.num_layers):
            hf, mg = f"transformer.h.{i}.", param_names.layer(i)
            for hf_norm, mg_norm in (("ln_1", param_names.INPUT_NORM), ("ln_2", param_names.PRE_MLP_NORM)):
                for kind in ("weight", "bias"):
                    pair(f"{mg}{mg_norm}.{kind}", f"{hf}{hf_norm}.{kind}", (hidden,))
            # Conv1D stores [in, out]; c_attn's output is [q | k | v], each heads-contiguous.
            pair(f"{mg}{param_names.QKV}.weight", f"{hf}attn.c_attn.weight", (hidden, 3 * hidden), kind="conv1d_qkv")
            pair(f"{mg}{param_names.QKV}.bias", f"{hf}attn.c_attn.bias", (3 * hidden,), kind="fused_qkv")
            pair(f"{mg}{param_names.ATTENTION_OUT}.weight", f"{hf}attn.c_proj.weight", (hidden, hidden),
                 kind="transpose")
            pair(f"{mg}{param_names.ATTENTION_OUT}.bias", f"{hf}attn.c_proj.bias", (hidden,))
            pair(f"{mg}{param_names.FC1}.weight", f"{hf}mlp.c_fc.weight", (hidden, ffn), kind="transpose")
            pair(f"{mg}{param_names.FC1}.bias", f"{hf}mlp.c_fc.bias", (ffn,))
            pair(f"{mg}{param_names.FC2}.weight", f"{hf}mlp.c_proj.weight", (ffn, hidden), kind="transpose")
            pair(f"{mg}{param_names.FC2}.bias", f"{hf}mlp.c_proj.bias", (hidden,))
        pair(weight(param_names.FINAL_NORM), "transformer.ln_f.weight", (hidden,))
        pair(bias(param_names.FINAL_NORM), "transformer.ln_f.bias", (hidden,))
    else:
        mlp_ffn = cfg.expert_ffn_size if cfg.is_moe else ffn
        pair(weight(param_names.WORD_EMBEDDINGS), "model.embed_tokens.weight", (vocab, hidden), kind="vocab")
        for i in range(cfg.num_layers):
            hf, mg = f"model.layers.{i}.", param_names.layer(i)
            attention = f"{hf}self_attn."
            pair(f"{mg}{param_names.INPUT_NORM}.weight", f"{hf}input_layernorm.weight", (hidden,))
            pair(f"{mg}{param_names.QKV}.weight", tuple(f"{attention}{x}_proj.weight" for x in "qkv"),
                 (q_size, hidden), (kv_size, hidden), (kv_size, hidden), kind="qkv")
            if cfg.add_qkv_bias:
                pair(f"{mg}{param_names.QKV}.bias", tuple(f"{attention}{x}_proj.bias" for x in "qkv"),
                     (q_size,), (kv_size,), (kv_size,), kind="qkv")
            if cfg.qk_layernorm:
                for hf_norm, mg_norm in (("q_norm", param_names.Q_NORM), ("k_norm", param_names.K_NORM)):
                    pair(f"{mg}{mg_norm}.weight", f"{attention}{hf_norm}.weight", (cfg.head_dim,))
            pair(f"{mg}{param_names.ATTENTION_OUT}.weight", f"{attention}o_proj.weight", (hidden, q_size))
            if cfg.post_layer_norms:  # Gemma's sandwich norms
                pair(f"{mg}{param_names.POST_ATTENTION_NORM}.weight", f"{hf}post_attention_layernorm.weight",
                     (hidden,))
                pair(f"{mg}{param_names.PRE_MLP_NORM}.weight", f"{hf}pre_feedforward_layernorm.weight", (hidden,))
                pair(f"{mg}{param_names.POST_MLP_NORM}.weight", f"{hf}post_feedforward_layernorm.weight", (hidden,))
            else:
                pair(f"{mg}{param_names.PRE_MLP_NORM}.weight", f"{hf}post_attention_layernorm.weight", (hidden,))
            if cfg.is_moe:
                pair(f"{mg}{param_names.ROUTER}.weight", hf + _MOE_NAMES[arch][0], (cfg.num_moe_experts, hidden))
            for hf_mlp, mg_mlp, gate_name, up_name, down_name in _mlp_name_pairs(cfg, arch, i):
                pair(f"{mg_mlp}{param_names.LINEAR_FC1}.weight",
                     (f"{hf_mlp}{gate_name}.weight", f"{hf_mlp}{up_name}.weight"),
                     (mlp_ffn, hidden), (mlp_ffn, hidden), kind="gate_up")
                pair(f"{mg_mlp}{param_names.LINEAR_FC2}.weight", f"{hf_mlp}{down_name}.weight", (hidden, mlp_ffn))
        pair(weight(param_names.FINAL_NORM), "model.norm.weight", (hidden,))
    if not cfg.tie_embeddings:
        pair(weight(param_names.OUTPUT_LAYER), "lm_head.weight", (vocab, hidden), kind="vocab")
    return pairs


# kind -> (HF tensors -> the megatron tensor), given the config and the padded vocabulary size
_TO_MEGATRON = {
    "copy": lambda hf, cfg, padded: hf[0],
    "transpose": lambda hf, cfg, padded: hf[0].t(),
    "vocab": lambda hf, cfg, padded: _pad_vocab(hf[0], padded),  # padding rows are zero
    "qkv": lambda hf, cfg, padded: pack_qkv(*hf, cfg),
    "fused_qkv": lambda hf, cfg, padded: pack_qkv(*hf[0].chunk(3), cfg),
    "conv1d_qkv": lambda hf, cfg, padded: pack_qkv(*hf[0].t().chunk(3, dim=0), cfg),
    "gate_up": lambda hf, cfg, padded: torch.cat(hf),
}
# kind -> (the megatron tensor -> HF tensors), the inverse of _TO_MEGATRON
_TO_HF = {
    "copy": lambda tensor, cfg: (tensor,),
    "transpose": lambda tensor, cfg: (tensor.t(),),
    "vocab": lambda tensor, cfg: (tensor[: cfg.vocab_size],),  # padding rows dropped
    "qkv": lambda tensor, cfg: unpack_qkv(tensor, cfg),
    "fused_qkv": lambda tensor, cfg: (torch.cat(unpack_qkv(tensor, cfg)),),
    "conv1d_qkv": lambda tensor, cfg: (torch.cat(unpack_qkv(tensor, cfg)).t(),),
    "gate_up": lambda tensor, cfg: tuple(tensor.chunk(2)),
}


# kind -> (a LoRA B [out, rank] of the megatron weight -> the B of each HF module it is made of). A LoRA B
# keeps nn.Linear's [out, rank] layout also on GPT-2's Conv1D modules (PEFT's fan_in_fan_out), so the
# transposing kinds only split.
_LORA_B_TO_HF = {
    "copy": lambda b, cfg: (b,),
    "transpose": lambda b, cfg: (b,),
    "qkv": lambda b, cfg: unpack_qkv(b, cfg),
    "conv1d_qkv": lambda b, cfg: (torch.cat(unpack_qkv(b, cfg)),),
    "gate_up": lambda b, cfg: tuple(b.chunk(2)),
}


def lora_to_hf(adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]], cfg: GPTConfig,
               arch: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{megatron weight name: (A [rank, in], B [out, rank])} of TP=1 adapters -> {HF module name: (A, B)}.

    A megatron weight made of several HF weights (q/k/v, gate/up) has one A for all of them: each HF
    module gets that A and its rows of B, which is the same update (B_q A is the q rows of B A).
    """
    check_exportable(cfg, arch)
    out = {}
    for pair in _weight_table(cfg, arch):
        if pair.megatron in adapters:
            a, b = adapters[pair.megatron]
            for hf_name, hf_b in zip(pair.hf, _LORA_B_TO_HF[pair.kind](b, cfg)):
                out[hf_name.removesuffix(".weight")] = (a.contiguous().clone(), hf_b.contiguous().clone())
    missing = set(adapters) - {pair.megatron for pair in _weight_table(cfg, arch)}
    if missing:
        raise ConfigError(f"adapters on {sorted(missing)[:3]} have no {arch} module to export to")
    return out


def _megatron_shape(pair: _WeightPair, padded: int) -> tuple[int, ...]:
    """The shape of the megatron tensor `pair.kind` makes of HF tensors of `pair.hf_shapes`."""
    first = pair.hf_shapes[0]
    if pair.kind == "vocab":
        return (padded, *first[1:])
    if pair.kind in ("transpose", "conv1d_qkv"):
        return tuple(reversed(first))
    if pair.kind in ("qkv", "gate_up"):  # concatenated along the first dimension
        return (sum(shape[0] for shape in pair.hf_shapes), *first[1:])
    return first


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], cfg: GPTConfig, arch: str) -> dict[str, torch.Tensor]:
    """Full TP=1 megatron GPTModel state dict (without `_extra_state`) from a full HF state dict.

    The vocabulary is zero-padded to `padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)`.
    Every HF tensor must be consumed: leftovers raise DataError.
    """
    if arch not in ARCHS:
        raise ConfigError(f"arch={arch!r} is not supported; supported HF architectures: {list(ARCHS)}")
    state = {
        name: tensor
        for name, tensor in _strip_prefix(hf_state_dict, arch).items()
        if not name.endswith(_IGNORED_SUFFIXES[arch])
    }
    if not cfg.tie_embeddings and "lm_head.weight" not in state:
        raise ConfigError(
            f"{arch} config: tie_word_embeddings=False but the checkpoint has no lm_head.weight "
            "(a base model without LM head, or a config that should say tie_word_embeddings=true)"
        )
    source = _Tensors(state, f"HF {arch} state dict")
    padded = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    out = {pair.megatron: _TO_MEGATRON[pair.kind](
               [source.take(name, shape) for name, shape in zip(pair.hf, pair.hf_shapes)], cfg, padded)
           for pair in _weight_table(cfg, arch)}
    if cfg.tie_embeddings:
        # Some checkpoints store the tied head anyway; accept it only if it really is the embedding.
        head = source.pop_if_present("lm_head.weight")
        embed = out[param_names.weight(param_names.WORD_EMBEDDINGS)][: cfg.vocab_size]
        if head is not None and not torch.equal(head, embed):
            raise ConfigError(
                f"{arch} config: tie_word_embeddings=True but the checkpoint's lm_head.weight differs from the "
                "input embedding; set tie_word_embeddings=false in config.json if the head is separate"
            )
    source.finish()
    return {name: tensor.contiguous() for name, tensor in out.items()}


def megatron_to_hf(megatron_state_dict: Mapping[str, torch.Tensor], cfg: GPTConfig,
                   arch: str) -> dict[str, torch.Tensor]:
    """Full HF state dict (as `save_pretrained` writes it) from a full TP=1 megatron state dict.

    `_extra_state` entries are ignored; padding vocabulary rows are dropped; a tied head is not
    written (transformers ties it on load). Every returned tensor owns its memory.
    """
    check_exportable(cfg, arch)
    source = _Tensors(
        {name: t for name, t in megatron_state_dict.items() if not name.endswith("_extra_state")},
        "megatron state dict",
    )
    padded = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    out: dict[str, torch.Tensor] = {}
    for pair in _weight_table(cfg, arch):
        out.update(zip(pair.hf, _TO_HF[pair.kind](source.take(pair.megatron, _megatron_shape(pair, padded)), cfg)))
    if cfg.tie_embeddings:
        source.pop_if_present(param_names.weight(param_names.OUTPUT_LAYER))  # a copy of the embedding on the last stage
    source.finish()
    # Views of one megatron tensor (q/k/v, gate/up) would share storage, which safetensors refuses.
    return {name: tensor.contiguous().clone() for name, tensor in out.items()}
