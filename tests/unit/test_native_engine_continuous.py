"""Continuous batching in the native engine against its static-batch loop (continuous_batching=False).

Each row decodes at its own cache column, finished rows leave the decode batch at once and waiting
prompts take their cache rows; none of that may change a row's tokens or logprobs (its draws are
keyed by its sample index and its own step).
"""
from __future__ import annotations

import pytest
import torch

from aligner.generation.engine import SamplingParams
from aligner.generation.reference import generate_full_forward
from tests.unit.test_native_engine import (
    CONFIGS,
    LOGPROB_TOLERANCE,
    PAD,
    VOCAB,
    make_engine,
    make_model,
    responses,
    training_logprobs,
)

pytestmark = pytest.mark.usefixtures("single_process")


def mixed_prompts(count: int = 11, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 12, 5, 9, 3, 12, 7, 2, 10, 4, 6][:count]
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def both_loops(cfg, model, prompts, sampling, **options):
    """(continuous, static-batch) rollouts of the same request."""
    continuous = make_engine(cfg, model, **options).generate(prompts, sampling)
    static_batch = make_engine(cfg, model, continuous_batching=False, **options).generate(prompts, sampling)
    return continuous, static_batch


def assert_same_rollout(got, expected):
    assert torch.equal(got.response_tokens, expected.response_tokens)
    assert torch.equal(got.response_lengths, expected.response_lengths)
    assert torch.equal(got.ended_with_stop, expected.ended_with_stop)
    assert float((got.logprobs - expected.logprobs).abs().max()) < LOGPROB_TOLERANCE
    assert got.prompt_tokens == expected.prompt_tokens


