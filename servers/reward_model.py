"""Reward-model server: a PyTriton transport over `aligner.models.reward.RewardInference`.

    python examples/nlp/gpt/serve_reward_model.py init_from=CHECKPOINT [key=value ...]
    torchrun --nproc_per_node N examples/nlp/gpt/serve_reward_model.py init_from=CHECKPOINT \
        parallel.tensor_model_parallel_size=2

Rank 0 runs Triton; every rank computes (see `servers.triton.CollectiveServing`). The rewards are
exactly what `RewardInference.infer` returns in process (the trainers call the same code): the
score at the last token of each sequence, normalised with the checkpoint's statistics unless
`normalize_rewards=false`. The client is `aligner.clients.reward.RewardClient`; the names and
packing rules both sides share are in `aligner.clients.protocol`.

Requests (Triton model `server.model_name`, default "reward_model"; every tensor has a leading
batch dimension, one row per sequence). Send ONE of:
  tokens            int64 [batch, width]  token ids, right-padded (the padding values are ignored)
  sequence_lengths  int64 [batch, 1]      number of real tokens of each row, 1..width
or
  sentences         bytes [batch, 1]      UTF-8 texts, tokenized on the server exactly as reward
                                          training lays out a text: [bos if the tokenizer has one]
                                          + tokenizer.encode(text) + [eos] (no eos with
                                          `append_eos=false`)
or
  conversations     bytes [batch, 1]      UTF-8 JSON {"prompt": text or {role, content} messages,
                                          "response": text or an assistant message}, tokenized on
                                          the server as reward training lays out the same record
                                          (`aligner.data.reward.request_sample_tokens`, with the
                                          server's `chat_template` and `append_eos`): the SFT
                                          encoding of the conversation up to the end of the reply
Responses, one row per sequence:
  rewards           float32 [batch, A]    one reward per attribute (the checkpoint's attribute order);
                                          NaN for a rejected row
  error             bytes [batch, 1]      empty if the row was scored, else why it was rejected
                                          (e.g. "token id 40 at position 3 is outside the vocabulary [0, 30)")

Batching. Triton's dynamic batcher merges concurrent requests (up to `server.max_batch_size` rows,
waiting at most `server.max_queue_delay_microseconds`, preferring `server.preferred_batch_sizes`,
by default micro_batch_size x data-parallel size). Triton merges only requests whose tensors have
the same width, so the client pads token widths to a few buckets (powers of two). The server
scores all valid rows of a merged batch in one collective call: it cuts the padding down to the
longest row rounded up to `pad_sequence_length_to_multiple` (at most max_position_embeddings),
and `RewardInference` pads the rows to a multiple of micro_batch_size x DP. Padding never changes
a reward: attention is causal and the reward is read at the row's last real token.

Errors. PyTriton (0.7) has no per-request error for a non-decoupled model: an exception in the
callback fails every request of the merged batch with the same message. So each row is validated
before anything runs, and a bad row is answered in its own `error` output (NaN rewards) while the
other rows and requests of the batch are scored normally; `RewardClient` raises
`RewardServerError` with the message. Rejected: token ids < 0 or >= the model's vocabulary,
an empty sequence (length 0), a sequence longer than max_position_embeddings or than the tokens
sent, more than one kind of input or none, texts that are not UTF-8, conversations that are not
JSON or not a valid prompt and response (e.g. a prompt ending with an assistant turn), and a
request whose input tensors carry more than `server.max_request_bytes` bytes (every row gets the
same error, naming the key; nothing is tokenized or computed). Triton itself rejects a wrong dtype
(e.g. int32 tokens), an unknown input name or more rows than `server.max_batch_size` before the
callback runs, with an error for that request only. Triton 2.5x (PyTriton 0.7) has no request-size
limit of its own: an oversize request is still received and copied to the callback before it is
refused, and Triton's shared-memory pools keep the size of the largest request they have carried.
An exception while the model runs (a bug, out of memory) fails that merged batch; the server keeps
serving the next one.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Optional, Sequence

import numpy as np
import torch
from omegaconf import MISSING

from aligner.clients.protocol import (
    CONVERSATIONS,
    ERROR,
    LENGTHS,
    PAD_ID,
    REWARD_MODEL,
    REWARDS,
    SENTENCES,
    TOKENS,
    encode_errors,
    packed_width,
    request_over_size_cap,
    token_outside_vocabulary,
)
from aligner.config import ConfigError, at_least
from aligner.hf.sources import resolve_model_source, source_kind
from aligner.models.reward import RewardInferenceConfig
from aligner.runtime.distributed import ParallelConfig
from servers.triton import CollectiveServing, ServerConfig, TritonModel

LOGGER = logging.getLogger(__name__)


@dataclass
class RewardServerConfig:
    """Schema of aligner/conf/inference_rm.yaml (examples/nlp/gpt/serve_reward_model.py)."""

    RENAMED_KEYS: ClassVar[tuple] = (("rm_model_file", "init_from"),)

    init_from: str = MISSING  # reward-model checkpoint, or its training run's directory (the latest checkpoint)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    inference: RewardInferenceConfig = field(default_factory=RewardInferenceConfig)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(model_name=REWARD_MODEL))
    normalize_rewards: bool = True  # apply the checkpoint's reward normalisation
    pad_sequence_length_to_multiple: int = at_least(1, 8)
    append_eos: bool = True  # `sentences`/`conversations` input: end with eos, as reward training does
    chat_template: bool = True  # `conversations` input: the chat template, as the reward model's data.chat_template

    def validate(self) -> None:
        """Checks across sections (the schema checks single values when the config loads)."""
        if self.parallel.virtual_pipeline_model_parallel_size:
            raise ConfigError("the reward server does not use a virtual pipeline; set "
                              "parallel.virtual_pipeline_model_parallel_size=null")
        if self.parallel.sequence_parallel:
            raise ConfigError("the reward server does not use sequence parallelism; "
                              "set parallel.sequence_parallel=false")
        self.server.validate()


class RewardModelServer:
    """Decodes reward requests, scores the valid rows collectively, encodes one answer per request."""

    def __init__(self, loaded, serving: CollectiveServing, *, pad_sequence_length_to_multiple: int = 8,
                 append_eos: bool = True, chat_template: bool = True, max_request_bytes: Optional[int] = None):
        """loaded: `aligner.models.reward.LoadedRewardModel`; serving runs its `inference.infer`;
        max_request_bytes: `server.max_request_bytes` (None: no cap)."""
        from aligner.data.reward import RewardTokenLayout

        self.loaded = loaded
        self.serving = serving
        self.attributes = list(loaded.info.attributes)
        self.vocab_size = loaded.model_cfg.vocab_size
        self.max_length = loaded.model_cfg.max_position_embeddings
        self.pad_to_multiple = pad_sequence_length_to_multiple
        self.max_request_bytes = max_request_bytes
        self.layout = RewardTokenLayout(loaded.tokenizer, append_eos, chat_template)  # the one reward training uses
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads

    def triton_model(self, server: ServerConfig, data_parallel_size: int) -> TritonModel:
        from pytriton.model_config import Tensor

        preferred = server.preferred_batch_sizes
        if preferred is None:  # a batch that fills one micro batch on every data-parallel rank
            preferred = [min(self.loaded.inference.micro_batch_size * data_parallel_size, server.max_batch_size)]
        return TritonModel(
            name=server.model_name,
            infer_fn=self.infer,
            inputs=[Tensor(name=TOKENS, dtype=np.int64, shape=(-1,), optional=True),
                    Tensor(name=LENGTHS, dtype=np.int64, shape=(1,), optional=True),
                    Tensor(name=SENTENCES, dtype=bytes, shape=(1,), optional=True),
                    Tensor(name=CONVERSATIONS, dtype=bytes, shape=(1,), optional=True)],
            outputs=[Tensor(name=REWARDS, dtype=np.float32, shape=(len(self.attributes),)),
                     Tensor(name=ERROR, dtype=bytes, shape=(1,))],
            max_batch_size=server.max_batch_size,
            max_queue_delay_microseconds=server.max_queue_delay_microseconds,
            preferred_batch_sizes=list(preferred),
        )

    # -- the Triton callback

    def infer(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """One merged batch: validate every row, score the valid ones in one collective call."""
        decoded = [self.decode_rows(request) for request in requests]  # per request, per row: (ids or None, error)
        valid = [(request_index, row, ids) for request_index, rows in enumerate(decoded)
                 for row, (ids, _) in enumerate(rows) if ids is not None]
        rewards = [np.full((len(rows), len(self.attributes)), np.nan, dtype=np.float32) for rows in decoded]
        if valid:
            tokens, lengths = self.pack([ids for _, _, ids in valid])
            try:
                scores = self.serving.run(tokens, lengths).float().numpy()  # [valid rows, A]
            except Exception as error:
                LOGGER.exception("reward model failed on a batch of %s", tuple(tokens.shape))
                raise RuntimeError(f"the reward model failed on a batch of {tokens.shape[0]} sequences of up to "
                                   f"{tokens.shape[1]} tokens: {type(error).__name__}: {error}") from None
            for (request_index, row, _), score in zip(valid, scores):
                rewards[request_index][row] = score
        return [{REWARDS: request_rewards, ERROR: encode_errors([error for _, error in rows])}
                for request_rewards, rows in zip(rewards, decoded)]

    def pack(self, sequences: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad to the longest row rounded up to the multiple (capped at the model's max length)."""
        width = packed_width(max(len(ids) for ids in sequences), self.pad_to_multiple, self.max_length)
        tokens = torch.full((len(sequences), width), PAD_ID, dtype=torch.int64)  # [rows, width]
        for row, ids in enumerate(sequences):
            tokens[row, :len(ids)] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        return tokens, torch.tensor([len(ids) for ids in sequences], dtype=torch.int64)

    # -- decoding and validation (never raises: a bad request gets errors, the batch goes on)

    def decode_rows(self, request: Mapping[str, np.ndarray]) -> list[tuple[Optional[np.ndarray], str]]:
        """Per row of one request: (token ids, "") or (None, why the row is rejected). Never raises."""
        rows = _batch_size(request)
        try:
            oversize = request_over_size_cap(request, self.max_request_bytes)
            if oversize:
                return self._reject_all(rows, oversize)
            return self._decode(request, rows)
        except Exception as error:  # a request shape nobody anticipated: reject it, keep the batch
            LOGGER.exception("could not decode a request")
            return [(None, f"could not decode the request: {type(error).__name__}: {error}")] * rows

    def _decode(self, request: Mapping[str, np.ndarray], rows: int) -> list[tuple[Optional[np.ndarray], str]]:
        names = set(request.keys())
        kinds = [kind for kind, inputs in ((TOKENS, {TOKENS, LENGTHS}), (SENTENCES, {SENTENCES}),
                                           (CONVERSATIONS, {CONVERSATIONS})) if names & inputs]
        if len(kinds) > 1:
            return self._reject_all(rows, f"send only one of: {TOKENS} + {LENGTHS}, {SENTENCES}, {CONVERSATIONS}; "
                                    f"got {', '.join(sorted(names))}")
        if SENTENCES in names:
            return [self._decode_text(text) for text in request[SENTENCES].reshape(rows, -1)[:, 0]]
        if CONVERSATIONS in names:
            return [self._decode_conversation(payload) for payload in request[CONVERSATIONS].reshape(rows, -1)[:, 0]]
        if not {TOKENS, LENGTHS} <= names:
            missing = sorted({TOKENS, LENGTHS} - names)
            return self._reject_all(
                rows, f"missing input {', '.join(missing)}: send {TOKENS} (int64 [batch, width], right-padded) with "
                f"{LENGTHS} (int64 [batch, 1]), or {SENTENCES} or {CONVERSATIONS} (bytes [batch, 1]); "
                f"got {sorted(names) or 'nothing'}")
        tokens, lengths = request[TOKENS], request[LENGTHS]
        if tokens.dtype.kind not in "iu" or lengths.dtype.kind not in "iu":
            return self._reject_all(rows, f"{TOKENS} and {LENGTHS} must be int64, "
                                          f"got {tokens.dtype} and {lengths.dtype}")
        if tokens.ndim != 2 or lengths.shape != (tokens.shape[0], 1):
            return self._reject_all(rows, f"{TOKENS} must be [batch, width] and {LENGTHS} [batch, 1]; got shapes "
                                    f"{list(tokens.shape)} and {list(lengths.shape)}")
        width = tokens.shape[1]
        decoded = []
        for row in range(rows):
            length = int(lengths[row, 0])
            if length > width:
                decoded.append((None, f"{LENGTHS} is {length} but only {width} token columns were sent"))
            else:
                decoded.append(self._check(tokens[row, :max(length, 0)], length))
        return decoded

    def _decode_text(self, text) -> tuple[Optional[np.ndarray], str]:
        try:
            text = bytes(text).decode("utf-8")
        except (UnicodeDecodeError, TypeError) as error:
            return None, f"{SENTENCES} must be UTF-8 text ({error})"
        with self._tokenizer_lock:
            ids = np.asarray(self.layout.text(text), dtype=np.int64)
        return self._check(ids, len(ids))

    def _decode_conversation(self, payload) -> tuple[Optional[np.ndarray], str]:
        from aligner.data.reward import request_sample_tokens

        try:
            with self._tokenizer_lock:
                ids = np.asarray(request_sample_tokens(payload, self.layout), dtype=np.int64)
        except ValueError as error:
            return None, f"{CONVERSATIONS}: {error}"
        return self._check(ids, len(ids))

    def _check(self, ids: np.ndarray, length: int) -> tuple[Optional[np.ndarray], str]:
        if length <= 0:
            return None, f"empty sequence (length {length}); a sequence needs at least one token"
        if length > self.max_length:
            return None, (f"{length} tokens is longer than the model's max_position_embeddings "
                          f"({self.max_length})")
        outside = token_outside_vocabulary(ids, self.vocab_size)
        return (None, outside) if outside else (ids, "")

    @staticmethod
    def _reject_all(rows: int, message: str) -> list[tuple[None, str]]:
        return [(None, message)] * rows


