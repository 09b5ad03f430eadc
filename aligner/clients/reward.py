"""Client of the reward-model server (servers/reward_model.py describes the wire format).

    with RewardClient("127.0.0.1", 5555) as client:
        client.wait_until_ready(timeout_s=60)
        futures = [client.infer_async(batch) for batch in token_batches]   # many in flight
        rewards = [future.result() for future in futures]                   # each [len(batch), A]

Texts (`infer_text`) and conversations (`infer_conversations`: prompts as text or messages, responses
as text or assistant messages) are tokenized by the server exactly as reward training tokenizes them.
One client may be shared by any number of threads; up to `max_workers` requests are in flight at
once, which is what lets the server batch them together.
"""
from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Sequence, Union

import numpy as np

from aligner.clients import (
    ClientError,
    ModelServerClient,
    RequestError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
    rejected_rows_message,
    utf8_bytes,
)
from aligner.clients.protocol import (
    CONVERSATIONS,
    LENGTHS,
    REWARD_MODEL,
    REWARDS,
    SENTENCES,
    TOKENS,
    decode_errors,
    padded_width,
    right_padded,
)

__all__ = ["RewardClient", "RewardServerError", "ServerUnavailableError", "RequestTimeoutError", "RequestError",
           "ClientError"]

class RewardServerError(ServerError):
    """The reward server rejected a request (the message says which sequence and why) or failed on it."""


class RewardClient(ModelServerClient):
    """Rewards from a reward-model server; futures, thread-safe (see ModelServerClient)."""

    server_kind = "reward model"
    error_class = RewardServerError

    def __init__(self, host: str = "127.0.0.1", port: int = 5555, model_name: str = REWARD_MODEL, *,
                 timeout_s: float = 60.0, ready_timeout_s: float = 30.0, max_workers: int = 8):
        super().__init__(host, port, model_name, timeout_s=timeout_s, ready_timeout_s=ready_timeout_s,
                         max_workers=max_workers)

    def start_hint(self) -> str:
        return ("Start it with: python examples/nlp/gpt/serve_reward_model.py init_from=<checkpoint> "
                f"server.host={self.host} server.port={self.port} server.model_name={self.model_name}")

    def infer_async(self, token_lists: Sequence[Sequence[int]]) -> Future:
        """Rewards of token sequences (each the full query + response ids): a Future of [B, A] float32."""
        sequences = [np.asarray(tokens).reshape(-1) for tokens in token_lists]
        if not sequences:
            raise ValueError("infer_async needs at least one sequence")
        tokens = right_padded(sequences, padded_width(max(len(ids) for ids in sequences)))  # [B, width]
        lengths = np.array([[len(ids)] for ids in sequences], dtype=np.int64)  # [B, 1]
        return self.infer_tensors_async({TOKENS: tokens, LENGTHS: lengths})

    def infer(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """Blocking `infer_async`: [B, A] float32."""
        return self.infer_async(token_lists).result()

    def infer_text_async(self, texts: Sequence[str]) -> Future:
        """Rewards of texts, tokenized by the server as [bos] + text + [eos]: a Future of [B, A] float32."""
        if isinstance(texts, str):
            raise TypeError("infer_text_async takes a list of texts, not one string")
        if not texts:
            raise ValueError("infer_text_async needs at least one text")
        sentences = np.array([[utf8_bytes(text, f"texts[{row}]")] for row, text in enumerate(texts)],
                             dtype=object)  # [B, 1]
        return self.infer_tensors_async({SENTENCES: sentences})

    def infer_text(self, texts: Sequence[str]) -> np.ndarray:
        return self.infer_text_async(texts).result()

    def infer_conversations_async(self, prompts: Sequence[Union[str, list]],
                                  responses: Sequence[Union[str, dict]]) -> Future:
        """Rewards of (prompt, response) samples, tokenized by the server as reward training tokenizes a
        {"prompt", "response"} record: a Future of [B, A] float32.

        prompts: text or lists of {"role", "content"} messages; responses: text or assistant messages.
        """
        if isinstance(prompts, str) or isinstance(responses, (str, dict)):
            raise TypeError("infer_conversations_async takes lists of prompts and responses, not one of each")
        if len(prompts) != len(responses) or not prompts:
            raise ValueError(f"infer_conversations_async needs as many responses as prompts (at least one); "
                             f"got {len(prompts)} prompts and {len(responses)} responses")
        rows = []
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            # Each side on its own first, so that an error names the field that holds the bad text.
            utf8_bytes(json.dumps(prompt, ensure_ascii=False), f"prompts[{row}]")
            utf8_bytes(json.dumps(response, ensure_ascii=False), f"responses[{row}]")
            rows.append([json.dumps({"prompt": prompt, "response": response}, ensure_ascii=False).encode("utf-8")])
        return self.infer_tensors_async({CONVERSATIONS: np.array(rows, dtype=object)})  # [B, 1]

    def infer_conversations(self, prompts: Sequence[Union[str, list]],
                            responses: Sequence[Union[str, dict]]) -> np.ndarray:
        return self.infer_conversations_async(prompts, responses).result()

    def infer_tensors_async(self, inputs: dict[str, np.ndarray]) -> Future:
        """Send request tensors as they are (names and dtypes as in servers/reward_model.py)."""
        answer: Future = Future()
        self.submit(inputs).add_done_callback(lambda sent: _settle(answer, sent))
        return answer


def _settle(answer: Future, sent: Future) -> None:
    """Turn the server's outputs into rewards, or its per-sequence errors into RewardServerError."""
    try:
        outputs = sent.result()
        rejected = rejected_rows_message("server", decode_errors(outputs))
        if rejected:
            raise RewardServerError(rejected)
        answer.set_result(np.asarray(outputs[REWARDS], dtype=np.float32))
    except BaseException as error:  # noqa: BLE001 - every failure belongs to the caller's future
        answer.set_exception(error)
