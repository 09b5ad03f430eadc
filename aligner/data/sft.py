"""Supervised fine-tuning data: records -> (tokens, loss_mask), packing and collation.

Four record layouts are accepted, one record per JSONL line or Parquet/Arrow row (NeMo-Aligner's two and
TRL's two; `aligner.data.records` reads the file):
  {"input": "<prompt>", "output": "<response>"}
  {"system": "...", "conversations": [{"from": "User", "value": "..."},
                                      {"from": "Assistant", "value": "..."}, ...]}
  {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                {"role": "assistant", "content": "..."}, ...]}
  {"prompt": "<text>" or [messages], "completion": "<text>" or [{"role": "assistant", "content": "..."}]}
A prompt/completion record with a text prompt is an input/output record; with a conversational prompt the
loss covers the completion only (TRL's prompt-completion format), not earlier assistant turns of the prompt.
Turns are parsed by `aligner.data.conversation.parse_messages` (role/content or from/value;
system, user/human, assistant/gpt in any case); a conversation opens with a user turn (after any
system turns) and ends with the assistant's reply; a "mask" key is accepted and ignored (the loss
always covers exactly the assistant turns). Tokens come from `ChatEncoder`: an input/output
record is a one-turn conversation under the chat template, or [bos] + input, output + [eos]
without one (or with `data.chat_template=false`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from aligner.data.blending import IndexedSubset
from aligner.data.conversation import (
    ChatEncoder,
    Messages,
    Prompt,
    parse_answer,
    parse_messages,
    parse_prompt,
    require_user_first,
    template_errors,
)
from aligner.data.jsonl import DataError, optional_str, require_str
from aligner.data.records import Layouts, open_records
from aligner.runtime.distributed import is_rank_zero
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer

CONVERSATION_KEYS = ("conversations", "messages")  # NeMo-Aligner's and TRL's key for a list of turns
PROGRESS_BAR_MIN_RECORDS = 10_000
SFT_LAYOUTS = Layouts("SFT", (("input", "output"), ("conversations",), ("messages",), ("prompt", "completion")))


@dataclass
class SFTExample:
    tokens: list[int]
    loss_mask: list[int]  # 1 where the token is part of a response the model must predict


@dataclass
class SFTStats:
    """What tokenization did to the file; the trainer logs it."""

    records: int = 0
    truncated: int = 0  # longer than max_seq_length, cut at the end
    dropped: int = 0  # nothing left to learn after truncation (no loss token)

    @property
    def kept(self) -> int:
        return self.records - self.dropped


def conversation_key(record: dict) -> Optional[str]:
    """The key holding a record's list of turns ("conversations" or "messages"), or None."""
    return next((key for key in CONVERSATION_KEYS if key in record), None)


def parse_conversation(record: dict, path: str | Path, line: int, ends_with_reply: bool = True) -> Messages:
    """Validate a {"system", "conversations"} or {"messages"} record into role/content messages.

    ends_with_reply: refuse turns after the last assistant turn (training; annotation scores the
    last reply of a conversation whatever follows it).
    """
    key = conversation_key(record)
    if key is None:
        raise _no_known_layout(record, path, line)
    messages = parse_messages(record[key], key, path, line)
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{path}:{line}: {key!r} has no assistant turn; there is nothing to train on")
    require_user_first(messages, key, path, line)
    if ends_with_reply and messages[-1]["role"] != "assistant":
        # As a record without an assistant turn is refused: the turns after the last reply have
        # no loss, so such a record is most likely cut short or mis-exported.
        raise DataError(f"{path}:{line}: {key!r} ends with a {messages[-1]['role']} turn; an SFT conversation "
                        "ends with the assistant's reply (nothing after it is trained on)")
    system = optional_str(record, "system", path, line) if key == "conversations" else ""
    if system.strip():
        messages.insert(0, {"role": "system", "content": system})
    return messages


def prompt_and_answer(record: dict, path: str | Path, line: int) -> tuple[Prompt, str]:
    """(prompt, answer) of an SFT record: input and output, or a conversation cut before its last
    assistant turn and that turn's text (what a reward model scores as {"prompt", "response"})."""
    if conversation_key(record) is None:
        if "input" in record or "output" in record:
            return require_str(record, "input", path, line), require_str(record, "output", path, line)
        if "prompt" in record or "completion" in record:
            return parse_prompt(record, "prompt", path, line), parse_answer(record, "completion", path, line)
        raise _no_known_layout(record, path, line)
    messages = parse_conversation(record, path, line, ends_with_reply=False)
    last = max(index for index, message in enumerate(messages) if message["role"] == "assistant")
    prompt = messages[:last]
    if not prompt or prompt[-1]["role"] == "assistant":
        raise DataError(f"{path}:{line}: {conversation_key(record)!r}: the last assistant turn does not follow a "
                        "user or system turn, so it has no prompt to answer")
    return prompt, messages[last]["content"]


