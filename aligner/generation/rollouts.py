"""Experience collection shared by the RL actors (PPO, REINFORCE/RLOO): prompts, rollouts, scores.

    prompts = PromptDataset(path, tokenizer, max_prompt_length)         # every rank holds all prompts
    order = PromptOrder(len(prompts), seed)                             # resumable shuffled order
    rows = collect_rollouts(engine, router, batch_prompts, sampling, on_generated=send_requests)
    batch = RolloutBatch.from_rows(my_rows, pad_id)                     # tensors for the update

Generation goes through the router (`aligner.generation.router_client`), one micro-batch of
prompts at a time; `on_generated` runs right after each micro-batch, which is where the actor
sends its reward-model and critic requests as futures, so scoring overlaps the generation of the
next micro-batch (NeMo-Aligner's overlap). Rows (`RolloutRow`) are keyed by prompt position, so they
can travel between data-parallel ranks (`rebalance_rollouts`) with their scores attached.

Token in, token out: the prompt tokens and the engine's response ids go unchanged to the reward
model, the critic and the training batch; nothing is decoded and re-encoded on the way (a
response's text re-encodes to other ids whenever the policy spelled a word in unusual pieces).

The reward sources (a reward-model server, or a Python function `fn(prompt, response_text) -> float`
given the prompt as the data gave it, for verifiable tasks such as the demo's arithmetic) and the
checks of their scores are in `aligner.generation.rewards`.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from aligner.data.conversation import ChatEncoder, Prompt, parse_prompt, template_errors
from aligner.data.jsonl import DataError
from aligner.data.records import Layouts, open_records
from aligner.generation.engine import GenerationEngine, Rollout, SamplingParams
from aligner.generation.sampling import sample_keys
from aligner.models.logprobs import pack_sequences, response_mask, response_values
from aligner.runtime.seeds import epoch_seed

# ----------------------------------------------------------------------------- prompts
PROMPT_LAYOUTS = Layouts("prompt", (("prompt",),))


class PromptDataset:
    """Prompts of a data file (JSONL, Parquet, Arrow: `aligner.data.records`), `{"prompt": text or
    [{"role", "content"}, ...]}` per record, other columns allowed.

    prompts[i] is the prompt as the data gave it (what reward functions receive), columns(i) the record's
    other columns (a ground-truth answer, test cases...: reward functions receive them by keyword; read from the
    file when asked), record(i) where it is ("file:line" or
    "file:row N", for messages about its scores), tokens[i] what the policy is given
    (`ChatEncoder.prompt_tokens`: the chat template's rendering with the generation prompt, a string
    being one user turn; [bos] + text without a template or with use_template=False), so prompt +
    generated answer is the SFT encoding of the conversation.
    """

    def __init__(self, path, tokenizer, max_prompt_length: int, use_template: bool = True,
                 length_key: str = "data.max_prompt_length"):
        self.path = str(path)
        self.prompts: list[Prompt] = []
        self.tokens: list[list[int]] = []
        self.lines: list[int] = []  # each prompt's line (JSONL) or `Row` in the file
        self.records = open_records(path)
        self.positions: list[int] = []  # each prompt's index in self.records
        self.too_long = 0
        self.shortest_too_long: Optional[int] = None  # tokens of the shortest prompt skipped
        encoder = ChatEncoder(tokenizer, use_template)
        for position, (line, record) in enumerate(self.records):
            prompt = parse_prompt(record, "prompt", path, line)
            with template_errors(path, line):
                ids = encoder.prompt_tokens(prompt)
            if len(ids) > max_prompt_length:
                self.too_long += 1  # a cut prompt would ask a different question: skip it
                self.shortest_too_long = min(len(ids), self.shortest_too_long or len(ids))
                continue
            self.prompts.append(prompt)
            self.tokens.append(ids)
            self.lines.append(line)
            self.positions.append(position)
        # A chat template's own tokens count (SmolLM2's default system prompt alone is about 30), so a
        # limit that fits the texts may still skip them all: say so, with the length that would fit.
        self.skipped_note = "" if not self.too_long else (
            f"{path}: {self.too_long} of {self.too_long + len(self.tokens)} prompts are longer than {length_key}="
            f"{max_prompt_length} tokens as rendered (chat template included; the shortest of them has "
            f"{self.shortest_too_long}) and are skipped")
        if not self.tokens:
            if not self.too_long:
                raise DataError(f"{path}: the file holds no prompts; expected {{\"prompt\": ...}} lines")
            raise DataError(f"{path}: all {self.too_long} prompts are longer than {length_key}={max_prompt_length} "
                            f"tokens as rendered (chat template included; the shortest has {self.shortest_too_long}): "
                            f"raise {length_key} to at least {self.shortest_too_long}")

    def __len__(self) -> int:
        return len(self.tokens)

    def columns(self, index: int) -> dict:
        """Prompt `index`'s record without its prompt: the other columns of its line or row (a null one left out)."""
        return record_columns(self.records[self.positions[index]])

    def record(self, index: int) -> str:
        """Where prompt `index` is in the data: "file:line"."""
        return f"{self.path}:{self.lines[index]}"


