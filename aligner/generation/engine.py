"""The one generation interface trainers see: refit, generate, generate_stream, generate_turns,
release_for_update, free.

Engines: `aligner.generation.native.NativeEngine` (KV-cached, on the training weights, CPU and GPU)
and `aligner.generation.trtllm.TensorRTLLMEngine` (GPU clusters, optional extra).
"""
from __future__ import annotations

from abc import abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Protocol, Sequence, Union

import torch

from aligner.runtime.seeds import SAMPLER_SEED_RANGE, SEED_WEIGHT, derive_seed


@dataclass
class SamplingParams:
    """How to continue prompts. temperature 0 or greedy=True means argmax decoding."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0  # stop tokens are masked out until this many tokens were generated
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    greedy: bool = False
    stop_token_ids: list = field(default_factory=list)  # empty: the tokenizer's eos
    stop_strings: list = field(default_factory=list)  # checked on the decoded response
    fixed_length: bool = False  # keep sampling past a stop token (OpenAI's original RLHF setting)
    seed: int = 0  # sample i draws from a generator seeded by (seed, first_sample + i): a rollout is reproducible
    first_sample: int = 0  # the stream number of a request's first prompt (`turn_sampling` numbers episodes so)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


@dataclass
class Rollout:
    """What generation returns; all tensors on CPU, rows in prompt order.

    response_tokens: [batch, max_new_tokens] padded with pad_id after each response's end.
    logprobs: [batch, max_new_tokens] log-probability of each generated token under the sampling
        distribution's logits divided by the temperature (0 after the end), the same quantity
        the training forward computes for PPO's ratio.
    response_lengths: [batch] tokens generated (a final stop token included).
    ended_with_stop: [batch] bool, whether the response ended with a stop token / stop string.
    """

    prompt_tokens: list
    response_tokens: torch.Tensor
    logprobs: torch.Tensor
    response_lengths: torch.Tensor
    ended_with_stop: torch.Tensor


# What a turn's callback answers: the tokens that continue the episode (after the model's reply), None when the
# episode has ended, or a Future of either (the environment answers in a thread while other episodes decode).
TurnAnswer = Union[Optional[Sequence[int]], "Future[Optional[Sequence[int]]]"]
# on_turn(episode, response_ids, logprobs, ended_with_stop) -> TurnAnswer
OnTurn = Callable[[int, list, list, bool], TurnAnswer]


def turn_sampling(sampling: SamplingParams, episode: int, turn: int) -> SamplingParams:
    """The sampling of one turn of one episode in `generate_turns`: turn t of episode i draws from the stream
    (seed + t * SEED_WEIGHT, first_sample + i), as a one-prompt request. Its draws depend on (seed, episode, turn)
    alone, not on which episodes are still running nor on the path; and turn 0 of episode i draws what row i of a
    single-turn request with the same sampling draws, so a one-turn episode is the single-turn rollout.
    """
    seed = derive_seed(sampling.seed, turn, weights=(SEED_WEIGHT,), seed_weight=1, modulus=SAMPLER_SEED_RANGE)
    return replace(sampling, seed=seed, first_sample=sampling.first_sample + episode)


def answer_of(answer: TurnAnswer) -> Optional[list]:
    """A turn's answer as a list of tokens (None: the episode ended), waiting for it when it is a Future."""
    if isinstance(answer, Future):
        answer = answer.result()
    return None if answer is None else list(answer)


class GenerationEngine(Protocol):
    """Everything trainers call on an engine. Engines subclass it: what an engine does not need it
    inherits (a no-op, or the plain way of doing it), so callers never ask an engine's name or `hasattr`."""

    def refit(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        """Make the engine serve the current training weights (default: nothing to do)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollout:
        """Continue every prompt (collective: every rank of the model-parallel group calls it)."""

    def generate_stream(self, next_request: Callable[[], Optional[tuple]], longest_prompt: int) -> Iterator[tuple]:
        """(key, Rollout) of each request (key, prompts, sampling) that next_request() gives until None.

        A request's rollout is `generate`'s on it alone. Default: one `generate` call per request, in
        order; the native engine decodes across requests (continuous batching), taking each when cache
        rows free up and yielding it as it completes. No prompt is longer than longest_prompt.
        """
        while (request := next_request()) is not None:
            key, prompts, sampling = request
            yield key, self.generate(prompts, sampling)

    def generate_turns(self, first_prompts: list[list[int]], sampling: SamplingParams, on_turn: OnTurn,
                       longest_prompt: int) -> None:
        """Multi-turn episodes: continue each first prompt, and each episode again with what on_turn appends.

        Whenever a turn of episode i (its index in first_prompts) ends, on_turn(i, response_ids, logprobs,
        ended_with_stop) says how the episode goes on: the tokens to append after the reply (boundary +
        environment tokens), None when it has ended, or a Future of that. The next turn continues the whole
        episode so far (prompt, replies, appended tokens). Turn t of episode i samples with
        `turn_sampling(sampling, i, t)`. No episode's tokens before a turn exceed longest_prompt. on_turn is
        called in the caller's thread.

        Default: turn by turn, every running episode's whole history generated again (one `generate_stream`
        request per episode), the next turn once every answer of this one is in. The native engine keeps
        each episode's KV cache row across turns (only the appended tokens are prefilled) and decodes the
        other episodes while an answer is outstanding.
        """
        histories = {episode: list(prompt) for episode, prompt in enumerate(first_prompts)}
        turns = dict.fromkeys(histories, 0)
        while histories:
            requests = iter([(episode, [history], turn_sampling(sampling, episode, turns[episode]))
                             for episode, history in histories.items()])
            answers = {}
            for episode, rollout in self.generate_stream(lambda queue=requests: next(queue, None), longest_prompt):
                length = int(rollout.response_lengths[0])
                response = rollout.response_tokens[0, :length].tolist()
                answers[episode] = (response, on_turn(episode, response, rollout.logprobs[0, :length].tolist(),
                                                      bool(rollout.ended_with_stop[0])))
            for episode in sorted(answers):
                response, answer = answers[episode]
                appended = answer_of(answer)
                if appended is None:
                    del histories[episode]
                else:
                    histories[episode] += response + appended
                    turns[episode] += 1

    def release_for_update(self) -> None:
        """Between generating and a weight update: give training the memory of what the update makes
        stale; what stays valid may be kept for the next step (default: everything `free` releases)."""
        self.free()

    def free(self) -> None:
        """Release engine memory (KV cache, engine weights) so training has it back (default: nothing held)."""
