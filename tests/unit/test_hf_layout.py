"""HF <-> megatron layout: exact round trips, megatron's grouped QKV layout, config mapping, errors.

Pure tensor checks (no megatron model, no process group); logit parity against transformers is in
tests/distributed/test_hf_parity.py.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aligner.hf.layout import (  # noqa: E402
    check_exportable,
    gpt_config_from_hf,
    hf_config_from_gpt,
    hf_to_megatron,
    infer_arch,
    megatron_to_hf,
)
from aligner.models.gpt import GPTConfig  # noqa: E402

VOCAB = 100  # padded to 128
LLAMA_FAMILY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
)


def hf_config(arch: str, **overrides):
    if arch == "gpt2":
        values = dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=32, n_inner=96)
        values.update(overrides)
        return transformers.GPT2Config(**values)
    values = dict(LLAMA_FAMILY, **overrides)
    if arch == "mistral":
        values.setdefault("sliding_window", None)
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig}[arch](**values)


def saved_state_dict(config) -> dict[str, torch.Tensor]:
    """A random HF state dict in the form save_pretrained writes (no tied lm_head)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    state = {name: torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


ROUND_TRIP_CASES = [
    ("llama", {}),
    ("llama", dict(tie_word_embeddings=True, head_dim=16)),  # head_dim != hidden/heads
    ("qwen2", {}),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("mistral", dict(num_key_value_heads=4)),
    ("gpt2", {}),
    ("gpt2", dict(tie_word_embeddings=False)),
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
        assert torch.equal(block[per_group * head_dim:(per_group + 1) * head_dim], k[group * head_dim:(group + 1) * head_dim])
        assert torch.equal(block[(per_group + 1) * head_dim:], v[group * head_dim:(group + 1) * head_dim])


def test_gpt2_conv1d_weights_are_transposed_and_c_attn_is_split_per_head():
    config = hf_config("gpt2")
    cfg, _ = gpt_config_from_hf(config)
    hf_state = saved_state_dict(config)
    megatron_state = hf_to_megatron(hf_state, cfg, "gpt2")
    assert torch.equal(megatron_state["decoder.layers.0.mlp.linear_fc1.weight"], hf_state["transformer.h.0.mlp.c_fc.weight"].t())
    assert torch.equal(
        megatron_state["decoder.layers.0.self_attention.linear_proj.weight"], hf_state["transformer.h.0.attn.c_proj.weight"].t()
    )
    c_attn = hf_state["transformer.h.0.attn.c_attn.weight"].t()  # [3H, H] = [q; k; v]
    qkv = megatron_state["decoder.layers.0.self_attention.linear_qkv.weight"]
    head_dim = 16
    for head in range(4):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        for part in range(3):  # q, k, v of this head
            assert torch.equal(qkv[(3 * head + part) * head_dim:(3 * head + part + 1) * head_dim], c_attn[part * 64:][rows])


def test_config_mapping():
    cfg, arch = gpt_config_from_hf(hf_config("qwen2", rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True))
    assert arch == "qwen2"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.ffn_size) == (2, 64, 8, 2, 96)
    assert (cfg.normalization, cfg.activation, cfg.position_embedding_type) == ("RMSNorm", "swiglu", "rope")
    assert (cfg.add_qkv_bias, cfg.add_bias_linear, cfg.tie_embeddings) == (True, False, True)
    assert (cfg.norm_epsilon, cfg.rotary_base, cfg.vocab_size, cfg.head_dim) == (1e-6, 1e6, VOCAB, 8)

    cfg, arch = gpt_config_from_hf(hf_config("gpt2", activation_function="gelu_new", n_inner=None), make_vocab_size_divisible_by=64)
    assert arch == "gpt2"
    assert (cfg.normalization, cfg.activation, cfg.position_embedding_type) == ("LayerNorm", "gelu_tanh", "learned_absolute")
    assert (cfg.add_qkv_bias, cfg.add_bias_linear, cfg.tie_embeddings) == (True, True, True)
    assert (cfg.ffn_size, cfg.max_position_embeddings, cfg.make_vocab_size_divisible_by) == (256, 32, 64)
    assert gpt_config_from_hf(hf_config("gpt2", activation_function="gelu"))[0].activation == "gelu"


def test_raw_config_json_with_legacy_rope_fields():
    raw = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None)
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
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope"),
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
    llama_like = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB)
    assert infer_arch(llama_like) == "llama"
    with pytest.raises(ValueError, match="model.add_qkv_bias=False cannot be exported as qwen2"):
        check_exportable(llama_like, "qwen2")
    with pytest.raises(ValueError, match="arch='bert'"):
        hf_config_from_gpt(llama_like, "bert")


def test_reading_hf_directories(tmp_path):
    """Sharded safetensors are merged; missing config, weights or shards are named in the error."""
    import json

    from safetensors.torch import save_file

    from aligner.hf.convert import export_hf, read_hf_config, read_hf_state_dict

    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        read_hf_state_dict(tmp_path)
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors, which is missing"):
        read_hf_state_dict(tmp_path)
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    state = read_hf_state_dict(tmp_path)
    assert sorted(state) == ["a", "b"] and torch.equal(state["b"], torch.zeros(3))
    # Export never writes into (or clears) a directory that already holds files.
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(tmp_path / "no_checkpoint", tmp_path)
