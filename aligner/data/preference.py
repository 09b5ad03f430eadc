"""Preference data for DPO-style training: (prompt, chosen, rejected) with the prompt kept apart.

One pair per JSONL line or Parquet/Arrow row (`aligner.data.records`), in NeMo-Aligner's keys or the short
ones (the demo's preference files):
  {"prompt": "12+7=", "chosen_response": "19", "rejected_response": "18"}
  {"prompt": "12+7=", "chosen": "19", "rejected": "18"}
optionally with given rewards for reward-aware losses (RPO): "chosen_reward", "rejected_reward".
Conversational pairs (TRL's layout): the prompt a list of {"role", "content"} messages, the answers
strings or assistant messages; or, without "prompt", chosen and rejected as whole conversations
that differ only in their final assistant message (TRL's implicit prompt):
  {"prompt": [{"role": "user", "content": "12+7="}], "chosen": [{"role": "assistant", "content": "19"}], ...}
  {"chosen": [{"role": "user", ...}, {"role": "assistant", "content": "19"}], "rejected": [... "18"}]}

Tokens come from `ChatEncoder.sample_tokens`, so prompt + response is exactly the SFT encoding of
the conversation up to the end of the reply (what SFT puts loss on is the response): with a chat
template the prompt ends with the generation prompt and a response with its end-of-turn token;
without one (or `data.chat_template=false`) prompt = [bos] + prompt text, response = text + [eos].
Pairs longer than max_seq_length are dropped and counted, never truncated (a cut response is a
different response). Pairs whose chosen and rejected responses are the same tokens are dropped and
counted too: their margin is 0 whatever the weights, so no preference loss (DPO, IPO, RPO) has a
gradient on them, yet each would take a slot in its batch, shrink the mean over the real pairs and
pull the logged loss and accuracy toward a tie (only an SFT term on the chosen response could learn
from one, and that is SFT data, not a preference).

Rows are interleaved [chosen0, rejected0, chosen1, rejected1, ...] when collated, so a micro-batch
slice of 2k rows always holds k whole pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from aligner.data.conversation import ChatEncoder, Prompt, parse_answer, parse_messages, parse_prompt, template_errors
from aligner.data.jsonl import DataError
from aligner.data.records import Layouts, open_records
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer

KEY_LAYOUTS = (("chosen_response", "rejected_response"), ("chosen", "rejected"))
REWARD_KEYS = ("chosen_reward", "rejected_reward")
PREFERENCE_LAYOUTS = Layouts("preference", KEY_LAYOUTS)  # "prompt" may be implicit in the conversations


@dataclass
class PreferencePair:
    prompt: list[int]  # what the policy is given: [bos] + text, or the chat template's rendering
    chosen: list[int]  # response tokens, ending with eos (or the template's end-of-turn token)
    rejected: list[int]
    rewards: Optional[tuple[float, float]] = None  # given (chosen, rejected) rewards, for RPO


@dataclass
class PreferenceStats:
    records: int = 0
    dropped_too_long: int = 0
    dropped_identical: int = 0  # chosen == rejected (the same tokens): no preference to learn

    @property
    def kept(self) -> int:
        return self.records - self.dropped_too_long - self.dropped_identical


def _response_keys(record: dict, path, line: int) -> tuple[str, str]:
    for keys in KEY_LAYOUTS:
        if all(key in record for key in keys):
            return keys
    present = ", ".join(sorted(map(repr, record))) or "none"
    raise DataError(f"{path}:{line}: expected 'prompt' with 'chosen_response'/'rejected_response' "
                    f"(or 'chosen'/'rejected'); keys present: {present}")


def parse_pair(record: dict, chosen_key: str, rejected_key: str, path, line: int) -> tuple[Prompt, str, str]:
    """(prompt, chosen answer, rejected answer) of one record, with "prompt" or TRL's implicit prompt.

    Without a "prompt" key, chosen and rejected must be whole conversations: the same turns, then
    one assistant message each; the shared turns are the prompt.
    """
    if "prompt" in record or not isinstance(record.get(chosen_key), list):
        return (parse_prompt(record, "prompt", path, line), parse_answer(record, chosen_key, path, line),
                parse_answer(record, rejected_key, path, line))
    conversations = [parse_messages(record[key], key, path, line) for key in (chosen_key, rejected_key)]
    for key, messages in zip((chosen_key, rejected_key), conversations):
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise DataError(f"{path}:{line}: {key!r} without a 'prompt' key must be a whole conversation: "
                            "the prompt's turns, then the assistant's answer (TRL's implicit prompt)")
    if conversations[0][:-1] != conversations[1][:-1]:
        raise DataError(f"{path}:{line}: {chosen_key!r} and {rejected_key!r} differ before their last message; "
                        "with an implicit prompt both must repeat the same prompt turns (or give a 'prompt' key)")
    prompt = parse_prompt({"prompt": conversations[0][:-1]}, "prompt", path, line)
    return prompt, conversations[0][-1]["content"], conversations[1][-1]["content"]


def _rewards(record: dict, path, line: int) -> Optional[tuple[float, float]]:
    given = [key for key in REWARD_KEYS if key in record]
    if not given:
        return None
    if len(given) == 1:
        raise DataError(f"{path}:{line}: {given[0]!r} without {(set(REWARD_KEYS) - set(given)).pop()!r}; "
                        "give both rewards or neither")
    values = []
    for key in REWARD_KEYS:
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"{path}:{line}: {key!r} is {value!r}; expected a finite number")
        values.append(float(value))
    return values[0], values[1]


class PreferenceDataset(Dataset):
    """Tokenized preference pairs; optionally with reference logprobs per response (precomputed).

    reference_logprobs, once set, is [pairs, 2] float: the reference model's summed logprob of the
    chosen and the rejected response; items then carry it to the loss.
    """

    def __init__(self, pairs: list[PreferencePair], source: str = "<memory>"):
        if not pairs:
            raise DataError(f"{source}: no usable preference pairs")
        self.pairs = pairs
        self.source = source
        self.stats = PreferenceStats(records=len(pairs))
        self.reference_logprobs: Optional[torch.Tensor] = None

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer: Tokenizer, max_seq_length: int,
                   use_template: bool = True) -> "PreferenceDataset":
        """The pairs of a data file of any format (`aligner.data.records`), read lazily (`PreferenceFile`);
        use_template: render with the tokenizer's chat template (`data.chat_template`)."""
        return PreferenceFile(path, tokenizer, max_seq_length, use_template)

    def __len__(self) -> int:
        return len(self.pairs)

    def pair(self, index: int) -> PreferencePair:
        return self.pairs[index]

    def __getitem__(self, index: int) -> dict:
        pair = self.pair(index)
        item = {
            "prompt": torch.tensor(pair.prompt, dtype=torch.long),
            "chosen": torch.tensor(pair.chosen, dtype=torch.long),
            "rejected": torch.tensor(pair.rejected, dtype=torch.long),
        }
        if pair.rewards is not None:
            item["rewards"] = torch.tensor(pair.rewards, dtype=torch.float32)
        if self.reference_logprobs is not None:
            item["reference_logprobs"] = self.reference_logprobs[index]
        return item


