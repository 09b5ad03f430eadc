"""HF <-> megatron layout: exact round trips, megatron's grouped QKV layout, config mapping, errors.

Pure tensor checks (no megatron model, no process group); logit parity against transformers is in
tests/distributed/test_hf_parity.py.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aligner.hf.layout import check_exportable, gpt_config_from_hf, hf_config_from_gpt, infer_arch  # noqa: E402
from aligner.hf.weights import hf_to_megatron, megatron_to_hf  # noqa: E402
from aligner.models.gpt import GPTConfig  # noqa: E402

VOCAB = 100  # padded to 128
LLAMA_FAMILY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.2's


GEMMA3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, query_pre_attn_scalar=24,
              sliding_window=32, sliding_window_pattern=2)  # layers 1 and 3 in the window, 2 and 4 global


def hf_config(arch: str, **overrides):
    if arch == "gemma3_text":
        return transformers.Gemma3TextConfig(**dict(GEMMA3, **overrides))
    if arch == "gpt2":
        values = dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=32, n_inner=96)
        values.update(overrides)
        return transformers.GPT2Config(**values)
    values = dict(LLAMA_FAMILY, **overrides)
    if arch in ("mistral", "mixtral"):
        values.setdefault("sliding_window", None)
    if arch == "qwen3":
        values.setdefault("head_dim", 16)
    if arch == "mixtral":
        values = dict(dict(num_experts_per_tok=2, num_local_experts=4), **values)
    if arch == "qwen3_moe":
        values = dict(dict(num_experts_per_tok=2, num_experts=4, moe_intermediate_size=48, head_dim=16,
                           norm_topk_prob=True), **values)
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
            "mistral": transformers.MistralConfig, "mixtral": transformers.MixtralConfig,
            "qwen3_moe": transformers.Qwen3MoeConfig}[arch](**values)


def saved_state_dict(config) -> dict[str, torch.Tensor]:
    """A random HF state dict as save_pretrained writes it: no tied lm_head, and MoE experts one by one
    under the checkpoint names (transformers 5 fuses them in memory and splits them again on save)."""
    import tempfile

    from aligner.hf.convert import read_hf_state_dict

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param))
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return read_hf_state_dict(directory)


ROUND_TRIP_CASES = [
    ("llama", {}),
    ("llama", dict(tie_word_embeddings=True, head_dim=16)),  # head_dim != hidden/heads
    ("qwen2", {}),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("mistral", dict(num_key_value_heads=4)),
    ("gpt2", {}),
    ("gpt2", dict(tie_word_embeddings=False)),
    ("llama", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    ("qwen3", {}),
    ("qwen3", dict(tie_word_embeddings=True)),
    ("mixtral", {}),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(norm_topk_prob=False, num_experts_per_tok=1)),
    ("llama", dict(rope_parameters=dict(LLAMA3_ROPE, original_max_position_embeddings=4096, low_freq_factor=2.0,
                                        high_freq_factor=8.0, factor=16.0))),  # not Llama 3.1's values
    ("gemma3_text", {}),
    ("gemma3_text", dict(tie_word_embeddings=False, sliding_window_pattern=6, num_hidden_layers=6)),
]


@pytest.mark.parametrize("arch,overrides", ROUND_TRIP_CASES)
def test_hf_megatron_hf_round_trip_is_exact(arch, overrides):
    config = hf_config(arch, **overrides)
    cfg, detected = gpt_config_from_hf(config)
    assert detected == arch
    hf_state = saved_state_dict(config)
    megatron_state = hf_to_megatron(hf_state, cfg, arch)
    back = megatron_to_hf(megatron_state, cfg, arch)
    assert sorted(back) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    # safetensors refuses tensors that share memory; every exported tensor must own its storage.
    pointers = [tensor.untyped_storage().data_ptr() for tensor in back.values()]
    assert len(set(pointers)) == len(pointers)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_megatron_names_shapes_and_vocab_padding(arch):
    config = hf_config(arch)
    cfg, _ = gpt_config_from_hf(config)
    megatron_state = hf_to_megatron(saved_state_dict(config), cfg, arch)
    hidden, layers = 64, 2
    heads, groups = (4, 4) if arch == "gpt2" else (8, 2)
    head_dim = hidden // heads
    qkv_rows = (heads + 2 * groups) * head_dim
    expected = {
        "embedding.word_embeddings.weight": (128, hidden),
        "decoder.final_layernorm.weight": (hidden,),
    }
    for i in range(layers):
        layer = f"decoder.layers.{i}."
        expected.update({
            layer + "input_layernorm.weight": (hidden,),
            layer + "self_attention.linear_qkv.weight": (qkv_rows, hidden),
            layer + "self_attention.linear_proj.weight": (hidden, heads * head_dim),
            layer + "pre_mlp_layernorm.weight": (hidden,),
            layer + "mlp.linear_fc1.weight": (96 if arch == "gpt2" else 192, hidden),
            layer + "mlp.linear_fc2.weight": (hidden, 96),
        })
        if arch != "llama":
            expected[layer + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        if arch == "gpt2":
            for name in ("input_layernorm", "pre_mlp_layernorm", "self_attention.linear_proj", "mlp.linear_fc2"):
                expected[f"{layer}{name}.bias"] = (hidden,)
            expected[layer + "mlp.linear_fc1.bias"] = (96,)
    if arch == "gpt2":
        expected["embedding.position_embeddings.weight"] = (32, hidden)
        expected["decoder.final_layernorm.bias"] = (hidden,)
    else:
        expected["output_layer.weight"] = (128, hidden)
    assert {name: tuple(t.shape) for name, t in megatron_state.items()} == expected
    assert torch.count_nonzero(megatron_state["embedding.word_embeddings.weight"][VOCAB:]) == 0
    if "output_layer.weight" in megatron_state:
        assert torch.count_nonzero(megatron_state["output_layer.weight"][VOCAB:]) == 0


def test_llama_qkv_follows_megatrons_grouped_layout():
    """Per query group: its nq/ng query heads, then its key head, then its value head (no RoPE permutation)."""
    config = hf_config("llama")
    cfg, _ = gpt_config_from_hf(config)
    hf_state = saved_state_dict(config)
    qkv = hf_to_megatron(hf_state, cfg, "llama")["decoder.layers.1.self_attention.linear_qkv.weight"]
    q, k, v = (hf_state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    head_dim, per_group = 8, 4
    for group in range(2):
        block = qkv[group * (per_group + 2) * head_dim:(group + 1) * (per_group + 2) * head_dim]
        queries = q[group * per_group * head_dim:(group + 1) * per_group * head_dim]
        assert torch.equal(block[:per_group * head_dim], queries)
        assert torch.equal(block[per_group * head_dim:(per_group + 1) * head_dim],
                           k[group * head_dim:(group + 1) * head_dim])
        assert torch.equal(block[(per_group + 1) * head_dim:], v[group * head_dim:(group + 1) * head_dim])


def test_gpt2_conv1d_weights_are_transposed_and_c_attn_is_split_per_head():
    config = hf_config("gpt2")
    cfg, _ = gpt_config_from_hf(config)
    hf_state = saved_state_dict(config)
    megatron_state = hf_to_megatron(hf_state, cfg, "gpt2")
    assert torch.equal(megatron_state["decoder.layers.0.mlp.linear_fc1.weight"],
                       hf_state["transformer.h.0.mlp.c_fc.weight"].t())
    assert torch.equal(megatron_state["decoder.layers.0.self_attention.linear_proj.weight"],
                       hf_state["transformer.h.0.attn.c_proj.weight"].t())
    c_attn = hf_state["transformer.h.0.attn.c_attn.weight"].t()  # [3H, H] = [q; k; v]
    qkv = megatron_state["decoder.layers.0.self_attention.linear_qkv.weight"]
    head_dim = 16
    for head in range(4):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        for part in range(3):  # q, k, v of this head
            assert torch.equal(qkv[(3 * head + part) * head_dim:(3 * head + part + 1) * head_dim],
                               c_attn[part * 64:][rows])


def test_config_mapping():
    cfg, arch = gpt_config_from_hf(hf_config("qwen2", rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True))
    assert arch == "qwen2"
    assert ((cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.ffn_size)
            == (2, 64, 8, 2, 96))
    assert (cfg.normalization, cfg.activation, cfg.position_embedding_type) == ("RMSNorm", "swiglu", "rope")
    assert (cfg.add_qkv_bias, cfg.add_bias_linear, cfg.tie_embeddings) == (True, False, True)
    assert (cfg.norm_epsilon, cfg.rotary_base, cfg.vocab_size, cfg.head_dim) == (1e-6, 1e6, VOCAB, 8)

    cfg, arch = gpt_config_from_hf(hf_config("gpt2", activation_function="gelu_new", n_inner=None),
                                   make_vocab_size_divisible_by=64)
    assert arch == "gpt2"
    assert ((cfg.normalization, cfg.activation, cfg.position_embedding_type)
            == ("LayerNorm", "gelu_tanh", "learned_absolute"))
    assert (cfg.add_qkv_bias, cfg.add_bias_linear, cfg.tie_embeddings) == (True, True, True)
    assert (cfg.ffn_size, cfg.max_position_embeddings, cfg.make_vocab_size_divisible_by) == (256, 32, 64)
    assert gpt_config_from_hf(hf_config("gpt2", activation_function="gelu"))[0].activation == "gelu"


def test_raw_config_json_with_legacy_rope_fields():
    raw = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
               rope_scaling=None)
    cfg, arch = gpt_config_from_hf(raw)
    assert (arch, cfg.rotary_base, cfg.query_groups, cfg.tie_embeddings) == ("llama", 500000.0, 4, False)


@pytest.mark.parametrize("arch,overrides", ROUND_TRIP_CASES + [("mistral", dict(sliding_window=64))])
def test_config_round_trip_through_transformers(arch, overrides):
    cfg, _ = gpt_config_from_hf(hf_config(arch, **overrides))
    exported = hf_config_from_gpt(cfg, arch, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    assert exported.model_type == arch and exported.eos_token_id == 2 and exported.pad_token_id == 3
    assert gpt_config_from_hf(exported)[0] == cfg
    # A fresh transformers config object from the written dict maps to the same model.
    reloaded = transformers.AutoConfig.for_model(**exported.to_dict())
    assert gpt_config_from_hf(reloaded)[0] == cfg


UNSUPPORTED = [
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type='linear'"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters.rope_type='yarn'"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters.rope_type='dynamic'"),
    ("llama", dict(rope_parameters=dict(LLAMA3_ROPE, low_freq_factor=4.0)), "rope_parameters.high_freq_factor=4.0"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("gemma3_text", dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    ("gemma3_text", dict(hidden_activation="silu"), "hidden_activation='silu'"),
    ("gemma3_text", dict(layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"]),
     "layer_types="),
    ("gemma3_text", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}),
     "rope_parameters.rope_type='yarn'"),
    ("llama", dict(rope_parameters=dict(LLAMA3_ROPE, partial_rotary_factor=0.5)), "partial_rotary_factor=0.5"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding_window=16"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ("mixtral", dict(num_experts_per_tok=1), "num_experts_per_tok=1"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("llama", dict(rope_theta=10000.5), "rope_theta"),
    ("mistral", dict(sliding_window=16), "sliding_window=16"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "sliding_window=16"),
    ("gpt2", dict(activation_function="gelu_fast"), "activation_function"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights"),
]


@pytest.mark.parametrize("arch,overrides,field", UNSUPPORTED)
def test_unsupported_features_name_the_config_field(arch, overrides, field):
    with pytest.raises(ValueError, match=field):
        gpt_config_from_hf(hf_config(arch, **overrides))


def test_unknown_model_type_is_rejected():
    with pytest.raises(ValueError, match="model_type='bert'"):
        gpt_config_from_hf({"model_type": "bert"})


def test_sliding_window_no_shorter_than_the_context_is_accepted():
    cfg, arch = gpt_config_from_hf(hf_config("mistral", sliding_window=64))
    assert arch == "mistral" and cfg.max_position_embeddings == 64


def test_tied_head_that_differs_from_the_embedding_is_rejected():
    config = hf_config("qwen2", tie_word_embeddings=True)
    cfg, _ = gpt_config_from_hf(config)
    state = saved_state_dict(config)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    hf_to_megatron(state, cfg, "qwen2")  # a stored copy of the tied head is fine
    state["lm_head.weight"] += 1
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        hf_to_megatron(state, cfg, "qwen2")


def test_missing_untied_head_and_leftover_tensors_are_rejected():
    config = hf_config("llama")
    cfg, _ = gpt_config_from_hf(config)
    state = saved_state_dict(config)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        hf_to_megatron({k: v for k, v in state.items() if k != "lm_head.weight"}, cfg, "llama")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.bias"):
        hf_to_megatron(dict(state, **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}), cfg, "llama")
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[32\]"):
        hf_to_megatron(dict(state, **{"model.norm.weight": torch.zeros(32)}), cfg, "llama")


def test_base_model_checkpoints_without_prefix_and_rotary_buffers_are_accepted():
    config = hf_config("gpt2")
    cfg, _ = gpt_config_from_hf(config)
    state = saved_state_dict(config)
    bare = {name.removeprefix("transformer."): t for name, t in state.items()}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # causal-mask buffer of old GPT-2 checkpoints
    assert all(torch.equal(a, b) for a, b in zip(hf_to_megatron(bare, cfg, "gpt2").values(),
                                                  hf_to_megatron(state, cfg, "gpt2").values()))


def test_export_refuses_an_architecture_that_cannot_represent_the_model():
    gpt2_like = GPTConfig.gpt2(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB)
    assert infer_arch(gpt2_like) == "gpt2"
    with pytest.raises(ValueError, match="model.normalization='LayerNorm' cannot be exported as llama"):
        check_exportable(gpt2_like, "llama")
    llama_like = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                 vocab_size=VOCAB)
    assert infer_arch(llama_like) == "llama"
    with pytest.raises(ValueError, match="model.add_qkv_bias=False cannot be exported as qwen2"):
        check_exportable(llama_like, "qwen2")
    with pytest.raises(ValueError, match="arch='bert'"):
        hf_config_from_gpt(llama_like, "bert")


def test_reading_hf_directories(tmp_path):
    """Sharded safetensors are merged; missing config, weights or shards are named in the error."""
    import json

    from safetensors.torch import save_file

    from aligner.config import ConfigError, OutputError
    from aligner.data.jsonl import DataError
    from aligner.hf.convert import export_hf, read_hf_config, read_hf_state_dict

    with pytest.raises(ConfigError, match="no config.json"):
        read_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="model.safetensors.index.json"):
        read_hf_state_dict(tmp_path)
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="model-00002-of-00002.safetensors, which is missing"):
        read_hf_state_dict(tmp_path)
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    state = read_hf_state_dict(tmp_path)
    assert sorted(state) == ["a", "b"] and torch.equal(state["b"], torch.zeros(3))
    # Export never writes into (or clears) a directory that already holds files.
    with pytest.raises(OutputError, match="not empty"):
        export_hf(tmp_path.with_name("no_checkpoint"), tmp_path)


def test_llama3_rope_scaling_from_old_and_new_config_generations():
    raw = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=131072, rope_theta=500000.0,
               rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    cfg, _ = gpt_config_from_hf(raw)  # a Llama 3.x config.json as released (transformers 4 layout)
    assert (cfg.rotary_base, cfg.llama3_rope_scaling_factor) == (500000.0, 32.0)
    assert gpt_config_from_hf(hf_config("llama", rope_parameters=LLAMA3_ROPE))[0].llama3_rope_scaling_factor == 32.0
    assert gpt_config_from_hf(hf_config("llama"))[0].llama3_rope_scaling_factor is None
    raw["rope_scaling"] = dict(raw["rope_scaling"], high_freq_factor=1.0)
    with pytest.raises(ValueError,
                       match=r"rope_scaling.high_freq_factor=1.0 is not supported: it must be above low_freq_factor"):
        gpt_config_from_hf(raw)
    del raw["rope_scaling"]["original_max_position_embeddings"]
    with pytest.raises(ValueError, match=r"rope_scaling.original_max_position_embeddings is missing"):
        gpt_config_from_hf(raw)


@pytest.mark.parametrize("theta,factor,low,high,original", [
    (500000.0, 8.0, 1.0, 4.0, 8192), (500000.0, 32.0, 1.0, 4.0, 8192), (10000.0, 4.0, 1.0, 4.0, 8192),
    (500000.0, 16.0, 2.0, 8.0, 4096), (10000.0, 8.0, 1.0, 2.0, 2048), (1000000.0, 4.0, 0.5, 3.0, 32768)])
def test_megatron_llama3_rotary_frequencies_equal_transformers(theta, factor, low, high, original):
    """The one fact the whole scaling rests on: the model's scaled inverse frequencies (as the megatron model
    builds them, `configure_rotary_embedding`) are HF's, computed here in float64."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from aligner.models.gpt import configure_rotary_embedding

    rope = dict(LLAMA3_ROPE, rope_theta=theta, factor=factor, low_freq_factor=low, high_freq_factor=high,
                original_max_position_embeddings=original)
    config = hf_config("llama", rope_parameters=rope, head_dim=64, max_position_embeddings=4 * original)
    cfg, _ = gpt_config_from_hf(config)
    megatron = RotaryEmbedding(kv_channels=cfg.head_dim, rotary_percent=1.0, rotary_base=int(cfg.rotary_base),
                               use_cpu_initialization=True)
    configure_rotary_embedding(megatron, cfg)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.float64)
        try:
            hf_inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        finally:
            torch.set_default_dtype(torch.float32)
    plain = 1.0 / theta ** (torch.arange(0, 64, 2).double() / 64)
    # Low frequencies are divided by the factor, high ones kept, the band between smoothed.
    assert (hf_inv_freq < plain * (1 - 1e-9)).any() and (hf_inv_freq == plain).any()
    torch.testing.assert_close(megatron.inv_freq.double(), hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert float(attention_scaling) == 1.0  # llama3 does not rescale cos/sin


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_experts_map_to_megatron_local_experts(arch):
    """Per-expert HF tensors (as on disk) -> megatron's router and local_experts.{e} fc1 = [gate; up], fc2 = down."""
    config = hf_config(arch)
    cfg, _ = gpt_config_from_hf(config)
    hf_state = saved_state_dict(config)
    megatron_state = hf_to_megatron(hf_state, cfg, arch)
    router, expert, (gate, up, down) = {
        "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.", ("w1", "w3", "w2")),
        "qwen3_moe": ("mlp.gate", "mlp.experts.", ("gate_proj", "up_proj", "down_proj")),
    }[arch]
    expert_ffn = 96 if arch == "mixtral" else 48
    assert torch.equal(megatron_state["decoder.layers.1.mlp.router.weight"],
                       hf_state[f"model.layers.1.{router}.weight"])
    for e in range(4):
        hf_expert, mg_expert = f"model.layers.1.{expert}{e}.", f"decoder.layers.1.mlp.experts.local_experts.{e}."
        fc1 = megatron_state[mg_expert + "linear_fc1.weight"]
        assert fc1.shape == (2 * expert_ffn, 64)
        assert torch.equal(fc1[:expert_ffn], hf_state[f"{hf_expert}{gate}.weight"])
        assert torch.equal(fc1[expert_ffn:], hf_state[f"{hf_expert}{up}.weight"])
        assert torch.equal(megatron_state[mg_expert + "linear_fc2.weight"], hf_state[f"{hf_expert}{down}.weight"])
    assert not any(".mlp.linear_fc" in name for name in megatron_state)


