"""SFT data layer: JSONL validation, tokenization and masks, packing, collation, blending, sampling."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from aligner.config import ConfigError
from aligner.data.blending import BlendedDataset, IndexedSubset, split_indices
from aligner.data.conversation import ChatEncoder
from aligner.data.jsonl import DataError, read_jsonl, require_str
from aligner.data.sampler import DistributedBatchSampler
from aligner.data.sft import PackedSFTDataset, SFTDataset, collate_sft
from aligner.tokenizer import Tokenizer

from ..conftest import CHAT_KINDS, SAMPLE_ANSWERS, SAMPLE_PROMPTS

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = "hello world how are you fine thanks be brief System User Assistant : a b c d e f g".split()
VOCAB = {token: index for index, token in enumerate(SPECIALS + WORDS)}
PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END = (VOCAB[t] for t in SPECIALS if t != "<unk>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def ids(text: str) -> list[int]:
    return [VOCAB[word] for word in text.split()]


def make_tokenizer(directory: Path, chat_template: str | None = None, bos: bool = True, pad: bool = True) -> Tokenizer:
    raw = RawTokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="</s>",
        unk_token="<unk>",
        bos_token="<s>" if bos else None,
        pad_token="<pad>" if pad else None,
        additional_special_tokens=SPECIALS[4:],
    )
    if chat_template:
        hf.chat_template = chat_template
    hf.save_pretrained(str(directory))
    return Tokenizer(directory)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture
def plain_tokenizer(tmp_path) -> Tokenizer:
    return make_tokenizer(tmp_path / "plain_tokenizer")


@pytest.fixture
def chat_tokenizer(tmp_path) -> Tokenizer:
    return make_tokenizer(tmp_path / "chat_tokenizer", chat_template=CHAT_TEMPLATE)


# ---------------------------------------------------------------- jsonl


def test_read_jsonl_skips_blank_lines_and_numbers_from_one(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"a": 1}, "", "   ", {"a": 2}])
    assert list(read_jsonl(path)) == [(1, {"a": 1}), (4, {"a": 2})]


@pytest.mark.parametrize(
    "bad_line, expected",
    [('{"input": "x",', "invalid JSON"), ("[1, 2]", "found a JSON list"), ('"text"', "found a JSON str")],
)
def test_read_jsonl_errors_name_file_and_line(tmp_path, bad_line, expected):
    path = write_jsonl(tmp_path / "data.jsonl", [{"a": 1}, {"a": 2}, bad_line])
    with pytest.raises(DataError) as error:
        list(read_jsonl(path))
    assert str(error.value).startswith(f"{path}:3: ")
    assert expected in str(error.value) and "expected" in str(error.value)


def test_read_jsonl_refuses_text_utf8_cannot_encode_naming_line_and_field(tmp_path):
    """A lone surrogate is valid JSON ("\\ud800") but no tokenizer takes it: refused where it is read."""
    lone = json.dumps({"messages": [{"role": "user", "content": "hi \ud800"}, {"role": "assistant", "content": "x"}]})
    assert "\\ud800" in lone
    path = write_jsonl(tmp_path / "data.jsonl", [{"a": "\U0001F600 \u00e9"}, lone])  # a valid pair, then a lone one
    with pytest.raises(DataError, match=rf"^{path}:2: field 'messages\[0\]\.content' holds text that cannot be "
                                        r"encoded as UTF-8 \(a lone surrogate such as \\ud800, at character 4\)"):
        list(read_jsonl(path))
    assert list(read_jsonl(write_jsonl(tmp_path / "ok.jsonl", [{"a": "\U0001F600"}]))) == [(1, {"a": "\U0001F600"})]


def test_read_jsonl_names_the_line_of_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(b'{"a": %d}\n' % index for index in range(5)) + b'{"a": "\xff"}\n{"a": 6}\n')
    with pytest.raises(DataError, match=rf"^{path}:6: not valid UTF-8 \(invalid start byte at byte 8 of the line\)"):
        list(read_jsonl(path))


def test_read_jsonl_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"missing\.jsonl: cannot open data file"):
        list(read_jsonl(tmp_path / "missing.jsonl"))


def test_field_helpers_report_key_type_and_emptiness():
    record = {"text": 3, "blank": "  "}
    with pytest.raises(DataError, match=r"^f\.jsonl:7: key 'text' is a int; expected a string"):
        require_str(record, "text", "f.jsonl", 7)
    with pytest.raises(DataError, match=r"^f\.jsonl:7: key 'blank' is empty"):
        require_str(record, "blank", "f.jsonl", 7)
    assert require_str(record, "blank", "f.jsonl", 7, allow_empty=True) == "  "
    with pytest.raises(DataError, match=r"^f\.jsonl:7: missing key 'absent'"):
        require_str(record, "absent", "f.jsonl", 7)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_round_trip(tmp_path, plain_tokenizer):
    assert (plain_tokenizer.eos_id, plain_tokenizer.bos_id, plain_tokenizer.pad_id) == (EOS, BOS, PAD)
    assert plain_tokenizer.vocab_size == len(VOCAB)
    assert not plain_tokenizer.has_chat_template
    assert plain_tokenizer.encode("hello world") == ids("hello world")  # no bos/eos added
    assert plain_tokenizer.decode([BOS] + ids("hello world") + [EOS]) == "hello world"
    plain_tokenizer.save(tmp_path / "saved")
    assert Tokenizer(tmp_path / "saved").encode("how are you") == ids("how are you")


def test_tokenizer_pad_falls_back_to_eos_and_bos_may_be_absent(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "t", bos=False, pad=False)
    assert tokenizer.pad_id == EOS and tokenizer.bos_id is None


def test_tokenizer_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer directory .*nope does not exist"):
        Tokenizer(tmp_path / "nope")


def test_generation_prompt_is_a_prefix_of_the_training_example(chat_tokenizer, plain_tokenizer):
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine thanks"}]
    for tokenizer in (chat_tokenizer, plain_tokenizer):
        prompt = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True)
        tokens, loss_mask = tokenizer.encode_chat(chat)
        assert tokens[: len(prompt)] == prompt
        assert not any(loss_mask[: len(prompt)]) and all(loss_mask[len(prompt) :])


# ---------------------------------------------------------------- SFT examples


def test_input_output_record(tmp_path, plain_tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": "how are you", "output": "fine thanks"}])
    item = SFTDataset(path, plain_tokenizer, max_seq_length=64)[0]
    assert item["tokens"].tolist() == [BOS] + ids("how are you fine thanks") + [EOS]
    assert item["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert item["tokens"].dtype == item["loss_mask"].dtype == torch.long


def test_conversation_with_plain_layout(tmp_path, plain_tokenizer):
    record = {
        "system": "be brief",
        "mask": "User",
        "conversations": [
            {"from": "User", "value": "hello"},
            {"from": "Assistant", "value": "hello world"},
            {"role": "human", "content": "how are you"},
            {"role": "GPT", "content": "fine"},
        ],
    }
    item = SFTDataset(write_jsonl(tmp_path / "data.jsonl", [record]), plain_tokenizer, 64)[0]
    # <s>System: be brief\nUser: hello\nAssistant: hello world</s>User: how are you\nAssistant: fine</s>
    expected = [
        ([BOS] + ids("System : be brief User : hello Assistant :"), 0),
        (ids("hello world") + [EOS], 1),
        (ids("User : how are you Assistant :"), 0),
        (ids("fine") + [EOS], 1),
    ]
    assert item["tokens"].tolist() == [token for part, _ in expected for token in part]
    assert item["loss_mask"].tolist() == [flag for part, flag in expected for _ in part]


def test_conversation_with_chat_template_masks_assistant_turns_and_end_of_turn(tmp_path, chat_tokenizer):
    record = {
        "system": "be brief",
        "conversations": [
            {"from": "user", "value": "hello"},
            {"from": "assistant", "value": "hello world"},
            {"from": "user", "value": "how are you"},
            {"from": "assistant", "value": "fine thanks"},
        ],
    }
    item = SFTDataset(write_jsonl(tmp_path / "data.jsonl", [record]), chat_tokenizer, 64)[0]
    expected = [
        ([SYSTEM] + ids("be brief") + [END, USER] + ids("hello") + [END, ASSISTANT], 0),
        (ids("hello world") + [END], 1),
        ([USER] + ids("how are you") + [END, ASSISTANT], 0),
        (ids("fine thanks") + [END], 1),
    ]
    assert item["tokens"].tolist() == [token for part, _ in expected for token in part]
    assert item["loss_mask"].tolist() == [flag for part, flag in expected for _ in part]


def test_chat_template_that_rewrites_earlier_turns_is_rejected(tmp_path):
    # Renders only the last message: prefixes of the chat are not prefixes of its text.
    tokenizer = make_tokenizer(tmp_path / "t", chat_template="{{ messages[-1]['content'] }}")
    record = {"conversations": [{"from": "user", "value": "hello"}, {"from": "assistant", "value": "world"}]}
    with pytest.raises(DataError, match=r"data\.jsonl:1: .*does not render a conversation"):
        SFTDataset(write_jsonl(tmp_path / "data.jsonl", [record]), tokenizer, 64)


USER_TURN = {"from": "user", "value": "hello"}
ASSISTANT_TURN = {"from": "assistant", "value": "world"}


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"input": "hello"}, "missing key 'output'"),
        ({"input": "hello", "output": ""}, "key 'output' is empty"),
        ({"input": 5, "output": "x"}, "key 'input' is a int; expected a string"),
        ({"text": "hello"}, "none of 'input'/'output', 'prompt'/'completion', 'conversations' or 'messages'"),
        ({"conversations": "hello"}, "conversations is a str; expected a non-empty list"),
        ({"conversations": []}, "conversations is an empty list"),
        ({"conversations": [USER_TURN, "world"]}, r"conversations\[1\] is a str; expected a JSON object"),
        ({"conversations": [USER_TURN, {"from": "assistant"}]}, r"conversations\[1\] needs string 'role' \(or 'from'\) "
                                                                r"and 'content' \(or 'value'\); keys present: 'from'"),
        ({"conversations": [USER_TURN, {"from": "robot", "value": "x"}]}, r"unknown role 'robot'"),
        ({"conversations": [USER_TURN, USER_TURN]}, "'conversations' has no assistant turn"),
        ({"system": 3, "conversations": [USER_TURN, ASSISTANT_TURN]}, "key 'system' is a int"),
        ({"messages": [USER_TURN, {"role": "toolbox", "content": "x"}]}, r"messages\[1\] has unknown role 'toolbox'"),
        # a tool turn is a role (its answer is rendered, not trained on), but nothing after the last reply is
        ({"messages": [USER_TURN, ASSISTANT_TURN, {"role": "tool", "content": "x"}]},
         "'messages' ends with a tool turn"),
        ({"messages": [USER_TURN]}, "'messages' has no assistant turn"),
        ({"messages": {"role": "user", "content": "x"}}, "messages is a dict; expected a non-empty list"),
        # As an empty 'output' is: an empty turn has nothing to say (only a system turn may be empty).
        ({"messages": [USER_TURN, {"role": "assistant", "content": " "}]},
         r"messages\[1\] is an assistant turn with empty content"),
        ({"conversations": [{"from": "user", "value": ""}, ASSISTANT_TURN]},
         r"conversations\[0\] is a user turn with empty content"),
        # Nothing after the last reply is trained on: a record cut short, refused like one with no reply.
        ({"messages": [USER_TURN, ASSISTANT_TURN, USER_TURN]}, "'messages' ends with a user turn; an SFT "
                                                               "conversation ends with the assistant's reply"),
        ({"messages": [ASSISTANT_TURN, USER_TURN, ASSISTANT_TURN]},
         r"'messages' opens with an assistant turn \(messages\[0\]\); a conversation opens with a user turn"),
        ({"system": "be brief", "conversations": [ASSISTANT_TURN]}, "'conversations' opens with an assistant turn"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, ASSISTANT_TURN]},
         r"messages\[0\]\.content\[0\] is a 'image' part; expected text parts"),
        ({"messages": [{"role": "user", "content": "hello \ud800"}, ASSISTANT_TURN]},
         r"field 'messages\[0\]\.content' holds text that cannot be encoded as UTF-8"),
    ],
)
def test_malformed_records_name_file_and_line(tmp_path, plain_tokenizer, record, expected):
    good = {"input": "hello", "output": "world"}
    path = write_jsonl(tmp_path / "data.jsonl", [good, "", record])
    with pytest.raises(DataError, match=rf"^{tmp_path}/data\.jsonl:3: .*{expected}"):
        SFTDataset(path, plain_tokenizer, 64)


@pytest.mark.parametrize("tokenizer_kind", ["plain", "chat"])
def test_an_assistant_first_conversation_is_refused_for_the_right_reason(tmp_path, tokenizer_kind):
    """With a chat template the rendering of the (empty) turns before it failed as 'an empty conversation'."""
    tokenizer = make_tokenizer(tmp_path / "t", chat_template=CHAT_TEMPLATE if tokenizer_kind == "chat" else None)
    path = write_jsonl(tmp_path / "data.jsonl", [{"messages": [ASSISTANT_TURN, USER_TURN, ASSISTANT_TURN]}])
    with pytest.raises(DataError, match=rf"^{path}:1: 'messages' opens with an assistant turn") as error:
        SFTDataset(path, tokenizer, 64)
    assert "empty" not in str(error.value)


def test_text_content_parts_give_the_tokens_of_the_joined_text(tmp_path, chat_tokenizer):
    parts = {"role": "user", "content": [{"type": "text", "text": "how are"}, {"type": "text", "text": " you"}]}
    plain = {"role": "user", "content": "how are you"}
    answer_parts = {"role": "assistant", "content": [{"type": "text", "text": "fine"}]}
    answer = {"role": "assistant", "content": "fine"}
    with_parts = SFTDataset(write_jsonl(tmp_path / "a.jsonl", [{"messages": [parts, answer_parts]}]), chat_tokenizer,
                            64)
    as_text = SFTDataset(write_jsonl(tmp_path / "b.jsonl", [{"messages": [plain, answer]}]), chat_tokenizer, 64)
    assert with_parts[0]["tokens"].tolist() == as_text[0]["tokens"].tolist()
    assert with_parts[0]["loss_mask"].tolist() == as_text[0]["loss_mask"].tolist()


def test_truncation_keeps_the_start_and_drops_examples_without_response(tmp_path, plain_tokenizer):
    records = [
        {"input": "hello", "output": "fine"},  # 4 tokens: fits
        {"input": "how are", "output": "a b c d"},  # 8 tokens: truncated to 6, keeps "a b"
        {"input": "a b c d e f", "output": "thanks"},  # the prompt fills 6 tokens: dropped
    ]
    dataset = SFTDataset(write_jsonl(tmp_path / "data.jsonl", records), plain_tokenizer, max_seq_length=6)
    assert (dataset.stats.records, dataset.stats.truncated, dataset.stats.dropped, dataset.stats.kept) == (3, 2, 1, 2)
    assert len(dataset) == 2
    assert dataset[1]["tokens"].tolist() == [BOS] + ids("how are a b c")
    assert dataset[1]["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1]
    # A data-set-level error names the file without a line (no line is at fault).
    path = write_jsonl(tmp_path / "long.jsonl", records[2:])
    with pytest.raises(DataError, match=rf"^{path}: no usable examples \(1 records, 1 dropped"):
        SFTDataset(path, plain_tokenizer, max_seq_length=6)


# ---------------------------------------------------------------- conversational records on real chat templates


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s."""
    spans, start = [], None
    for index, flag in enumerate(mask + [0]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            spans.append((start, index))
            start = None
    return spans


@pytest.mark.parametrize("kind", CHAT_KINDS)
def test_input_output_is_a_one_turn_conversation(tmp_path, chat_tokenizers, kind):
    tokenizer = chat_tokenizers[kind]
    prompt, answer = SAMPLE_PROMPTS["text"], SAMPLE_ANSWERS["text"]
    conversation = SAMPLE_PROMPTS["user"] + [{"role": "assistant", "content": answer}]
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": prompt, "output": answer}, {"messages": conversation}])
    dataset = SFTDataset(path, tokenizer, 256)
    tokens, mask = dataset[0]["tokens"].tolist(), dataset[0]["loss_mask"].tolist()
    if kind == "plain":  # NeMo-Aligner's layout: [bos] + input, output + [eos]
        assert tokens == [tokenizer.bos_id] + tokenizer.encode(prompt) + tokenizer.encode(answer) + [tokenizer.eos_id]
    else:
        assert tokens == dataset[1]["tokens"].tolist() and mask == dataset[1]["loss_mask"].tolist()
        rendered = tokenizer.render_chat([{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": answer}])
        assert tokens == tokenizer.hf.encode(rendered, add_special_tokens=False)
    (start, end), = _spans(mask)
    assert tokenizer.hf.decode(tokens[start:end]) == answer + tokenizer.hf.eos_token
    assert tokens[:start] == ChatEncoder(tokenizer).prompt_tokens(prompt)  # what generation is given


@pytest.mark.parametrize("kind", CHAT_KINDS)
@pytest.mark.parametrize("with_system", [True, False])
def test_multi_turn_conversations_and_messages_mask_every_assistant_turn(tmp_path, chat_tokenizers, kind, with_system):
    tokenizer = chat_tokenizers[kind]
    turns = [("user", "hello"), ("assistant", "hello, how are you?"), ("user", "Twelve plus seven?"),
             ("assistant", "nineteen: 12+7=19")]
    system = "You are a helpful assistant." if with_system else ""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": role, "content": content} for role, content in turns]
    nemo = {"system": system, "mask": "User",
            "conversations": [{"from": role.capitalize(), "value": content} for role, content in turns]}
    path = write_jsonl(tmp_path / "data.jsonl", [nemo, {"messages": messages}])
    dataset = SFTDataset(path, tokenizer, 256)
    tokens, mask = dataset[0]["tokens"].tolist(), dataset[0]["loss_mask"].tolist()
    assert tokens == dataset[1]["tokens"].tolist() and mask == dataset[1]["loss_mask"].tolist()
    if kind != "plain":
        assert tokens == tokenizer.hf.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    replies = [tokenizer.hf.decode(tokens[start:end]) for start, end in _spans(mask)]
    assert replies == [content + tokenizer.hf.eos_token for role, content in turns if role == "assistant"]


@pytest.mark.parametrize("kind", ("smollm2", "llama3"))
def test_chat_template_false_gives_the_plain_layout(tmp_path, chat_tokenizers, kind):
    tokenizer = chat_tokenizers[kind]
    records = [{"input": "hello", "output": "fine thanks"},
               {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine thanks"}]}]
    dataset = SFTDataset(write_jsonl(tmp_path / "data.jsonl", records), tokenizer, 64, use_template=False)
    bos, eos, encode = tokenizer.bos_id, tokenizer.eos_id, tokenizer.encode
    assert dataset[0]["tokens"].tolist() == [bos] + encode("hello") + encode("fine thanks") + [eos]
    assert dataset[1]["tokens"].tolist() == [bos] + encode("User: hello\n") + encode("Assistant: ") + encode(
        "fine thanks") + [eos]


# ---------------------------------------------------------------- packing and collation


def _tensor_examples(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """Examples whose tokens identify them: example i holds 100*i + position."""
    return [
        {"tokens": torch.arange(length) + 100 * index, "loss_mask": (torch.arange(length) % 2).long()}
        for index, length in enumerate(lengths)
    ]


def test_packing_keeps_examples_whole_and_within_the_pack_size():
    lengths = [7, 3, 5, 2, 8, 1, 4, 4, 6]
    examples = _tensor_examples(lengths)
    packed = PackedSFTDataset(examples, max_seq_length=10, seed=1)
    assert len(packed) == 4  # 40 tokens fill 4 packs exactly: 8+2, 7+3, 6+4, 5+4+1
    seen = []
    for pack in packed:
        assert len(pack["tokens"]) <= 10
        assert len(pack["tokens"]) == len(pack["loss_mask"]) == len(pack["segment_ids"])
        boundaries = torch.nonzero(torch.diff(pack["segment_ids"])).flatten() + 1
        segment_starts = [0] + boundaries.tolist()
        assert pack["segment_ids"].tolist() == sorted(pack["segment_ids"].tolist())  # 0,0,1,1,1,2,...
        for segment, (start, end) in enumerate(zip(segment_starts, segment_starts[1:] + [len(pack["tokens"])])):
            assert (pack["segment_ids"][start:end] == segment).all()
            index = int(pack["tokens"][start]) // 100
            assert torch.equal(pack["tokens"][start:end], examples[index]["tokens"])
            assert torch.equal(pack["loss_mask"][start:end], examples[index]["loss_mask"])
            seen.append(index)
    assert sorted(seen) == list(range(len(lengths)))
    assert PackedSFTDataset(examples, 10, seed=1).packs == packed.packs


def test_packing_rejects_examples_longer_than_a_pack():
    with pytest.raises(ValueError, match="longer than the pack size 4"):
        PackedSFTDataset(_tensor_examples([3, 5]), max_seq_length=4)


def test_collate_unpacked_shifts_and_pads():
    examples = [
        {"tokens": torch.tensor([1, 11, 12, 13, 2]), "loss_mask": torch.tensor([0, 0, 1, 1, 1])},
        {"tokens": torch.tensor([1, 21, 2]), "loss_mask": torch.tensor([0, 1, 1])},
    ]
    batch = collate_sft(examples, pad_id=0)
    assert batch["tokens"].tolist() == [[1, 11, 12, 13], [1, 21, 2, 0]]
    assert batch["labels"].tolist() == [[11, 12, 13, 2], [21, 2, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert batch["attention_mask"] is None
    padded = collate_sft(examples, pad_id=0, pad_to_multiple_of=8)
    assert padded["tokens"].shape == padded["labels"].shape == padded["loss_mask"].shape == (2, 8)
    assert padded["loss_mask"][:, 4:].sum() == 0


def test_loader_pads_rows_to_the_longest_on_cpu_and_to_a_multiple_of_8_on_gpu(monkeypatch):
    from aligner.data.loader import MicroBatchLoader
    from aligner.runtime import cpu_bridge, distributed

    examples = [{"tokens": torch.arange(1, n + 1), "loss_mask": torch.ones(n, dtype=torch.long)} for n in (5, 10, 7)]

    def first_batch(**pad):
        loader = MicroBatchLoader(examples, global_batch_size=3, micro_batch_size=3, data_parallel_rank=0,
                                  data_parallel_size=1, seed=0, shuffle=False, pad_id=0, **pad)
        return next(loader.iterate(0))[0]

    assert distributed.pad_multiple(None) == 1 and distributed.pad_multiple(4) == 4
    assert first_batch()["tokens"].shape == (3, 9)  # the longest row's 10 tokens, less the last (a label only)
    assert first_batch(pad_to_multiple_of=8)["tokens"].shape == (3, 16)
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)  # as at TP=2
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 1)
    assert distributed.pad_multiple(None) == 2 and first_batch()["tokens"].shape == (3, 10)
    monkeypatch.setattr(cpu_bridge, "needed", lambda: False)  # as on a GPU
    assert distributed.pad_multiple(None) == 8 and first_batch()["tokens"].shape == (3, 16)


def test_with_experts_split_over_ranks_every_rank_pads_to_the_longest_and_nothing_packs(monkeypatch, world_group):
    """EP > 1: megatron's allgather dispatcher gathers as many tokens from every rank, so each step's
    rows are padded to the longest of any data-parallel rank (a MAX over the group), packing is off and
    token budgets are refused. (Two real ranks: tests/distributed/test_sft_parity.py's MoE EP=2 run.)"""
    from megatron.core import parallel_state

    from aligner.data.loader import MicroBatchLoader
    from aligner.models.packing import PackingSection, packs_here
    from aligner.runtime import distributed

    examples = [{"tokens": torch.arange(1, n + 1), "loss_mask": torch.ones(n, dtype=torch.long)} for n in (5, 10, 7)]
    loader = MicroBatchLoader(examples, global_batch_size=3, micro_batch_size=3, data_parallel_rank=0,
                              data_parallel_size=1, seed=0, shuffle=False, pad_id=0)
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 1)
    assert distributed.longest_across_expert_ranks(9) == 9 and packs_here(PackingSection())
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda: world_group)
    assert distributed.longest_across_expert_ranks(9) == 9  # the MAX over this one-process group
    assert not packs_here(PackingSection())
    with pytest.raises(ConfigError, match="packing.micro_batch_tokens needs parallel.expert_model_parallel_size=1"):
        PackingSection(micro_batch_tokens=64).check_layout(1, 16, "x", expert_model_parallel_size=2)
    # Another rank's rows are 16 long: this rank's step is collated again to exactly that length.
    monkeypatch.setattr(distributed, "longest_across_expert_ranks", lambda length: max(length, 16))
    batch = next(loader.iterate(0))[0]
    assert batch["tokens"].shape == (3, 16) and batch["loss_mask"][:, 9:].sum() == 0
    assert batch["tokens"][1, :9].tolist() == list(range(1, 10))


def test_collate_packed_builds_segment_positions_and_block_causal_mask():
    pack = {
        "tokens": torch.tensor([1, 2, 3, 4, 5, 6]),
        "loss_mask": torch.tensor([0, 1, 1, 0, 1, 1]),
        "segment_ids": torch.tensor([0, 0, 0, 1, 1, 2]),
    }
    short = {
        "tokens": torch.tensor([7, 8, 9]),
        "loss_mask": torch.tensor([0, 1, 1]),
        "segment_ids": torch.tensor([0, 0, 0]),
    }
    batch = collate_sft([pack, short], pad_id=0)
    seq_len = 5
    assert batch["tokens"].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4, 5, 6], [8, 9, 0, 0, 0]]
    # The label crossing into the next segment (4 after 3) is masked by loss_mask, not attention.
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    mask = batch["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, 1, seq_len, seq_len)
    segments = [[0, 0, 0, 1, 1], [0, 0, 0, -1, -1]]  # -1 = padding
    for row in range(2):
        for query, key in itertools.product(range(seq_len), repeat=2):
            same, is_pad = segments[row][query] == segments[row][key], segments[row][query] < 0
            attends = key == query if is_pad else (key <= query and same)
            assert bool(mask[row, 0, query, key]) == (not attends), (row, query, key)


def test_sft_dataset_items_pack_and_collate(tmp_path, plain_tokenizer):
    records = [{"input": "hello", "output": "world"}, {"input": "how are you", "output": "fine thanks"}]
    dataset = SFTDataset(write_jsonl(tmp_path / "data.jsonl", records), plain_tokenizer, 16)
    packed = PackedSFTDataset(dataset, max_seq_length=16)
    assert len(packed) == 1
    batch = collate_sft([packed[0]], pad_id=plain_tokenizer.pad_id, pad_to_multiple_of=4)
    assert batch["tokens"].shape == (1, 12) and batch["attention_mask"].shape == (1, 1, 12, 12)
    assert int(batch["loss_mask"].sum()) == 2 + 3  # "world</s>" and "fine thanks</s>"


# ---------------------------------------------------------------- splits and blends


def test_split_indices_is_a_deterministic_partition():
    train, validation = (part.tolist() for part in split_indices(100, "95,5", seed=3))
    assert (len(train), len(validation)) == (95, 5)
    assert sorted(train + validation) == list(range(100))
    assert [part.tolist() for part in split_indices(100, [0.95, 0.05], seed=3)] == [train, validation]
    assert [part.tolist() for part in split_indices(100, "95,5", seed=4)] != [train, validation]
    assert split_indices(10, "1,0", seed=0)[1].tolist() == []
    assert [len(part) for part in split_indices(7, "2,1", seed=0)] == [5, 2]  # 4.67/2.33 rounded
    subset = IndexedSubset(list("abcdefghij"), [3, 1])
    assert (len(subset), subset[0], subset[1]) == (2, "d", "b")


@pytest.mark.parametrize("spec", ["a,b", "95", "90,5,5", "0,0", "-1,2", [], "95;5"])
def test_split_indices_rejects_malformed_specs(spec):
    with pytest.raises(ValueError, match="split"):
        split_indices(10, spec, seed=0)


def test_blended_dataset_counts_cycling_and_determinism():
    datasets = [[("a", i) for i in range(10)], [("b", i) for i in range(2)], [("c", i) for i in range(5)]]
    blend = BlendedDataset(datasets, weights=[5, 3, 2], num_samples=7, seed=0)
    # 7 * (0.5, 0.3, 0.2) = 3.5, 2.1, 1.4 -> 3, 2, 1 plus the spare sample to the largest remainder.
    assert blend.counts == [4, 2, 1] and len(blend) == 7
    items = [blend[index] for index in range(len(blend))]
    assert [sum(name == tag for name, _ in items) for tag in "abc"] == [4, 2, 1]
    assert len({item for item in items if item[0] == "a"}) == 4  # no repeats before a data set is used up
    cycled = BlendedDataset(datasets, weights=[0, 1, 0], num_samples=5, seed=0)
    assert sorted(cycled[index][1] for index in range(5)).count(0) in (2, 3)  # both items used, cycled
    assert {cycled[index][1] for index in range(5)} == {0, 1}
    again = BlendedDataset(datasets, weights=[5, 3, 2], num_samples=7, seed=0)
    assert [again[index] for index in range(7)] == items
    with pytest.raises(ValueError, match="one weight per data set"):
        BlendedDataset(datasets, [1, 1], 4, seed=0)


# ---------------------------------------------------------------- sampler


def _global_batches(sampler: DistributedBatchSampler, steps: int) -> list[list[int]]:
    micro_batches = list(itertools.islice(iter(sampler), steps * sampler.num_microbatches))
    per_step = sampler.num_microbatches
    return [sum(micro_batches[step * per_step : (step + 1) * per_step], []) for step in range(steps)]


def test_sampler_dp_ranks_partition_the_single_rank_global_batch():
    single = DistributedBatchSampler(
        50, global_batch_size=12, micro_batch_size=3, data_parallel_rank=0, data_parallel_size=1, seed=7
    )
    assert single.num_microbatches == 4 and single.steps_per_epoch == 4
    reference = _global_batches(single, steps=9)  # crosses two epoch boundaries
    ranks = [DistributedBatchSampler(50, 12, 2, rank, 3, seed=7) for rank in range(3)]
    assert ranks[0].num_microbatches == 2
    per_rank = [_global_batches(sampler, steps=9) for sampler in ranks]
    for step in range(9):
        assert sum((per_rank[rank][step] for rank in range(3)), []) == reference[step]
    first_micro_batch = next(iter(ranks[1]))
    assert first_micro_batch == reference[0][4:6]
    epoch0 = sum(reference[:4], [])
    assert len(set(epoch0)) == 48 and epoch0 == single.epoch_permutation(0)[:48]
    assert single.epoch_permutation(0) != single.epoch_permutation(1)


def test_sampler_without_shuffle_reads_in_order_and_stops_after_epochs():
    sampler = DistributedBatchSampler(10, 4, 2, data_parallel_rank=1, data_parallel_size=2, shuffle=False, epochs=2)
    assert list(sampler) == [[2, 3], [6, 7], [2, 3], [6, 7]]


def test_sampler_resumes_at_the_next_global_batch():
    full = _global_batches(DistributedBatchSampler(30, 8, 2, 1, 2, seed=5), steps=10)
    for done in (0, 1, 3, 5):  # 3 steps per epoch, so 3 and 5 resume in later epochs
        sampler = DistributedBatchSampler(30, 8, 2, 1, 2, seed=5, consumed_samples=done * 8)
        resumed = _global_batches(sampler, steps=10 - done)
        assert resumed == full[done:]


@pytest.mark.parametrize(
    "arguments, expected",
    [
        (dict(global_batch_size=10, micro_batch_size=2, data_parallel_size=3), "global_batch_size=10 .* 2 \\* 3 = 6"),
        (dict(global_batch_size=8, micro_batch_size=0, data_parallel_size=1), "must be positive"),
        (dict(global_batch_size=8, micro_batch_size=2, data_parallel_size=2, data_parallel_rank=2), "outside"),
        (dict(global_batch_size=8, micro_batch_size=2, data_parallel_size=1, consumed_samples=4), "consumed_samples=4"),
        (dict(global_batch_size=128, micro_batch_size=2, data_parallel_size=1), "fewer than one global batch"),
    ],
)
def test_sampler_rejects_inconsistent_sizes(arguments, expected):
    arguments = {"data_parallel_rank": 0, **arguments}
    with pytest.raises(ValueError, match=expected):
        DistributedBatchSampler(dataset_length=100, **arguments)