def stop_token_of(cfg, model, prompts, new_tokens: int) -> int:
    """A token the model says early in some rows (so that rows stop at different steps)."""
    free_run = make_engine(cfg, model).generate(prompts, SamplingParams(max_new_tokens=new_tokens, greedy=True,
                                                                        stop_token_ids=[VOCAB - 1]))
    counts = torch.bincount(free_run.response_tokens[:, :new_tokens // 2].flatten(), minlength=VOCAB)
    return int(counts.argmax())


SAMPLINGS = {
    "greedy": dict(greedy=True),
    "t1.3": dict(temperature=1.3, seed=4),
    "topk-topp": dict(temperature=0.7, top_k=20, top_p=0.9, seed=3),
    "min-new-tokens": dict(temperature=1.0, seed=6, min_new_tokens=3),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("case", sorted(SAMPLINGS))
def test_continuous_batching_gives_the_static_batch_rollout(name, case):
    """Mixed prompt lengths, more prompts than rows (refills), rows stopping early at different steps."""
    cfg, model = make_model(name)
    prompts = mixed_prompts()
    stop = stop_token_of(cfg, model, prompts, 12)
    sampling = SamplingParams(max_new_tokens=12, stop_token_ids=[stop, VOCAB - 2], **SAMPLINGS[case])
    continuous, static_batch = both_loops(cfg, model, prompts, sampling, max_batch_size=4)
    assert_same_rollout(continuous, static_batch)
    lengths = continuous.response_lengths
    assert continuous.ended_with_stop.any() and lengths.min() < lengths.max()  # early stops happened
    expected = training_logprobs(model, cfg, continuous, 1.0 if sampling.is_greedy else sampling.temperature)
    assert float((continuous.logprobs - expected).abs().max()) < LOGPROB_TOLERANCE


def test_greedy_rows_equal_full_forward_decoding():
    cfg, model = make_model("llama")
    prompts = mixed_prompts()
    stop = stop_token_of(cfg, model, prompts, 14)
    rollout = make_engine(cfg, model, max_batch_size=3).generate(
        prompts, SamplingParams(max_new_tokens=14, greedy=True, stop_token_ids=[stop]))
    assert responses(rollout) == generate_full_forward([model], prompts, vocab_size=VOCAB, eos_id=stop, pad_id=PAD,
                                                       max_new_tokens=14)


@pytest.mark.parametrize("options", [dict(static_decode=True), dict()], ids=["static-step", "dynamic-step"])
def test_stop_strings_fixed_length_and_the_static_step(options):
    cfg, model = make_model("qwen")
    prompts = mixed_prompts()
    def decode(ids): return "".join(f"<{i}>" for i in ids)
    free_run = make_engine(cfg, model).generate(prompts, SamplingParams(max_new_tokens=10, greedy=True,
                                                                        stop_token_ids=[VOCAB - 1]))
    pair = f"<{int(free_run.response_tokens[2, 3])}><{int(free_run.response_tokens[2, 4])}>"
    stop = int(free_run.response_tokens[0, 2])
    for sampling in (SamplingParams(max_new_tokens=10, temperature=1.1, seed=2, stop_strings=[pair]),
                     SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[VOCAB - 1], stop_strings=[pair]),
                     SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[stop], fixed_length=True)):
        continuous, static_batch = both_loops(cfg, model, prompts, sampling, max_batch_size=3, decode=decode,
                                              **options)
        assert_same_rollout(continuous, static_batch)
    assert bool(continuous.ended_with_stop.any()) and (continuous.response_lengths == 10).all()


def test_finished_rows_leave_the_decode_batch_and_waiting_prompts_refill_it(monkeypatch):
    """Rows computed per decode step and prompts per prefill, counted at the engine's forward calls."""
    cfg, model = make_model("gpt2")
    prompts = mixed_prompts()
    stop = stop_token_of(cfg, model, prompts, 12)
    sampling = SamplingParams(max_new_tokens=12, greedy=True, stop_token_ids=[stop])
    reference = make_engine(cfg, model, continuous_batching=False).generate(prompts, sampling)
    lengths = reference.response_lengths.tolist()
    assert min(lengths) < 12 and len(set(lengths)) > 2

    engine = make_engine(cfg, model, max_batch_size=4)
    decode_rows, prefill_rows = [], []
    decode_forward, prefill_forward = engine._decode_forward, engine._prefill_forward
    monkeypatch.setattr(engine, "_decode_forward",
                        lambda tokens, *args: decode_rows.append(tokens.shape[0]) or decode_forward(tokens, *args))
    monkeypatch.setattr(engine, "_prefill_forward",
                        lambda tokens, *args, **kw: prefill_rows.append(tokens.shape[0]) or prefill_forward(
                            tokens, *args, **kw))
    rollout = engine.generate(prompts, sampling)
    assert_same_rollout(rollout, reference)
    # Each prompt is prefilled once; each response token but a row's last is one decode row: no row is
    # computed after it finished (the static-batch loop computes every row until its chunk's longest ends).
    assert sum(prefill_rows) == len(prompts) and prefill_rows[0] == 4 and len(prefill_rows) > 3
    assert sum(decode_rows) == sum(n - 1 for n in lengths)
    assert max(decode_rows) <= 4 and min(decode_rows) < 4 and decode_rows[-1] < 4  # shrinks at the end

    # The schedule replayed from the reference lengths: each iteration decodes the rows kept from the
    # last one, admits waiting prompts into free rows, samples one token per row and drops finished rows.
    waiting, tokens_left, expected_decode = list(lengths), [], []
    while waiting or tokens_left:
        if tokens_left:
            expected_decode.append(len(tokens_left))
        while waiting and len(tokens_left) < 4:
            tokens_left.append(waiting.pop(0))
        tokens_left = [n - 1 for n in tokens_left if n > 1]
    assert decode_rows == expected_decode


def test_kv_cache_rows_are_reused_across_refills():
    cfg, model = make_model("llama")
    prompts = mixed_prompts()
    engine = make_engine(cfg, model, max_batch_size=4)
    engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    keys = engine._kv_cache[0]
    assert keys.shape[1] == 4 and keys.shape[-1] == 12 + 6  # max_batch_size rows, longest prompt + new tokens
