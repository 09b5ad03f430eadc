"""The one generation interface trainers see: refit, generate, generate_stream, release_for_update, free.

Engines: `aligner.generation.native.NativeEngine` (KV-cached, on the training weights, CPU and GPU)
and `aligner.generation.trtllm.TensorRTLLMEngine` (GPU clusters, optional extra).
"""
from __future__ import annotations

from abc import abstractmethod
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

    def release_for_update(self) -> None:
        """Between generating and a weight update: give training the memory of what the update makes
        stale; what stays valid may be kept for the next step (default: everything `free` releases)."""
        self.free()

    def free(self) -> None:
        """Release engine memory (KV cache, engine weights) so training has it back (default: nothing held)."""
