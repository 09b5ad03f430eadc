"""A critic client stand-in for tests that exercise the actor alone: values 0 everywhere, no training,
no server. With zero values, GAE advantages are discounted returns, so the actor's computation is
unchanged."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import torch


def done(value) -> Future:
    """A future that already holds `value` (what the real clients return, answered at once)."""
    future: Future = Future()
    future.set_result(value)
    return future


class NullCritic:
    def infer_async(self, sequences) -> Future:
        return done(SimpleNamespace(values=[torch.zeros(len(s)) for s in sequences], rewards=None))

    def train_async(self, sequences, prompt_lengths, returns, old_values, loss_mask=None) -> Future:
        return done({"rows": float(len(sequences))})

    def save(self, step: int) -> str:
        return "(no critic)"

    def restore(self, step: int) -> str:
        return "(no critic)"


class TokenCritic(NullCritic):
    """Values that depend on the tokens (so GAE's advantages do), the same for the same sequence; no training."""

    def infer_async(self, sequences) -> Future:
        values = [torch.tensor([(token * 37 % 11) / 11 - 0.5 for token in sequence]) for sequence in sequences]
        return done(SimpleNamespace(values=values, rewards=None))
