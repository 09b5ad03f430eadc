"""Multi-turn generation on kept KV cache rows (NativeEngine.generate_turns) against the protocol's turn-by-turn
path that generates every episode's whole history again: same tokens, logprobs within rounding; a continuation
prefills only its appended tokens; a slow answer for one episode does not hold up the others."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from aligner.generation.engine import GenerationEngine, SamplingParams
from aligner.generation.native import NativeEngine
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.runtime.errors import ConfigError

pytestmark = pytest.mark.usefixtures("single_process")

VOCAB = 128
FIRST_PROMPTS = [[5, 9, 13], [7] * 12, [3, 4, 5, 6, 7, 8], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
TURNS = [1, 4, 2, 5, 3]  # episode i ends after TURNS[i] turns
FALLBACK_S = 60.0  # a slow answer the test waits for comes at the latest after this (a failure, not a hang)


def toy_engine(max_batch_size: int, arch: str = "llama", **options) -> NativeEngine:
    cfg = getattr(GPTConfig, arch)(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   ffn_hidden_size=128, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, transformer_config(cfg)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.1 * torch.randn(param.shape))
    return NativeEngine([model], cfg, pad_id=0, eos_id=1, max_batch_size=max_batch_size, max_sequence_length=160,
                        **options)


class Reprefilled(GenerationEngine):
    """An engine's generate and generate_stream with the protocol's generate_turns (every turn re-prefills)."""

    def __init__(self, engine: GenerationEngine):
        self.engine = engine

    def generate(self, prompts, sampling):
        return self.engine.generate(prompts, sampling)

    def generate_stream(self, next_request, longest_prompt):
        return self.engine.generate_stream(next_request, longest_prompt)


def appended(episode: int, turn: int) -> list[int]:
    """A scripted environment's answer: 2 to 6 tokens that differ by episode and turn."""
    return [(30 + 7 * episode + 3 * turn + k) % VOCAB for k in range(2 + (episode + turn) % 5)]


def run_turns(engine: GenerationEngine, sampling: SamplingParams, answer=lambda episode, turn, tokens: tokens):
    """{(episode, turn): (response ids, logprobs, ended_with_stop)} of generate_turns on FIRST_PROMPTS."""
    turns = {}

    def on_turn(episode, ids, logprobs, stopped):
        turn = sum(key[0] == episode for key in turns)
        turns[episode, turn] = (ids, logprobs, stopped)
        return answer(episode, turn, None if turn + 1 >= TURNS[episode] else appended(episode, turn))

    engine.generate_turns(FIRST_PROMPTS, sampling, on_turn, longest_prompt=120)
    return turns


def assert_same_turns(kept: dict, reprefilled: dict) -> None:
    assert sorted(kept) == sorted(reprefilled) == sorted((e, t) for e, n in enumerate(TURNS) for t in range(n))
    for key in kept:
        ids, logprobs, stopped = kept[key]
        assert ids == reprefilled[key][0], key
        assert stopped == reprefilled[key][2], key
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(reprefilled[key][1]), atol=1e-5, rtol=0), key


SAMPLINGS = {
    "greedy": SamplingParams(max_new_tokens=6, greedy=True, stop_token_ids=[26, 74, 102, 29, 111]),
    "sampled": SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, stop_token_ids=list(range(1, VOCAB, 9))),
}


@pytest.mark.parametrize("static_decode", [False, True], ids=["dynamic_step", "static_step"])
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_episodes_on_kept_cache_rows_equal_episodes_prefilled_again_each_turn(name, static_decode):
    sampling = SAMPLINGS[name]
    # 2 cache rows for 5 episodes: episodes wait for a row, rows change hands and swap places as turns end
    engine = toy_engine(max_batch_size=2, static_decode=static_decode)
    kept = run_turns(engine, sampling)
    reprefilled = run_turns(Reprefilled(engine), sampling)
    assert_same_turns(kept, reprefilled)
    assert len({len(ids) for ids, _, _ in kept.values()}) > 1  # turns of different lengths: some ended by a stop
    assert any(stopped for _, _, stopped in kept.values()) and not all(stopped for _, _, stopped in kept.values())


def test_learned_positions_and_layer_norms_continue_at_the_rows_own_positions():
    """GPT-2's learned position embeddings read a continuation's positions directly (no rotary tables)."""
    engine = toy_engine(max_batch_size=3, arch="gpt2")
    sampling = SAMPLINGS["sampled"]
    assert_same_turns(run_turns(engine, sampling), run_turns(Reprefilled(engine), sampling))