def record_columns(record: dict) -> dict:
    """A prompt record's columns besides the prompt (what reward functions receive by keyword)."""
    return {key: value for key, value in record.items() if key != "prompt"}


def first_prompt_record(path) -> tuple[str, object, dict]:
    """("file:line", prompt, other columns) of the first record of a prompt file: what the reward functions are
    probed with before the model is built (no tokenizer needed)."""
    for line, record in open_records(path):
        return f"{path}:{line}", parse_prompt(record, "prompt", path, line), record_columns(record)
    raise DataError(f"{path}: the file holds no prompts; expected {{\"prompt\": ...}} lines")


class PromptOrder:
    """Which prompts each step uses: a seeded shuffle per epoch, read from a position that is saved.

    Every rank computes the same order, so `take(n)` returns the same indices everywhere.
    """

    def __init__(self, num_prompts: int, seed: int, shuffle: bool = True):
        self.num_prompts, self.seed, self.shuffle = num_prompts, seed, shuffle
        self.consumed = 0  # prompts handed out so far, across epochs

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(epoch_seed(self.seed, epoch)).shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        indices = []
        while len(indices) < count:
            epoch, offset = divmod(self.consumed, self.num_prompts)
            chunk = self._epoch_order(epoch)[offset:offset + count - len(indices)]
            indices.extend(chunk)
            self.consumed += len(chunk)
        return indices

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


# ----------------------------------------------------------------------------- generation
def collect_rollouts(engine: GenerationEngine, router, prompts: Sequence[list[int]], sampling: SamplingParams,
                     on_generated: Optional[Callable[[list[int], Rollout], None]] = None) -> dict[int, "RolloutRow"]:
    """Generate every prompt once across the data-parallel replicas; returns this replica's rows by
    prompt position. on_generated(indices, rollout) runs after each micro-batch on every rank of the
    replica (send scoring requests there; the answers are attached to the rows later).

    Micro-batches go through the engine's `generate_stream`: the native engine decodes across them, taking the
    router's next micro-batch when its cache rows free up, so a finished row is refilled by a waiting
    prompt instead of idling until its micro-batch's longest row ends; other engines generate them one
    by one. Each micro-batch's rows are the same either way: its seed and row numbers do not depend on
    how it is scheduled.
    """

    def micro_sampling(indices: list[int]) -> SamplingParams:
        # The engine's row streams are (seed, row of the micro-batch): one seed for every micro-batch would
        # give row r of each the same random numbers, so each micro-batch gets a seed of its own first index.
        return dataclasses.replace(sampling, seed=micro_batch_seed(sampling.seed, indices[0]))

    def rows_of(indices: list[int], rollout: Rollout) -> list[RolloutRow]:
        if on_generated is not None:
            on_generated(indices, rollout)
        rows = []
        for row in range(len(indices)):
            length = int(rollout.response_lengths[row])
            rows.append(RolloutRow(prompt=list(rollout.prompt_tokens[row]),
                                   response=rollout.response_tokens[row, :length].clone(),
                                   logprobs=rollout.logprobs[row, :length].clone(),
                                   ended_with_stop=bool(rollout.ended_with_stop[row])))
        return rows

    def stream(next_indices):
        def next_request():
            indices = next_indices()
            return None if indices is None else (indices, [list(prompts[i]) for i in indices], micro_sampling(indices))

        longest = max(len(p) for p in prompts)
        for indices, rollout in engine.generate_stream(next_request, longest_prompt=longest):
            yield indices, rows_of(indices, rollout)

    return router.route_stream(len(prompts), stream).results


def generate_share(engine: GenerationEngine, prompts: Sequence[list[int]], sampling: SamplingParams, batch_size: int,
                   replica: int = 0, replicas: int = 1) -> dict[int, list[int]]:
    """This data-parallel replica's share of answers to `prompts`: {prompt index: response ids}.

    The prompts go to the engine in batches of batch_size, dealt round-robin to the replicas, and each
    batch samples with a seed of its own first index (`micro_batch_seed`), so a prompt's answer does not
    depend on the number of replicas. The batches stream through the engine (continuous batching: rows
    freed by short answers are refilled from the next batch). The engine's ids are kept as they are:
    decoding and re-encoding could spell an answer differently.
    """
    requests = iter([(start, list(prompts[start:start + batch_size]),
                      dataclasses.replace(sampling, seed=micro_batch_seed(sampling.seed, start)))
                     for number, start in enumerate(range(0, len(prompts), batch_size))
                     if number % replicas == replica])
    answers = {}
    for start, rollout in engine.generate_stream(lambda: next(requests, None),
                                                 longest_prompt=max(len(prompt) for prompt in prompts)):
        for row in range(len(rollout.prompt_tokens)):
            answers[start + row] = rollout.response_tokens[row, : int(rollout.response_lengths[row])].tolist()
    return answers


def gather_shares(share: dict, replicas: int, group=None) -> dict:
    """The union of every replica's dict (all_gather over `group`); the dict itself with one replica."""
    if replicas == 1:
        return share
    gathered = [None] * replicas
    torch.distributed.all_gather_object(gathered, share, group=group)
    return {key: value for part in gathered for key, value in part.items()}


