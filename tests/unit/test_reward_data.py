"""Reward-model data layer: comparison layouts, attribute labels, drops, errors, collation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from aligner.data.jsonl import DataError
from aligner.data.reward import (
    ComparisonDataset,
    RegressionDataset,
    collate_comparisons,
    collate_regression,
    parse_label,
)
from aligner.demo.arithmetic import attribute_records, preference_records
from aligner.demo.tokenizer import train_char_tokenizer
from aligner.tokenizer import Tokenizer

from ..conftest import CHAT_KINDS, SAMPLE_ANSWERS, SAMPLE_PROMPTS, sft_reference

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = "what is two plus two four five six hello world good bad a b c d e".split()
VOCAB = {token: index for index, token in enumerate(SPECIALS + WORDS)}
PAD, BOS, EOS = VOCAB["<pad>"], VOCAB["<s>"], VOCAB["</s>"]
ATTRIBUTES = ["helpfulness", "correctness", "verbosity"]


def ids(text: str) -> list[int]:
    return [VOCAB[word] for word in text.split()]


def make_tokenizer(directory: Path, bos: bool = True) -> Tokenizer:
    raw = RawTokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", bos_token="<s>" if bos else None
    )
    hf.save_pretrained(str(directory))
    return Tokenizer(directory)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture
def tokenizer(tmp_path) -> Tokenizer:
    return make_tokenizer(tmp_path / "tokenizer")


PAIRS = [
    {"prompt": "what is two plus two", "chosen": "four", "rejected": "five six"},
    {"prompt": "hello", "chosen": "hello world", "rejected": "bad"},
]


# ---------------------------------------------------------------- comparisons


@pytest.mark.parametrize("bos", [True, False])
@pytest.mark.parametrize("append_eos", [True, False])
def test_prompt_chosen_rejected_layout_tokens(tmp_path, bos, append_eos):
    tokenizer = make_tokenizer(tmp_path / "t", bos=bos)
    dataset = ComparisonDataset(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), tokenizer, 16, append_eos=append_eos)
    start, end = ([BOS] if bos else []), ([EOS] if append_eos else [])
    assert dataset.layout == "pairs" and len(dataset) == 2
    assert dataset[0]["chosen"].tolist() == start + ids("what is two plus two four") + end
    assert dataset[0]["rejected"].tolist() == start + ids("what is two plus two five six") + end
    assert dataset[1]["chosen"].tolist() == start + ids("hello hello world") + end
    assert dataset[1]["rejected"].tolist() == start + ids("hello bad") + end
    assert dataset[0]["chosen"].dtype == dataset[0]["rejected"].dtype == torch.long
    assert (dataset.stats.records, dataset.stats.kept, dataset.stats.dropped_too_long) == (2, 2, 0)


@pytest.mark.parametrize("bos", [True, False])
@pytest.mark.parametrize("append_eos", [True, False])
def test_text_layout_pairs_consecutive_lines(tmp_path, bos, append_eos):
    tokenizer = make_tokenizer(tmp_path / "t", bos=bos)
    lines = [{"text": "hello good"}, {"text": "hello bad"}, "", {"text": "a b c"}, {"text": "a"}]
    dataset = ComparisonDataset(write_jsonl(tmp_path / "text.jsonl", lines), tokenizer, 16, append_eos=append_eos)
    start, end = ([BOS] if bos else []), ([EOS] if append_eos else [])
    assert dataset.layout == "text" and len(dataset) == 2
    assert [dataset[0]["chosen"].tolist(), dataset[0]["rejected"].tolist()] == [
        start + ids("hello good") + end,
        start + ids("hello bad") + end,
    ]
    assert [dataset[1]["chosen"].tolist(), dataset[1]["rejected"].tolist()] == [
        start + ids("a b c") + end,
        start + ids("a") + end,
    ]
    assert dataset.stats.records == 2  # pairs, not lines


def test_too_long_pairs_are_dropped_whole_and_counted(tmp_path, tokenizer):
    records = [
        {"prompt": "a", "chosen": "b", "rejected": "c"},  # 4 tokens each: fits
        {"prompt": "a", "chosen": "b c d e", "rejected": "c"},  # chosen has 7 tokens
        {"prompt": "a", "chosen": "b", "rejected": "b c d"},  # rejected has 6 tokens
        {"prompt": "a b", "chosen": "c", "rejected": "d"},  # exactly 5: fits
    ]
    dataset = ComparisonDataset(write_jsonl(tmp_path / "pairs.jsonl", records), tokenizer, max_seq_length=5)
    assert (dataset.stats.records, dataset.stats.kept, dataset.stats.dropped_too_long) == (4, 2, 2)
    assert dataset[1]["chosen"].tolist() == [BOS] + ids("a b c") + [EOS]
    with pytest.raises(DataError, match=r"pairs\.jsonl: no usable comparisons: all 4 pairs .*max_seq_length=3"):
        ComparisonDataset(tmp_path / "pairs.jsonl", tokenizer, max_seq_length=3)


def test_empty_comparison_file_is_an_error(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"empty\.jsonl: the file holds no records"):
        ComparisonDataset(write_jsonl(tmp_path / "empty.jsonl", ["", " "]), tokenizer, 16)


@pytest.mark.parametrize(
    "lines, line, expected",
    [
        ([PAIRS[0], '{"prompt": "a",'], 2, "invalid JSON"),
        ([PAIRS[0], {"prompt": "a", "chosen": "b"}], 2, "missing key 'rejected'"),
        ([PAIRS[0], PAIRS[1], {"prompt": "a", "chosen": " ", "rejected": "b"}], 3, "key 'chosen' is empty"),
        ([PAIRS[0], {"prompt": ["a"], "chosen": "b", "rejected": "c"}], 2,
         r"prompt\[0\] is a str; expected a JSON object"),
        ([PAIRS[0], {"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                     "chosen": "b", "rejected": "c"}], 2, "'prompt' ends with an assistant turn"),
        ([PAIRS[0], {"prompt": [{"role": "bot", "content": "a"}], "chosen": "b", "rejected": "c"}], 2,
         "unknown role 'bot'"),
        ([PAIRS[0], {"prompt": "a", "chosen": {"role": "user", "content": "b"}, "rejected": "c"}], 2,
         r"'chosen' holds 1 message\(s\) \(user\)"),
        ([{"text": "a"}, {"text": "b"}, "", {"text": "c"}], 4, r"odd number of records \(3\)"),
        ([{"text": "a"}, {"chosen": "b"}], 2, "missing key 'text'"),
        ([{"text": "a"}, {"text": 3}], 2, "key 'text' is a int"),
        ([{"text": "a b", "label": "helpfulness:3"}, {"text": "a"}], 1, "looks like attribute"),
        ([{"answer": "a"}], 1, "cannot tell the comparison layout"),
    ],
)
def test_malformed_comparisons_name_file_and_line(tmp_path, tokenizer, lines, line, expected):
    path = write_jsonl(tmp_path / "file.jsonl", lines)
    with pytest.raises(DataError, match=rf"^{tmp_path}/file\.jsonl:{line}: .*{expected}"):
        ComparisonDataset(path, tokenizer, 16)


def test_collate_comparisons_interleaves_pairs_and_pads_right():
    examples = [
        {"chosen": torch.tensor([1, 11, 12, 2]), "rejected": torch.tensor([1, 13, 2])},
        {"chosen": torch.tensor([1, 21, 2]), "rejected": torch.tensor([1, 22, 23, 24, 25, 2])},
    ]
    batch = collate_comparisons(examples, pad_id=0)
    assert batch["tokens"].tolist() == [
        [1, 11, 12, 2, 0, 0],
        [1, 13, 2, 0, 0, 0],
        [1, 21, 2, 0, 0, 0],
        [1, 22, 23, 24, 25, 2],
    ]
    assert batch["lengths"].tolist() == [4, 3, 3, 6]
    rows = torch.arange(4)
    assert batch["tokens"][rows, batch["lengths"] - 1].tolist() == [2, 2, 2, 2]  # the reward is read at eos
    assert batch["position_ids"].tolist() == [list(range(6))] * 4
    assert batch["attention_mask"] is None
    assert batch["tokens"].dtype == batch["lengths"].dtype == batch["position_ids"].dtype == torch.long
    # A contiguous half of the rows is one whole pair.
    first_pair = collate_comparisons(examples[:1], pad_id=0, pad_to_multiple_of=6)
    assert batch["tokens"][:2].tolist() == first_pair["tokens"].tolist()
    padded = collate_comparisons(examples, pad_id=0, pad_to_multiple_of=4)
    assert padded["tokens"].shape == padded["position_ids"].shape == (4, 8)
    assert padded["lengths"].tolist() == [4, 3, 3, 6]
    assert (padded["tokens"][:, 6:] == 0).all()
    assert collate_comparisons(examples, pad_id=0, pad_to_multiple_of=3)["tokens"].shape == (4, 6)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        collate_comparisons(examples, pad_id=0, pad_to_multiple_of=0)


# ---------------------------------------------------------------- regression


def test_regression_string_and_dict_labels_with_masks(tmp_path, tokenizer):
    records = [
        {"text": "hello world", "label": "helpfulness:4,correctness:3,verbosity:1"},
        {"text": "good", "label": " correctness : 2.5 , helpfulness:0"},  # spaces allowed, order free
        {"text": "bad", "label": {"verbosity": 2, "helpfulness": 1.5}},  # correctness missing: masked
    ]
    dataset = RegressionDataset(write_jsonl(tmp_path / "labels.jsonl", records), tokenizer, 16, ATTRIBUTES)
    assert len(dataset) == 3
    assert dataset[0]["tokens"].tolist() == [BOS] + ids("hello world") + [EOS]
    assert dataset[0]["labels"].tolist() == [4.0, 3.0, 1.0] and dataset[0]["label_mask"].tolist() == [1, 1, 1]
    assert dataset[1]["labels"].tolist() == [0.0, 2.5, 0.0] and dataset[1]["label_mask"].tolist() == [1, 1, 0]
    assert dataset[2]["labels"].tolist() == [1.5, 0.0, 2.0] and dataset[2]["label_mask"].tolist() == [1, 0, 1]
    assert dataset[0]["labels"].dtype == dataset[0]["label_mask"].dtype == torch.float32


def test_regression_append_eos_and_column_order(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "labels.jsonl", [{"text": "a b", "label": "verbosity:1,helpfulness:3"}])
    dataset = RegressionDataset(path, tokenizer, 16, ["verbosity", "correctness", "helpfulness"], append_eos=False)
    assert dataset[0]["tokens"].tolist() == [BOS] + ids("a b")
    assert dataset[0]["labels"].tolist() == [1.0, 0.0, 3.0] and dataset[0]["label_mask"].tolist() == [1, 0, 1]


def test_regression_drops_too_long_texts(tmp_path, tokenizer):
    records = [{"text": "a b c d", "label": "helpfulness:1"}, {"text": "a", "label": "helpfulness:2"}]
    dataset = RegressionDataset(write_jsonl(tmp_path / "labels.jsonl", records), tokenizer, 4, ATTRIBUTES)
    assert (dataset.stats.records, dataset.stats.kept, dataset.stats.dropped_too_long) == (2, 1, 1)
    assert dataset[0]["labels"].tolist() == [2.0, 0.0, 0.0]
    with pytest.raises(DataError, match=r"labels\.jsonl: no usable examples"):
        RegressionDataset(tmp_path / "labels.jsonl", tokenizer, 2, ATTRIBUTES)
    with pytest.raises(DataError, match=r"empty\.jsonl: the file holds no records"):
        RegressionDataset(write_jsonl(tmp_path / "empty.jsonl", [""]), tokenizer, 4, ATTRIBUTES)


@pytest.mark.parametrize(
    "record, expected",
    [
        ('{"text": "a", "label": ', "invalid JSON"),
        ({"text": "a"}, "missing key 'label'"),
        ({"label": "helpfulness:1"}, "missing key 'text'"),
        ({"prompt": "a", "label": "helpfulness:1"}, "missing key 'response'"),
        ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "response": "c",
          "label": "helpfulness:1"}, "'prompt' ends with an assistant turn"),
        ({"prompt": "a", "response": [{"role": "user", "content": "b"}], "label": "helpfulness:1"},
         r"'response' holds 1 message\(s\) \(user\)"),
        ({"prompt": "a", "response": "b"}, "missing key 'label'"),
        ({"text": "", "label": "helpfulness:1"}, "key 'text' is empty"),
        ({"text": 7, "label": "helpfulness:1"}, "key 'text' is a int; expected a string"),
        ({"text": "a", "label": ["helpfulness", 1]}, "'label' is a list"),
        ({"text": "a", "label": "humor:1"}, "unknown attribute 'humor'.*known attributes: helpfulness, correctness"),
        ({"text": "a", "label": {"humor": 1}}, "unknown attribute 'humor'"),
        ({"text": "a", "label": "helpfulness=4"}, "malformed label 'helpfulness=4'.*not 'name:value'"),
        ({"text": "a", "label": "helpfulness:4,"}, "malformed label"),
        ({"text": "a", "label": "helpfulness:high"}, "'helpfulness' has value 'high', which is not a number"),
        ({"text": "a", "label": "helpfulness:"}, "'helpfulness' has value '', which is not a number"),
        ({"text": "a", "label": "helpfulness:nan"}, "expected a finite number"),
        ({"text": "a", "label": "helpfulness:1,helpfulness:2"}, "'helpfulness' is given twice"),
        ({"text": "a", "label": {"helpfulness": "4"}}, "'helpfulness' is a str; expected a number"),
        ({"text": "a", "label": {"helpfulness": True}}, "'helpfulness' is a bool; expected a number"),
        ({"text": "a", "label": ""}, "names no attribute"),
        ({"text": "a", "label": {}}, "names no attribute"),
    ],
)
def test_malformed_regression_records_name_file_and_line(tmp_path, tokenizer, record, expected):
    good = {"text": "a b", "label": "helpfulness:1"}
    path = write_jsonl(tmp_path / "file.jsonl", [good, "", good, record])
    with pytest.raises(DataError, match=rf"^{tmp_path}/file\.jsonl:4: .*{expected}"):
        RegressionDataset(path, tokenizer, 16, ATTRIBUTES)


def test_parse_label_is_usable_on_its_own():
    assert parse_label("b:2", ["a", "b"], "x.jsonl", 5) == ([0.0, 2.0], [0.0, 1.0])
    assert parse_label({"a": -1, "b": 0.25}, ["a", "b"], "x.jsonl", 5) == ([-1.0, 0.25], [1.0, 1.0])
    with pytest.raises(DataError, match=r"^x\.jsonl:5: unknown attribute 'c' in 'label'; known attributes: a, b \("):
        parse_label("c:1", ["a", "b"], "x.jsonl", 5)


@pytest.mark.parametrize("attributes", [[], ["a", "a"], ["a:b"], [""]])
def test_regression_rejects_unusable_attribute_lists(tmp_path, tokenizer, attributes):
    path = write_jsonl(tmp_path / "labels.jsonl", [{"text": "a", "label": "a:1"}])
    with pytest.raises(ValueError, match="attribute"):
        RegressionDataset(path, tokenizer, 16, attributes)


def test_collate_regression_pads_and_stacks_labels():
    examples = [
        {"tokens": torch.tensor([1, 5, 2]), "labels": torch.tensor([4.0, 0.0]), "label_mask": torch.tensor([1.0, 0.0])},
        {"tokens": torch.tensor([1, 6, 7, 8, 2]), "labels": torch.tensor([1.0, 2.0]), "label_mask": torch.ones(2)},
    ]
    batch = collate_regression(examples, pad_id=0, pad_to_multiple_of=4)
    assert batch["tokens"].tolist() == [[1, 5, 2, 0, 0, 0, 0, 0], [1, 6, 7, 8, 2, 0, 0, 0]]
    assert batch["lengths"].tolist() == [3, 5]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    assert batch["labels"].tolist() == [[4.0, 0.0], [1.0, 2.0]]
    assert batch["label_mask"].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert batch["labels"].dtype == batch["label_mask"].dtype == torch.float32
    assert batch["attention_mask"] is None


# ---------------------------------------------------------------- conversational records on real chat templates


@pytest.mark.parametrize("kind", CHAT_KINDS)
@pytest.mark.parametrize("prompt_name", sorted(SAMPLE_PROMPTS))
@pytest.mark.parametrize("answer_name", sorted(SAMPLE_ANSWERS))
def test_conversational_ranking_pairs_are_the_sft_encoding(tmp_path, chat_tokenizers, kind, prompt_name, answer_name):
    tokenizer = chat_tokenizers[kind]
    prompt, chosen = SAMPLE_PROMPTS[prompt_name], SAMPLE_ANSWERS[answer_name]
    rejected = {"role": "assistant", "content": "I do not know."}
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": prompt, "chosen": chosen, "rejected": rejected}])
    dataset = ComparisonDataset(path, tokenizer, 256)
    assert dataset[0]["chosen"].tolist() == sft_reference(tokenizer, prompt, chosen)[0]
    assert dataset[0]["rejected"].tolist() == sft_reference(tokenizer, prompt, rejected)[0]
    assert dataset[0]["chosen"][-1] == tokenizer.eos_id  # the reward is read at the reply's end-of-turn token
    implicit = {"chosen": SAMPLE_PROMPTS["user"] + [{"role": "assistant", "content": "Paris."}],
                "rejected": SAMPLE_PROMPTS["user"] + [rejected]}
    explicit = {"prompt": SAMPLE_PROMPTS["user"], "chosen": "Paris.", "rejected": rejected}
    both = ComparisonDataset(write_jsonl(tmp_path / "both.jsonl", [implicit, explicit]), tokenizer, 256)
    assert ([both[0][key].tolist() for key in ("chosen", "rejected")]
            == [both[1][key].tolist() for key in ("chosen", "rejected")])


@pytest.mark.parametrize("kind", CHAT_KINDS)
@pytest.mark.parametrize("prompt_name", sorted(SAMPLE_PROMPTS))
def test_conversational_regression_records_are_the_sft_encoding(tmp_path, chat_tokenizers, kind, prompt_name):
    tokenizer = chat_tokenizers[kind]
    prompt = SAMPLE_PROMPTS[prompt_name]
    records = [{"prompt": prompt, "response": answer, "label": {"helpfulness": 3}}
               for answer in SAMPLE_ANSWERS.values()]
    dataset = RegressionDataset(write_jsonl(tmp_path / "labels.jsonl", records), tokenizer, 256, ATTRIBUTES)
    for item, answer in zip(dataset, SAMPLE_ANSWERS.values()):
        assert item["tokens"].tolist() == sft_reference(tokenizer, prompt, answer)[0]
        assert item["labels"].tolist() == [3.0, 0.0, 0.0]
    # Without the end marker (append_eos=false) the sequence stops after the reply's text.
    no_eos = RegressionDataset(tmp_path / "labels.jsonl", tokenizer, 256, ATTRIBUTES, append_eos=False)
    assert no_eos[0]["tokens"].tolist() == dataset[0]["tokens"].tolist()[:-1]


def test_chat_template_false_and_raw_text_keep_the_plain_layout(tmp_path, chat_tokenizers):
    tokenizer = chat_tokenizers["llama3"]
    bos, eos, encode = tokenizer.bos_id, tokenizer.eos_id, tokenizer.encode
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "12+7=", "chosen": "19", "rejected": "18"}])
    plain = ComparisonDataset(pairs, tokenizer, 64, use_template=False)
    assert plain[0]["chosen"].tolist() == [bos] + encode("12+7=") + encode("19") + [eos]
    labels = write_jsonl(tmp_path / "labels.jsonl", [{"text": "12+7=19", "label": "helpfulness:1"},
                                                    {"prompt": "12+7=", "response": "19", "label": "helpfulness:1"}])
    for use_template in (True, False):  # raw text is raw text, whatever the setting
        dataset = RegressionDataset(labels, tokenizer, 64, ATTRIBUTES, use_template=use_template)
        assert dataset[0]["tokens"].tolist() == [bos] + encode("12+7=19") + [eos]
    templated = RegressionDataset(labels, tokenizer, 64, ATTRIBUTES)[1]["tokens"].tolist()
    assert templated == sft_reference(tokenizer, "12+7=", "19")[0] != plain[0]["chosen"].tolist()


# ---------------------------------------------------------------- the demo task's files


def test_demo_preference_and_attribute_files_load_and_round_trip(tmp_path):
    preferences = preference_records(40, seed=3)
    attributes = attribute_records(40, seed=3)
    texts = [record[key] for record in preferences for key in ("prompt", "chosen", "rejected")]
    train_char_tokenizer(texts + [record["text"] for record in attributes], tmp_path / "tokenizer")
    tokenizer = Tokenizer(tmp_path / "tokenizer")

    pairs = ComparisonDataset(write_jsonl(tmp_path / "preferences.jsonl", preferences), tokenizer, 16)
    assert len(pairs) == len(preferences) and pairs.stats.dropped_too_long == 0
    for item, record in zip(pairs, preferences):
        for key in ("chosen", "rejected"):
            tokens = item[key].tolist()
            assert tokens[0] == tokenizer.bos_id and tokens[-1] == tokenizer.eos_id
            assert tokenizer.decode(tokens) == record["prompt"] + record[key]
    batch = collate_comparisons([pairs[index] for index in range(4)], tokenizer.pad_id)
    assert (batch["tokens"][torch.arange(8), batch["lengths"] - 1] == tokenizer.eos_id).all()

    labelled = RegressionDataset(write_jsonl(tmp_path / "attributes.jsonl", attributes), tokenizer, 16, ["correctness"])
    assert len(labelled) == len(attributes)
    for item, record in zip(labelled, attributes):
        assert tokenizer.decode(item["tokens"].tolist()) == record["text"]
        assert item["labels"].tolist() == [float(record["label"]["correctness"])]
        assert item["label_mask"].tolist() == [1.0]


def test_a_server_request_with_a_lone_surrogate_is_a_row_error_naming_the_field(tmp_path, chat_tokenizers):
    """A JSON request may escape a lone surrogate; the row is refused (a ValueError the server answers for
    that row) naming the field, instead of the tokenizer's TypeError."""
    from aligner.data.reward import RewardTokenLayout, request_sample_tokens

    layout = RewardTokenLayout(chat_tokenizers["smollm2"])
    payload = json.dumps({"prompt": [{"role": "user", "content": "hi \ud800"}], "response": "x"}).encode()
    assert b"\\ud800" in payload
    with pytest.raises(DataError, match=r"^field 'prompt\[0\]\.content' holds text that cannot be encoded as UTF-8"):
        request_sample_tokens(payload, layout)