def test_moe_routing_maps_to_megatrons_router_options():
    """mixtral and qwen3_moe(norm_topk_prob) renormalise the top-k: megatron's softmax over the top-k logits;
    qwen3_moe without it keeps the full softmax's top-k: moe_router_pre_softmax. No aux loss."""
    mixtral, _ = gpt_config_from_hf(hf_config("mixtral"))
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk, mixtral.moe_router_pre_softmax) == (4, 2, False)
    assert (mixtral.expert_ffn_size, mixtral.qk_layernorm, mixtral.moe_aux_loss_coeff) == (96, False, 0.0)
    qwen, _ = gpt_config_from_hf(hf_config("qwen3_moe", norm_topk_prob=True))
    assert ((qwen.moe_router_pre_softmax, qwen.expert_ffn_size, qwen.ffn_size, qwen.qk_layernorm)
            == (False, 48, 96, True))
    assert gpt_config_from_hf(hf_config("qwen3_moe", norm_topk_prob=False))[0].moe_router_pre_softmax is True
    # The same routing weights, computed both ways, for a renormalised top-2 of 6 experts:
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    full = torch.softmax(logits, -1)
    top, index = full.topk(2, -1)
    for pre_softmax, expected in ((False, top / top.sum(-1, keepdim=True)), (True, top)):
        probs, routing_map = topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax)
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, index, True))
        torch.testing.assert_close(probs.gather(1, index), expected, rtol=1e-6, atol=0)  # megatron: fp32 softmax


