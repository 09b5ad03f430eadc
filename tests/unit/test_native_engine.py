"""The native engine on one process: parity with megatron's own forward, sampling rules, refit."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from aligner.generation.engine import SamplingParams
from aligner.generation.native import NativeEngine
from aligner.generation.reference import generate_full_forward
from aligner.models.forward import forward_logits
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.models.logprobs import pack_sequences, response_logprobs, sequence_logprobs

pytestmark = pytest.mark.usefixtures("single_process")

VOCAB, PAD, EOS = 100, 0, 2  # vocab 100 is padded to 128: padded rows must never be sampled
LOGPROB_TOLERANCE = 1e-5

CONFIGS = {
    # RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings
    "llama": GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=128, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                             max_position_embeddings=64),
    # LayerNorm, GELU (tanh), learned positions, biases everywhere, tied embeddings
    "gpt2": GPTConfig.gpt2(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                           make_vocab_size_divisible_by=64, max_position_embeddings=64),
    # Qwen2-like: bias on qkv only, tied embeddings, head_dim != hidden / heads
    "qwen": GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                            kv_channels=32, ffn_hidden_size=96, vocab_size=VOCAB, add_qkv_bias=True,
                            tie_embeddings=True, make_vocab_size_divisible_by=64, max_position_embeddings=64),
    # Qwen3-MoE-like: per-head q/k norm, Llama 3.x RoPE scaling, megatron's MoE layer (4 experts, top 2)
    "moe": GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                           ffn_hidden_size=96, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                           max_position_embeddings=64, qk_layernorm=True, llama3_rope_scaling_factor=8.0,
                           num_moe_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2),
    # Gemma 3-like: zero-centred and post-attention/MLP norms, scaled embeddings, gated GELU, q/k norm, softmax
    # scale 24 ** -0.5, the first of every two layers a sliding-window layer rotating at its own base
    "gemma": GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                             ffn_hidden_size=96, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                             max_position_embeddings=64, activation="geglu_tanh", qk_layernorm=True,
                             zero_centered_norm=True, post_layer_norms=True, scale_embeddings=True,
                             query_pre_attn_scalar=24.0, rotary_base=1000000.0, sliding_window=48,
                             sliding_window_pattern=2, local_rotary_base=10000.0, tie_embeddings=True),
}


def make_model(name: str, seed: int = 0):
    """CONFIGS[name] and its `signal_model`."""
    return CONFIGS[name], signal_model(CONFIGS[name], seed)


def signal_model(cfg, seed: int = 0):
    """A random model whose every tensor carries signal (not megatron's init: zero biases, unit norms)."""
    model = build_gpt_model(cfg, transformer_config(cfg)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            is_norm_weight = "norm" in param_name and param_name.endswith("weight")
            param.copy_((1.0 if is_norm_weight else 0.0) + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def make_engine(cfg, model, **overrides) -> NativeEngine:
    options = dict(pad_id=PAD, eos_id=EOS, max_batch_size=8, max_sequence_length=40)
    options.update(overrides)
    return NativeEngine([model], cfg, **options)


def make_prompts(count: int = 7, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 12, 5, 9, 3, 12, 7, 2][:count]
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def responses(rollout) -> list[list[int]]:
    return [rollout.response_tokens[i, :n].tolist() for i, n in enumerate(rollout.response_lengths.tolist())]


def training_logprobs(model, cfg, rollout, temperature: float) -> torch.Tensor:
    tokens, prompt_lengths = pack_sequences(rollout.prompt_tokens, rollout.response_tokens, rollout.response_lengths,
                                            PAD)
    return sequence_logprobs([model], tokens, prompt_lengths, rollout.response_lengths, vocab_size=cfg.vocab_size,
                             temperature=temperature, response_width=rollout.response_tokens.shape[1])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_equals_full_forward_argmax_decoding(name):
    cfg, model = make_model(name)
    prompts = make_prompts()
    rollout = make_engine(cfg, model).generate(prompts, SamplingParams(max_new_tokens=14, greedy=True))
    expected = generate_full_forward([model], prompts, vocab_size=VOCAB, eos_id=EOS, pad_id=PAD, max_new_tokens=14)
    assert responses(rollout) == expected
    assert rollout.prompt_tokens == prompts and rollout.response_tokens.shape == (len(prompts), 14)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=3, stop_token_ids=[5, 6, 7]),
    SamplingParams(max_new_tokens=16, temperature=1.3, seed=4),
    SamplingParams(max_new_tokens=16, greedy=True),
], ids=["t0.7-topk-topp-stops", "t1.3", "greedy"])
def test_engine_logprobs_equal_the_training_forward(name, sampling):
    cfg, model = make_model(name)
    rollout = make_engine(cfg, model).generate(make_prompts(), sampling)
    expected = training_logprobs(model, cfg, rollout, 1.0 if sampling.is_greedy else sampling.temperature)
    diff = float((rollout.logprobs - expected).abs().max())
    print(f"{name}: max |engine - training| logprob = {diff:.2e}")
    assert diff < LOGPROB_TOLERANCE
    after_end = torch.arange(16).unsqueeze(0) >= rollout.response_lengths.unsqueeze(1)
    assert (rollout.logprobs[~after_end] < 0).all()
    assert (rollout.logprobs[after_end] == 0).all() and (rollout.response_tokens[after_end] == PAD).all()


