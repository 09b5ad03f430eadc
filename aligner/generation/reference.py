"""Reference decoding by full forward passes (no KV cache): simple, obviously correct, any TP/PP.

Used for evaluation of small models and as the ground truth the fast engine is tested against.
Each step re-runs the whole sequence, so cost grows quadratically with length: fine for the short
answers of evaluation sets, not for rollouts.
"""
from __future__ import annotations

from typing import Sequence

import torch

from aligner.models.forward import forward_logits


@torch.no_grad()
def generate_full_forward(
    model_chunks: Sequence[torch.nn.Module],
    prompts: list[list[int]],
    *,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 256,
) -> list[list[int]]:
    """Continue each prompt until eos or max_new_tokens; returns the new tokens (eos included).

    temperature 0 is greedy (argmax); otherwise sampling from softmax(logits / temperature) with a
    generator seeded by `seed`, identical on every rank so all ranks pick the same tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    responses: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        responses.extend(_generate_batch(model_chunks, prompts[start:start + batch_size], vocab_size, eos_id,
                                         pad_id, max_new_tokens, temperature, generator))
    return responses


def _generate_batch(model_chunks, prompts, vocab_size, eos_id, pad_id, max_new_tokens, temperature, generator):
    sequences = [list(prompt) for prompt in prompts]
    responses: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    for _ in range(max_new_tokens):
        active = [i for i, done in enumerate(finished) if not done]
        if not active:
            break
        lengths = torch.tensor([len(sequences[i]) for i in active])
        # Right padding: causal attention keeps every real position blind to the padding after it.
        tokens = torch.full((len(active), int(lengths.max())), pad_id, dtype=torch.long)
        for row, i in enumerate(active):
            tokens[row, : len(sequences[i])] = torch.tensor(sequences[i])
        logits = forward_logits(model_chunks, tokens, vocab_size)  # [rows, seq, vocab]
        last = logits[torch.arange(len(active)), lengths - 1]  # [rows, vocab]
        if temperature > 0:
            probs = torch.softmax(last / temperature, dim=-1)
            next_tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            next_tokens = last.argmax(dim=-1)
        for row, i in enumerate(active):
            token = int(next_tokens[row])
            sequences[i].append(token)
            responses[i].append(token)
            finished[i] = token == eos_id
    return responses
