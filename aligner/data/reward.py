"""Reward-model data: comparison pairs (Bradley-Terry ranking) and attribute labels (SteerLM regression).

Comparison files come in two layouts, detected from the first record of each file:
  {"prompt": "<prompt>", "chosen": "<response>", "rejected": "<response>"}   one pair per line
  {"text": "<prompt + chosen>"} then {"text": "<prompt + rejected>"}          NeMo-Aligner: two lines per pair
In the pair layout the prompt may be {"role", "content"} messages and the answers assistant
messages, or chosen/rejected whole conversations without "prompt" (TRL's implicit prompt; see
`aligner.data.preference.parse_pair`).
Regression files hold one labelled sample per line, the label as a string or an object:
  {"text": "...", "label": "helpfulness:4,correctness:3"}
  {"text": "...", "label": {"helpfulness": 4, "correctness": 3}}
  {"prompt": "<text or messages>", "response": "<text or assistant message>", "label": ...}

Tokens (`RewardTokenLayout`): a prompt and a response are `ChatEncoder.sample_tokens`, the same
tokens as the SFT encoding of the conversation up to the end of the reply, and the same tokens a
policy's rollout has (prompt + generated answer); without a chat template (or with
`data.chat_template=false`) that is [bos] + prompt + response + [eos]. A raw {"text"} is
[bos] + text + [eos]. The reward is read at the last token: eos, or with a template the
end-of-turn token that closes the reply (what a generated answer ends with).

Sequences longer than max_seq_length are dropped, never truncated: cutting a response
changes what is being judged, so a truncated pair or label would be a wrong example.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from aligner.data.conversation import ChatEncoder, Prompt, parse_answer, parse_prompt, template_errors
from aligner.data.jsonl import DataError, require_encodable, require_str
from aligner.data.preference import parse_pair
from aligner.data.records import Layouts, Records, open_records
from aligner.data.sft import PROGRESS_BAR_MIN_RECORDS
from aligner.runtime.distributed import is_rank_zero
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer

PAIR_KEYS = ("prompt", "chosen", "rejected")
REQUEST_KEYS = ("prompt", "response")  # a conversational reward-server request: a regression record's sample
COMPARISON_LAYOUTS = Layouts("reward-model comparison", (("chosen", "rejected"), ("text",)))
REGRESSION_LAYOUTS = Layouts("attribute (regression)", (("text", "label"), ("prompt", "response", "label")))
LABEL_EXAMPLE = "'helpfulness:4,correctness:3' or {\"helpfulness\": 4, \"correctness\": 3}"


@dataclass
class RewardDataStats:
    """What tokenization did to the file; the trainer logs it."""

    records: int = 0  # comparisons (pairs) or labelled texts read
    dropped_too_long: int = 0  # a sequence longer than max_seq_length (dropped, never truncated)

    @property
    def kept(self) -> int:
        return self.records - self.dropped_too_long


@dataclass
class Comparison:
    chosen: list[int]
    rejected: list[int]


@dataclass
class LabelledText:
    tokens: list[int]
    labels: list[float]  # one per attribute, 0.0 where masked
    label_mask: list[float]  # 1.0 where the record gives the attribute


def _keys_present(record: dict) -> str:
    return ", ".join(sorted(map(repr, record))) or "none"


def _check_max_seq_length(max_seq_length: int) -> None:
    if max_seq_length < 1:
        raise ConfigError(
            f"max_seq_length must be at least 1 (the reward is read at the last token), got {max_seq_length}"
        )


class RewardTokenLayout:
    """The tokens a reward model scores: training data and the reward server both encode through this.

    append_eos: end with eos; false drops a final eos (the raw text layout then has none).
    use_template: render prompts with the tokenizer's chat template (`data.chat_template`).
    """

    def __init__(self, tokenizer: Tokenizer, append_eos: bool = True, use_template: bool = True):
        self.tokenizer = tokenizer
        self.append_eos = append_eos
        self.encoder = ChatEncoder(tokenizer, use_template=use_template)

    def text(self, text: str) -> list[int]:
        """A raw text: [bos if the tokenizer has one] + its tokens + [eos]."""
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        return self._end(bos + self.tokenizer.encode(text) + [self.tokenizer.eos_id])

    def sample(self, prompt: Prompt, response: str) -> list[int]:
        """A prompt (text or messages) and its response: prompt tokens + answer tokens."""
        prompt_tokens, answer_tokens = self.encoder.sample_tokens(prompt, response)
        return self._end(prompt_tokens + answer_tokens)

    def _end(self, tokens: list[int]) -> list[int]:
        return tokens if self.append_eos or tokens[-1:] != [self.tokenizer.eos_id] else tokens[:-1]


# ---------------------------------------------------------------- comparisons


def _detect_comparison_layout(record: dict, path: str | Path, line: int) -> str:
    if any(key in record for key in PAIR_KEYS):
        return "pairs"
    if "text" in record:
        return "text"
    raise DataError(
        f"{path}:{line}: cannot tell the comparison layout: the first record has neither 'prompt'/'chosen'/'rejected' "
        f"nor 'text' (keys present: {_keys_present(record)}); expected "
        '{"prompt", "chosen", "rejected"} per line, or {"text"} lines alternating chosen and rejected'
    )


def _text_of_comparison(record: dict, path: str | Path, line: int) -> str:
    """A record of the 'text' comparison layout: its text."""
    if "label" in record:
        # An attribute file fed to the comparison reader would silently pair unrelated texts.
        raise DataError(
            f"{path}:{line}: record has a 'label' key, so this looks like attribute (regression) data; "
            "comparison files in the 'text' layout hold only {\"text\"} lines, chosen then rejected"
        )
    return require_str(record, "text", path, line)


def _records_progress(records: Records, path: str | Path) -> Iterable:
    """The records with a progress bar on rank 0 for a large file."""
    quiet = len(records) <= PROGRESS_BAR_MIN_RECORDS or not is_rank_zero()
    return tqdm(records, total=len(records), desc=f"tokenizing {path}", disable=True if quiet else None)


class ComparisonDataset(Dataset):
    """Tokenized (chosen, rejected) pairs of one data file (any format of `aligner.data.records`), for a
    pairwise ranking loss.

    Every pair is tokenized once when the dataset is built (a bad record fails now, naming its file and
    line or row; the stats are known); then only the kept pairs' indices are kept (numpy), and a pair is
    read and tokenized again when indexed.
    append_eos: end every sequence with eos (the reward is read at the last token, so the
    model sees the same end marker at training and at scoring time).
    use_template: render prompts with the tokenizer's chat template (`data.chat_template`).
    """

    def __init__(self, path: str | Path, tokenizer: Tokenizer, max_seq_length: int, append_eos: bool = True,
                 use_template: bool = True):
        _check_max_seq_length(max_seq_length)
        self.path = path
        self.max_seq_length = max_seq_length
        self.stats = RewardDataStats()
        self.records = open_records(path)
        if not len(self.records):
            raise DataError(f"{path}: the file holds no records; expected comparison pairs")
        self.layout = _detect_comparison_layout(self.records[0], path, self.records.where(0))
        if self.layout == "text" and len(self.records) % 2:
            raise DataError(
                f"{path}:{self.records.where(len(self.records) - 1)}: odd number of records ({len(self.records)}) in "
                "the 'text' comparison layout; expected each chosen text to be followed by its rejected text on the "
                "next line"
            )
        self.encode = RewardTokenLayout(tokenizer, append_eos, use_template)
        pairs = len(self.records) // (2 if self.layout == "text" else 1)
        kept = np.zeros(pairs, dtype=bool)
        chosen_text = None
        for position, (line, record) in enumerate(_records_progress(self.records, path)):
            if self.layout == "pairs":
                comparison = self._pair(record, line)
            elif position % 2 == 0:
                chosen_text = _text_of_comparison(record, path, line)
                continue
            else:
                comparison = Comparison(self.encode.text(chosen_text), self.encode.text(
                    _text_of_comparison(record, path, line)))
            self.stats.records += 1
            if max(len(comparison.chosen), len(comparison.rejected)) > max_seq_length:
                self.stats.dropped_too_long += 1
                continue
            kept[self.stats.records - 1] = True
        self.indices = np.flatnonzero(kept)  # [comparisons]: which pair of the file each one is
        if not len(self.indices):
            raise DataError(
                f"{path}: no usable comparisons: all {self.stats.records} pairs have a sequence longer than "
                f"max_seq_length={max_seq_length}; raise max_seq_length or shorten the data"
            )

    def _pair(self, record: dict, line: int) -> Comparison:
        prompt, chosen, rejected = parse_pair(record, "chosen", "rejected", self.path, line)
        with template_errors(self.path, line):
            return Comparison(self.encode.sample(prompt, chosen), self.encode.sample(prompt, rejected))

    def comparison(self, index: int) -> Comparison:
        """Comparison `index`, read and tokenized."""
        pair = int(self.indices[index])
        if self.layout == "pairs":
            return self._pair(self.records[pair], self.records.where(pair))
        chosen, rejected = (self.records[position] for position in (2 * pair, 2 * pair + 1))
        return Comparison(self.encode.text(_text_of_comparison(chosen, self.path, self.records.where(2 * pair))),
                          self.encode.text(_text_of_comparison(rejected, self.path,
                                                               self.records.where(2 * pair + 1))))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        comparison = self.comparison(index)
        return {
            "chosen": torch.tensor(comparison.chosen, dtype=torch.long),
            "rejected": torch.tensor(comparison.rejected, dtype=torch.long),
        }


# ---------------------------------------------------------------- regression (attribute labels)


def _label_number(name: str, value: Any, path: str | Path, line: int, in_text: bool) -> float:
    """A label value: a JSON number in an object, or (in_text) the text after ':' in a label string."""
    if in_text:
        try:
            number = float(value)
        except ValueError:
            raise DataError(
                f"{path}:{line}: label {name!r} has value {value!r}, which is not a number; "
                f"expected e.g. {LABEL_EXAMPLE}"
            ) from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise DataError(f"{path}:{line}: label {name!r} is a {type(value).__name__}; expected a number")
    if not math.isfinite(number):
        raise DataError(f"{path}:{line}: label {name!r} is {value!r}; expected a finite number")
    return number


def _label_items(value: Any, path: str | Path, line: int) -> list[tuple[str, float]]:
    """(name, value) pairs of a label string or object, in the order given."""
    if isinstance(value, dict):
        return [(name, _label_number(name, raw, path, line, in_text=False)) for name, raw in value.items()]
    if not isinstance(value, str):
        raise DataError(f"{path}:{line}: 'label' is a {type(value).__name__}; expected {LABEL_EXAMPLE}")
    if not value.strip():
        return []
    items: list[tuple[str, float]] = []
    for item in value.split(","):
        name, colon, raw = item.partition(":")
        name = name.strip()
        if not colon or not name:
            raise DataError(
                f"{path}:{line}: malformed label {value!r}: item {item.strip()!r} is not 'name:value'; "
                f"expected {LABEL_EXAMPLE}"
            )
        if any(name == seen for seen, _ in items):
            raise DataError(f"{path}:{line}: malformed label {value!r}: attribute {name!r} is given twice")
        items.append((name, _label_number(name, raw.strip(), path, line, in_text=True)))
    return items


def parse_label(value: Any, attributes: list[str], path: str | Path, line: int) -> tuple[list[float], list[float]]:
    """Attribute values of one record's label, in the order of `attributes`, and their mask.

    value: "helpfulness:4,correctness:3" or {"helpfulness": 4, "correctness": 3}. An attribute
    the label leaves out gets value 0.0 and mask 0.0; a name not in `attributes` is an error.
    """
    columns = {name: column for column, name in enumerate(attributes)}
    labels = [0.0] * len(attributes)
    mask = [0.0] * len(attributes)
    items = _label_items(value, path, line)
    if not items:
        raise DataError(
            f"{path}:{line}: 'label' names no attribute, so there is nothing to learn; expected {LABEL_EXAMPLE}"
        )
    for name, number in items:
        if name not in columns:
            raise DataError(
                f"{path}:{line}: unknown attribute {name!r} in 'label'; known attributes: {', '.join(attributes)} "
                "(add it to the model's attributes, or remove it from the data)"
            )
        labels[columns[name]] = number
        mask[columns[name]] = 1.0
    return labels, mask


def _check_attributes(attributes: list[str]) -> None:
    if not attributes:
        raise ConfigError("attributes is empty; expected the attribute names to predict, e.g. ['helpfulness']")
    for name in attributes:
        if not isinstance(name, str) or not name.strip() or name != name.strip() or any(c in name for c in ",:"):
            raise ConfigError(
                f"attribute name {name!r} is not usable in a label; expected a non-empty name without ',' or ':'"
            )
    if len(set(attributes)) != len(attributes):
        raise ConfigError(f"attributes {attributes} name an attribute twice; each must be a distinct output column")


def regression_sample_tokens(record: dict, encode: RewardTokenLayout, path: str | Path, line: int) -> list[int]:
    """The tokens of a labelled record: a raw {"text"} or a {"prompt", "response"} conversation."""
    if "text" in record or "prompt" not in record:
        return encode.text(require_str(record, "text", path, line))
    prompt, response = parse_prompt(record, "prompt", path, line), parse_answer(record, "response", path, line)
    with template_errors(path, line):
        return encode.sample(prompt, response)


def request_sample_tokens(payload: bytes, encode: RewardTokenLayout) -> list[int]:
    """Tokens of one conversational reward-server request: UTF-8 JSON {"prompt", "response"}.

    Laid out exactly as the same {"prompt", "response"} record is for training. Raises ValueError
    saying what is wrong (the server answers it for that row only).
    """
    try:
        record = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"not UTF-8 JSON ({error})") from None
    if not isinstance(record, dict):
        raise DataError(f"a JSON {type(record).__name__}; expected an object "
                        '{"prompt": text or messages, "response": text or an assistant message}')
    unknown = sorted(set(record) - set(REQUEST_KEYS))
    if unknown:
        raise DataError(f"unknown key(s) {', '.join(map(repr, unknown))}; expected only 'prompt' and 'response'")
    require_encodable(record, "")  # JSON may escape a lone surrogate that no tokenizer takes
    where = "request"
    try:
        prompt, response = parse_prompt(record, "prompt", where, 0), parse_answer(record, "response", where, 0)
        with template_errors(where, 0):
            return encode.sample(prompt, response)
    except DataError as error:
        raise DataError(str(error).removeprefix(f"{where}:0: ")) from None


class RegressionDataset(Dataset):
    """Tokenized samples with per-attribute labels (SteerLM attribute prediction) of one data file (any format
    of `aligner.data.records`), tokenized once when built, then read and tokenized again when indexed (only the
    kept records' indices are kept).

    attributes: the attribute names to predict; their order is the order of the output columns.
    use_template: render prompts with the tokenizer's chat template (`data.chat_template`).
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer,
        max_seq_length: int,
        attributes: list[str],
        append_eos: bool = True,
        use_template: bool = True,
    ):
        _check_max_seq_length(max_seq_length)
        _check_attributes(attributes)
        self.path = path
        self.max_seq_length = max_seq_length
        self.attributes = list(attributes)
        self.stats = RewardDataStats()
        self.records = open_records(path)
        if not len(self.records):
            raise DataError(f"{path}: the file holds no records; expected {{\"text\", \"label\"}} or "
                            "{\"prompt\", \"response\", \"label\"} per line")
        self.encode = RewardTokenLayout(tokenizer, append_eos, use_template)
        kept = np.zeros(len(self.records), dtype=bool)
        for position, (line, record) in enumerate(_records_progress(self.records, path)):
            example = self._example(record, line)
            self.stats.records += 1
            if len(example.tokens) > max_seq_length:
                self.stats.dropped_too_long += 1
                continue
            kept[position] = True
        self.indices = np.flatnonzero(kept)  # [examples]: the record each one comes from
        if not len(self.indices):
            raise DataError(
                f"{path}: no usable examples: all {self.stats.records} texts are longer than "
                f"max_seq_length={max_seq_length}; raise max_seq_length or shorten the data"
            )

    def _example(self, record: dict, line: int) -> LabelledText:
        tokens = regression_sample_tokens(record, self.encode, self.path, line)
        if "label" not in record:
            raise DataError(f"{self.path}:{line}: missing key 'label' (keys present: {_keys_present(record)})")
        labels, label_mask = parse_label(record["label"], self.attributes, self.path, line)
        return LabelledText(tokens, labels, label_mask)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        position = int(self.indices[index])
        example = self._example(self.records[position], self.records.where(position))
        return {
            "tokens": torch.tensor(example.tokens, dtype=torch.long),
            "labels": torch.tensor(example.labels, dtype=torch.float32),
            "label_mask": torch.tensor(example.label_mask, dtype=torch.float32),
        }