def test_sequence_logprobs_equal_per_sequence_log_softmax():
    cfg, model = make_model("gpt2")
    prompts = make_prompts(4)
    response_tokens = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(2))
    response_lengths = torch.tensor([6, 0, 3, 1])
    tokens, prompt_lengths = pack_sequences(prompts, response_tokens, response_lengths, PAD)
    assert tokens.shape == (4, 12) and prompt_lengths.tolist() == [1, 12, 5, 9]
    result = sequence_logprobs([model], tokens, prompt_lengths, response_lengths, vocab_size=VOCAB,
                               temperature=0.8, response_width=6)
    for row, (prompt, length) in enumerate(zip(prompts, response_lengths.tolist())):
        sequence = torch.tensor([prompt + response_tokens[row, :length].tolist()])
        logits = forward_logits([model], sequence, VOCAB)[0].double() / 0.8  # unpadded, on its own
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, sequence[0, len(prompt):, None])
        assert torch.allclose(result[row, :length].double(), expected.squeeze(1), atol=1e-5)
        assert (result[row, length:] == 0).all()


def test_response_logprobs_carry_gradients_to_the_model():
    cfg, model = make_model("llama")
    tokens, prompt_lengths = pack_sequences(make_prompts(3), torch.full((3, 4), 7), torch.tensor([4, 2, 3]), PAD)
    model.train()
    logits = model(tokens, torch.arange(tokens.shape[1]).expand(3, -1), None)
    logprobs = response_logprobs(logits, tokens, prompt_lengths, torch.tensor([4, 2, 3]), vocab_size=VOCAB,
                                 temperature=0.7)
    logprobs.sum().backward()
    assert model.output_layer.weight.grad is not None and model.output_layer.weight.grad[:VOCAB].abs().sum() > 0
    assert (model.output_layer.weight.grad[VOCAB:] == 0).all()  # padded vocabulary rows take no gradient
    model.zero_grad()
    model.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cpu_onednn_products_give_the_blas_products_rollouts(name):
    """On CPU the decode products run on oneDNN; BLAS's W @ x (the GPU path) must give the same rows."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    cfg, model = make_model(name)
    prompts = make_prompts()
    sampling = SamplingParams(max_new_tokens=14, temperature=1.0, seed=5)
    onednn = make_engine(cfg, model)
    assert onednn.state.onednn_products  # fp32 on CPU: the path under test is the one in use
    blas = make_engine(cfg, model)
    blas.state.onednn_products = False
    expected = blas.generate(prompts, sampling)
    rollout = onednn.generate(prompts, sampling)
    assert torch.equal(rollout.response_tokens, expected.response_tokens)
    assert torch.allclose(rollout.logprobs, expected.logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.parametrize("library", ["blas", "onednn"])
def test_a_single_sequence_decodes_on_the_preferred_library_with_the_same_tokens(monkeypatch, library):
    """One sequence per call on the general decode path (the C++ step off: test_cpu_decode.py): the decode
    products on BLAS (the weights as they are) where BLAS is preferred, on oneDNN (packed copies) otherwise; both
    give the rows of the many-sequence path within rounding."""
    from aligner.generation.native import cpu_decode
    from aligner.runtime import cpu_products

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    cfg, model = make_model("llama")
    prompt = make_prompts()[:1]
    sampling = SamplingParams(max_new_tokens=14, temperature=1.0, seed=5)
    expected = make_engine(cfg, model).generate(prompt * 2, sampling)  # two sequences: oneDNN, packed
    monkeypatch.setenv(cpu_products.PREFERENCE_VARIABLE, library)
    monkeypatch.setenv(cpu_decode.SETTING_VARIABLE, "general")
    engine = make_engine(cfg, model)
    calls = {"onednn": 0, "blas": 0}
    onednn_product, blas_product = cpu_products.weight_times_columns, torch.mm

    def counted(name, product):
        def call(*args):
            calls[name] += 1
            return product(*args)
        return call

    monkeypatch.setattr(cpu_products, "weight_times_columns", counted("onednn", onednn_product))
    monkeypatch.setattr(torch, "mm", counted("blas", blas_product))
    rollout = engine.generate(prompt, sampling)
    products_per_step = 4 * cfg.num_layers + 1  # qkv, proj, fc1, fc2 per layer, and the output layer
    decode_products = products_per_step * (sampling.max_new_tokens - 1)
    assert calls[library] >= decode_products and calls["onednn" if library == "blas" else "blas"] < decode_products
    assert engine.state.single_sequence_on_blas == (library == "blas")
    assert torch.equal(rollout.response_tokens[0], expected.response_tokens[0])
    assert torch.allclose(rollout.logprobs[0], expected.logprobs[0], atol=LOGPROB_TOLERANCE, rtol=0)
    monkeypatch.undo()
    engine.generate(prompt * 2, sampling)
    assert not engine.state.single_sequence_on_blas  # many sequences: back on the packed oneDNN products


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_weights_give_the_unpacked_rollouts(name):
    """pack_weights: the products read oneDNN's packed copies; the weights as they are must give the same rows."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    cfg, model = make_model(name)
    prompts = make_prompts()
    sampling = SamplingParams(max_new_tokens=14, temperature=1.0, seed=5)
    packed = make_engine(cfg, model)
    segment = packed.state.segments[0]
    products = [layer.qkv.product for layer in segment.layers] + [segment.output_product]
    assert all(product.is_mkldnn for product in products)  # the path under test is the one in use
    expected = make_engine(cfg, model, pack_weights=False).generate(prompts, sampling)
    rollout = packed.generate(prompts, sampling)
    assert torch.equal(rollout.response_tokens, expected.response_tokens)
    assert torch.allclose(rollout.logprobs, expected.logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


def test_packed_copies_are_remade_for_changed_weights_only():
    """In-place updates and new storage are seen at the next call; refit() repacks writes that bypass
    the version counter; free() drops the copies."""
    cfg, model = make_model("llama")
    engine, prompts = make_engine(cfg, model), make_prompts()
    greedy = SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[VOCAB - 1])

    def expected():
        return generate_full_forward([model], prompts, vocab_size=VOCAB, eos_id=VOCAB - 1, pad_id=PAD,
                                     max_new_tokens=10)

    def copies():
        return {key: entry.packed for key, entry in engine._packed.items()}

    before = engine.generate(prompts, greedy)
    packed = copies()
    assert len(packed) == 2 * 4 + 1  # qkv, proj, fc1, fc2 per layer and the output layer
    weights = [model.output_layer.weight] + [model.get_parameter(f"decoder.layers.{index}.{name}.weight")
                                             for index in range(2) for name in ("self_attention.linear_qkv",
                                             "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert engine.packed_weight_bytes == sum(weight.numel() * 4 for weight in weights)
    engine.generate(prompts, greedy)
    assert all(copies()[key] is copy for key, copy in packed.items())  # nothing changed: the same copies
    fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
    proj = model.decoder.layers[1].self_attention.linear_proj.weight
    with torch.no_grad():
        fc1.mul_(-1.0)  # an in-place update (an optimizer step): bumps the version counter
    proj.data = proj.data.clone() * 0.5  # new storage
    after = engine.generate(prompts, greedy)
    assert responses(after) == expected() and responses(after) != responses(before)
    changed = {key for key, copy in copies().items() if copy is not packed[key]}
    assert changed == {id(fc1), id(proj)}
    with torch.no_grad():
        fc1.data.mul_(-1.0)  # bypasses the version counter: refit() is the way to make it seen
    engine.refit([model])
    assert all(copy is not packed[key] for key, copy in copies().items())
    assert responses(engine.generate(prompts, greedy)) == expected()
    cache_bytes = engine.kv_cache_bytes
    alive = [weakref.ref(copy) for copy in copies().values()]
    engine.release_for_update()  # what the RL actor does before training: the cache stays
    assert engine.packed_weight_bytes == 0 and engine.kv_cache_bytes == cache_bytes > 0
    gc.collect()
    assert not any(ref() is not None for ref in alive)  # nothing (segments, the C++ step) holds a copy: freed
    assert responses(engine.generate(prompts, greedy)) == expected() and len(copies()) == len(packed)
    engine.free()
    assert engine.packed_weight_bytes == 0 and engine.kv_cache_bytes == 0


def test_rows_do_not_depend_on_the_rest_of_the_batch():
    cfg, model = make_model("llama")
    a, b, c, d = make_prompts(4)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=30, seed=11)
    first = make_engine(cfg, model).generate([a, b, c, d], sampling)
    # Other neighbours (another padding width), and a batch split into chunks of 2 by the engine.
    other = make_engine(cfg, model).generate([a, [9] * 20, c], sampling)
    chunked = make_engine(cfg, model, max_batch_size=2).generate([a, b, c, d], sampling)
    for row in (0, 2):
        assert torch.equal(other.response_tokens[row], first.response_tokens[row])
        assert torch.allclose(other.logprobs[row], first.logprobs[row], atol=1e-5)
    assert torch.equal(chunked.response_tokens, first.response_tokens)
    again = make_engine(cfg, model).generate([a, b, c, d], sampling)
    assert torch.equal(again.response_tokens, first.response_tokens)
    reseeded = make_engine(cfg, model).generate([a, b, c, d], SamplingParams(**{**vars(sampling), "seed": 12}))
    assert not torch.equal(reseeded.response_tokens, first.response_tokens)


def test_stop_token_ids_end_responses_and_are_counted():
    cfg, model = make_model("gpt2")
    engine, prompts = make_engine(cfg, model), make_prompts()
    free_run = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[VOCAB - 1]))
    stop = int(free_run.response_tokens[0, 3])  # whatever row 0 says fourth
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[stop]))
    for row, tokens in enumerate(free_run.response_tokens.tolist()):
        end = tokens.index(stop) + 1 if stop in tokens else 10
        assert rollout.response_tokens[row, :end].tolist() == tokens[:end]
        assert int(rollout.response_lengths[row]) == end
        assert bool(rollout.ended_with_stop[row]) == (stop in tokens)
    assert int(rollout.response_lengths[0]) <= 4 and bool(rollout.ended_with_stop[0])