def test_qwen3_config_and_qk_norm_names():
    config = hf_config("qwen3")
    cfg, arch = gpt_config_from_hf(config)
    assert ((arch, cfg.qk_layernorm, cfg.head_dim, cfg.add_qkv_bias, cfg.norm_epsilon)
            == ("qwen3", True, 16, False, 1e-6))
    assert infer_arch(cfg) == "qwen3"
    hf_state = saved_state_dict(config)
    megatron_state = hf_to_megatron(hf_state, cfg, "qwen3")
    for hf_norm, mg_norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
        assert torch.equal(megatron_state[f"decoder.layers.0.self_attention.{mg_norm}.weight"],
                           hf_state[f"model.layers.0.self_attn.{hf_norm}.weight"])
    # A Qwen3 config.json without head_dim means the class default 128, not hidden / heads.
    raw = dict(config.to_dict())
    del raw["head_dim"]
    assert gpt_config_from_hf(raw)[0].head_dim == 128


def test_new_families_infer_their_export_arch_and_refuse_the_others():
    for arch in ("qwen3", "mixtral", "qwen3_moe"):
        cfg, _ = gpt_config_from_hf(hf_config(arch))
        assert infer_arch(cfg) == arch
    mixtral, _ = gpt_config_from_hf(hf_config("mixtral"))
    with pytest.raises(ValueError, match="model.num_moe_experts=4 cannot be exported as llama"):
        check_exportable(mixtral, "llama")
    with pytest.raises(ValueError, match="model.qk_layernorm=False cannot be exported as qwen3_moe"):
        check_exportable(mixtral, "qwen3_moe")
    qwen_unnormalised, _ = gpt_config_from_hf(hf_config("qwen3_moe", norm_topk_prob=False))
    with pytest.raises(ValueError, match="model.qk_layernorm=True cannot be exported as mixtral"):
        check_exportable(qwen_unnormalised, "mixtral")
    qwen3, _ = gpt_config_from_hf(hf_config("qwen3"))
    with pytest.raises(ValueError, match="model.num_moe_experts=None cannot be exported as qwen3_moe"):
        check_exportable(qwen3, "qwen3_moe")


