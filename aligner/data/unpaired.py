"""Unpaired feedback for KTO: one completion per prompt, labelled desirable (true) or undesirable (false).

One example per JSONL line or Parquet/Arrow row (`aligner.data.records`), TRL's unpaired layout, plain or
conversational:
  {"prompt": "12+7=", "completion": "19", "label": true}
  {"prompt": [{"role": "user", "content": "12+7="}], "completion": [{"role": "assistant", "content": "18"}],
   "label": false}

Tokens come from `ChatEncoder.sample_tokens`, as for preference pairs (aligner/data/preference.py):
prompt + completion is the SFT encoding of the conversation up to the end of the reply. Examples
longer than max_seq_length are dropped and counted, never truncated.

KTO's reference point is estimated from mismatched pairs: example i also carries the completion of the
next example (in the file's order, wrapping around) whose prompt differs from its own, so the pairs do not
depend on batching, shuffling or the parallel layout, and a file that lists a prompt's good and bad
answers side by side still pairs each with another prompt's answer. A mismatched completion is cut to fit max_seq_length
after its prompt: it is only a sample for the estimate. Collated rows interleave
[completion0, mismatched0, completion1, mismatched1, ...], as preference pairs interleave chosen and
rejected, so the DPO machinery (reference logprobs precomputed or swapped in) serves both.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from aligner.data.conversation import ChatEncoder, parse_answer, parse_prompt, template_errors
from aligner.data.jsonl import DataError, require_key
from aligner.data.preference import collate_rows, stack_optional
from aligner.data.records import Layouts, open_records
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer

UNPAIRED_LAYOUTS = Layouts("unpaired (KTO)", (("prompt", "completion", "label"),))


@dataclass
class UnpairedExample:
    prompt: list[int]  # [bos] + text, or the chat template's rendering up to the generation prompt
    completion: list[int]  # ending with eos (or the template's end-of-turn token)
    desirable: bool


@dataclass
class UnpairedStats:
    records: int = 0
    dropped_too_long: int = 0
    desirable: int = 0  # kept examples of each label
    undesirable: int = 0

    @property
    def kept(self) -> int:
        return self.records - self.dropped_too_long


def _mismatched_indices(prompts: list[list[int]]) -> list[int]:
    """For each example, the next one (wrapping around) with another prompt; the next one outright where
    every prompt is the same. Linear: each run of equal consecutive prompts points past its end."""
    count = len(prompts)
    starts = [index for index in range(count) if index == 0 or prompts[index] != prompts[index - 1]]
    if len(starts) == 1:
        return [(index + 1) % count for index in range(count)]
    found = []
    for run, start in enumerate(starts):
        end = starts[run + 1] if run + 1 < len(starts) else count
        target = starts[(run + 1) % len(starts)]
        if prompts[target] == prompts[start]:  # the last run wraps onto a first run of the same prompt
            target = starts[(run + 2) % len(starts)]
        found.extend([target] * (end - start))
    return found


class UnpairedDataset(Dataset):
    """Tokenized KTO examples, each with its mismatched completion; optionally reference logprobs.

    reference_logprobs, once set, is [examples, 2] float: the reference model's summed logprob of the
    completion and of the mismatched completion; items then carry it to the loss.
    """

    def __init__(self, examples: list[UnpairedExample], max_seq_length: int, source: str = "<memory>"):
        self.examples, self.max_seq_length, self.source = examples, max_seq_length, source
        self._index([example.prompt for example in examples], [example.desirable for example in examples])

    def _index(self, prompts: Sequence, labels: Sequence[bool]) -> None:
        """Mismatched partners and stats from each example's prompt (tokens, or a key equal iff they are equal)."""
        if len(prompts) < 2:
            raise DataError(f"{self.source}: KTO needs at least 2 usable examples (the KL estimate pairs each prompt "
                            f"with another example's completion), got {len(prompts)}")
        self.mismatched = np.asarray(_mismatched_indices(prompts), dtype=np.int64)
        self.stats = UnpairedStats(records=len(prompts), desirable=int(sum(labels)),
                                   undesirable=len(labels) - int(sum(labels)))
        self.reference_logprobs = None

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer: Tokenizer, max_seq_length: int,
                   use_template: bool = True) -> "UnpairedDataset":
        """The examples of a data file of any format (`aligner.data.records`), read lazily (`UnpairedFile`)."""
        return UnpairedFile(path, tokenizer, max_seq_length, use_template)

    def example(self, index: int) -> UnpairedExample:
        return self.examples[index]

    def __len__(self) -> int:
        return len(self.mismatched)

    def __getitem__(self, index: int) -> dict:
        example = self.example(index)
        other = self.example(int(self.mismatched[index]))
        room = self.max_seq_length - len(example.prompt)  # >= 1: the example itself fits
        item = {
            "prompt": torch.tensor(example.prompt, dtype=torch.long),
            "completion": torch.tensor(example.completion, dtype=torch.long),
            "mismatched": torch.tensor(other.completion[:room], dtype=torch.long),
            "desirable": torch.tensor(example.desirable),
        }
        if self.reference_logprobs is not None:
            item["reference_logprobs"] = self.reference_logprobs[index]
        return item