# ---------------------------------------------------------------- collation


def _pad_right(sequences: list[torch.Tensor], pad_id: int, pad_to_multiple_of: int) -> dict:
    """tokens [N, S] right-padded, lengths [N], position_ids [N, S]; S rounded up to the multiple."""
    if not sequences:
        raise ValueError("cannot collate an empty batch")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be at least 1, got {pad_to_multiple_of}")
    lengths = torch.tensor([len(sequence) for sequence in sequences], dtype=torch.long)
    seq_len = -(-int(lengths.max()) // pad_to_multiple_of) * pad_to_multiple_of
    tokens = torch.full((len(sequences), seq_len), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    return {
        "tokens": tokens,
        "lengths": lengths,  # the reward is read at index lengths - 1
        "position_ids": torch.arange(seq_len).repeat(len(sequences), 1),
        # Padding is on the right, so under the model's causal mask it never reaches a real position.
        "attention_mask": None,
    }


def collate_comparisons(examples: list[dict[str, torch.Tensor]], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """Right-pad comparison pairs into one batch of 2B sequences.

    Rows are interleaved [chosen0, rejected0, chosen1, rejected1, ...], so any contiguous
    slice of 2k rows (a micro-batch split) holds k whole pairs. Returns tokens and
    position_ids [2B, S] long, lengths [2B] long (true lengths), attention_mask None.
    """
    sequences = [example[key] for example in examples for key in ("chosen", "rejected")]
    return _pad_right(sequences, pad_id, pad_to_multiple_of)


def collate_regression(examples: list[dict[str, torch.Tensor]], pad_id: int, pad_to_multiple_of: int = 1) -> dict:
    """Right-pad labelled texts into a batch.

    Returns tokens and position_ids [B, S] long, lengths [B] long, labels and
    label_mask [B, A] float (A = number of attributes), attention_mask None.
    """
    batch = _pad_right([example["tokens"] for example in examples], pad_id, pad_to_multiple_of)
    batch["labels"] = torch.stack([example["labels"] for example in examples])
    batch["label_mask"] = torch.stack([example["label_mask"] for example in examples])
    return batch
