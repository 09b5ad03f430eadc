"""Reward (and value) models: the GPT body with a scalar head per attribute on the last stage.

The head replaces megatron's vocabulary projection (`output_layer`) on the last pipeline stage, so
the model's output is a score per token and attribute, [batch, seq, num_attributes]. A sequence's
reward is its score at the last non-padding token of `query + response`. Embeddings are untied
for reward models: the LM head they were tied to is gone.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from aligner import checkpointing
from aligner.checkpointing import CheckpointError
from aligner.config import at_least
from aligner.models import lora
from aligner.models.forward import run_microbatches
from aligner.models.gpt import GPTConfig, build_gpt_model, build_model_chunks
from aligner.runtime import distributed, seeds
from aligner.runtime.distributed import ParallelConfig, device
from aligner.tokenizer import Tokenizer

# The head sits where megatron expects the output layer (module name `output_layer`, parameters
# `weight`/`bias`) but is stored under its own checkpoint key, so an LM checkpoint's vocabulary
# projection never loads into it (shapes differ), and loading an LM checkpoint into a reward model
# skips exactly the head's state-dict names (it is initialised fresh).
HEAD_STATE_PREFIX = "output_layer."
HEAD_CHECKPOINT_KEY = "reward_head."


class RewardHead(torch.nn.Module):
    """Linear map hidden -> num_attributes, called like megatron's output layer.

    Replicated on every tensor-parallel rank (its input, the final hidden state, is identical on
    all of them). Initialised N(0, 1/sqrt(hidden + 1)) with zero bias, the reward-head init of
    OpenAI's RLHF code as catalogued in "The N Implementation Details of RLHF with PPO".
    """

    def __init__(self, hidden_size: int, num_attributes: int, dtype: torch.dtype, seed: int = 0,
                 train_bias: bool = True):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)  # same head on every rank, whatever the layout
        std = 1.0 / math.sqrt(hidden_size + 1)
        self.weight = torch.nn.Parameter(
            (torch.randn(num_attributes, hidden_size, generator=generator) * std).to(dtype))
        # A ranking loss sees only reward differences: the bias's true gradient is exactly zero, and
        # Adam would turn the float noise left in it into lr-sized random steps. Frozen there.
        self.bias = torch.nn.Parameter(torch.zeros(num_attributes, dtype=dtype), requires_grad=train_bias)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        # hidden_states: [seq, batch, hidden] -> scores [seq, batch, num_attributes]
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        # No tensor-parallel axis: replicated on every TP rank.
        sharded = make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix, {}, sharded_offsets)
        for tensor in sharded.values():
            tensor.key = tensor.key.replace(HEAD_STATE_PREFIX, HEAD_CHECKPOINT_KEY, 1)
        return sharded


def build_reward_model(cfg: GPTConfig, config, *, num_attributes: int = 1, head_seed: int = 0,
                       train_bias: bool = True, pre_process: Optional[bool] = None,
                       post_process: Optional[bool] = None, vp_stage: Optional[int] = None):
    """A GPTModel whose last stage outputs per-token scores instead of vocabulary logits.

    train_bias: False for ranking losses, which are blind to a constant shift of the reward.
    """
    model = build_gpt_model(dataclasses.replace(cfg, tie_embeddings=False), config, pre_process=pre_process,
                            post_process=post_process, vp_stage=vp_stage)
    if model.post_process:
        model.output_layer = RewardHead(cfg.hidden_size, num_attributes, config.params_dtype, head_seed, train_bias)
    model.num_attributes = num_attributes
    return model


@torch.no_grad()
def fold_normalization_into_head(chunks, normalization: "RewardNormalization") -> None:
    """Rescale the head so the model outputs normalised rewards: w <- w / std, b <- (b - mean) / std.

    A critic initialised from a reward model then predicts values in the units of the (normalised)
    rewards the actor trains on, instead of starting off by the reward model's raw offset.
    """
    from megatron.core.utils import unwrap_model

    for chunk in unwrap_model(list(chunks)):
        head = getattr(chunk, "output_layer", None)
        if isinstance(head, RewardHead):
            mean = torch.tensor(normalization.mean, dtype=head.weight.dtype, device=head.weight.device)
            std = torch.tensor(normalization.std, dtype=head.weight.dtype, device=head.weight.device)
            head.weight.div_(std.unsqueeze(1))
            head.bias.sub_(mean).div_(std)


def scores_at_last_token(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """scores [batch, seq, A], lengths [batch] -> [batch, A], taken at index lengths - 1."""
    return scores[torch.arange(scores.shape[0], device=scores.device), lengths.to(scores.device) - 1]


def scores_within_length(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """scores [batch, seq, A], lengths [batch] -> the same scores with every column >= length set to 0."""
    columns = torch.arange(scores.shape[1], device=scores.device)
    inside = columns.unsqueeze(0) < lengths.to(scores.device).unsqueeze(1)  # [batch, seq]
    return scores * inside.unsqueeze(-1).to(scores.dtype)


@dataclass
class RewardInferenceConfig:
    """The `inference:` section of the servers that run `RewardInference` (reward model, critic)."""

    micro_batch_size: int = at_least(1, 4)  # rows per forward pass on each data-parallel rank


@dataclass
class RewardNormalization:
    """Served reward = (raw - mean) / std per attribute, measured on a reference set after training."""

    mean: list = field(default_factory=list)
    std: list = field(default_factory=list)

    def apply(self, rewards: torch.Tensor) -> torch.Tensor:
        if not self.mean:
            return rewards
        mean = torch.tensor(self.mean, dtype=rewards.dtype)
        std = torch.tensor(self.std, dtype=rewards.dtype)
        return (rewards - mean) / std


class RewardInference:
    """Rewards for a batch of sequences, computed collectively by every rank of the job.

    Every rank passes the same full batch; the rows are split over data-parallel ranks (padded to
    a multiple of micro_batch_size x DP), run through the pipeline in micro batches, and gathered
    back, so every rank returns the full [batch, A] result. The reward server and the trainers
    call this same code.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], num_attributes: int, micro_batch_size: int,
                 normalization: Optional[RewardNormalization] = None):
        self.chunks = list(model_chunks)
        self.num_attributes = num_attributes
        self.micro_batch_size = micro_batch_size
        self.normalization = normalization

    @torch.no_grad()
    def infer(self, tokens: torch.Tensor, lengths: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """tokens [B, S] right-padded, lengths [B], the same on every rank -> rewards [B, A] on every rank."""
        rewards = self._over_data_parallel(tokens, lengths, self.infer_local)
        if normalize and self.normalization is not None:
            rewards = self.normalization.apply(rewards)
        return rewards

    @torch.no_grad()
    def token_scores(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Raw scores at every token, [B, S, A] on every rank: column c scores the prefix tokens[:c + 1]
        (a critic's value of that state); 0 from each row's length on. Same inputs as `infer`."""
        return self._over_data_parallel(tokens, lengths, self.token_scores_local)

    def _over_data_parallel(self, tokens: torch.Tensor, lengths: torch.Tensor, local_fn) -> torch.Tensor:
        """Split the rows over data-parallel ranks, run local_fn on this rank's rows, gather all rows."""
        from megatron.core import parallel_state as ps

        batch_size = tokens.shape[0]
        dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows_per_rank = -(-batch_size // dp_size)
        padded = rows_per_rank * dp_size
        if padded > batch_size:  # filler rows: copies of row 0, dropped after the gather
            tokens = torch.cat([tokens, tokens[:1].expand(padded - batch_size, -1)])
            lengths = torch.cat([lengths, lengths[:1].expand(padded - batch_size)])
        rows = slice(dp_rank * rows_per_rank, (dp_rank + 1) * rows_per_rank)
        local = local_fn(tokens[rows], lengths[rows]).to(device())
        if dp_size > 1:
            gathered = [torch.empty_like(local) for _ in range(dp_size)]
            dist.all_gather(gathered, local, group=ps.get_data_parallel_group())
            local = torch.cat(gathered)
        return local[:batch_size].cpu()

    @torch.no_grad()
    def infer_local(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Raw rewards [rows, A] for this data-parallel rank's own rows (collective within its
        model-parallel group only): pads rows to a multiple of the micro batch, runs the pipeline."""
        return self._run_local(tokens, lengths, scores_at_last_token, (self.num_attributes,))

    @torch.no_grad()
    def token_scores_local(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Raw per-token scores [rows, S, A] for this data-parallel rank's own rows (see token_scores)."""
        return self._run_local(tokens, lengths, scores_within_length, (tokens.shape[1], self.num_attributes))

    def _run_local(self, tokens: torch.Tensor, lengths: torch.Tensor, select, row_shape: tuple) -> torch.Tensor:
        """select(scores [mb, S, A], lengths [mb]) -> [mb, *row_shape] for every micro batch of these rows."""
        from megatron.core import parallel_state as ps

        rows, seq_length = tokens.shape
        padded = -(-rows // self.micro_batch_size) * self.micro_batch_size
        if padded > rows:
            tokens = torch.cat([tokens, tokens[:1].expand(padded - rows, -1)])
            lengths = torch.cat([lengths, lengths[:1].expand(padded - rows)])
        position_ids = torch.arange(seq_length).unsqueeze(0).expand(self.micro_batch_size, -1)
        microbatches = [
            {"tokens": tokens[i:i + self.micro_batch_size], "lengths": lengths[i:i + self.micro_batch_size],
             "position_ids": position_ids}
            for i in range(0, padded, self.micro_batch_size)
        ]
        captured: list[torch.Tensor] = []

        def forward_fn(model, batch):
            return model(batch["tokens"], batch["position_ids"], None)

        def capture(batch, scores):
            captured.append(select(scores.float(), batch["lengths"]))
            return scores.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        for chunk in self.chunks:
            chunk.eval()
        run_microbatches(self.chunks, microbatches, forward_fn, capture, forward_only=True,
                         seq_length=seq_length, micro_batch_size=self.micro_batch_size)
        local = torch.cat(captured) if captured else torch.zeros(padded, *row_shape)
        local = local.to(device())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(local, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return local[:rows].cpu()


REWARD_TYPES = ("binary_ranking", "regression")  # Bradley-Terry pairs | one regressed score per attribute


@dataclass
class RewardModelInfo:
    """The `reward` section of a reward-model checkpoint's meta."""

    type: str = "binary_ranking"  # one of REWARD_TYPES
    attributes: list = field(default_factory=lambda: ["reward"])
    normalization: Optional[dict] = None  # {"mean": [...], "std": [...]} per attribute, or None

    @classmethod
    def from_meta(cls, meta: dict, checkpoint_dir) -> "RewardModelInfo":
        if "reward" not in meta:
            raise CheckpointError(
                f"{checkpoint_dir} is not a reward-model checkpoint (no 'reward' section in its meta); "
                f"train one with examples/nlp/gpt/train_reward_model.py"
            )
        return cls(**meta["reward"])


@dataclass
class LoadedRewardModel:
    inference: RewardInference
    tokenizer: object
    model_cfg: GPTConfig
    info: RewardModelInfo
    chunks: list


def load_reward_model(checkpoint_dir, *, micro_batch_size: int, normalize: bool = True) -> LoadedRewardModel:
    """Build this rank's reward-model chunks for the current parallel layout and load a checkpoint.

    `aligner.runtime.distributed.initialize(...)` must have been called (any TP/PP/DP layout).
    normalize: apply the checkpoint's stored reward normalisation to what `inference.infer` returns.
    """
    from pathlib import Path

    from megatron.core import parallel_state as ps

    meta = checkpointing.read_meta(checkpoint_dir)
    info = RewardModelInfo.from_meta(meta, checkpoint_dir)
    model_cfg = GPTConfig.from_dict(meta["model"])
    parallel = ParallelConfig(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
    )
    seeds.set_seed(0)
    chunks = build_model_chunks(
        model_cfg, parallel, distributed.resolve_precision("auto"),
        lambda cfg, config, **kw: build_reward_model(cfg, config, num_attributes=len(info.attributes), **kw),
    )
    lora.load_for_inference(checkpoint_dir, chunks)  # an adapter checkpoint: its head and adapters onto its base
    normalization = RewardNormalization(**info.normalization) if (normalize and info.normalization) else None
    inference = RewardInference(chunks, len(info.attributes), micro_batch_size, normalization)
    tokenizer = Tokenizer(Path(checkpoint_dir) / checkpointing.TOKENIZER_DIR)
    return LoadedRewardModel(inference, tokenizer, model_cfg, info, chunks)