def test_eos_is_the_default_stop_and_max_new_tokens_caps_the_rest():
    cfg, model = make_model("llama")
    engine, prompts = make_engine(cfg, model), make_prompts()
    free_run = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[VOCAB - 1]))
    eos = int(free_run.response_tokens[1, 2])
    rollout = make_engine(cfg, model, eos_id=eos).generate(prompts, SamplingParams(max_new_tokens=10, greedy=True))
    assert int(rollout.response_lengths[1]) <= 3 and bool(rollout.ended_with_stop[1])
    unstopped = ~rollout.ended_with_stop
    assert (rollout.response_lengths[unstopped] == 10).all()
    short = engine.generate(prompts, SamplingParams(max_new_tokens=3, greedy=True, stop_token_ids=[VOCAB - 1]))
    assert torch.equal(short.response_tokens, free_run.response_tokens[:, :3])
    assert (short.response_lengths == 3).all() and not short.ended_with_stop.any()


def test_min_new_tokens_masks_stop_tokens_until_reached():
    cfg, model = make_model("llama")
    engine, prompts = make_engine(cfg, model), make_prompts()
    free_run = engine.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=[VOCAB - 1]))
    first_tokens = sorted(set(free_run.response_tokens[:, 0].tolist()))
    sampling = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=first_tokens, min_new_tokens=3)
    rollout = engine.generate(prompts, sampling)
    assert (rollout.response_lengths >= 3).all()
    assert not torch.isin(rollout.response_tokens[:, :3], torch.tensor(first_tokens)).any()
    # Sampling as well: across seeds, no stop token ever appears before min_new_tokens.
    for seed in range(3):
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=2.0, seed=seed,
                                                          stop_token_ids=list(range(3, 60)), min_new_tokens=2))
        assert not torch.isin(sampled.response_tokens[:, :2], torch.arange(3, 60)).any()
        assert (sampled.response_lengths >= 2).all()


