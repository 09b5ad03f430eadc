"""Continuous batching in the native engine against its static-batch loop (continuous_batching=False).

Each row decodes at its own cache column, finished rows leave the decode batch at once and waiting
prompts take their cache rows; none of that may change a row's tokens or logprobs (its draws are
keyed by its sample index and its own step).
"""
from __future__ import annotations

import pytest
import torch

from aligner.generation.engine import GenerationEngine, SamplingParams
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


# The KV-cached decode against one full forward of the finished rows: other products, summed in other orders.
# 1e-5 held on the Intel Xeon; on an AMD EPYC the Gemma-style model (scaled embeddings, logprobs down to -4.6)
# measured 1.38e-5 (min-new-tokens). A wrong position or mask moves a logprob by far more than 3e-5.
DECODE_VS_FULL_FORWARD_TOLERANCE = 3e-5

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
    assert float((continuous.logprobs - expected).abs().max()) < DECODE_VS_FULL_FORWARD_TOLERANCE


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


def scheduled_decode_rows(lengths: list, rows: int) -> list:
    """Rows of each decode step, replayed from the response lengths: each iteration decodes the rows kept
    from the last one, admits waiting prompts into free rows, samples a token per row, drops finished rows."""
    waiting, tokens_left, decode_rows = list(lengths), [], []
    while waiting or tokens_left:
        if tokens_left:
            decode_rows.append(len(tokens_left))
        while waiting and len(tokens_left) < rows:
            tokens_left.append(waiting.pop(0))
        tokens_left = [n - 1 for n in tokens_left if n > 1]
    return decode_rows


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
    decode_forward, prefill_forward = engine.forward.decode_forward, engine.forward.prefill_forward
    monkeypatch.setattr(engine.forward, "decode_forward",
                        lambda tokens, *args: decode_rows.append(tokens.shape[0]) or decode_forward(tokens, *args))
    monkeypatch.setattr(engine.forward, "prefill_forward",
                        lambda tokens, *args, **kw: prefill_rows.append(tokens.shape[0]) or prefill_forward(
                            tokens, *args, **kw))
    rollout = engine.generate(prompts, sampling)
    assert_same_rollout(rollout, reference)
    # Each prompt is prefilled once; each response token but a row's last is one decode row: no row is
    # computed after it finished (the static-batch loop computes every row until its chunk's longest ends).
    assert sum(prefill_rows) == len(prompts) and prefill_rows[0] == 4 and len(prefill_rows) > 3
    assert sum(decode_rows) == sum(n - 1 for n in lengths)
    assert max(decode_rows) <= 4 and min(decode_rows) < 4 and decode_rows[-1] < 4  # shrinks at the end

    assert decode_rows == scheduled_decode_rows(lengths, 4)


def test_kv_cache_rows_are_reused_across_refills():
    cfg, model = make_model("llama")
    prompts = mixed_prompts()
    engine = make_engine(cfg, model, max_batch_size=4)
    engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    keys = engine._kv_cache[0]
    assert keys.shape[1] == 4 and keys.shape[-1] == 12 + 6  # max_batch_size rows, longest prompt + new tokens


def requests_of(prompts, sampling, size: int) -> list[tuple]:
    """(key, prompts, sampling) per run of `size` prompts, each with a seed of its own (as rollouts send them)."""
    return [(start, prompts[start:start + size], SamplingParams(**{**vars(sampling), "seed": sampling.seed + start}))
            for start in range(0, len(prompts), size)]


@pytest.mark.parametrize("case", ["greedy", "topk-topp", "min-new-tokens"])
def test_a_stream_of_requests_gives_each_request_its_own_generate_rollout(monkeypatch, case):
    """generate_stream refills rows across requests; each request's rollout is generate's on it alone."""
    cfg, model = make_model("llama")
    prompts = mixed_prompts() + mixed_prompts(seed=2)
    stop = stop_token_of(cfg, model, prompts, 12)
    sampling = SamplingParams(max_new_tokens=12, stop_token_ids=[stop], **SAMPLINGS[case])
    requests = requests_of(prompts, sampling, 4)
    reference = make_engine(cfg, model, continuous_batching=False)
    expected = {key: reference.generate(batch, batch_sampling) for key, batch, batch_sampling in requests}

    engine = make_engine(cfg, model, max_batch_size=4)
    decode_rows, pulled_at = [], []
    decode_forward = engine.forward.decode_forward
    monkeypatch.setattr(engine.forward, "decode_forward",
                        lambda tokens, *args: decode_rows.append(tokens.shape[0]) or decode_forward(tokens, *args))
    pending = list(requests)

    def next_request():
        pulled_at.append(len(decode_rows))
        return pending.pop(0) if pending else None

    done = []
    for key, rollout in engine.generate_stream(next_request, longest_prompt=max(map(len, prompts))):
        assert_same_rollout(rollout, expected[key])
        done.append(key)
    assert sorted(done) == sorted(expected) and len(pulled_at) == len(requests) + 1
    # Requests are pulled as rows free up, not all at once, and their prompts refill rows across requests.
    assert pulled_at == sorted(pulled_at) and pulled_at[-2] > 0
    lengths = [n for key, _, _ in requests for n in expected[key].response_lengths.tolist()]
    assert decode_rows == scheduled_decode_rows(lengths, 4)