class UnpairedFile(UnpairedDataset):
    """The examples of a data file: every record is tokenized once when built (a bad record fails now, naming
    its file and line or row), then only the kept records' indices, labels and a hash of each prompt's tokens
    (to pick mismatched partners) are kept (numpy); an example is read and tokenized again when indexed."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, max_seq_length: int, use_template: bool = True):
        if max_seq_length < 2:
            raise ConfigError(f"max_seq_length must be at least 2 (a prompt token and a completion token), "
                              f"got {max_seq_length}")
        self.encoder, self.max_seq_length, self.source = ChatEncoder(tokenizer, use_template=use_template), \
            max_seq_length, str(path)
        self.records = open_records(path)
        kept = np.zeros(len(self.records), dtype=bool)
        prompt_keys = np.zeros(len(self.records), dtype=np.int64)
        labels = np.zeros(len(self.records), dtype=bool)
        records = dropped_too_long = 0
        for index, (line, record) in enumerate(self.records):
            example = self._encode(record, line)
            records += 1
            if len(example.prompt) + len(example.completion) > max_seq_length:
                dropped_too_long += 1
                continue
            # Equal prompts hash alike; two different ones colliding (2^-64) would only pair an example with its
            # own prompt's completion for the KL estimate.
            kept[index], prompt_keys[index], labels[index] = True, hash(tuple(example.prompt)), example.desirable
        if records == 0:
            raise DataError(f"{path}: the file holds no records; expected {{prompt, completion, label}} lines")
        if kept.sum() < 2 and dropped_too_long:
            raise DataError(f"{path}: {int(kept.sum())} usable examples: {dropped_too_long} of {records} "
                            f"are longer than max_seq_length={max_seq_length}; raise it or shorten the data")
        self.indices = np.flatnonzero(kept)  # [examples]: the record each example comes from
        self._index(prompt_keys[self.indices], labels[self.indices])
        self.stats = UnpairedStats(records, dropped_too_long, self.stats.desirable, self.stats.undesirable)

    def _encode(self, record: dict, line: int) -> UnpairedExample:
        path = self.source
        label = require_key(record, "label", path, line)
        if not isinstance(label, bool):
            raise DataError(f"{path}:{line}: 'label' is {label!r}; expected true (desirable) or false (undesirable)")
        prompt_text = parse_prompt(record, "prompt", path, line)
        completion_text = parse_answer(record, "completion", path, line)
        with template_errors(path, line):
            prompt, completion = self.encoder.sample_tokens(prompt_text, completion_text)
        return UnpairedExample(prompt, completion, label)

    def example(self, index: int) -> UnpairedExample:
        position = int(self.indices[index])
        return self._encode(self.records[position], self.records.where(position))


def collate_unpaired(items: list[dict], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """`collate_rows` of the examples, interleaved completion/mismatched: for B examples 2B rows, each row's
    example's label `desirable` [2B] bool (per row, as the loader slices micro batches by rows), and, when
    every item has them, reference_logprobs [2B] float."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    rows = [(item["prompt"], item[side]) for item in items for side in ("completion", "mismatched")]
    batch = collate_rows(rows, pad_id, pad_to_multiple_of)
    batch["desirable"] = torch.stack([item["desirable"] for item in items]).repeat_interleave(2)
    return stack_optional(batch, items, ("reference_logprobs",))