def test_stop_strings_end_responses_on_the_decoded_text():
    cfg, model = make_model("qwen")
    prompts = make_prompts()
    def decode(ids): return "".join(f"<{i}>" for i in ids)
    engine = make_engine(cfg, model, decode=decode)
    free_run = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[VOCAB - 1]))
    pair = f"<{int(free_run.response_tokens[2, 4])}><{int(free_run.response_tokens[2, 5])}>"
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[VOCAB - 1],
                                                      stop_strings=[pair]))
    for row, tokens in enumerate(free_run.response_tokens.tolist()):
        text_ends = [n for n in range(1, 11) if pair in decode(tokens[:n])]
        end = text_ends[0] if text_ends else 10
        assert int(rollout.response_lengths[row]) == end and bool(rollout.ended_with_stop[row]) == bool(text_ends)
        assert rollout.response_tokens[row, :end].tolist() == tokens[:end]
    assert int(rollout.response_lengths[2]) <= 6 and bool(rollout.ended_with_stop[2])
    with pytest.raises(ValueError, match="decode"):
        make_engine(cfg, model).generate(prompts, SamplingParams(max_new_tokens=4, stop_strings=["x"]))


def test_fixed_length_samples_past_stop_tokens():
    cfg, model = make_model("gpt2")
    engine, prompts = make_engine(cfg, model), make_prompts()
    free_run = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[VOCAB - 1]))
    stop = int(free_run.response_tokens[0, 2])
    fixed = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[stop],
                                                    fixed_length=True))
    assert torch.equal(fixed.response_tokens, free_run.response_tokens)
    assert (fixed.response_lengths == 10).all() and (fixed.logprobs < 0).all()
    assert torch.equal(fixed.ended_with_stop, (free_run.response_tokens == stop).any(dim=1))
    expected = training_logprobs(model, cfg, fixed, 1.0)
    assert float((fixed.logprobs - expected).abs().max()) < LOGPROB_TOLERANCE