def test_gemma3_config_and_weight_names():
    config = hf_config("gemma3_text")
    cfg, arch = gpt_config_from_hf(config)
    assert arch == "gemma3_text" and infer_arch(cfg) == "gemma3_text"
    assert (cfg.activation, cfg.qk_layernorm, cfg.zero_centered_norm, cfg.post_layer_norms, cfg.scale_embeddings,
            cfg.tie_embeddings) == ("geglu_tanh", True, True, True, True, True)
    assert (cfg.head_dim, cfg.query_pre_attn_scalar, cfg.sliding_window, cfg.sliding_window_pattern,
            cfg.rotary_base, cfg.local_rotary_base) == (16, 24.0, 32, 2, 1e6, 1e4)
    assert [cfg.is_sliding_window_layer(n) for n in range(1, 5)] == [True, False, True, False]
    hf_state = saved_state_dict(config)
    megatron_state = hf_to_megatron(hf_state, cfg, arch)
    layer, hf_layer = "decoder.layers.1.", "model.layers.1."
    for megatron_name, hf_name in (("input_layernorm", "input_layernorm"),
                                   ("self_attention.linear_proj.post_layernorm", "post_attention_layernorm"),
                                   ("pre_mlp_layernorm", "pre_feedforward_layernorm"),
                                   ("mlp.linear_fc2.post_layernorm", "post_feedforward_layernorm"),
                                   ("self_attention.q_layernorm", "self_attn.q_norm")):
        # zero-centred, as HF stores them (megatron's norm scales by 1 + weight too)
        assert torch.equal(megatron_state[f"{layer}{megatron_name}.weight"], hf_state[f"{hf_layer}{hf_name}.weight"])
    # An older config.json: rope_theta and rope_local_base_freq, the pattern as an int
    raw = dict(model_type="gemma3_text", **{k: v for k, v in GEMMA3.items()}, rope_theta=500000.0,
               rope_local_base_freq=20000.0)
    legacy, _ = gpt_config_from_hf(raw)
    assert (legacy.rotary_base, legacy.local_rotary_base, legacy.sliding_window_pattern) == (500000.0, 20000.0, 2)
    llama, _ = gpt_config_from_hf(hf_config("llama"))
    with pytest.raises(ValueError, match="model.activation=.swiglu. cannot be exported as gemma3_text"):
        check_exportable(llama, "gemma3_text")
    with pytest.raises(ValueError, match="model.activation=.geglu_tanh. cannot be exported as llama"):
        check_exportable(cfg, "llama")