def encode_record(record: dict, tokenizer: Tokenizer, path: str | Path, line: int,
                  use_template: bool = True) -> SFTExample:
    """Tokenize one SFT record of any format (not truncated); use_template is `data.chat_template`."""
    encoder = ChatEncoder(tokenizer, use_template=use_template)
    if conversation_key(record) is not None:
        messages = parse_conversation(record, path, line)
        with template_errors(path, line):
            return SFTExample(*encoder.conversation_tokens(messages))
    if "input" in record or "output" in record:
        prompt, response = require_str(record, "input", path, line), require_str(record, "output", path, line)
        with template_errors(path, line):
            return SFTExample(*encoder.input_output_tokens(prompt, response))
    if "prompt" in record or "completion" in record:
        prompt, completion = parse_prompt(record, "prompt", path, line), parse_answer(record, "completion", path, line)
        with template_errors(path, line):
            if isinstance(prompt, str):  # one user turn: the tokens of the same {"input", "output"} record
                return SFTExample(*encoder.input_output_tokens(prompt, completion))
            prompt_tokens, completion_tokens = encoder.sample_tokens(prompt, completion)
        return SFTExample(prompt_tokens + completion_tokens, [0] * len(prompt_tokens) + [1] * len(completion_tokens))
    raise _no_known_layout(record, path, line)


def _no_known_layout(record: dict, path: str | Path, line: int) -> DataError:
    return DataError(f"{path}:{line}: record has none of 'input'/'output', 'prompt'/'completion', 'conversations' "
                     f"or 'messages' "
                     f"(keys present: {', '.join(sorted(map(repr, record))) or 'none'})")


class SFTDataset(Dataset):
    """Tokenized SFT examples of one data file (any format of `aligner.data.records`), truncated to max_seq_length.

    Every record is tokenized once when the dataset is built (so a bad record fails now, naming its
    file and line or row, and the stats are known); only the kept records' indices and token counts are
    kept (numpy), and an item is read and tokenized again when indexed: a large data set never sits
    in Python lists.

    prepare_record: maps each (record, path, line) to the SFT record to encode, e.g. SteerLM's
    attribute conditioning (aligner/data/steerlm.py) writes the attribute values into the prompt.
    use_template: render with the tokenizer's chat template (`data.chat_template`).
    """

    def __init__(self, path: str | Path, tokenizer: Tokenizer, max_seq_length: int,
                 prepare_record: Optional[Callable[[dict, str | Path, int], dict]] = None, use_template: bool = True):
        if max_seq_length < 2:
            raise ConfigError(f"max_seq_length must be at least 2 (an input and a label), got {max_seq_length}")
        self.path = path
        self.max_seq_length = max_seq_length
        self.stats = SFTStats()
        self.records = open_records(path)
        self.prepare_record, self.tokenizer, self.use_template = prepare_record, tokenizer, use_template
        kept = np.zeros(len(self.records), dtype=bool)
        lengths = np.zeros(len(self.records), dtype=np.int32)
        quiet = len(self.records) <= PROGRESS_BAR_MIN_RECORDS or not is_rank_zero()
        progress = tqdm(self.records, total=len(self.records), desc=f"tokenizing {path}",
                        disable=True if quiet else None)
        for index, (line, record) in enumerate(progress):
            example = self._encode(record, line)
            self.stats.records += 1
            if example.truncated:
                self.stats.truncated += 1
            # The first token is never a label, so it alone cannot carry loss.
            if not any(example.loss_mask[1:]):
                self.stats.dropped += 1
                continue
            kept[index], lengths[index] = True, len(example.tokens)
        self.indices = np.flatnonzero(kept)  # [examples]: the record each example comes from
        self.lengths = lengths[self.indices]  # [examples]: its tokens after truncation
        if not len(self.indices):
            raise DataError(
                f"{path}: no usable examples ({self.stats.records} records, {self.stats.dropped} dropped "
                f"because no response token fits in max_seq_length={max_seq_length})"
            )

    def _encode(self, record: dict, line: int) -> "_Encoded":
        if self.prepare_record is not None:
            record = self.prepare_record(record, self.path, line)
        example = encode_record(record, self.tokenizer, self.path, line, self.use_template)
        if len(example.tokens) <= self.max_seq_length:
            return _Encoded(example.tokens, example.loss_mask, truncated=False)
        # Keep the start: the prompt and the beginning of the response.
        return _Encoded(example.tokens[:self.max_seq_length], example.loss_mask[:self.max_seq_length], truncated=True)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        position = int(self.indices[index])
        example = self._encode(self.records[position], self.records.where(position))
        return {
            "tokens": torch.tensor(example.tokens, dtype=torch.long),
            "loss_mask": torch.tensor(example.loss_mask, dtype=torch.long),
        }


@dataclass
class _Encoded(SFTExample):
    truncated: bool = False


