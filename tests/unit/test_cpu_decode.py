"""The C++ decode step on a CPU (aligner/generation/native/cpu_decode.py), of one row and of many: the general
path's tokens and the training forward's logprobs, where it applies; the general path everywhere else."""
from __future__ import annotations

import logging

import pytest
import torch

from aligner.generation.engine import SamplingParams
from aligner.generation.native import cpu_decode
from aligner.models.gpt import GPTConfig
from aligner.runtime.errors import ConfigError
from tests.unit.test_native_engine import (
    CONFIGS,
    LOGPROB_TOLERANCE,
    VOCAB,
    make_engine,
    make_prompts,
    signal_model,
    training_logprobs,
)

pytestmark = pytest.mark.usefixtures("single_process")

SUPPORTED = {
    "llama": CONFIGS["llama"],  # grouped-query attention, untied output layer
    "qwen": CONFIGS["qwen"],  # qkv bias, tied embeddings, head_dim 32 != hidden / heads
    # sizes that are no multiple of a vector (72, 100, head_dim 24), biases on every linear layer, one group
    "odd": GPTConfig.llama(num_layers=2, hidden_size=72, num_attention_heads=3, num_query_groups=1, kv_channels=24,
                           ffn_hidden_size=100, vocab_size=VOCAB, add_bias_linear=True, add_qkv_bias=True,
                           make_vocab_size_divisible_by=64, max_position_embeddings=64),
    # attention long enough to be split across threads (kv_len * head_dim * heads >= 2**16)
    "long": GPTConfig.llama(num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=64,
                            ffn_hidden_size=128, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                            max_position_embeddings=320),
}


@pytest.fixture
def cpp_steps(monkeypatch):
    """Records the C++ steps run, (rows, kv_len) each; skips where the extension cannot be built (no compiler)."""
    if cpu_decode.extension() is None:
        pytest.skip("the C++ decode step could not be built on this machine")
    calls = []
    step = cpu_decode.CpuDecode.step

    def counted(self, tokens, inputs, keys, values):
        calls.append((tokens.shape[0], inputs.kv_len))
        return step(self, tokens, inputs, keys, values)

    monkeypatch.setattr(cpu_decode.CpuDecode, "step", counted)
    return calls


@pytest.fixture(params=["own", "onednn"])
def products(request, monkeypatch):
    """Both routes of a step of many rows, whatever this CPU chooses: the C++ step's own products for up to 8 rows
    ("own", cpu_decode.cpp's rows_times_matrix) or oneDNN's from 2 ("onednn"). Returns the most own rows."""
    if cpu_decode.extension() is None:
        pytest.skip("the C++ decode step could not be built on this machine")
    most = 1 if request.param == "onednn" else cpu_decode.extension().max_own_rows
    if most == 1 and request.param == "own":
        pytest.skip("built without vector registers: one row at most runs the own products")
    monkeypatch.setattr(cpu_decode, "own_rows", lambda flags: most)
    return most