def _batch_size(request: Mapping[str, np.ndarray]) -> int:
    # Triton guarantees every input of a request has the same leading batch dimension (>= 1).
    return next(iter(request.values())).shape[0] if len(request) else 1


def serve_reward_model(cfg: RewardServerConfig) -> None:
    """Load the checkpoint on every rank of the job and serve it until SIGINT/SIGTERM."""
    from aligner.models.reward import load_reward_model
    from aligner.runtime import distributed
    from aligner.training.metrics import get_logger
    from servers.triton import check_ports_free, prepare_environment, serve

    cfg.validate()
    source_kind(cfg.init_from, "init_from")
    if distributed.rank_and_world_from_env()[0] == 0:  # fail before loading a model if Triton cannot start
        prepare_environment()
        check_ports_free(cfg.server)
    checkpoint = resolve_model_source(cfg.init_from, "init_from", get_logger().info)  # a run dir: its latest
    data_parallel_size = distributed.initialize(cfg.parallel)
    try:
        loaded = load_reward_model(checkpoint, micro_batch_size=cfg.inference.micro_batch_size,
                                   normalize=cfg.normalize_rewards)
        serving = CollectiveServing(lambda tokens, lengths: loaded.inference.infer(tokens, lengths))
        server = RewardModelServer(loaded, serving, pad_sequence_length_to_multiple=cfg.pad_sequence_length_to_multiple,
                                   append_eos=cfg.append_eos, chat_template=cfg.chat_template,
                                   max_request_bytes=cfg.server.max_request_bytes)
        ready = (f"reward model server ready on {cfg.server.http_url} (model '{cfg.server.model_name}', "
                 f"attributes {server.attributes})")
        serve(cfg.server, [server.triton_model(cfg.server, data_parallel_size)], serving, ready_message=ready)
    finally:
        distributed.shutdown()