def test_a_stream_refuses_requests_it_cannot_serve():
    cfg, model = make_model("llama")
    prompts = mixed_prompts()
    sampling = SamplingParams(max_new_tokens=4, greedy=True)
    engine = make_engine(cfg, model, max_batch_size=2)
    other = [(0, prompts[:2], sampling), (1, prompts[2:4], SamplingParams(max_new_tokens=5, greedy=True))]
    with pytest.raises(ValueError, match="but for the seed"):
        list(engine.generate_stream(lambda: other.pop(0) if other else None, longest_prompt=12))
    long = [(0, prompts[:2], sampling), (1, [[5] * 13], sampling)]
    with pytest.raises(ValueError, match="longest_prompt=12"):
        list(engine.generate_stream(lambda: long.pop(0) if long else None, longest_prompt=12))
    static_batch = make_engine(cfg, model, continuous_batching=False)
    plain = requests_of(prompts, sampling, 3)
    streamed = dict(static_batch.generate_stream(lambda: plain.pop(0) if plain else None, longest_prompt=12))
    assert sorted(streamed) == [0, 3, 6, 9]
    assert_same_rollout(streamed[3], static_batch.generate(prompts[3:6], sampling))


class GenerateOnly(GenerationEngine):
    """An engine with generate only: it streams by the protocol's default, one generate call per micro-batch."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, sampling):
        return self.engine.generate(prompts, sampling)


@pytest.mark.parametrize("router_kind", ["static", "dynamic"])
def test_rollouts_stream_micro_batches_through_the_engine_with_the_same_rows(router_kind):
    from aligner.generation.rollouts import collect_rollouts
    from aligner.generation.router_client import DynamicRouter, StaticRouter

    cfg, model = make_model("gpt2")
    prompts = mixed_prompts() + mixed_prompts(seed=3)
    # a sixth of the vocabulary stops a row: responses of every length
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, stop_token_ids=list(range(3, 20)))

    events = []  # "pull" (the engine asks for a micro-batch) and "done" (one is complete), in order

    def collect(engine):
        router = (StaticRouter(micro_batch_size=4) if router_kind == "static"
                  else DynamicRouter(micro_batch_size=4, host="127.0.0.1", timeout_s=60))
        generated = []
        try:
            rows = collect_rollouts(engine, router, prompts, sampling,
                                    on_generated=lambda indices, rollout: events.append("done") or generated.append(
                                        list(indices)))
        finally:
            router.close()
        return rows, generated

    expected, expected_batches = collect(GenerateOnly(make_engine(cfg, model, max_batch_size=4,
                                                                  continuous_batching=False)))
    engine = make_engine(cfg, model, max_batch_size=4)
    stream = engine.generate_stream
    engine.generate_stream = lambda next_request, **kw: stream(lambda: events.append("pull") or next_request(), **kw)
    events.clear()
    rows, batches = collect(engine)
    assert sorted(rows) == list(range(len(prompts))) and sorted(map(tuple, batches)) == sorted(map(tuple,
                                                                                                 expected_batches))
    # One stream over every micro-batch (then the empty queue), the next one taken before the first ends.
    assert events.count("pull") == len(batches) + 1 and events[:2] == ["pull", "pull"]
    for index, row in rows.items():
        assert row.prompt == expected[index].prompt and torch.equal(row.response, expected[index].response)
        assert row.ended_with_stop == expected[index].ended_with_stop
        assert torch.allclose(row.logprobs, expected[index].logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.parametrize("rows", [12, 5])
def test_a_prompt_admitted_several_times_is_prefilled_once(rows):
    """A group's samples (each prompt k times, adjacent): admitted together, the prompt runs through the
    prefill once and its cache rows and logits are copied; the rollout is the one of prefilling every row.
    With 5 cache rows the groups are split across admissions (refills), so copies land between other rows."""
    cfg, model = make_model("llama")
    distinct = mixed_prompts(3)  # lengths 1, 12, 5
    prompts = [prompt for prompt in distinct for _ in range(4)]
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
    shared = make_engine(cfg, model, max_batch_size=rows)
    prefilled = []  # rows of each prefill forward
    forward = shared.forward.prefill_forward
    shared.forward.prefill_forward = lambda tokens, *args, **kwargs: (prefilled.append(tokens.shape[0]),
                                                                forward(tokens, *args, **kwargs))[1]
    got = shared.generate(prompts, sampling)
    expected = make_engine(cfg, model, max_batch_size=rows, shared_prefill=False).generate(prompts, sampling)
    assert_same_rollout(got, expected)
    # each admission prefills its distinct prompts only: 3 rows for 12 admitted at once; with 5 rows the
    # first admission holds prompts 0,0,0,0,1 (2 distinct), refills hold at most one new group each
    assert prefilled == [3] if rows == 12 else (prefilled[0] == 2 and sum(prefilled) < len(prompts)), prefilled
    samples = responses(got)
    assert any(samples[i] != samples[i + 1] for i in range(3)), "a group's samples drew the same tokens"
    training = training_logprobs(model, cfg, got, sampling.temperature)
    assert float((got.logprobs - training).abs().max()) < LOGPROB_TOLERANCE