def test_answers_that_come_late_and_out_of_order_give_the_same_episodes():
    """Answers as Futures finished by threads in another order than asked: the rows' schedule changes, the
    episodes do not (each turn draws from its own (episode, turn) stream)."""
    sampling = SAMPLINGS["sampled"]
    engine = toy_engine(max_batch_size=3)
    def answer_after(delay, tokens):
        time.sleep(delay)
        return tokens

    with ThreadPoolExecutor(3) as threads:
        def late(episode, turn, tokens):
            return threads.submit(answer_after, 0.002 * ((episode * 7 + turn * 3) % 5), tokens)
        kept = run_turns(engine, sampling, late)
    assert_same_turns(kept, run_turns(Reprefilled(engine), sampling))


def test_a_continuation_prefills_only_the_last_reply_token_and_the_appended_tokens():
    engine = toy_engine(max_batch_size=5)
    prefills = []  # (first cache column, real tokens) of each prefilled row
    original = engine.forward.prefill_forward

    def counting(tokens, positions, keys, values, key_masked, last_columns=None, continued=False):
        real = [tokens.shape[1]] * tokens.shape[0] if last_columns is None else (last_columns + 1).tolist()
        starts = positions[:, 0].tolist() if continued else [0] * tokens.shape[0]
        prefills.extend(zip(starts, real))
        return original(tokens, positions, keys, values, key_masked, last_columns=last_columns, continued=continued)

    engine.forward.prefill_forward = counting
    turns = run_turns(engine, SAMPLINGS["greedy"])
    expected = [(0, len(prompt)) for prompt in FIRST_PROMPTS]
    for episode, prompt in enumerate(FIRST_PROMPTS):
        history = len(prompt)
        for turn in range(TURNS[episode] - 1):
            history += len(turns[episode, turn][0])
            # the reply's last token (sampled, never in the cache) and the environment's tokens, after the rest
            expected.append((history - 1, 1 + len(appended(episode, turn))))
            history += len(appended(episode, turn))
    assert sorted(prefills) == sorted(expected)


def test_an_episode_waiting_for_its_environment_does_not_hold_up_the_others():
    """Episode 0's first answer comes only once episode 1 has played all its turns (or, as a fallback that
    fails the test instead of hanging, after a minute): continuous batching across turns lets episode 1 on."""
    engine = toy_engine(max_batch_size=2)
    first_prompts = FIRST_PROMPTS[:2]
    slow: Future = Future()
    events = []

    def on_turn(episode, ids, logprobs, stopped):
        turn = sum(e == episode for e, _ in events)
        events.append((episode, turn))
        if episode == 0:
            return slow if turn == 0 else None
        if turn < 3:
            return [50, 51, 52]
        if not slow.done():
            slow.set_result([60, 61])  # episode 1 has ended: now episode 0's answer
        return None

    def answer_anyway():
        if not slow.done():
            slow.set_result([70])

    fallback = threading.Timer(FALLBACK_S, answer_anyway)
    fallback.start()
    try:
        engine.generate_turns(first_prompts, SAMPLINGS["greedy"], on_turn, longest_prompt=120)
    finally:
        fallback.cancel()
    # episode 1 played its 4 turns while episode 0 waited after its first; episode 0's second turn came after
    assert events == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (0, 1)] or \
        events == [(1, 0), (0, 0), (1, 1), (1, 2), (1, 3), (0, 1)]
    assert slow.result() == [60, 61]  # answered by episode 1's end, not by the fallback


def test_a_continuation_past_the_limits_is_refused_as_generate_refuses_a_long_prompt():
    engine = toy_engine(max_batch_size=2)
    sampling = SAMPLINGS["greedy"]  # 6 new tokens; the engine's max_sequence_length is 160
    with pytest.raises(ConfigError, match="exceeds the engine's max_sequence_length=160"):
        engine.generate_turns([[5, 6, 7]], sampling, lambda *turn: [9] * 150, longest_prompt=300)
    with pytest.raises(ValueError, match="more than longest_prompt=40"):
        engine.generate_turns([[5, 6, 7]], sampling, lambda *turn: [9] * 40, longest_prompt=40)
    with pytest.raises(ValueError, match="outside"):
        engine.generate_turns([[5, 6, 7]], sampling, lambda *turn: [VOCAB], longest_prompt=40)
