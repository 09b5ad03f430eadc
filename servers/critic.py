"""PPO critic server: a PyTriton transport over `aligner.algorithms.critic.Critic`.

    python examples/nlp/gpt/serve_ppo_critic.py critic.init_from=RM_CHECKPOINT [key=value ...]
    torchrun --nproc_per_node N examples/nlp/gpt/serve_ppo_critic.py critic.init_from=... \
        parallel.tensor_model_parallel_size=2

The critic (its model, initialisation, resuming, training loop, loss and checkpoints) is
`aligner.algorithms.critic`; this module decodes and validates requests, calls the library on
every rank and encodes the answers. Rank 0 runs Triton; every rank of the TP/PP/DP job computes
(see `servers.triton.CollectiveServing`). The client is `aligner.clients.critic.CriticClient`;
the names and packing rules both sides share are in `aligner.clients.protocol`.

Every call (inference, training, saving, the reward pass) runs as one collective call under
CollectiveServing's lock: an inference that arrives during training waits for it, and training
never starts in the middle of an inference.

Triton models (names from `server.*_model_name`; every tensor has a leading batch dimension):

critic_infer  (dynamic batching, like the reward-model server)
  in   tokens            int64 [B, width]   token ids (prompt + response), right-padded
       sequence_lengths  int64 [B, 1]       real tokens per row, 1..width
  out  values            float32 [B, width] column c = the critic's value of the prefix tokens[:c + 1];
                                            0 from the row's length on; NaN for a rejected row.
                                            The value of response token j (whose logprob the actor
                                            reads from logits column prompt_length - 1 + j, see
                                            aligner/models/logprobs.py) is at column
                                            prompt_length - 1 + j.
       error             bytes [B, 1]       empty if the row was computed, else why it was rejected
       rewards           float32 [B, 1]     combined mode only: the reward model's (normalised) reward
  Rows are validated one by one exactly as the reward-model server does (ids outside the
  vocabulary, empty or too long sequences, lengths beyond the tokens sent, missing inputs, a
  request over `server.max_request_bytes`); the
  client pads widths to powers of two so concurrent requests batch together, and the server cuts
  the padding to the longest row rounded up to `pad_sequence_length_to_multiple`.

critic_train  (no batching: one request is one rollout batch, sent as Triton batch size 1)
  in   tokens            int64 [1, B, width]  prompt + response per row, right-padded
       sequence_lengths  int64 [1, B]         prompt + response length per row
       prompt_lengths    int64 [1, B]         prompt length per row (>= 1, < sequence length)
       returns           float32 [1, B, T]    value targets per response token (T >= longest response;
                                              entries past a response's end are ignored)
       old_values        float32 [1, B, T]    the critic's values at rollout time, same layout
       loss_mask         float32 [1, B, T]    optional: 1 on the response tokens to train on (an agent episode's
                                              model tokens; the environment's are left out); absent: all
  out  value_loss, clip_fraction, explained_variance, grad_norm, lr, critic_step: float32 [1, 1] each
       error             bytes [1, 1]         empty, or why the batch was rejected (nothing trained)
  A batch of more than `server.max_train_rows` rows or `server.max_request_bytes` bytes is rejected
  before anything is checked or trained.
  Training (`Critic.train`): `train.epochs_per_call` passes over the batch, in optimizer steps of
  `train.global_batch_size` rows (B must be a multiple of it). The loss is
  `aligner.rl.shaping.value_loss_sum` (clipped with `train.clip_val`), the mean over the
  response tokens (those of loss_mask) of the optimizer step. value_loss, clip_fraction and grad_norm are means over
  the call's optimizer steps (one step: the loss before the update); explained_variance compares
  old_values with returns (the critic before the update); lr is the last step's rate; critic_step
  counts optimizer steps since the critic was created.

critic_save
  in   step   int64 [1, 1]   the caller's step (the actor passes its own, so checkpoints pair up)
  out  path   bytes [1, 1]   checkpoint.save_dir/step_<step> (model, optimizer, LR schedule, critic
                             step); the newest checkpoint.keep_last are kept
       error  bytes [1, 1]

critic_restore
  in   step   int64 [1, 1]   the caller's step of a checkpoint critic_save wrote (a resumed actor's step)
  out  path   bytes [1, 1]   the checkpoint loaded: the critic is as it was saved, whatever it trained since
       error  bytes [1, 1]   e.g. no checkpoint of that step is left in checkpoint.save_dir

reward_model  (combined mode only: `combined.reward_model_init_from=<reward-model checkpoint>`)
  The reward-model server's model, same inputs and outputs (servers/reward_model.py), so the
  existing RewardClient works unchanged (the actor's `reward.source=combined` reads the rewards
  from critic_infer's answers instead). The reward-model weights are swapped into the critic's
  model for each reward pass: one set of devices holds both models.

Errors. As in the reward-model server, a bad row or request is answered in its `error` output and
the server keeps serving; an exception while the model runs fails that call only.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Sequence

import numpy as np
import torch

from aligner import checkpointing
from aligner.algorithms.critic import Critic, CriticConfig, CriticTrainBatch, build_critic
from aligner.clients.protocol import (
    CRITIC_INFER_MODEL,
    CRITIC_RESTORE_MODEL,
    CRITIC_SAVE_MODEL,
    CRITIC_TRAIN_INPUTS,
    CRITIC_TRAIN_METRICS,
    CRITIC_TRAIN_MODEL,
    ERROR,
    LENGTHS,
    LOSS_MASK,
    OLD_VALUES,
    PAD_ID,
    PATH,
    PROMPT_LENGTHS,
    RETURNS,
    REWARD_MODEL,
    REWARDS,
    STEP,
    TOKENS,
    VALUES,
    encode_errors,
    packed_width,
    request_over_size_cap,
    token_outside_vocabulary,
)
from aligner.config import ConfigError, at_least
from servers.triton import CollectiveServing, ServerConfig, TritonModel

LOGGER = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- config schema
@dataclass
class CriticServingConfig(ServerConfig):
    """`server:` plus the names of the critic's Triton models (model_name is critic_infer's)."""

    model_name: str = CRITIC_INFER_MODEL
    train_model_name: str = CRITIC_TRAIN_MODEL
    save_model_name: str = CRITIC_SAVE_MODEL
    restore_model_name: str = CRITIC_RESTORE_MODEL
    reward_model_name: str = REWARD_MODEL  # combined mode: the reward-model server's model
    max_request_bytes: int = 256 << 20  # a critic_train request is a whole rollout batch
    max_train_rows: int = 8192  # rows (sequences) of one critic_train request at most


@dataclass
class CriticServerConfig(CriticConfig):
    """Schema of conf/gpt_ppo_critic.yaml (examples/nlp/gpt/serve_ppo_critic.py): the critic's
    settings (`aligner.algorithms.critic.CriticConfig`) and how it is served."""

    RENAMED_KEYS: ClassVar[tuple] = (("reward_model_file", "combined.reward_model_init_from"),
                                     ("normalize_rewards", "combined.normalize_rewards"))
    RETIRED_KEYS: ClassVar[tuple] = (
        ("combine_rm_and_critic", "combined mode is on exactly when combined.reward_model_init_from is set"),)

    server: CriticServingConfig = field(default_factory=CriticServingConfig)
    pad_sequence_length_to_multiple: int = at_least(1, 8)

    def validate(self) -> None:
        super().validate()
        if self.server.max_train_rows < self.train.global_batch_size:
            raise ConfigError(f"server.max_train_rows ({self.server.max_train_rows}) must be at least "
                              f"train.global_batch_size ({self.train.global_batch_size})")
        names = self.model_names()
        if len(set(names)) != len(names):
            raise ConfigError(f"the server's model names must differ, got {names}")
        self.server.validate()

    def model_names(self) -> list[str]:
        """The Triton models the server serves (the reward model's in combined mode)."""
        server = self.server
        names = [server.model_name, server.train_model_name, server.save_model_name, server.restore_model_name]
        return names + ([server.reward_model_name] if self.combined.enabled else [])


class Op(enum.IntEnum):
    """What a collective call does; the first tensor every rank receives."""

    VALUES = 0  # values (+ rewards in combined mode)
    REWARDS = 1  # rewards only (the reward_model Triton model)
    TRAIN = 2
    SAVE = 3
    RESTORE = 4


def run_op(critic: Critic, op: torch.Tensor, *tensors: torch.Tensor):
    """The one collective entry point (CollectiveServing calls it on every rank): the library call `op` names."""
    op = Op(int(op[0]))
    if op == Op.VALUES:
        return critic.values_and_rewards(*tensors)
    if op == Op.REWARDS:
        return critic.rewards(*tensors)
    if op == Op.TRAIN:
        return critic.train(CriticTrainBatch(*tensors))
    if op == Op.SAVE:
        return critic.save(int(tensors[0][0]))
    return critic.restore(int(tensors[0][0]))


# ----------------------------------------------------------------------------- the transport (rank 0)
class _OpChannel:
    """`run(*tensors)` of one op over the critic's CollectiveServing (what RewardModelServer calls)."""

    def __init__(self, serving: CollectiveServing, op: Op):
        self.serving, self.op = serving, op

    def run(self, *tensors: torch.Tensor):
        return self.serving.run(torch.tensor([int(self.op)], dtype=torch.int64), *tensors)


class TrainRequestError(ValueError):
    pass


class CriticServer:
    """Decodes critic requests, runs them collectively, encodes the answers."""

    def __init__(self, cfg: CriticServerConfig, critic: Critic, serving: CollectiveServing, tokenizer,
                 reward_tokenizer=None):
        from aligner.models.reward import LoadedRewardModel, RewardModelInfo
        from servers.reward_model import RewardModelServer

        self.cfg = cfg
        self.serving = serving
        self.combined = critic.combined
        self.vocab_size = critic.model_cfg.vocab_size
        self.max_length = critic.model_cfg.max_position_embeddings
        self.critic_step = critic.step  # at start-up (for the ready line)

        def reward_server(inference, tok, op, attributes):
            view = LoadedRewardModel(inference, tok, critic.model_cfg, RewardModelInfo(attributes=attributes),
                                     critic.chunks)
            return RewardModelServer(view, _OpChannel(serving, op),
                                     pad_sequence_length_to_multiple=cfg.pad_sequence_length_to_multiple,
                                     max_request_bytes=cfg.server.max_request_bytes)

        # The reward-model server's row decoding and validation, reused for critic_infer's rows.
        self.rows = reward_server(critic.value_inference, tokenizer, Op.VALUES, ["value"])
        self.reward_server = (reward_server(critic.reward_inference, reward_tokenizer, Op.REWARDS,
                                            critic.reward_attributes)
                              if self.combined else None)

    def triton_models(self, data_parallel_size: int) -> list[TritonModel]:
        from pytriton.model_config import Tensor

        server = self.cfg.server
        preferred = server.preferred_batch_sizes or [
            min(self.cfg.inference.micro_batch_size * data_parallel_size, server.max_batch_size)]
        infer_outputs = [Tensor(name=VALUES, dtype=np.float32, shape=(-1,)),
                         Tensor(name=ERROR, dtype=bytes, shape=(1,))]
        if self.combined:
            infer_outputs.append(Tensor(name=REWARDS, dtype=np.float32, shape=(1,)))
        models = [
            TritonModel(name=server.model_name, infer_fn=self.infer,
                        inputs=[Tensor(name=TOKENS, dtype=np.int64, shape=(-1,), optional=True),
                                Tensor(name=LENGTHS, dtype=np.int64, shape=(1,), optional=True)],
                        outputs=infer_outputs, max_batch_size=server.max_batch_size,
                        max_queue_delay_microseconds=server.max_queue_delay_microseconds,
                        preferred_batch_sizes=list(preferred)),
            # Batch size 1 = one whole rollout batch per request; Triton never merges two of them.
            TritonModel(name=server.train_model_name, infer_fn=self.train,
                        inputs=[Tensor(name=TOKENS, dtype=np.int64, shape=(-1, -1), optional=True),
                                Tensor(name=LENGTHS, dtype=np.int64, shape=(-1,), optional=True),
                                Tensor(name=PROMPT_LENGTHS, dtype=np.int64, shape=(-1,), optional=True),
                                Tensor(name=RETURNS, dtype=np.float32, shape=(-1, -1), optional=True),
                                Tensor(name=OLD_VALUES, dtype=np.float32, shape=(-1, -1), optional=True),
                                Tensor(name=LOSS_MASK, dtype=np.float32, shape=(-1, -1), optional=True)],
                        outputs=[*(Tensor(name=name, dtype=np.float32, shape=(1,)) for name in CRITIC_TRAIN_METRICS),
                                 Tensor(name=ERROR, dtype=bytes, shape=(1,))],
                        max_batch_size=1, max_queue_delay_microseconds=0),
            *(TritonModel(name=name, infer_fn=infer_fn,
                          inputs=[Tensor(name=STEP, dtype=np.int64, shape=(1,))],
                          outputs=[Tensor(name=PATH, dtype=bytes, shape=(1,)),
                                   Tensor(name=ERROR, dtype=bytes, shape=(1,))],
                          max_batch_size=1, max_queue_delay_microseconds=0)
              for name, infer_fn in ((server.save_model_name, self.save),
                                     (server.restore_model_name, self.restore))),
        ]
        if self.combined:
            models.append(self.reward_server.triton_model(
                dataclasses.replace(server, model_name=server.reward_model_name), data_parallel_size))
        return models

    @property
    def model_names(self) -> list[str]:
        return self.cfg.model_names()

    # -- critic_infer
    def infer(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """One merged batch: validate every row (as the reward server does), compute the valid ones together."""
        decoded = [self.rows.decode_rows(request) for request in requests]
        widths = [request[TOKENS].shape[1] if TOKENS in request and request[TOKENS].ndim == 2 else 1
                  for request in requests]
        values = [np.full((len(rows), width), np.nan, dtype=np.float32) for rows, width in zip(decoded, widths)]
        rewards = [np.full((len(rows), 1), np.nan, dtype=np.float32) for rows in decoded]
        valid = [(request_index, row, ids) for request_index, rows in enumerate(decoded)
                 for row, (ids, _) in enumerate(rows) if ids is not None]
        if valid:
            tokens, lengths = self.rows.pack([ids for _, _, ids in valid])
            try:
                computed_values, computed_rewards = _OpChannel(self.serving, Op.VALUES).run(tokens, lengths)
            except Exception as error:
                LOGGER.exception("the critic failed on a batch of %s", tuple(tokens.shape))
                raise RuntimeError(f"the critic failed on a batch of {tokens.shape[0]} sequences of up to "
                                   f"{tokens.shape[1]} tokens: {type(error).__name__}: {error}") from None
            computed_values = computed_values.float().numpy()  # [valid rows, packed width]
            for index, (request_index, row, ids) in enumerate(valid):
                out = values[request_index][row]
                out[:] = 0.0
                out[:len(ids)] = computed_values[index, :len(ids)]
                if computed_rewards is not None:
                    rewards[request_index][row] = computed_rewards[index].float().numpy()
        answers = []
        for request_values, request_rewards, rows in zip(values, rewards, decoded):
            answer = {VALUES: request_values, ERROR: encode_errors([error for _, error in rows])}
            if self.combined:
                answer[REWARDS] = request_rewards
            answers.append(answer)
        return answers

    # -- critic_train
    def train(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return [self._train_one(request) for request in requests]

    def _train_one(self, request: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            batch = self.decode_train(request)
        except TrainRequestError as error:
            return _train_answer({name: float("nan") for name in CRITIC_TRAIN_METRICS}, str(error))
        try:
            metrics = _OpChannel(self.serving, Op.TRAIN).run(*batch.tensors())
        except Exception as error:
            LOGGER.exception("critic training failed on a batch of %s", tuple(batch.tokens.shape))
            raise RuntimeError(f"critic training failed on a batch of {batch.rows} sequences: "
                               f"{type(error).__name__}: {error}") from None
        self.critic_step = int(metrics.critic_step)
        return _train_answer(dataclasses.asdict(metrics), "")

    def decode_train(self, request: Mapping[str, np.ndarray]) -> CriticTrainBatch:
        """Check a train request: the batch cut to the longest row and response, or TrainRequestError
        saying what is wrong."""
        oversize = request_over_size_cap(request, self.cfg.server.max_request_bytes)
        if oversize:
            raise TrainRequestError(oversize)
        missing = [name for name in CRITIC_TRAIN_INPUTS if name not in request]
        if missing:
            raise TrainRequestError(f"missing input {', '.join(missing)}; a train request carries "
                                    f"{list(CRITIC_TRAIN_INPUTS)}")
        tokens, lengths, prompts, returns, old_values = (request[name] for name in CRITIC_TRAIN_INPUTS)
        rows, max_rows = (tokens.shape[1] if tokens.ndim > 1 else 0), self.cfg.server.max_train_rows
        if rows > max_rows:
            raise TrainRequestError(f"a train batch of {rows} rows is more than the server accepts ({max_rows} rows, "
                                    f"server.max_train_rows): split the rollout batch, or restart the server with a "
                                    f"larger server.max_train_rows")
        if tokens.shape[0] != 1:
            raise TrainRequestError("one train request is one rollout batch (Triton batch size 1); "
                                    f"got {tokens.shape[0]}")
        tokens, lengths, prompts, returns, old_values = (x[0] for x in (tokens, lengths, prompts, returns, old_values))
        loss_mask = request[LOSS_MASK][0] if LOSS_MASK in request else np.ones_like(returns)
        rows = tokens.shape[0]
        if lengths.shape != (rows,) or prompts.shape != (rows,):
            raise TrainRequestError(f"{LENGTHS} and {PROMPT_LENGTHS} need one entry per row of {TOKENS} ({rows}); "
                                    f"got shapes {list(lengths.shape)} and {list(prompts.shape)}")
        if returns.shape != old_values.shape or returns.shape[0] != rows or loss_mask.shape != returns.shape:
            raise TrainRequestError(f"{RETURNS}, {OLD_VALUES} (and {LOSS_MASK} if sent) must be [rows={rows}, response "
                                    f"width]; got {list(returns.shape)}, {list(old_values.shape)} and "
                                    f"{list(loss_mask.shape)}")
        global_batch = self.cfg.train.global_batch_size
        if rows == 0 or rows % global_batch:
            raise TrainRequestError(f"a train batch of {rows} rows is not a multiple of train.global_batch_size "
                                    f"({global_batch})")
        width, response_width = tokens.shape[1], returns.shape[1]
        for row in range(rows):
            length, prompt = int(lengths[row]), int(prompts[row])
            where = f"row {row}:"
            if not 1 <= prompt < length:
                raise TrainRequestError(f"{where} {PROMPT_LENGTHS} {prompt} must be >= 1 and less than its "
                                        f"{LENGTHS} {length} (at least one response token)")
            if length > min(width, self.max_length):
                raise TrainRequestError(f"{where} {LENGTHS} {length} exceeds the {width} token columns sent or the "
                                        f"model's max_position_embeddings ({self.max_length})")
            if length - prompt > response_width:
                raise TrainRequestError(f"{where} its response has {length - prompt} tokens but {RETURNS} has only "
                                        f"{response_width} columns")
            outside = token_outside_vocabulary(tokens[row, :length], self.vocab_size)
            if outside:
                raise TrainRequestError(f"{where} {outside}")
            for name, array in ((RETURNS, returns), (OLD_VALUES, old_values)):
                if not np.isfinite(array[row, :length - prompt]).all():
                    raise TrainRequestError(f"{where} {name} has a non-finite value within the response")
        longest, longest_response = int(lengths.max()), int((lengths - prompts).max())
        packed_columns = packed_width(longest, self.cfg.pad_sequence_length_to_multiple, self.max_length)
        packed = np.full((rows, packed_columns), PAD_ID, dtype=np.int64)  # the sender's padding may be anything
        for row in range(rows):
            packed[row, :lengths[row]] = tokens[row, :lengths[row]]
        as_tensor = lambda array, dtype: torch.from_numpy(np.ascontiguousarray(array)).to(dtype)  # noqa: E731
        return CriticTrainBatch(as_tensor(packed, torch.int64), as_tensor(lengths, torch.int64),
                                as_tensor(prompts, torch.int64),
                                as_tensor(returns[:, :longest_response], torch.float32),
                                as_tensor(old_values[:, :longest_response], torch.float32),
                                as_tensor(loss_mask[:, :longest_response], torch.float32))

    # -- critic_save, critic_restore
    def save(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return self._checkpoint_calls(requests, Op.SAVE)

    def restore(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return self._checkpoint_calls(requests, Op.RESTORE)

    def _checkpoint_calls(self, requests: Sequence[Mapping[str, np.ndarray]], op: Op) -> list[dict[str, np.ndarray]]:
        """Each request's step saved (Op.SAVE) or restored (Op.RESTORE); a checkpoint that cannot be restored is
        answered in `error`, any other failure fails the call."""
        verb = {Op.SAVE: "saving", Op.RESTORE: "restoring"}[op]
        answers = []
        for request in requests:
            step = int(np.asarray(request[STEP]).reshape(-1)[0])
            if step < 0:
                answers.append(_path_answer("", f"{STEP} must be >= 0, got {step}"))
                continue
            try:
                path = _OpChannel(self.serving, op).run(torch.tensor([step], dtype=torch.int64))
            except checkpointing.CheckpointError as error:
                answers.append(_path_answer("", str(error)))
                continue
            except Exception as error:
                LOGGER.exception("%s the critic failed", verb)
                raise RuntimeError(f"{verb} the critic at step {step} failed: "
                                   f"{type(error).__name__}: {error}") from None
            LOGGER.info("%s the critic: %s", {Op.SAVE: "saved", Op.RESTORE: "restored"}[op], path)
            answers.append(_path_answer(str(path), ""))
        return answers


def _train_answer(metrics: Mapping[str, float], error: str) -> dict[str, np.ndarray]:
    answer = {name: np.array([[metrics[name]]], dtype=np.float32) for name in CRITIC_TRAIN_METRICS}
    answer[ERROR] = encode_errors([error])
    return answer


def _path_answer(path: str, error: str) -> dict[str, np.ndarray]:
    return {PATH: np.array([[path.encode()]], dtype=object), ERROR: encode_errors([error])}


def serve_critic(cfg: CriticServerConfig) -> None:
    """Build the critic on every rank of the job and serve it until SIGINT/SIGTERM (then raise
    `stopping.Interrupted`: the entry point exits 128 + the signal number)."""
    from aligner.runtime import distributed
    from aligner.tokenizer import Tokenizer
    from servers.triton import check_ports_free, prepare_environment, serve

    cfg.validate()
    cfg.require_checkpoints()
    if distributed.rank_and_world_from_env()[0] == 0:  # fail before loading a model if Triton cannot start
        prepare_environment()
        check_ports_free(cfg.server)
    try:
        critic, data_parallel_size = build_critic(cfg)
        serving = CollectiveServing(functools.partial(run_op, critic))
        reward_tokenizer = Tokenizer(critic.reward_tokenizer_dir) if critic.combined else None
        server = CriticServer(cfg, critic, serving, Tokenizer(critic.tokenizer_dir), reward_tokenizer)
        ready = (f"critic server ready on {cfg.server.http_url} (models {server.model_names}, "
                 f"critic step {critic.step})")
        try:
            serve(cfg.server, server.triton_models(data_parallel_size), serving, ready_message=ready)
        except KeyboardInterrupt:
            if critic.step != critic.saved_step:
                # Not saved here: a critic checkpoint must pair with the actor's checkpoint of the same
                # PPO step, and only the actor knows that step (it asks for critic_save when it saves,
                # also when it is stopped; launch_ppo.py stops the actor before the servers).
                LOGGER.warning("stopping with %d critic steps that no checkpoint holds (critic step %d, newest "
                               "checkpoint at critic step %d): the actor's next checkpoint request "
                               "would have saved them",
                               critic.step - critic.saved_step, critic.step, critic.saved_step)
            raise
    finally:
        distributed.shutdown()
