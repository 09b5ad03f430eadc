"""Client of the PPO critic server (servers/critic.py describes the wire format).

    with CriticClient("127.0.0.1", 5560) as critic:
        critic.wait_until_ready(timeout_s=60)
        inferred = critic.infer_async(token_lists).result()        # .values [B, longest], .rewards
        metrics = critic.train_async(token_lists, prompt_lengths, returns, old_values).result()
        path = critic.save(step)

Values are per token column: `values[b, c]` is the critic's value of the prefix token_lists[b][:c + 1]
(0 past the row's end); the actor reads the value of response token j at column
prompt_length - 1 + j, the column it reads that token's logprob from. In combined mode the server
also returns each sequence's reward-model reward (`rewards`), and serves the reward model under
its usual name, so a `RewardClient` can talk to the same server.

Thread-safe like every ModelServerClient; many inference requests may be in flight (the server
batches them), train and save calls go one at a time.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from aligner.clients import (
    ClientError,
    ModelServerClient,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
    rejected_rows_message,
)
from aligner.clients.protocol import (
    CRITIC_INFER_MODEL,
    CRITIC_RESTORE_MODEL,
    CRITIC_SAVE_MODEL,
    CRITIC_TRAIN_METRICS,
    CRITIC_TRAIN_MODEL,
    LENGTHS,
    LOSS_MASK,
    OLD_VALUES,
    PATH,
    PROMPT_LENGTHS,
    RETURNS,
    REWARDS,
    STEP,
    TOKENS,
    VALUES,
    decode_errors,
    padded_width,
    right_padded,
)

__all__ = ["CriticClient", "CriticInference", "CriticServerError", "ServerUnavailableError", "RequestTimeoutError",
           "ClientError"]

class CriticServerError(ServerError):
    """The critic server rejected a request (the message says which row and why) or failed on it."""


@dataclass
class CriticInference:
    values: np.ndarray  # float32 [B, longest sequence]: value at every token column, 0 past each row's end
    rewards: Optional[np.ndarray]  # float32 [B]: the reward model's rewards (combined mode), else None


def _start_hint(host: str, port: int) -> str:
    return ("Start it with: python examples/nlp/gpt/serve_ppo_critic.py critic.init_from=<reward-model checkpoint> "
            f"server.host={host} server.port={port}")


class _CriticModel(ModelServerClient):
    """One of the critic server's Triton models (train, save)."""

    server_kind = "critic"
    error_class = CriticServerError

    def start_hint(self) -> str:
        return _start_hint(self.host, self.port)