class PackedSFTDataset(Dataset):
    """Several SFT examples per sequence, packed first-fit-decreasing into max_seq_length.

    Items carry "segment_ids" (0,0,0,1,1,2,...) so collation can restart position
    ids per example and keep examples from attending to each other. Packing is a
    pure function of the lengths and `seed` (which only breaks ties between
    equal lengths), so every rank builds the same packs.
    """

    def __init__(self, dataset: Dataset, max_seq_length: int, seed: int = 0):
        lengths = example_lengths(dataset)
        too_long = [index for index, length in enumerate(lengths) if length > max_seq_length]
        if too_long:
            raise ConfigError(
                f"{len(too_long)} examples (e.g. index {too_long[0]}, {lengths[too_long[0]]} tokens) are longer "
                f"than the pack size {max_seq_length}; build the dataset with max_seq_length <= the pack size"
            )
        self.dataset = dataset
        self.max_seq_length = max_seq_length
        tie_break = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
        order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], tie_break[index]))
        self.packs: list[list[int]] = []  # dataset indices per pack
        free_space: list[int] = []
        for index in order:
            # First fit: a linear scan is fine for the data set sizes SFT uses.
            target = next((pack for pack, space in enumerate(free_space) if space >= lengths[index]), None)
            if target is None:
                self.packs.append([])
                free_space.append(max_seq_length)
                target = len(self.packs) - 1
            self.packs[target].append(index)
            free_space[target] -= lengths[index]

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        examples = [self.dataset[member] for member in self.packs[index]]
        segment_ids = [torch.full_like(example["tokens"], segment) for segment, example in enumerate(examples)]
        return {
            "tokens": torch.cat([example["tokens"] for example in examples]),
            "loss_mask": torch.cat([example["loss_mask"] for example in examples]),
            "segment_ids": torch.cat(segment_ids),
        }


def example_lengths(dataset: Dataset) -> list[int]:
    """Tokens of each item of an SFT dataset (or a subset or blend of them): from the token counts an
    `SFTDataset` keeps, without tokenizing again; by indexing for other datasets."""
    if isinstance(dataset, SFTDataset):
        return dataset.lengths.tolist()
    if isinstance(dataset, IndexedSubset) and isinstance(dataset.dataset, SFTDataset):
        return dataset.dataset.lengths[dataset.indices].tolist()
    return [len(dataset[index]["tokens"]) for index in range(len(dataset))]


def collate_sft(examples: list[dict[str, torch.Tensor]], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """Right-pad examples into a batch of next-token-prediction inputs and labels.

    Returns, with S = padded length - 1:
      tokens, labels, position_ids: [B, S] long; loss_mask: [B, S] float (0 on padding);
      lengths: [B] long, the real (not padding) tokens of each row of tokens;
      attention_mask: None when no example is packed (the model applies a causal mask),
      else a [B, 1, S, S] bool mask, True = masked out, that is causal within each segment.
    """
    packed = any("segment_ids" in example for example in examples)
    longest = max(len(example["tokens"]) for example in examples)
    # The model sees S = length - 1 positions, so round S (not the raw length) up.
    seq_len = -(-(longest - 1) // pad_to_multiple_of) * pad_to_multiple_of
    batch_size = len(examples)
    sequences = torch.full((batch_size, seq_len + 1), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((batch_size, seq_len + 1), dtype=torch.float32)
    # Padding gets segment -1 so it never shares a segment with real tokens.
    segment_ids = torch.full((batch_size, seq_len + 1), -1, dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example["tokens"])
        sequences[row, :length] = example["tokens"]
        loss_mask[row, :length] = example["loss_mask"].float()
        segment_ids[row, :length] = example["segment_ids"] if "segment_ids" in example else 0
    segment_ids = segment_ids[:, :-1]
    batch = {
        "tokens": sequences[:, :-1].contiguous(),
        "labels": sequences[:, 1:].contiguous(),
        "loss_mask": loss_mask[:, 1:].contiguous(),  # a label is learned iff it is a response token
        "position_ids": _position_ids(segment_ids),
        "attention_mask": None,
        "lengths": torch.tensor([min(len(example["tokens"]), seq_len) for example in examples]),
    }
    if packed:
        positions = torch.arange(seq_len)
        causal = positions[None, :] <= positions[:, None]  # [S, S]: key <= query
        same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, S, S]
        # Padding has segment -1 everywhere, so give it only its own diagonal.
        padding = (segment_ids < 0)[:, :, None] | (segment_ids < 0)[:, None, :]
        attend = causal & same_segment & ~padding
        attend |= torch.eye(seq_len, dtype=torch.bool)
        batch["attention_mask"] = ~attend[:, None]
    return batch


def _position_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... restarting where the segment changes; padding continues counting."""
    batch_size, seq_len = segment_ids.shape
    positions = torch.arange(seq_len).expand(batch_size, seq_len)
    # Real segment starts; padding (-1) is folded into the segment before it.
    starts = torch.zeros_like(segment_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = (segment_ids[:, 1:] != segment_ids[:, :-1]) & (segment_ids[:, 1:] >= 0)
    segment_start = torch.cummax(torch.where(starts, positions, 0), dim=1).values
    return positions - segment_start