def micro_batch_seed(seed: int, first_index: int) -> int:
    """Sampling seed of the micro-batch that starts at prompt `first_index`: a hash of both, in [0, 2**32).

    Micro-batches are fixed runs of indices, so a prompt's sample does not depend on which replica
    generated it.
    """
    return int(sample_keys(seed, torch.tensor([first_index]))[0])


@dataclass
class RolloutRow:
    """One sampled response, and what the step attaches to it once it is scored."""

    prompt: list  # prompt token ids
    response: torch.Tensor  # [len] long: the engine's ids, stop token included
    logprobs: torch.Tensor  # [len] the engine's logprobs of them
    ended_with_stop: bool
    given_prompt: object = None  # the prompt as the data gave it (text or messages), for reward functions
    score: Optional[float] = None
    score_replaced: bool = False  # the source's score was invalid: `score` is reward.invalid_value
    score_parts: dict = field(default_factory=dict)  # reward functions: each one's own score, by name
    values: Optional[torch.Tensor] = None  # [len] the critic's value of each response token's state
    # [len] bool: the tokens the loss trains on; None: all of them. An agent episode's row (the response is
    # everything after the prompt) is True on the model's tokens only (`aligner.agents.rollout.episode_row`).
    loss_mask: Optional[torch.Tensor] = None
    # An advantage for every trained token in place of the estimator's (an episode ended by a bad tool call under
    # rollout.on_bad_call=fixed_advantage); None: the estimator's.
    fixed_advantage: Optional[float] = None
    # The weight version (policy step) that generated the response, where a generation worker says so
    # (asynchronous RL, `aligner.algorithms.rl_async`); None: the trainer's own current weights.
    policy_version: Optional[int] = None


@dataclass
class RolloutBatch:
    """A batch of rows as tensors in the training layout (`aligner.models.logprobs.pack_sequences`).

    tokens [B, S] prompt + response from column 0, right-padded; per-token tensors [B, T] over
    response positions (T = widest response), 0 past each response's end.
    """

    indices: list  # positions of the rows in the step's rollouts
    tokens: torch.Tensor  # [B, S]
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] bool, True on the response tokens trained on (a row's loss_mask, else all)
    engine_logprobs: torch.Tensor  # [B, T]
    ended_with_stop: torch.Tensor  # [B] bool
    rows: list  # the RolloutRows (scores and values attached by the actor)

    @classmethod
    def from_rows(cls, indexed_rows: Sequence[tuple[int, RolloutRow]], pad_id: int, seq_length: Optional[int] = None,
                  response_width: Optional[int] = None) -> "RolloutBatch":
        """seq_length / response_width: fixed widths (a pipeline schedule needs one sequence length)."""
        indices = [index for index, _ in indexed_rows]
        rows = [row for _, row in indexed_rows]
        lengths = torch.tensor([len(row.response) for row in rows], dtype=torch.long)
        width = max(int(lengths.max()), 1) if response_width is None else response_width
        responses = torch.full((len(rows), width), pad_id, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width)
        for b, row in enumerate(rows):
            responses[b, :len(row.response)] = row.response
            logprobs[b, :len(row.logprobs)] = row.logprobs
        tokens, prompt_lengths = pack_sequences([row.prompt for row in rows], responses, lengths, pad_id)
        if seq_length is not None:
            if tokens.shape[1] > seq_length:
                raise ValueError(f"a rollout of {tokens.shape[1]} tokens exceeds the fixed length {seq_length}")
            tokens = torch.nn.functional.pad(tokens, (0, seq_length - tokens.shape[1]), value=pad_id)
        mask = response_mask(lengths, width)
        for b, row in enumerate(rows):
            if row.loss_mask is not None:
                mask[b, :len(row.response)] &= row.loss_mask.bool()
        ended = torch.tensor([row.ended_with_stop for row in rows], dtype=torch.bool)
        return cls(indices, tokens, prompt_lengths, lengths, mask, logprobs, ended, rows)

    def scores(self) -> torch.Tensor:
        """The rows' scores [B] (float32)."""
        return torch.tensor([float(row.score) for row in self.rows], dtype=torch.float32)

    def values(self) -> torch.Tensor:
        """The rows' critic values [B, T] (float32), 0 past each response's end."""
        out = torch.zeros(self.mask.shape, dtype=torch.float32)
        for b, row in enumerate(self.rows):
            out[b, :len(row.values)] = torch.as_tensor(row.values, dtype=torch.float32)
        return out


def values_at_response(values: torch.Tensor, prompt_length: int, response_length: int) -> torch.Tensor:
    """Per-token values of one sequence [width] -> [response_length] (`logprobs.response_values` of one row)."""
    return response_values(values.unsqueeze(0), torch.tensor([prompt_length]), response_length)[0]


def full_sequences(rollout: Rollout) -> list[list[int]]:
    """prompt + response ids of every row of a Rollout."""
    return [list(rollout.prompt_tokens[row])
            + rollout.response_tokens[row, :int(rollout.response_lengths[row])].tolist()
            for row in range(len(rollout.prompt_tokens))]