class PreferenceFile(PreferenceDataset):
    """The pairs of a data file: every record is tokenized once when built (a bad record fails now, naming its
    file and line or row; the stats are known), then only the kept records' indices are kept (numpy) and a
    pair is read and tokenized again when indexed, so a large file never sits in Python lists."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, max_seq_length: int, use_template: bool = True):
        if max_seq_length < 2:
            raise ConfigError(f"max_seq_length must be at least 2 (a prompt token and a response token), "
                              f"got {max_seq_length}")
        self.encoder = ChatEncoder(tokenizer, use_template=use_template)
        self.records, self.source, self.reference_logprobs = open_records(path), str(path), None
        kept, stats, with_rewards = np.zeros(len(self.records), dtype=bool), PreferenceStats(), None
        for index, (line, record) in enumerate(self.records):
            pair = self._encode(record, line)
            if with_rewards is None:
                with_rewards = pair.rewards is not None
            elif with_rewards != (pair.rewards is not None):
                # A batch mixing pairs with and without rewards has no consistent RPO target.
                raise DataError(f"{path}:{line}: {'no' if with_rewards else ''} rewards here, but the file's "
                                f"first record {'has' if with_rewards else 'has none'}; all records or none")
            stats.records += 1
            if pair.chosen == pair.rejected:
                stats.dropped_identical += 1
            elif len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) > max_seq_length:
                stats.dropped_too_long += 1
            else:
                kept[index] = True
        if stats.records == 0:
            raise DataError(f"{path}: the file holds no records; expected preference pairs in JSONL")
        if not kept.any():
            raise DataError(f"{path}: no usable pairs among the {stats.records}: {stats.dropped_too_long} longer than "
                            f"max_seq_length={max_seq_length}, {stats.dropped_identical} with chosen == rejected")
        self.indices = np.flatnonzero(kept)  # [pairs]: the record each pair comes from
        self.stats = stats

    def _encode(self, record: dict, line: int) -> PreferencePair:
        path = self.source
        chosen_key, rejected_key = _response_keys(record, path, line)
        prompt_text, chosen_text, rejected_text = parse_pair(record, chosen_key, rejected_key, path, line)
        with template_errors(path, line):
            prompt, chosen = self.encoder.sample_tokens(prompt_text, chosen_text)
            rejected = self.encoder.sample_tokens(prompt_text, rejected_text)[1]
        return PreferencePair(prompt, chosen, rejected, _rewards(record, path, line))

    def __len__(self) -> int:
        return len(self.indices)

    def pair(self, index: int) -> PreferencePair:
        position = int(self.indices[index])
        return self._encode(self.records[position], self.records.where(position))


def collate_rows(rows: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """Right-padded rows prompt + response from column 0: tokens, position_ids [rows, S] long;
    prompt_lengths, response_lengths [rows] long; attention_mask None (causal; padding sits after every
    sequence)."""
    longest = max(len(prompt) + len(response) for prompt, response in rows)
    seq_len = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    for row, (prompt, response) in enumerate(rows):
        tokens[row, : len(prompt)] = prompt
        tokens[row, len(prompt): len(prompt) + len(response)] = response
    return {
        "tokens": tokens,
        "position_ids": torch.arange(seq_len).repeat(len(rows), 1),
        "attention_mask": None,
        "prompt_lengths": torch.tensor([len(prompt) for prompt, _ in rows]),
        "response_lengths": torch.tensor([len(response) for _, response in rows]),
    }


def stack_optional(batch: dict, items: list[dict], keys: tuple[str, ...]) -> dict:
    """batch[key] = the items' values of key, stacked and flattened (float), for each key every item has;
    a key some items have and some not is an error."""
    for key in keys:
        present = [key in item for item in items]
        if all(present):
            batch[key] = torch.stack([item[key] for item in items]).reshape(-1).float()
        elif any(present):
            raise DataError(f"some items in the batch have {key!r} and some do not")
    return batch


def collate_preferences(items: list[dict], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """`collate_rows` of the pairs, interleaved chosen/rejected: for B pairs 2B rows, and, when every item
    has them, rewards [2B] and reference_logprobs [2B] float."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    rows = [(item["prompt"], item[side]) for item in items for side in ("chosen", "rejected")]
    return stack_optional(collate_rows(rows, pad_id, pad_to_multiple_of), items, ("rewards", "reference_logprobs"))