def test_padded_vocabulary_is_never_sampled():
    cfg, model = make_model("llama")
    with torch.no_grad():
        model.output_layer.weight[VOCAB:] = 10.0  # padded rows would win every argmax and draw
    engine, prompts = make_engine(cfg, model), make_prompts()
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True))
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=3.0, seed=1))
    assert greedy.response_tokens.max() < VOCAB and sampled.response_tokens.max() < VOCAB
    assert torch.isfinite(sampled.logprobs).all()


def test_refit_is_free_and_sees_weight_changes():
    cfg, model = make_model("llama")
    engine, prompts = make_engine(cfg, model), make_prompts()
    greedy = SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[VOCAB - 1])
    before = engine.generate(prompts, greedy)
    cache = engine._kv_cache
    # An optimizer step updates parameters in place: the engine serves the new weights at once.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(5)))
    after = engine.generate(prompts, greedy)
    expected = generate_full_forward([model], prompts, vocab_size=VOCAB, eos_id=VOCAB - 1, pad_id=PAD,
                                     max_new_tokens=10)
    assert responses(after) == expected and responses(after) != responses(before)
    # A different model object: refit points at its tensors, no copy, the cache is kept.
    _, other = make_model("llama", seed=9)
    engine.refit([other])
    assert engine.state.segments[0].layers[0].qkv.weight is other.decoder.layers[0].self_attention.linear_qkv.weight
    refitted = engine.generate(prompts, greedy)
    assert engine._kv_cache is cache
    assert responses(refitted) == generate_full_forward([other], prompts, vocab_size=VOCAB, eos_id=VOCAB - 1,
                                                        pad_id=PAD, max_new_tokens=10)
    engine.free()
    assert engine._kv_cache is None
    assert torch.equal(engine.generate(prompts, greedy).response_tokens, refitted.response_tokens)