def general_rollout(monkeypatch, cfg, model, prompts, sampling, **engine_options):
    """The same call with the C++ step off."""
    monkeypatch.setenv(cpu_decode.SETTING_VARIABLE, "general")
    try:
        return make_engine(cfg, model, **engine_options).generate(prompts, sampling)
    finally:
        monkeypatch.delenv(cpu_decode.SETTING_VARIABLE)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_one_sequence_decodes_in_cpp_with_the_general_paths_tokens_and_the_training_logprobs(name, cpp_steps,
                                                                                            monkeypatch):
    cfg = SUPPORTED[name]
    model = signal_model(cfg)
    length = 260 if name == "long" else 9
    prompt = [torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(2)).tolist()]
    max_len = length + 24
    for sampling in (SamplingParams(max_new_tokens=20, greedy=True, fixed_length=True),
                     SamplingParams(max_new_tokens=20, temperature=0.8, top_k=30, seed=7, fixed_length=True)):
        cpp_steps.clear()
        rollout = make_engine(cfg, model, max_sequence_length=max_len).generate(prompt, sampling)
        # every decode step, each one column further
        assert cpp_steps == [(1, kv_len) for kv_len in range(length + 1, length + 20)]
        expected = training_logprobs(model, cfg, rollout, 1.0 if sampling.is_greedy else sampling.temperature)
        assert float((rollout.logprobs - expected).abs().max()) < LOGPROB_TOLERANCE
        general = general_rollout(monkeypatch, cfg, model, prompt, sampling, max_sequence_length=max_len)
        assert len(cpp_steps) == 19  # the general engine ran none
        assert torch.equal(rollout.response_tokens, general.response_tokens)
        assert torch.allclose(rollout.logprobs, general.logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", ["llama", "odd"])
@pytest.mark.parametrize("continuous", [False, True])
def test_many_rows_decode_in_cpp_with_the_general_paths_tokens_and_the_training_logprobs(name, continuous, products,
                                                                                          cpp_steps, monkeypatch):
    """Prompts of several lengths: the static-batch loop (left padding: a bias and each row's own positions, one
    shared column) and continuous batching (max_batch_size 3 for 7 prompts: each row at its own column)."""
    cfg = SUPPORTED[name]
    model = signal_model(cfg)
    prompts = make_prompts()
    options = dict(max_batch_size=3 if continuous else 8, continuous_batching=continuous)
    for sampling in (SamplingParams(max_new_tokens=14, greedy=True, stop_token_ids=[VOCAB - 1]),
                     SamplingParams(max_new_tokens=14, temperature=1.1, top_k=40, seed=8, stop_token_ids=[5, 6])):
        cpp_steps.clear()
        rollout = make_engine(cfg, model, **options).generate(prompts, sampling)
        rows = {batch for batch, _ in cpp_steps}
        assert max(rows) == (3 if continuous else 7) and len(cpp_steps) >= 13  # every step in C++, many rows
        expected = training_logprobs(model, cfg, rollout, 1.0 if sampling.is_greedy else sampling.temperature)
        assert float((rollout.logprobs - expected).abs().max()) < LOGPROB_TOLERANCE
        general = general_rollout(monkeypatch, cfg, model, prompts, sampling, **options)
        assert torch.equal(rollout.response_tokens, general.response_tokens)
        assert torch.equal(rollout.response_lengths, general.response_lengths)
        assert torch.allclose(rollout.logprobs, general.logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


def test_weights_changed_in_place_are_seen_at_one_row_and_at_many(products, cpp_steps):
    cfg = SUPPORTED["llama"]
    model = signal_model(cfg)
    engine = make_engine(cfg, model)
    sampling = SamplingParams(max_new_tokens=12, greedy=True, fixed_length=True)
    for prompts in (make_prompts()[1:2], make_prompts()[:4]):
        before = engine.generate(prompts, sampling)
        with torch.no_grad():  # a training update, in place: the C++ step holds the same tensors
            for param in model.parameters():
                param.mul_(1.3)
        cpp_steps.clear()
        after = engine.generate(prompts, sampling)
        assert {batch for batch, _ in cpp_steps} == {len(prompts)}
        assert not torch.equal(before.logprobs, after.logprobs)
        expected = training_logprobs(model, cfg, after, 1.0)
        assert float((after.logprobs - expected).abs().max()) < LOGPROB_TOLERANCE


def test_without_packed_weights_rows_beyond_the_own_products_and_the_static_step_take_the_general_path(
        products, cpp_steps):
    cfg = SUPPORTED["llama"]
    model = signal_model(cfg)
    prompts, sampling = make_prompts(), SamplingParams(max_new_tokens=6, greedy=True, fixed_length=True)
    prompts = (prompts * 2)[:products + 1]  # one row more than the own products serve
    unpacked = make_engine(cfg, model, pack_weights=False, max_batch_size=len(prompts))
    many = unpacked.generate(prompts, sampling)
    assert cpp_steps == [] and not unpacked.state.cpu_decode.batched
    fewer = unpacked.generate(prompts[:products], sampling)  # no packed copy needed
    assert {batch for batch, _ in cpp_steps} == {products}
    assert torch.equal(fewer.response_tokens, many.response_tokens[:products])
    cpp_steps.clear()
    static = make_engine(cfg, model, static_decode=True).generate(prompts, sampling)  # what a graph captures
    assert cpp_steps == [] and torch.equal(static.response_tokens, many.response_tokens)


@pytest.mark.parametrize("name,reason", [("gpt2", "normalization"), ("moe", "qk_layernorm"),
                                         ("gemma", "activation")])
def test_models_the_cpp_step_cannot_run_decode_on_the_general_path(name, reason, cpp_steps):
    cfg = CONFIGS[name]
    engine = make_engine(cfg, signal_model(cfg))
    rollout = engine.generate(make_prompts()[:1], SamplingParams(max_new_tokens=6, greedy=True))
    assert engine.state.cpu_decode is None and cpp_steps == [] and rollout.response_tokens.shape == (1, 6)
    assert reason in cpu_decode.unsupported(engine.state, engine.state.segments)


def test_a_live_lora_adapter_or_another_dtype_is_left_to_the_general_path():
    cfg = SUPPORTED["llama"]
    engine = make_engine(cfg, signal_model(cfg))
    engine.generate(make_prompts()[:1], SamplingParams(max_new_tokens=2, greedy=True))
    state, segments = engine.state, engine.state.segments
    assert cpu_decode.unsupported(state, segments) is None and state.cpu_decode is not None
    layer = segments[0].layers[0]
    adapted = layer._replace(fc2=layer.fc2._replace(lora_a=torch.zeros(2, cfg.ffn_hidden_size)))
    segments[0].layers[0] = adapted
    assert cpu_decode.unsupported(state, segments) == "a live LoRA adapter"
    segments[0].layers[0] = layer
    state.dtype = torch.bfloat16
    assert cpu_decode.unsupported(state, segments) == "not fp32 on a CPU"


def test_the_setting_turns_it_off_and_a_wrong_value_is_one_line(monkeypatch):
    cfg = SUPPORTED["llama"]
    engine = make_engine(cfg, signal_model(cfg))
    monkeypatch.setenv(cpu_decode.SETTING_VARIABLE, "general")
    engine.generate(make_prompts()[:1], SamplingParams(max_new_tokens=2, greedy=True))
    assert engine.state.cpu_decode is None
    monkeypatch.setenv(cpu_decode.SETTING_VARIABLE, "fast")
    with pytest.raises(ConfigError, match=r"ALIGNER_CPU_DECODE='fast': choose one of auto, general"):
        engine.generate(make_prompts()[:1], SamplingParams(max_new_tokens=2, greedy=True))


def test_a_failed_build_warns_once_and_decodes_on_the_general_path(monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(cpu_decode, "_extension", {})
    monkeypatch.setattr(cpu_decode.cpp_extension, "load", no_compiler)
    cfg = SUPPORTED["llama"]
    model = signal_model(cfg)
    sampling = SamplingParams(max_new_tokens=8, greedy=True, fixed_length=True)
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        rollouts = [make_engine(cfg, model).generate(make_prompts()[2:3], sampling) for _ in range(2)]
    warnings = [record.getMessage() for record in caplog.records if record.name == cpu_decode.__name__]
    assert warnings == ["the C++ decode step on a CPU could not be built (c++: command not found); decoding "
                        "through the general path"]
    expected = training_logprobs(model, cfg, rollouts[1], 1.0)
    assert torch.equal(rollouts[0].response_tokens, rollouts[1].response_tokens)
    assert float((rollouts[1].logprobs - expected).abs().max()) < LOGPROB_TOLERANCE


def test_a_lock_left_by_a_killed_build_is_cleared_before_building(monkeypatch, tmp_path):
    """torch's loader waits forever on the lock file of a build that was killed; under our own lock (which the
    kernel releases when its process dies) such a file can only be stale, and is removed first."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen = {}

    def load(name, sources, build_directory, **kwargs):
        seen["lock left"] = (tmp_path / name / "lock").exists()
        seen["sources"] = sources
        return "module"

    monkeypatch.setattr(cpu_decode.cpp_extension, "load", load)
    monkeypatch.setattr(cpu_decode, "_extension", {})
    first = cpu_decode._build()  # learns the name
    (tmp_path / next(p.name for p in tmp_path.iterdir() if p.is_dir()) / "lock").write_text("")
    assert first == "module" and cpu_decode._build() == "module"
    assert seen == {"lock left": False, "sources": [str(cpu_decode.SOURCE)]}


def test_a_call_outside_the_cache_or_vocabulary_fails_with_a_message_not_a_bad_write(cpp_steps):
    cfg = SUPPORTED["llama"]
    engine = make_engine(cfg, signal_model(cfg))
    engine.generate(make_prompts()[:2], SamplingParams(max_new_tokens=2, greedy=True))
    keys, values = engine._cache(2)
    state = engine.state
    rope = tuple(table[:, :2] for table in state.rope_columns)
    length = keys.shape[-1]

    def step(tokens, column, kv_len, bias=None):
        inputs = engine.forward.decode_inputs(torch.tensor(column), None, kv_len, bias, rope)
        return state.cpu_decode.step(torch.tensor(tokens), inputs, keys[:, :2], values[:, :2])

    with pytest.raises(RuntimeError, match=f"kv_len {length + 1} outside the cache"):
        step([5, 6], [3, 4], length + 1)
    with pytest.raises(RuntimeError, match="column 9 outside the cache"):
        step([5, 6], [3, 9], 8)
    with pytest.raises(RuntimeError, match="token 1000000 outside the vocabulary"):
        step([5, 10**6], [3, 4], 8)
    with pytest.raises(RuntimeError, match=r"bias \[batch \* groups, kv_len\]"):
        step([5, 6], [3, 4], 8, bias=torch.zeros(2 * state.groups, 1, 7))
    logits = step([5, 6], [3, 4], 8, bias=torch.zeros(2 * state.groups, 1, 8))
    assert logits.shape == (2, state.segments[0].output_weight.shape[0]) and logits.isfinite().all()


def test_the_own_products_serve_many_rows_only_without_avx512():
    assert cpu_decode.own_rows("fpu sse2 avx avx2 fma bmi2") == cpu_decode.OWN_ROWS_WITHOUT_AVX512 == 8
    assert cpu_decode.own_rows("fpu sse2 avx avx2 fma avx512f avx512_bf16") == 1
    assert cpu_decode.own_rows("fpu sse2 avx") == 1  # no AVX2: plain loops, one row


def test_the_products_run_on_torchs_threads(cpp_steps):
    """Built without OpenMP, at::parallel_for would run every product on the calling thread (silently: the
    tokens are the same, the step 1.5x slower on two cores)."""
    threads = torch.get_num_threads()
    try:
        for wanted in (2, 1):
            torch.set_num_threads(wanted)
            assert cpu_decode.extension().parallel_threads() == wanted
    finally:
        torch.set_num_threads(threads)
