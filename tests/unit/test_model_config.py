"""GPTConfig and ParallelConfig: the MoE, q/k-norm and RoPE-scaling fields map onto megatron's
TransformerConfig / GPTModel, and settings megatron cannot run are refused naming the field."""
from __future__ import annotations

import pytest

from aligner.models.gpt import GPTConfig, num_parameters, transformer_config
from aligner.runtime.distributed import ParallelConfig

VOCAB = 100


def test_moe_and_qk_norm_fields_reach_megatrons_transformer_config():
    cfg = GPTConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, qk_layernorm=True,
                    num_moe_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2, moe_router_pre_softmax=True)
    config = transformer_config(cfg, expert_parallel_size=2)
    assert (config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_router_topk) == (4, 48, 2)
    assert ((config.moe_router_pre_softmax, config.moe_router_score_function, config.qk_layernorm)
            == (True, "softmax", True))
    assert (config.expert_model_parallel_size, config.moe_grouped_gemm) == (2, False)
    # No aux loss unless asked for: training sees only the task loss.
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("none", 0.0)
    weighted = transformer_config(GPTConfig(vocab_size=VOCAB, num_moe_experts=4, moe_aux_loss_coeff=0.01))
    assert (weighted.moe_router_load_balancing_type, weighted.moe_aux_loss_coeff) == ("aux_loss", 0.01)
    dense = transformer_config(GPTConfig(vocab_size=VOCAB))
    assert dense.num_moe_experts is None and dense.qk_layernorm is False


@pytest.mark.parametrize("fields,parallel,message", [
    (dict(num_moe_experts=4, moe_router_topk=1), {}, "moe_router_topk=1 needs model.moe_router_pre_softmax=true"),
    (dict(num_moe_experts=4, moe_router_topk=5), {}, r"moe_router_topk=5 must be in \[1, num_moe_experts=4\]"),
    (dict(num_moe_experts=3), dict(expert_parallel_size=2),
     "num_moe_experts=3 is not divisible by expert_model_parallel_size=2"),
    (dict(num_moe_experts=4, moe_ffn_hidden_size=33), dict(tensor_parallel_size=2), "moe_ffn_hidden_size=33"),
    (dict(num_moe_experts=4, moe_token_dispatcher_type="flex"), {}, "dispatcher_type='flex' is not one of allgather"),
    (dict(num_moe_experts=4, add_bias_linear=True), {}, "add_bias_linear=true is not supported with MoE"),
    ({}, dict(expert_parallel_size=2), "expert_model_parallel_size=2 needs an MoE model"),
    (dict(llama3_rope_scaling_factor=8.0, position_embedding_type="learned_absolute"), {},
     "llama3_rope_scaling_factor"),
])
def test_settings_megatron_cannot_run_are_refused_naming_the_field(fields, parallel, message):
    cfg = GPTConfig(vocab_size=VOCAB, **fields)
    with pytest.raises(ValueError, match=message):
        cfg.validate(**parallel)


def test_expert_parallel_size_must_divide_the_data_parallel_size():
    assert ParallelConfig(expert_model_parallel_size=2).data_parallel_size(4) == 4
    assert ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2).data_parallel_size(4) == 2
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 must divide the data-parallel size 1"):
        ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2).data_parallel_size(2)
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 must divide the data-parallel size 4"):
        ParallelConfig(expert_model_parallel_size=3).data_parallel_size(4)


def test_parameter_count_includes_every_expert_and_the_qk_norms():
    dense = GPTConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, num_layers=2)
    moe = GPTConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, num_layers=2,
                    num_moe_experts=4, qk_layernorm=True)
    per_layer_mlp = 64 * 96 * 3
    assert num_parameters(moe) - num_parameters(dense) == 2 * (3 * per_layer_mlp + 4 * 64 + 2 * 16)


def test_moe_training_at_tp2_is_refused_before_megatron_fails_mid_step():
    from aligner.training.setup import check_trainable

    moe = GPTConfig(vocab_size=VOCAB, num_moe_experts=4)
    check_trainable(transformer_config(moe))  # TP=1 trains
    check_trainable(transformer_config(GPTConfig(vocab_size=VOCAB), tensor_parallel_size=2))  # dense at TP=2 trains
    with pytest.raises(ValueError, match="num_moe_experts=4.*tensor_model_parallel_size=2 only with "
                                         "parallel.sequence_parallel=true"):
        check_trainable(transformer_config(moe, tensor_parallel_size=2))
