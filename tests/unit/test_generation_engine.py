"""The GenerationEngine protocol's inherited behaviour: what an engine that implements only `generate` does."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from aligner.generation.engine import GenerationEngine, Rollout, SamplingParams, turn_sampling


class CountingEngine(GenerationEngine):
    """Answers each prompt with its own length; records calls to generate and free."""

    def __init__(self):
        self.calls: list = []

    def generate(self, prompts, sampling):
        self.calls.append(("generate", [list(prompt) for prompt in prompts], (sampling.seed, sampling.first_sample)))
        rows = len(prompts)
        return Rollout([list(p) for p in prompts], torch.tensor([[len(p)] for p in prompts]), torch.zeros(rows, 1),
                       torch.ones(rows, dtype=torch.long), torch.ones(rows, dtype=torch.bool))

    def free(self):
        self.calls.append(("free",))


def test_an_engine_must_generate():
    class Silent(GenerationEngine):
        pass

    with pytest.raises(TypeError, match="generate"):
        Silent()


def test_the_default_stream_is_one_generate_call_per_request_in_order():
    engine = CountingEngine()
    requests = [("a", [[1, 2], [3]], SamplingParams(seed=5)), ("b", [[4, 5, 6]], SamplingParams(seed=6))]
    pulled = []

    def next_request():
        pulled.append(len(pulled))
        return requests[len(pulled) - 1] if len(pulled) <= len(requests) else None

    stream = engine.generate_stream(next_request, longest_prompt=3)
    key, rollout = next(stream)
    # lazy: the second request is pulled only when the first one's rollout was taken
    assert (key, rollout.response_tokens.tolist(), pulled) == ("a", [[2], [1]], [0])
    assert [(key, rollout.response_tokens.tolist()) for key, rollout in stream] == [("b", [[3]])]
    assert pulled == [0, 1, 2]
    assert engine.calls == [("generate", [[1, 2], [3]], (5, 0)), ("generate", [[4, 5, 6]], (6, 0))]


def test_refit_is_a_no_op_and_release_for_update_frees_by_default():
    engine = CountingEngine()
    engine.refit([torch.nn.Linear(2, 2)])
    assert engine.calls == []
    engine.release_for_update()
    assert engine.calls == [("free",)]


def test_the_default_turns_generate_each_episodes_whole_history_again_with_the_turns_seed():
    engine = CountingEngine()
    sampling = SamplingParams(seed=5)
    answered = Future()
    answered.set_result([8, 9])
    answers = {(0, 0): [7], (1, 0): answered, (1, 1): None, (0, 1): None}
    turns = []

    def on_turn(episode, ids, logprobs, stopped):
        turn = sum(e == episode for e, _ in turns)
        turns.append((episode, ids))
        return answers[episode, turn]

    engine.generate_turns([[1, 2], [3]], sampling, on_turn, longest_prompt=8)
    # turn 0: each first prompt (the reply is its length); turn 1: prompt + reply + appended tokens
    assert turns == [(0, [2]), (1, [1]), (0, [4]), (1, [4])]
    stream = lambda episode, turn: (turn_sampling(sampling, episode, turn).seed,  # noqa: E731
                                    turn_sampling(sampling, episode, turn).first_sample)
    assert engine.calls == [("generate", [[1, 2]], stream(0, 0)), ("generate", [[3]], stream(1, 0)),
                            ("generate", [[1, 2, 2, 7]], stream(0, 1)), ("generate", [[3, 1, 8, 9]], stream(1, 1))]
    # turn 0 of episode i is row i of a single-turn request; every turn draws its own stream
    assert stream(0, 0) == (5, 0) and stream(1, 0) == (5, 1) and len({s for *_, s in engine.calls}) == 4
