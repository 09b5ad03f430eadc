"""The megatron name table (aligner.models.parameter_names) names exactly a real GPTModel's parameters."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from aligner.models import parameter_names as param_names
from aligner.models.gpt import GPTConfig, build_model_chunks
from aligner.runtime.distributed import ParallelConfig

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             vocab_size=64, max_position_embeddings=32)


def names_from_table(cfg: GPTConfig) -> set[str]:
    """Every parameter of a local-spec GPTModel, spelled with the table (an independent listing of the
    table's use by hf/layout.py, trtllm.py and native/weights.py)."""
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    norm_kinds = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    names = {param_names.weight(param_names.WORD_EMBEDDINGS)}
    names |= {f"{param_names.FINAL_NORM}.{kind}" for kind in norm_kinds}
    if cfg.position_embedding_type == "learned_absolute":
        names.add(param_names.weight(param_names.POSITION_EMBEDDINGS))
    if not cfg.tie_embeddings:
        names.add(param_names.weight(param_names.OUTPUT_LAYER))
    for index in range(cfg.num_layers):
        layer = param_names.layer(index)
        names |= {f"{layer}{norm}.{kind}" for norm in (param_names.INPUT_NORM, param_names.PRE_MLP_NORM)
                  for kind in norm_kinds}
        qkv_kinds = ("weight", "bias") if cfg.add_bias_linear or cfg.add_qkv_bias else ("weight",)
        names |= {f"{layer}{param_names.QKV}.{kind}" for kind in qkv_kinds}
        names |= {f"{layer}{param_names.ATTENTION_OUT}.{kind}" for kind in kinds}
        if cfg.qk_layernorm:
            names |= {f"{layer}{norm}.weight" for norm in (param_names.Q_NORM, param_names.K_NORM)}
        if cfg.is_moe:
            names.add(param_names.weight(layer + param_names.ROUTER))
            names |= {f"{layer}{param_names.expert(e)}{linear}.weight" for e in range(cfg.num_moe_experts)
                      for linear in (param_names.LINEAR_FC1, param_names.LINEAR_FC2)}
        else:
            names |= {f"{layer}{module}.{kind}" for module in (param_names.FC1, param_names.FC2) for kind in kinds}
    return names


@pytest.mark.parametrize("overrides", [
    {},  # llama-style
    {"qk_layernorm": True, "kv_channels": 16},  # qwen3-style
    dataclasses.asdict(GPTConfig.gpt2()),  # gpt2-style: LayerNorm, biases, learned positions, tied head
    {"add_qkv_bias": True},  # qwen2-style
    {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48},  # mixtral-style
], ids=["llama", "qk_norm", "gpt2", "qkv_bias", "moe"])
def test_the_table_names_every_parameter_of_a_megatron_model(single_process, overrides):
    cfg = GPTConfig(**{**overrides, **SMALL})
    chunk = build_model_chunks(cfg, ParallelConfig(), torch.float32)[0]
    actual = {name for name, _ in chunk.named_parameters()}
    assert actual == names_from_table(cfg)
    for module in (param_names.LAYERS, param_names.layer(0) + param_names.QKV, param_names.layer(1) + param_names.MLP):
        chunk.get_submodule(module.rstrip("."))  # module paths the native engine binds