def test_rows_longer_than_the_sliding_window_are_refused_in_one_line():
    cfg, _ = gpt_config_from_hf(hf_config("gemma3_text"))
    cfg.check_sequence_lengths([(32, "data.max_seq_length=32")], "model.max_position_embeddings")
    with pytest.raises(ValueError, match=r"^data.max_seq_length=33 is above model.sliding_window=32: sliding-window "
                                         r"attention is not implemented \(rows up to the window are exact\)"):
        cfg.check_sequence_lengths([(33, "data.max_seq_length=33")], "model.max_position_embeddings")
    no_window = GPTConfig(vocab_size=VOCAB, max_position_embeddings=64)
    no_window.check_sequence_lengths([(64, "data.max_seq_length=64")], "model.max_position_embeddings")


@pytest.mark.parametrize("overrides,message", [
    (dict(post_layer_norms=True), "model.post_layer_norms needs model.zero_centered_norm=true"),
    (dict(zero_centered_norm=True, post_layer_norms=True, num_moe_experts=4),
     "model.post_layer_norms=true is implemented for dense MLPs"),
    (dict(zero_centered_norm=True, normalization="LayerNorm"), "model.zero_centered_norm needs model.normalization"),
    (dict(sliding_window=64, transformer_impl="transformer_engine"),
     "model.sliding_window is implemented for model.transformer_impl=local only"),
    (dict(llama3_rope_scaling_factor=8.0, llama3_rope_high_freq_factor=1.0),
     "model.llama3_rope_high_freq_factor=1.0 must be above model.llama3_rope_low_freq_factor=1.0"),
])
def test_new_model_fields_refuse_combinations_they_do_not_implement(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(vocab_size=VOCAB, **overrides).validate()