def kv_cache_bytes_formula(cfg, rows: int, length: int) -> int:
    """keys + values: layers x rows x query groups x head_dim x columns, fp32."""
    return 2 * cfg.num_layers * rows * cfg.query_groups * cfg.head_dim * length * 4


def test_kv_cache_holds_what_each_call_needs_not_max_sequence_length():
    cfg, model = make_model("llama")  # 2 layers, 2 query groups, head_dim 16
    engine, prompts = make_engine(cfg, model, max_batch_size=8, max_sequence_length=40), make_prompts()  # longest 12
    assert engine.kv_cache_bytes == 0  # nothing is allocated before the first call

    def generate(batch, new_tokens):
        rollout = engine.generate(batch, SamplingParams(max_new_tokens=new_tokens, greedy=True))
        expected = generate_full_forward([model], batch, vocab_size=VOCAB, eos_id=EOS, pad_id=PAD,
                                         max_new_tokens=new_tokens)
        assert responses(rollout) == expected

    generate(prompts, 6)  # 7 rows x (12 + 6) columns
    assert engine.kv_cache_bytes == kv_cache_bytes_formula(cfg, 7, 18) == 64512
    cache = engine._kv_cache
    generate(prompts[2:5], 4)  # 3 rows x (9 + 4): fits, the same tensors serve it
    assert engine._kv_cache is cache and engine.kv_cache_bytes == 64512
    generate(prompts, 20)  # longer: replaced by 7 x 32
    assert engine._kv_cache is not cache and engine.kv_cache_bytes == kv_cache_bytes_formula(cfg, 7, 32) == 114688
    # More rows than max_batch_size: chunks of 8 rows. The new cache is this call's size (8 x (7 + 3)),
    # not the largest of each dimension seen so far.
    generate([[5] * 7] * 10, 3)
    assert engine.kv_cache_bytes == kv_cache_bytes_formula(cfg, 8, 10) == 40960
    engine.free()
    assert engine.kv_cache_bytes == 0


def test_static_step_over_a_larger_reused_cache_equals_the_dynamic_step():
    """The static step attends over every cache column: extra (stale) columns must change nothing."""
    cfg, model = make_model("llama")
    prompts = make_prompts()
    sampling = SamplingParams(max_new_tokens=8, temperature=1.1, top_k=40, seed=8)
    static_engine = make_engine(cfg, model, static_decode=True)
    static_engine.generate(prompts, SamplingParams(max_new_tokens=25, temperature=1.0, seed=2))  # 7 x 37 cache
    step = static_engine._static_steps[7]
    assert static_engine.kv_cache_bytes == kv_cache_bytes_formula(cfg, 7, 37)
    short_prompts = [p[:4] for p in prompts]
    static = static_engine.generate(short_prompts, sampling)  # 7 x 12 needed: the 7 x 37 cache is reused
    assert static_engine._static_steps[7] is step and static_engine.kv_cache_bytes == kv_cache_bytes_formula(cfg, 7, 37)
    dynamic = make_engine(cfg, model).generate(short_prompts, sampling)
    assert torch.equal(static.response_tokens, dynamic.response_tokens)
    assert float((static.logprobs - dynamic.logprobs).abs().max()) < LOGPROB_TOLERANCE
    # A call that does not fit replaces the cache, and with it the steps captured against the old one.
    longer = [p + [7] * 20 for p in prompts[:2]]
    static = static_engine.generate(longer, sampling)
    assert static_engine._static_steps[2].keys.shape[-1] == 32 + 8 and 7 not in static_engine._static_steps
    assert torch.equal(static.response_tokens, make_engine(cfg, model).generate(longer, sampling).response_tokens)


