"""The wire protocol of the model servers: Triton model names, tensor names, metrics, row packing.

Both sides import it: the servers (`servers/reward_model.py`, `servers/critic.py`, whose docstrings
describe every tensor's dtype and shape) and their clients (`aligner.clients.reward`,
`aligner.clients.critic`). Every tensor has a leading batch dimension; `error` rows carry UTF-8
bytes, empty for a row that was computed.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

# Triton model names (the servers' defaults; configurable on both sides).
REWARD_MODEL = "reward_model"
CRITIC_INFER_MODEL, CRITIC_TRAIN_MODEL, CRITIC_SAVE_MODEL = "critic_infer", "critic_train", "critic_save"
CRITIC_RESTORE_MODEL = "critic_restore"

# Inputs. Sequences: TOKENS + LENGTHS (reward model and critic), or SENTENCES or CONVERSATIONS
# (reward model: tokenized on the server).
TOKENS, LENGTHS = "tokens", "sequence_lengths"
SENTENCES, CONVERSATIONS = "sentences", "conversations"
PROMPT_LENGTHS, RETURNS, OLD_VALUES = "prompt_lengths", "returns", "old_values"  # critic_train
LOSS_MASK = "loss_mask"  # critic_train, optional: 1 on the response tokens trained on (an episode's model tokens)
STEP = "step"  # critic_save, critic_restore
CRITIC_TRAIN_INPUTS = (TOKENS, LENGTHS, PROMPT_LENGTHS, RETURNS, OLD_VALUES)  # required; LOSS_MASK may follow

# Outputs.
REWARDS, VALUES, PATH, ERROR = "rewards", "values", "path", "error"
CRITIC_TRAIN_METRICS = ("value_loss", "clip_fraction", "explained_variance", "grad_norm", "lr", "critic_step")

MIN_PADDED_WIDTH = 8
PAD_ID = 0  # what servers pad packed rows with: any in-vocabulary id (padding after a row's end changes nothing)


def padded_width(longest: int) -> int:
    """Token columns a client sends for a request: the next power of two (at least MIN_PADDED_WIDTH).

    Triton batches only requests of the same width together; a few widths keep concurrent
    requests batchable, and the server cuts the padding off again before running the model.
    """
    width = MIN_PADDED_WIDTH
    while width < longest:
        width *= 2
    return width


def right_padded(sequences: Sequence[np.ndarray], width: int) -> np.ndarray:
    """[rows, width] token ids, each row right-padded with 0 (the server ignores the padding).

    Integer ids travel as int64; any other dtype is sent as it is, for the server to reject.
    """
    dtype = np.result_type(*[ids.dtype for ids in sequences if ids.size] or [np.int64])
    if dtype.kind in "iub":
        dtype = np.dtype(np.int64)
    tokens = np.zeros((len(sequences), width), dtype=dtype)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)] = ids
    return tokens


def packed_width(longest: int, multiple: int, max_length: int) -> int:
    """Columns the server computes for rows of up to `longest` tokens: rounded up to `multiple`, at
    most the model's max_position_embeddings (padding after a row's end never changes its result)."""
    return min(-(-longest // multiple) * multiple, max_length)


def token_outside_vocabulary(ids: np.ndarray, vocab_size: int) -> str:
    """Why a row's ids are not all in [0, vocab_size), or "" if they are."""
    outside = (ids < 0) | (ids >= vocab_size)
    if not outside.any():
        return ""
    position = int(np.argmax(outside))
    return f"token id {int(ids[position])} at position {position} is outside the vocabulary [0, {vocab_size})"


def encode_errors(errors: Sequence[str]) -> np.ndarray:
    """The `error` output: bytes [rows, 1], "" for a row that was computed."""
    return np.array([[error.encode()] for error in errors], dtype=object).reshape(-1, 1)


def decode_errors(outputs: Mapping[str, np.ndarray]) -> list[str]:
    """The `error` output of an answer, one string per row."""
    return [bytes(message).decode("utf-8", "replace") for message in outputs[ERROR].reshape(-1)]


def request_bytes(request: Mapping[str, np.ndarray]) -> int:
    """Bytes of a request's input tensors as sent: numbers' nbytes, byte strings' lengths."""
    total = 0
    for array in request.values():
        if array.dtype == object:
            total += sum(len(item) for item in array.reshape(-1))
        else:
            total += array.nbytes
    return total


def request_over_size_cap(request: Mapping[str, np.ndarray], max_request_bytes: Optional[int]) -> str:
    """Why a request is over `server.max_request_bytes`, or "" if it is not (or there is no cap)."""
    if max_request_bytes is None:
        return ""
    size = request_bytes(request)
    if size <= max_request_bytes:
        return ""
    return (f"the request carries {size} bytes, more than the server accepts ({max_request_bytes} bytes, "
            f"server.max_request_bytes): send fewer or shorter sequences per request, or restart the server "
            f"with a larger server.max_request_bytes")