class CriticClient(ModelServerClient):
    """Values, training and checkpoints from a PPO critic server; futures, thread-safe.

    timeout_s bounds one inference request; train_timeout_s one train or save call (a train call
    runs epochs_per_call passes over a whole rollout batch).
    """

    server_kind = "critic"
    error_class = CriticServerError

    def __init__(self, host: str = "127.0.0.1", port: int = 5560, *, infer_model: str = CRITIC_INFER_MODEL,
                 train_model: str = CRITIC_TRAIN_MODEL, save_model: str = CRITIC_SAVE_MODEL,
                 restore_model: str = CRITIC_RESTORE_MODEL, timeout_s: float = 60.0,
                 train_timeout_s: float = 1800.0, ready_timeout_s: float = 30.0, max_workers: int = 8):
        super().__init__(host, port, infer_model, timeout_s=timeout_s, ready_timeout_s=ready_timeout_s,
                         max_workers=max_workers)
        self._train = _CriticModel(host, port, train_model, timeout_s=train_timeout_s,
                                   ready_timeout_s=ready_timeout_s, max_workers=1)
        self._save = _CriticModel(host, port, save_model, timeout_s=train_timeout_s,
                                  ready_timeout_s=ready_timeout_s, max_workers=1)
        self._restore = _CriticModel(host, port, restore_model, timeout_s=train_timeout_s,
                                     ready_timeout_s=ready_timeout_s, max_workers=1)

    def start_hint(self) -> str:
        return _start_hint(self.host, self.port)

    def wait_until_ready(self, timeout_s: Optional[float] = None) -> None:
        """Return once the inference, train, save and restore models are ready; ServerUnavailableError after
        timeout_s."""
        super().wait_until_ready(timeout_s)
        for model in (self._train, self._save, self._restore):
            model.wait_until_ready(timeout_s)

    # -- inference
    def infer_async(self, token_lists: Sequence[Sequence[int]]) -> Future:
        """Values of token sequences (prompt + response ids): a Future of CriticInference."""
        sequences = [np.asarray(tokens).reshape(-1) for tokens in token_lists]
        if not sequences:
            raise ValueError("infer_async needs at least one sequence")
        longest = max(len(ids) for ids in sequences)
        tokens = right_padded(sequences, padded_width(longest))  # widths in power-of-two buckets batch together
        lengths = np.array([[len(ids)] for ids in sequences], dtype=np.int64)  # [B, 1]
        answer: Future = Future()
        self.submit({TOKENS: tokens, LENGTHS: lengths}).add_done_callback(
            lambda sent: _settle(answer, sent, lambda outputs: _inference(outputs, longest)))
        return answer

    def infer(self, token_lists: Sequence[Sequence[int]]) -> CriticInference:
        return self.infer_async(token_lists).result()

    # -- training
    def train_async(self, token_lists: Sequence[Sequence[int]], prompt_lengths: Sequence[int], returns,
                    old_values, loss_mask=None) -> Future:
        """Train on one rollout batch: a Future of the metrics dict (value_loss, clip_fraction,
        explained_variance, grad_norm, lr, critic_step).

        token_lists: prompt + response ids per row; prompt_lengths: per row; returns, old_values:
        [B, T] per response token (T >= the longest response; entries past a response's end are ignored);
        loss_mask: [B, T], true on the response tokens to train on (an agent episode's model tokens); None: all.
        """
        sequences = [np.asarray(tokens).reshape(-1) for tokens in token_lists]
        returns, old_values = (np.asarray(array, dtype=np.float32) for array in (returns, old_values))
        if not sequences:
            raise ValueError("train_async needs at least one sequence")
        if len(prompt_lengths) != len(sequences) or returns.ndim != 2 or returns.shape != old_values.shape \
                or returns.shape[0] != len(sequences):
            raise ValueError(f"train_async: {len(sequences)} sequences need {len(sequences)} prompt lengths and "
                             f"returns/old_values of shape [{len(sequences)}, T]; got {len(prompt_lengths)} and "
                             f"{list(returns.shape)}/{list(old_values.shape)}")
        tokens = right_padded(sequences, max(len(ids) for ids in sequences))
        inputs = {TOKENS: tokens[None],
                  LENGTHS: np.array([[len(ids) for ids in sequences]], dtype=np.int64),
                  PROMPT_LENGTHS: np.asarray(prompt_lengths, dtype=np.int64).reshape(1, -1),
                  RETURNS: returns[None], OLD_VALUES: old_values[None]}
        if loss_mask is not None:
            loss_mask = np.asarray(loss_mask, dtype=np.float32)
            if loss_mask.shape != returns.shape:
                raise ValueError(f"train_async: loss_mask must be shaped as returns {list(returns.shape)}, got "
                                 f"{list(loss_mask.shape)}")
            inputs[LOSS_MASK] = loss_mask[None]
        answer: Future = Future()
        self._train.submit(inputs).add_done_callback(
            lambda sent: _settle(answer, sent, lambda outputs: {name: float(outputs[name].reshape(-1)[0])
                                                                for name in CRITIC_TRAIN_METRICS}))
        return answer

    def train(self, token_lists, prompt_lengths, returns, old_values, loss_mask=None) -> dict[str, float]:
        return self.train_async(token_lists, prompt_lengths, returns, old_values, loss_mask).result()

    # -- checkpoints
    def save(self, step: int) -> str:
        """Save the critic as checkpoint.save_dir/step_<step>; returns the checkpoint's path."""
        return self._checkpoint_call(self._save, step)

    def restore(self, step: int) -> str:
        """Put the critic back to its checkpoint.save_dir/step_<step> (what `save(step)` wrote: a resumed actor's
        step), whatever it trained since; returns the checkpoint's path."""
        return self._checkpoint_call(self._restore, step)

    @staticmethod
    def _checkpoint_call(model: _CriticModel, step: int) -> str:
        sent = model.submit({STEP: np.array([[int(step)]], dtype=np.int64)})
        answer: Future = Future()
        sent.add_done_callback(lambda done: _settle(answer, done, lambda outputs: bytes(
            outputs[PATH].reshape(-1)[0]).decode("utf-8")))
        return answer.result()

    def close(self) -> None:
        super().close()
        for model in (self._train, self._save, self._restore):
            model.close()


def _inference(outputs: dict, longest: int) -> CriticInference:
    rewards = outputs.get(REWARDS)
    return CriticInference(values=np.asarray(outputs[VALUES][:, :longest], dtype=np.float32),
                           rewards=None if rewards is None else np.asarray(rewards, dtype=np.float32).reshape(-1))


def _settle(answer: Future, sent: Future, decode) -> None:
    """The server's outputs decoded, or its per-row / per-request errors as CriticServerError."""
    try:
        outputs = sent.result()
        errors = decode_errors(outputs)
        rejected = [message for message in errors if message]
        if rejected and VALUES in outputs:
            raise CriticServerError(rejected_rows_message("critic server", errors))
        if rejected:
            raise CriticServerError(f"the critic server rejected the request: {rejected[0]}")
        answer.set_result(decode(outputs))
    except BaseException as error:  # noqa: BLE001 - every failure belongs to the caller's future
        answer.set_exception(error)