def test_requests_the_engine_cannot_serve_are_refused_with_a_reason():
    cfg, model = make_model("llama")
    engine = make_engine(cfg, model)
    with pytest.raises(ValueError, match="max_sequence_length"):
        engine.generate([[5] * 30], SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match="vocab_size"):
        engine.generate([[5, VOCAB]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[5]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="learned positions"):
        gpt2_cfg, gpt2 = make_model("gpt2")
        make_engine(gpt2_cfg, gpt2, max_sequence_length=65)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_static_decode_step_gives_the_dynamic_steps_tokens_and_logprobs(name):
    """The graph-capturable step (whole cache, masked; inputs in fixed buffers) is the same math."""
    cfg, model = make_model(name)
    prompts = make_prompts()  # left padding of several widths: the padding bias is exercised
    sampled = SamplingParams(max_new_tokens=14, temperature=1.1, top_k=40, seed=8, stop_token_ids=[VOCAB - 1])
    for sampling in (sampled, SamplingParams(max_new_tokens=14, greedy=True)):
        dynamic = make_engine(cfg, model).generate(prompts, sampling)
        # max_batch_size 3: one static step (buffers) per decode batch size; the static-batch loop
        # decodes chunks of 3, 3 and 1 rows, continuous batching 3 rows until the prompts run out
        static_batch = make_engine(cfg, model, static_decode=True, max_batch_size=3, continuous_batching=False)
        assert torch.equal(static_batch.generate(prompts, sampling).response_tokens, dynamic.response_tokens)
        assert sorted(static_batch._static_steps) == [1, 3]
        static_engine = make_engine(cfg, model, static_decode=True, max_batch_size=3)
        static = static_engine.generate(prompts, sampling)
        assert 3 in static_engine._static_steps and set(static_engine._static_steps) <= {1, 2, 3}
        assert torch.equal(static.response_tokens, dynamic.response_tokens)
        assert torch.equal(static.response_lengths, dynamic.response_lengths)
        assert float((static.logprobs - dynamic.logprobs).abs().max()) < LOGPROB_TOLERANCE
        expected = training_logprobs(model, cfg, static, 1.0 if sampling.is_greedy else sampling.temperature)
        assert float((static.logprobs - expected).abs().max()) < LOGPROB_TOLERANCE
    # Reused buffers: a second call (other prompts, other padding) is still right.
    again = static_engine.generate(prompts[::-1], sampled)
    assert torch.equal(again.response_tokens, make_engine(cfg, model).generate(prompts[::-1], sampled).response_tokens)


def test_cuda_graphs_on_a_cpu_model_is_refused_with_a_reason():
    cfg, model = make_model("llama")
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device.*static_decode=True"):
        make_engine(cfg, model, cuda_graphs=True)


def test_static_steps_are_rebuilt_when_weight_storage_or_cache_moves():
    """A CUDA graph keeps the addresses it captured: moved weights or a new cache need a new step."""
    cfg, model = make_model("gpt2")
    engine, prompts = make_engine(cfg, model, static_decode=True), make_prompts()
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    first = engine.generate(prompts, greedy)
    step = engine._static_steps[len(prompts)]
    engine.generate(prompts, greedy)
    assert engine._static_steps[len(prompts)] is step  # nothing moved: reused
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    fc1.weight.data = fc1.weight.data.clone()  # e.g. offloaded and brought back
    assert torch.equal(engine.generate(prompts, greedy).response_tokens, first.response_tokens)
    assert engine._static_steps[len(prompts)] is not step
    step = engine._static_steps[len(prompts)]
    engine.free()
    assert engine._static_steps == {}
    assert torch.equal(engine.generate(prompts, greedy).response_tokens, first.response_tokens)
    assert engine._static_steps[len(prompts)] is not step


def test_sample_with_logprobs_is_the_plain_draw_and_its_float64_log_softmax():
    from aligner.generation import sampling as S

    generator = torch.Generator().manual_seed(3)
    logits = 3.0 * torch.randn(64, 50, generator=generator)
    logits[:, 40:] = float("-inf")  # padded vocabulary rows
    uniform = S.uniforms(S.sample_keys(5, torch.arange(64)), torch.arange(1))[:, 0]
    tokens, logprobs = S.sample_with_logprobs(logits, uniform)
    assert torch.equal(tokens, S.vocab_parallel_sample(logits, uniform))
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert tokens.max() < 40 and float((logprobs.double() - expected).abs().max()) < 1e-6


# HF models of the families the engine serves through megatron's own modules: q/k norm, llama3-scaled
# rotary tables (megatron's RotaryEmbedding), MoE layers (megatron's MoELayer in the decode step too).
HF_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_family_config(family: str):
    transformers = pytest.importorskip("transformers")
    if family == "llama3_tied":
        return transformers.LlamaConfig(**dict(HF_BASE, max_position_embeddings=16384), rope_parameters=LLAMA3_ROPE,
                                        tie_word_embeddings=True)
    if family == "llama3_2k":  # llama3 scaling with other parameters than Llama 3.1's (all three bands still hit)
        rope = dict(LLAMA3_ROPE, factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0,
                    original_max_position_embeddings=2048)
        return transformers.LlamaConfig(**dict(HF_BASE, max_position_embeddings=8192), rope_parameters=rope)
    if family == "qwen3":
        return transformers.Qwen3Config(**HF_BASE, head_dim=32)
    if family == "gemma3":  # layer 1 in a 32-token window at RoPE base 10000, layer 2 global at 1e6
        return transformers.Gemma3TextConfig(**HF_BASE, head_dim=32, query_pre_attn_scalar=24, sliding_window=32,
                                             layer_types=["sliding_attention", "full_attention"])
    if family == "mixtral":
        return transformers.MixtralConfig(**HF_BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    return transformers.Qwen3MoeConfig(**HF_BASE, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=48, norm_topk_prob=True)


def hf_and_megatron_models(family: str, directory):
    """A random HF model and the megatron model holding its weights (through the HF importer's layout)."""
    import transformers

    from aligner.hf.convert import read_hf_state_dict
    from aligner.hf.layout import gpt_config_from_hf
    from aligner.hf.weights import hf_to_megatron

    config = hf_family_config(family)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():  # every tensor carries signal (not HF's init)
            is_norm_weight = "norm" in name and name.endswith("weight")
            param.copy_((1.0 if is_norm_weight else 0.0) + 0.2 * torch.randn_like(param))
    hf_model.save_pretrained(str(directory))  # the per-expert names real checkpoints have
    cfg, arch = gpt_config_from_hf(config, make_vocab_size_divisible_by=64)
    model = build_gpt_model(cfg, transformer_config(cfg)).eval()
    result = model.load_state_dict(hf_to_megatron(read_hf_state_dict(directory), cfg, arch), strict=False)
    assert not result.unexpected_keys and all(key.endswith("_extra_state") for key in result.missing_keys)
    return hf_model, cfg, model


@pytest.mark.parametrize("family", ["llama3_tied", "llama3_2k", "qwen3", "mixtral", "qwen3_moe", "gemma3"])
def test_greedy_tokens_equal_transformers_generate(family, tmp_path):
    hf_model, cfg, model = hf_and_megatron_models(family, tmp_path)
    prompts = make_prompts()
    rollout = make_engine(cfg, model).generate(prompts, SamplingParams(max_new_tokens=14, greedy=True))
    for prompt, response in zip(prompts, responses(rollout)):
        with torch.no_grad():
            output = hf_model.generate(torch.tensor([prompt]),
                                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                       max_new_tokens=14, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
        assert response == output[0, len(prompt):].tolist(), (family, prompt)
    assert sum(len(r) for r in responses(rollout)) > 3 * len(prompts)  # not all stopping at once


def test_moe_engine_refuses_cuda_graphs_with_a_reason():
    cfg, model = make_model("moe")
    with pytest.raises(ValueError, match="cuda_graphs=True cannot capture an MoE model"):
        make_engine(cfg, model, cuda_graphs=True)


def test_gemma_rows_beyond_the_sliding_window_are_refused_by_engine_and_model():
    cfg, model = make_model("gemma")  # sliding_window=48
    engine = make_engine(cfg, model, max_sequence_length=64)
    with pytest.raises(ValueError, match=r"^longest prompt \(40 tokens\) \+ max_new_tokens \(9\) is above "
                                         r"model.sliding_window=48: sliding-window attention is not implemented"):
        engine.generate([[5] * 40], SamplingParams(max_new_tokens=9, greedy=True))
    assert engine.generate([[5] * 40], SamplingParams(max_new_tokens=8, greedy=True)).response_tokens.shape == (1, 8)
    with pytest.raises(ValueError, match=r"a row of 49 tokens is longer than model.sliding_window=48"):
        forward_logits([model], torch.full((1, 49), 5), VOCAB)
    assert forward_logits([model], torch.full((1, 48), 5), VOCAB).shape == (1, 48, VOCAB)
