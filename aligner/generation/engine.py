"""The one generation interface trainers see: refit, generate, free.

Engines: `aligner.generation.native.NativeEngine` (KV-cached, on the training weights, CPU and GPU)
and `aligner.generation.trtllm.TensorRTLLMEngine` (GPU clusters, optional extra).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch


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
    seed: int = 0  # sample i draws from a generator seeded by (seed, i): a rollout is reproducible

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


class GenerationEngine(Protocol):
    def refit(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        """Make the engine serve the current training weights."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollout:
        """Continue every prompt (collective: every rank of the model-parallel group calls it)."""

    def free(self) -> None:
        """Release engine memory (KV cache, engine weights) so training has it back."""


def generate_requests(engine, next_request: Callable[[], Optional[tuple]], longest_prompt: int) -> Iterator[tuple]:
    """(key, Rollout) of each request (key, prompts, sampling) that next_request() gives until None.

    Through the engine's `generate_stream` when it has one (the native engine: continuous batching
    across requests, each taken when cache rows free up, yielded as it completes), else one
    `generate` call per request, in order. Either way a request's rollout is `generate`'s on it alone.
    """
    if hasattr(engine, "generate_stream"):
        yield from engine.generate_stream(next_request, longest_prompt=longest_prompt)
        return
    while (request := next_request()) is not None:
        key, prompts, sampling = request
        yield key, engine.generate(prompts, sampling)
