"""The CPU-side parts of the TensorRT-LLM engine: weight conversion, config, sampling options, outputs.

TensorRT-LLM itself cannot be installed on these machines; what is checked here is everything it
would be fed. Per-rank q/k/v, MLP and head shards are checked against an independent path: the
megatron -> HF export (`megatron_to_hf`) followed by TRT-LLM's own recipe (split q, k, v per rank
and concatenate). The refit path from megatron's real TP=2 shards is checked under torchrun in
tests/distributed/test_trtllm_refit.py.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

from aligner.generation.engine import SamplingParams
from aligner.generation.trtllm import (
    INSTALL_HINT,
    TensorRTLLMEngine,
    megatron_to_trtllm_checkpoint,
    merge_megatron_tp_shards,
    rollout_from_outputs,
    sampling_to_trtllm,
    save_trtllm_checkpoint,
    split_megatron_tp,
    trtllm_config,
)
from aligner.hf.weights import megatron_to_hf
from aligner.models.gpt import GPTConfig, padded_vocab_size

VOCAB = 101  # not a multiple of 2 or 4: TRT-LLM pads the head; megatron pads to 128


def llama_cfg(**overrides) -> GPTConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96,
                  kv_channels=16, vocab_size=VOCAB, max_position_embeddings=64, rotary_base=500000.0)
    values.update(overrides)
    return GPTConfig.llama(**values)


def gpt2_cfg(**overrides) -> GPTConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=VOCAB,
                  max_position_embeddings=32, norm_epsilon=1e-5)
    values.update(overrides)
    return GPTConfig.gpt2(**values)


def random_megatron_state(cfg: GPTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full (TP=1) megatron GPTModel state dict of random numbers, padding vocab rows zero."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    hidden, ffn, padded = (cfg.hidden_size, cfg.ffn_size,
                           padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by))
    qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
    fc1 = 2 * ffn if cfg.activation == "swiglu" else ffn
    biases = cfg.add_bias_linear
    embedding = rand(padded, hidden)
    embedding[cfg.vocab_size:] = 0
    state = {"embedding.word_embeddings.weight": embedding}
    if cfg.position_embedding_type == "learned_absolute":
        state["embedding.position_embeddings.weight"] = rand(cfg.max_position_embeddings, hidden)
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            state[f"{p}{norm}.weight"] = rand(hidden)
            if cfg.normalization == "LayerNorm":
                state[f"{p}{norm}.bias"] = rand(hidden)
        state[f"{p}self_attention.linear_qkv.weight"] = rand(qkv, hidden)
        state[f"{p}self_attention.linear_proj.weight"] = rand(hidden, cfg.num_attention_heads * cfg.head_dim)
        state[f"{p}mlp.linear_fc1.weight"] = rand(fc1, hidden)
        state[f"{p}mlp.linear_fc2.weight"] = rand(hidden, ffn)
        if biases:
            state[f"{p}self_attention.linear_qkv.bias"] = rand(qkv)
            state[f"{p}self_attention.linear_proj.bias"] = rand(hidden)
            state[f"{p}mlp.linear_fc1.bias"] = rand(fc1)
            state[f"{p}mlp.linear_fc2.bias"] = rand(hidden)
    state["decoder.final_layernorm.weight"] = rand(hidden)
    if cfg.normalization == "LayerNorm":
        state["decoder.final_layernorm.bias"] = rand(hidden)
    if not cfg.tie_embeddings:
        output = rand(padded, hidden)
        output[cfg.vocab_size:] = 0
        state["output_layer.weight"] = output
    return state


def expected_llama_names(cfg: GPTConfig) -> set[str]:
    names = {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}
    for i in range(cfg.num_layers):
        names |= {f"transformer.layers.{i}.{n}.weight" for n in (
            "input_layernorm", "attention.qkv", "attention.dense", "post_layernorm", "mlp.fc", "mlp.gate", "mlp.proj")}
    return names


# ----------------------------------------------------------------------------- llama
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_rank_weights_match_hf_layout(tp, tied):
    cfg = llama_cfg(tie_embeddings=tied)
    full = random_megatron_state(cfg)
    hf = megatron_to_hf(full, cfg, "llama")
    config, ranks = megatron_to_trtllm_checkpoint(full, cfg, tp, "llama")
    assert len(ranks) == tp
    heads, groups, head_dim, hidden, ffn = (cfg.num_attention_heads, cfg.query_groups, cfg.head_dim,
                                            cfg.hidden_size, cfg.ffn_size)
    trt_vocab = -(-VOCAB // tp) * tp
    head = hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"]
    for r, weights in enumerate(ranks):
        assert set(weights) == expected_llama_names(cfg)
        assert torch.equal(weights["transformer.vocab_embedding.weight"], hf["model.embed_tokens.weight"])
        assert weights["lm_head.weight"].shape == (trt_vocab // tp, hidden)
        for i in range(cfg.num_layers):
            t, h = f"transformer.layers.{i}.", f"model.layers.{i}."
            q, k, v = (hf[f"{h}self_attn.{n}_proj.weight"] for n in "qkv")
            qkv = weights[f"{t}attention.qkv.weight"]
            assert qkv.shape == ((heads + 2 * groups) // tp * head_dim, hidden)
            # Rank r: query heads r*H/tp.., then key heads r*G/tp.., then value heads r*G/tp.., as TRT-LLM packs them.
            q_r = q.reshape(heads, head_dim, hidden)[r * heads // tp:(r + 1) * heads // tp].reshape(-1, hidden)
            k_r = k.reshape(groups, head_dim, hidden)[r * groups // tp:(r + 1) * groups // tp].reshape(-1, hidden)
            v_r = v.reshape(groups, head_dim, hidden)[r * groups // tp:(r + 1) * groups // tp].reshape(-1, hidden)
            assert torch.equal(qkv, torch.cat([q_r, k_r, v_r]))
            assert torch.equal(weights[f"{t}attention.dense.weight"], hf[f"{h}self_attn.o_proj.weight"].chunk(tp, 1)[r])
            assert torch.equal(weights[f"{t}mlp.fc.weight"], hf[f"{h}mlp.gate_proj.weight"].chunk(tp)[r])
            assert torch.equal(weights[f"{t}mlp.gate.weight"], hf[f"{h}mlp.up_proj.weight"].chunk(tp)[r])
            assert torch.equal(weights[f"{t}mlp.proj.weight"], hf[f"{h}mlp.down_proj.weight"].chunk(tp, 1)[r])
            assert weights[f"{t}mlp.fc.weight"].shape == (ffn // tp, hidden)
            assert torch.equal(weights[f"{t}input_layernorm.weight"], hf[f"{h}input_layernorm.weight"])
            assert torch.equal(weights[f"{t}post_layernorm.weight"], hf[f"{h}post_attention_layernorm.weight"])
        assert torch.equal(weights["transformer.ln_f.weight"], hf["model.norm.weight"])

    # The shards concatenate back to the full tensors.
    layer = "transformer.layers.1."
    assert torch.equal(torch.cat([w[f"{layer}mlp.fc.weight"] for w in ranks]),
                       hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(torch.cat([w[f"{layer}mlp.proj.weight"] for w in ranks], 1),
                       hf["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(torch.cat([w[f"{layer}attention.dense.weight"] for w in ranks], 1),
                       hf["model.layers.1.self_attn.o_proj.weight"])
    lm_head = torch.cat([w["lm_head.weight"] for w in ranks])
    assert torch.equal(lm_head[:VOCAB], head) and not lm_head[VOCAB:].any()
    per_rank_q = heads // tp * head_dim
    q_back = torch.cat([w[f"{layer}attention.qkv.weight"][:per_rank_q] for w in ranks])
    assert torch.equal(q_back, hf["model.layers.1.self_attn.q_proj.weight"])


def test_llama_config_fields():
    cfg = llama_cfg()
    config, _ = megatron_to_trtllm_checkpoint(random_megatron_state(cfg), cfg, 2, "llama", dtype="bfloat16")
    expected = {
        "architecture": "LlamaForCausalLM", "dtype": "bfloat16", "logits_dtype": "float32", "vocab_size": VOCAB,
        "max_position_embeddings": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_size": 16, "intermediate_size": 96, "hidden_act": "silu",
        "norm_epsilon": 1e-5, "position_embedding_type": "rope_gpt_neox", "rotary_base": 500000.0,
        "rotary_scaling": None, "attn_bias": False, "mlp_bias": False,
        "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1},
        "use_parallel_embedding": False, "share_embedding_table": False,
    }
    assert {key: config[key] for key in expected} == expected
    json.dumps(config)  # serialisable as config.json
    _, ranks = megatron_to_trtllm_checkpoint(random_megatron_state(cfg), cfg, 2, "llama", dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in ranks[0].values())


# ----------------------------------------------------------------------------- gpt2
@pytest.mark.parametrize("tp", [1, 2])
def test_gpt2_rank_weights_with_biases_and_tied_head(tp):
    cfg = gpt2_cfg()
    full = random_megatron_state(cfg, seed=1)
    hf = megatron_to_hf(full, cfg, "gpt2")
    config, ranks = megatron_to_trtllm_checkpoint(full, cfg, tp)  # arch inferred: gpt2
    assert config["architecture"] == "GPTForCausalLM" and config["hidden_act"] == "gelu"
    assert config["position_embedding_type"] == "learned_absolute" and config["bias"] is True
    hidden = cfg.hidden_size
    for r, weights in enumerate(ranks):
        assert torch.equal(weights["transformer.position_embedding.weight"], hf["transformer.wpe.weight"])
        for i in range(cfg.num_layers):
            t, h = f"transformer.layers.{i}.", f"transformer.h.{i}."
            q, k, v = hf[f"{h}attn.c_attn.weight"].t().chunk(3)  # Conv1D stores [in, out]
            assert torch.equal(weights[f"{t}attention.qkv.weight"],
                               torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]]))
            qb, kb, vb = hf[f"{h}attn.c_attn.bias"].chunk(3)
            assert torch.equal(weights[f"{t}attention.qkv.bias"],
                               torch.cat([qb.chunk(tp)[r], kb.chunk(tp)[r], vb.chunk(tp)[r]]))
            # Row-parallel biases are added once, after the all-reduce: not split.
            assert torch.equal(weights[f"{t}attention.dense.bias"], hf[f"{h}attn.c_proj.bias"])
            assert torch.equal(weights[f"{t}mlp.proj.bias"], hf[f"{h}mlp.c_proj.bias"])
            assert torch.equal(weights[f"{t}mlp.fc.weight"], hf[f"{h}mlp.c_fc.weight"].t().chunk(tp)[r])
            assert torch.equal(weights[f"{t}mlp.fc.bias"], hf[f"{h}mlp.c_fc.bias"].chunk(tp)[r])
            assert f"{t}mlp.gate.weight" not in weights
            for trt_norm, hf_norm in (("input_layernorm", "ln_1"), ("post_layernorm", "ln_2")):
                assert torch.equal(weights[f"{t}{trt_norm}.bias"], hf[f"{h}{hf_norm}.bias"])
        assert torch.equal(weights["transformer.ln_f.bias"], hf["transformer.ln_f.bias"])
    lm_head = torch.cat([w["lm_head.weight"] for w in ranks])
    assert lm_head.shape == (-(-VOCAB // tp) * tp, hidden)
    assert torch.equal(lm_head[:VOCAB], hf["transformer.wte.weight"])  # the tied head, written out


# ----------------------------------------------------------------------------- TP shards in
def test_tp_shards_in_give_the_same_checkpoint():
    cfg = llama_cfg()
    full = random_megatron_state(cfg)
    shards = split_megatron_tp(full, cfg, 2)
    # megatron's SwiGLU fc1 shard of rank r is [gate_r; up_r].
    gate, up = full["decoder.layers.0.mlp.linear_fc1.weight"].chunk(2)
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    merged = merge_megatron_tp_shards(shards, cfg)
    assert set(merged) == set(full) and all(torch.equal(merged[n], full[n]) for n in full)
    for tp in (2, 4, 1):  # same TP as the shards, and resharded
        _, from_full = megatron_to_trtllm_checkpoint(full, cfg, tp)
        _, from_shards = megatron_to_trtllm_checkpoint(shards, cfg, tp)
        for a, b in zip(from_full, from_shards):
            assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_transformer_engine_names_are_accepted():
    cfg = llama_cfg()
    full = random_megatron_state(cfg)
    te = {}
    for name, tensor in full.items():
        name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        te[name] = tensor
    te["decoder.layers.0.self_attention.core_attention._extra_state"] = None
    _, a = megatron_to_trtllm_checkpoint(full, cfg, 2)
    _, b = megatron_to_trtllm_checkpoint(te, cfg, 2)
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])


# ----------------------------------------------------------------------------- errors
def test_unsupported_models_and_layouts():
    with pytest.raises(ValueError, match="qwen2"):
        trtllm_config(llama_cfg(add_qkv_bias=True), 1)
    with pytest.raises(ValueError, match="tanh approximation"):
        trtllm_config(gpt2_cfg(activation="gelu"), 1)
    with pytest.raises(ValueError, match="RMSNorm|normalization"):
        trtllm_config(gpt2_cfg(), 1, arch="llama")
    with pytest.raises(ValueError, match="dtype"):
        trtllm_config(llama_cfg(), 1, dtype="int8")
    with pytest.raises(ValueError, match="llama3_rope_scaling_factor=8.0"):
        trtllm_config(llama_cfg(llama3_rope_scaling_factor=8.0), 1)
    for family_fields, arch in ((dict(qk_layernorm=True), "qwen3"), (dict(num_moe_experts=4), "mixtral")):
        with pytest.raises(ValueError, match=f"arch='{arch}'"):
            trtllm_config(llama_cfg(**family_fields), 1)
    cfg = llama_cfg()
    with pytest.raises(ValueError, match="num_query_groups=4 is not divisible by tensor_model_parallel_size=8"):
        megatron_to_trtllm_checkpoint(random_megatron_state(cfg), cfg, 8)
    broken = random_megatron_state(cfg)
    del broken["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match="linear_fc2"):
        megatron_to_trtllm_checkpoint(broken, cfg, 1)


def test_engine_without_tensorrt_llm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import tensorrt_llm raises ImportError
    with pytest.raises(ImportError) as error:
        TensorRTLLMEngine(llama_cfg(), pad_id=0, eos_id=2, work_dir="/nonexistent")
    assert "pip install 'aligner[trtllm]'" in str(error.value) and "generation.engine=native" in str(error.value)
    assert str(error.value) == INSTALL_HINT


def test_checkpoint_files(tmp_path):
    from safetensors.torch import load_file

    cfg = llama_cfg()
    config, ranks = megatron_to_trtllm_checkpoint(random_megatron_state(cfg), cfg, 2)
    save_trtllm_checkpoint(tmp_path, config, ranks)
    assert json.loads((tmp_path / "config.json").read_text()) == config
    loaded = load_file(str(tmp_path / "rank1.safetensors"))
    assert set(loaded) == set(ranks[1]) and torch.equal(loaded["lm_head.weight"], ranks[1]["lm_head.weight"])


# ----------------------------------------------------------------------------- sampling
def test_sampling_options():
    greedy = sampling_to_trtllm(SamplingParams(max_new_tokens=5, temperature=0.0), eos_id=2, pad_id=0, rows=range(3))
    assert {k: greedy[k] for k in ("end_id", "pad_id", "max_new_tokens", "min_length", "temperature", "top_k")} == \
        {"end_id": 2, "pad_id": 0, "max_new_tokens": 5, "min_length": 1, "temperature": 1.0, "top_k": 1}
    assert greedy["return_dict"] and greedy["output_log_probs"] and greedy["output_sequence_lengths"]
    assert "random_seed" not in greedy and "stop_words_list" not in greedy

    sampled = sampling_to_trtllm(
        SamplingParams(max_new_tokens=8, min_new_tokens=2, temperature=0.7, top_k=5, top_p=0.9, seed=3,
                       stop_token_ids=[7, 9, 11]), eos_id=2, pad_id=0, rows=[4, 5])
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["min_length"]) == (0.7, 5, 0.9, 2)
    assert sampled["end_id"] == 7
    assert sampled["random_seed"].tolist() == [3 * 1_000_003 + 4, 3 * 1_000_003 + 5]
    # Extra stop tokens: TRT-LLM's [batch, 2, n] layout (token ids; cumulative end offsets).
    assert sampled["stop_words_list"].tolist() == [[[9, 11], [1, 2]]] * 2
    full = sampling_to_trtllm(SamplingParams(max_new_tokens=8), eos_id=2, pad_id=0, rows=[0])
    assert (full["top_k"], full["top_p"], full["temperature"]) == (0, 1.0, 1.0)  # the whole distribution


@pytest.mark.parametrize("overrides, message", [
    (dict(stop_strings=["\n\n"]), "stop_strings"),
    (dict(fixed_length=True), "fixed_length"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
])
def test_unsupported_sampling_options(overrides, message):
    with pytest.raises(ValueError, match=message):
        sampling_to_trtllm(SamplingParams(**overrides), eos_id=2, pad_id=0, rows=[0])


def test_rollout_from_generate_outputs():
    prompts = [[5, 6], [5, 6, 7], [8]]
    eos = 2
    # [batch, beam, prompt + new]; TRT-LLM fills what follows a sequence's end with end_id.
    output_ids = torch.tensor([
        [[5, 6, 10, 11, 2, 2, 2]],   # stopped at eos, eos counted in the length
        [[5, 6, 7, 12, 2, 2, 2]],    # stopped at eos, eos not counted
        [[8, 13, 14, 15, 16, 2, 2]],  # ran to max_new_tokens
    ])
    sequence_lengths = torch.tensor([[5], [4], [5]])
    log_probs = -torch.arange(1, 1 + 3 * 4, dtype=torch.float32).reshape(3, 1, 4) / 10
    rollout = rollout_from_outputs(prompts, output_ids, sequence_lengths, log_probs, max_new_tokens=4,
                                   stop_token_ids=[eos], pad_id=0)
    assert rollout.response_tokens.tolist() == [[10, 11, 2, 0], [12, 2, 0, 0], [13, 14, 15, 16]]
    assert rollout.response_lengths.tolist() == [3, 2, 4]
    assert rollout.ended_with_stop.tolist() == [True, True, False]
    assert torch.allclose(rollout.logprobs[0], torch.tensor([-0.1, -0.2, -0.3, 0.0]))
    assert rollout.logprobs[1, 2:].tolist() == [0.0, 0.0]
    assert rollout.prompt_tokens == prompts
