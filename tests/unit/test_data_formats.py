"""Any data source: every reader takes JSONL, Parquet, Arrow files and `datasets` directories; TRL's columns;
`data.train=PATH` shorthands; data files checked before the model is built."""
from __future__ import annotations

import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aligner.algorithms.distillation import KDConfig
from aligner.algorithms.dpo import DPOConfig
from aligner.algorithms.kto import KTOConfig
from aligner.algorithms.reward_model import RewardModelConfig
from aligner.algorithms.rl_config import RLActorConfig
from aligner.algorithms.sft import SFTConfig, build_sft_trainer
from aligner.algorithms.spin import SPINConfig, load_demonstrations
from aligner.config import CONF_DIR, load_config
from aligner.data.jsonl import DataError
from aligner.data.preference import PreferenceDataset
from aligner.data.records import open_records, read_records
from aligner.data.reward import ComparisonDataset, RegressionDataset
from aligner.data.sft import SFTDataset, encode_record
from aligner.data.unpaired import UnpairedDataset
from aligner.generation.rollouts import PromptDataset
from aligner.training import setup
from aligner.training.run import run_training

from ..conftest import write_jsonl
from .test_sft_data import CHAT_TEMPLATE, make_tokenizer

FORMATS = ("jsonl", "parquet", "arrow_stream", "arrow_file", "datasets")


def write_records(directory, kind: str, records: list[dict], name: str = "data"):
    """The records as a data file (or save_to_disk directory) of `kind`; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        return write_jsonl(directory / f"{name}.jsonl", records)
    table = pa.Table.from_pylist(records)
    if kind == "parquet":
        pq.write_table(table, directory / f"{name}.parquet")
        return directory / f"{name}.parquet"
    if kind == "datasets":
        datasets.Dataset(table).save_to_disk(str(directory / name))
        return directory / name
    path = directory / f"{name}.arrow"
    with pa.OSFile(str(path), "wb") as sink:  # an IPC stream is what datasets writes; a file is Feather v2
        writer = (pa.ipc.new_stream if kind == "arrow_stream" else pa.ipc.new_file)(sink, table.schema)
        writer.write_table(table)
        writer.close()
    return path


@pytest.fixture
def chat_tokenizer(tmp_path):
    return make_tokenizer(tmp_path / "chat_tokenizer", chat_template=CHAT_TEMPLATE)


# ----------------------------------------------------------------------------- the reader
@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_gives_the_same_records_indexed_lazily(tmp_path, kind):
    records = [{"input": "hello", "output": "world", "score": 1.5},
               {"input": "how are you", "output": "fine", "score": None},  # a null column is left out, as in JSONL
               {"input": "a b", "output": "c", "score": 2.0}]
    expected = [{key: value for key, value in record.items() if value is not None} for record in records]
    path = write_records(tmp_path, kind, expected if kind == "jsonl" else records)  # Arrow: a column for all rows
    opened = open_records(path)
    assert len(opened) == 3
    assert [opened[index] for index in (2, 0, 1)] == [expected[2], expected[0], expected[1]]
    assert [record for _, record in opened] == [record for _, record in read_records(path)] == expected
    positions = [position for position, _ in read_records(path)]
    assert positions == [1, 2, 3]
    assert f"{path}:{positions[1]}: " == (f"{path}:2: " if kind == "jsonl" else f"{path}:row 2: ")


def test_jsonl_positions_are_its_lines_and_its_errors_stay_by_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"a": 1}])
    path.write_text(path.read_text() + "\n\n" + '{"a": 2}\n')
    opened = open_records(path)
    assert [opened.where(index) for index in range(len(opened))] == [1, 4] and opened[1] == {"a": 2}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": "\\ud800"}\n')
    with pytest.raises(DataError, match=rf"^{bad}:2: field 'a' holds text that cannot be encoded"):
        open_records(bad)


def test_other_suffixes_are_read_by_their_bytes_and_dataset_dicts_are_refused_naming_the_file(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=rf"^{csv}:1: invalid JSON"):  # not Parquet or Arrow: JSONL, line 1 named
        open_records(csv)
    text = tmp_path / "data.txt"
    text.write_text('{"a": 1}\n')
    assert list(open_records(text)) == [(1, {"a": 1})]
    records = [{"a": 1}, {"a": 2}]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "parquet.dat"))
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    stream = next((tmp_path / "saved").glob("*.arrow")).rename(tmp_path / "stream.bin")
    for unnamed in (tmp_path / "parquet.dat", stream):  # by their magic bytes
        assert [record for _, record in open_records(unnamed)] == records, unnamed
    with pytest.raises(DataError, match=rf"^{tmp_path / 'no.parquet'}: no such file"):
        open_records(tmp_path / "no.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a"}])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a datasets DatasetDict \(splits: train\); give one split's directory"):
        open_records(tmp_path / "dd")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=rf"^{broken}: cannot read it as parquet data"):
        open_records(broken)


# ----------------------------------------------------------------------------- every reader, every format
SFT_RECORDS = [{"input": "hello", "output": "world"}, {"input": "how are you", "output": "fine thanks"}]
PAIRS = [{"prompt": "hello", "chosen": "world", "rejected": "you"}, {"prompt": "a b", "chosen": "c", "rejected": "d"}]
UNPAIRED = [{"prompt": "hello", "completion": "world", "label": True},
            {"prompt": "a b", "completion": "d", "label": False}]
LABELLED = [{"text": "hello world", "label": {"helpfulness": 3}}, {"text": "a b", "label": {"helpfulness": 1}}]
PROMPTS = [{"prompt": "hello", "answer": "world", "level": 1}, {"prompt": "how are you", "answer": "fine", "level": 2}]


def _items(dataset) -> list:
    return [{key: value.tolist() for key, value in dataset[index].items()} for index in range(len(dataset))]


@pytest.mark.parametrize("kind", FORMATS[1:])
def test_every_reader_reads_every_format_as_it_reads_jsonl(tmp_path, kind, chat_tokenizer):
    def both(records, read):
        return [read(write_records(tmp_path / name, name, records)) for name in ("jsonl", kind)]

    jsonl, other = both(SFT_RECORDS, lambda path: SFTDataset(path, chat_tokenizer, 64))
    assert _items(other) == _items(jsonl) and len(jsonl) == 2
    jsonl, other = both(PAIRS, lambda path: PreferenceDataset.from_jsonl(path, chat_tokenizer, 64))
    assert _items(other) == _items(jsonl) and len(jsonl) == 2
    jsonl, other = both(UNPAIRED, lambda path: UnpairedDataset.from_jsonl(path, chat_tokenizer, 64))
    assert _items(other) == _items(jsonl) and [bool(item["desirable"]) for item in _items(other)] == [True, False]
    jsonl, other = both(PAIRS, lambda path: ComparisonDataset(path, chat_tokenizer, 64))
    assert _items(other) == _items(jsonl)
    jsonl, other = both(LABELLED, lambda path: RegressionDataset(path, chat_tokenizer, 64, ["helpfulness"]))
    assert _items(other) == _items(jsonl) and [item["labels"] for item in _items(other)] == [[3.0], [1.0]]
    jsonl, other = both(SFT_RECORDS, lambda path: load_demonstrations(str(path), chat_tokenizer, 64))
    assert other == jsonl and len(other) == 2
    jsonl, other = both(PROMPTS, lambda path: PromptDataset(path, chat_tokenizer, 64))
    assert other.tokens == jsonl.tokens and other.prompts == ["hello", "how are you"]
    # The record's other columns, for reward functions that read more than the prompt.
    others = [{key: value for key, value in record.items() if key != "prompt"} for record in PROMPTS]
    assert [other.columns(index) for index in range(2)] == [jsonl.columns(index) for index in range(2)] == others
    assert other.record(1) == f"{other.path}:row 2" and jsonl.record(1) == f"{jsonl.path}:2"


def test_a_bad_row_is_named_by_file_and_row(tmp_path, chat_tokenizer):
    path = write_records(tmp_path, "parquet", [{"input": "hello", "output": "world"}, {"input": "a", "output": ""}])
    with pytest.raises(DataError, match=rf"^{path}:row 2: key 'output' is empty"):
        SFTDataset(path, chat_tokenizer, 64)
    path = write_records(tmp_path, "parquet", [{"prompt": "a", "completion": "b", "label": True},
                                               {"prompt": "a", "completion": "c", "label": None}], "kto")
    with pytest.raises(DataError, match=rf"^{path}:row 2: missing key 'label'"):
        UnpairedDataset.from_jsonl(path, chat_tokenizer, 64)
    pair = {"prompt": "a", "chosen": "b", "rejected": "c", "chosen_reward": 1.0}
    path = write_records(tmp_path, "arrow_stream", [{**pair, "rejected_reward": 0.0},
                                                    {**pair, "rejected": "d", "rejected_reward": None}], "rpo")
    with pytest.raises(DataError, match=rf"^{path}:row 2: 'chosen_reward' without 'rejected_reward'"):
        PreferenceDataset.from_jsonl(path, chat_tokenizer, 64)


def test_sft_dataset_keeps_no_token_lists_and_tokenizes_when_indexed(tmp_path, chat_tokenizer):
    records = [{"input": "hello", "output": "world"}, {"input": "a b c d e f g a b c d e f g", "output": "e"},
               {"input": "how are you", "output": "fine"}]
    dataset = SFTDataset(write_records(tmp_path, "parquet", records), chat_tokenizer, 12)
    # The long record's response is cut off: dropped; only indices and lengths are kept (numpy).
    assert dataset.stats.records == 3 and dataset.stats.dropped == 1 and len(dataset) == 2
    assert dataset.indices.tolist() == [0, 2]
    expected = [encode_record(records[index], chat_tokenizer, "x", 1) for index in (0, 2)]
    assert [item["tokens"] for item in _items(dataset)] == [example.tokens for example in expected]
    assert dataset.lengths.tolist() == [len(example.tokens) for example in expected]
    assert not hasattr(dataset, "examples")


# ----------------------------------------------------------------------------- TRL's columns
def test_sft_prompt_completion_is_input_output_or_the_completion_of_a_conversation(tmp_path, chat_tokenizer):
    text = encode_record({"prompt": "hello", "completion": "world"}, chat_tokenizer, "x", 1)
    assert text == encode_record({"input": "hello", "output": "world"}, chat_tokenizer, "x", 1)
    # Conversational: the loss is on the completion only, not on the assistant turn inside the prompt.
    prompt = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
              {"role": "user", "content": "how are you"}]
    record = {"prompt": prompt, "completion": [{"role": "assistant", "content": "fine"}]}
    example = encode_record(record, chat_tokenizer, "x", 1)
    whole = encode_record({"messages": prompt + [{"role": "assistant", "content": "fine"}]}, chat_tokenizer, "x", 1)
    assert example.tokens == whole.tokens[:len(example.tokens)]
    assert sum(whole.loss_mask) > sum(example.loss_mask) > 0
    learned = [token for token, mask in zip(example.tokens, example.loss_mask) if mask]
    assert chat_tokenizer.decode(learned).split()[0] == "fine"
    # The same records from Parquet (a list of structs column).
    path = write_records(tmp_path, "parquet", [record, record])
    assert [item["loss_mask"].tolist() for item in SFTDataset(path, chat_tokenizer, 64)] == [example.loss_mask] * 2
    with pytest.raises(DataError, match=r"x:1: missing key 'completion'"):
        encode_record({"prompt": "hello"}, chat_tokenizer, "x", 1)


def test_trl_conversational_preference_and_unpaired_data_from_parquet(tmp_path, chat_tokenizer):
    user = [{"role": "user", "content": "hello"}]
    explicit = [{"prompt": user, "chosen": [{"role": "assistant", "content": "world"}],
                 "rejected": [{"role": "assistant", "content": "you"}]}] * 2
    implicit = [{"chosen": user + [{"role": "assistant", "content": "world"}],
                 "rejected": user + [{"role": "assistant", "content": "you"}]}] * 2
    strings = [{"prompt": "hello", "chosen": "world", "rejected": "you"}] * 2
    items = [_items(PreferenceDataset.from_jsonl(write_records(tmp_path, "parquet", records, name), chat_tokenizer, 64))
             for name, records in (("explicit", explicit), ("implicit", implicit), ("strings", strings))]
    assert items[0] == items[1] == items[2]  # a string prompt is one user turn
    unpaired = [{"prompt": user, "completion": [{"role": "assistant", "content": "world"}], "label": True},
                {"prompt": [{"role": "user", "content": "a b"}], "completion": [{"role": "assistant", "content": "c"}],
                 "label": False}]
    dataset = UnpairedDataset.from_jsonl(write_records(tmp_path, "parquet", unpaired, "kto"), chat_tokenizer, 64)
    assert (dataset.stats.desirable, dataset.stats.undesirable) == (1, 1)


# ----------------------------------------------------------------------------- data.train shorthands
SFT_YAML = CONF_DIR / "gpt_sft.yaml"


def test_a_path_or_a_list_of_paths_is_a_list_of_entries(tmp_path):
    paths = lambda entries: [(entry.path, entry.weight) for entry in entries]  # noqa: E731
    cfg = load_config(SFTConfig, SFT_YAML, ["data.train=a.parquet", "data.validation=[v.jsonl, w.arrow]"])
    assert paths(cfg.data.train) == [("a.parquet", 1.0)]
    assert paths(cfg.data.validation) == [("v.jsonl", 1.0), ("w.arrow", 1.0)]
    cfg = load_config(SFTConfig, SFT_YAML, ["data.train=[a.parquet, {path: b.jsonl, weight: 3}]"])
    assert paths(cfg.data.train) == [("a.parquet", 1.0), ("b.jsonl", 3.0)]
    config = tmp_path / "sft.yaml"
    entries = "  train:                   # several entries are blended by weight\n    - path: ???\n      weight: 1.0"
    config.write_text(SFT_YAML.read_text().replace(entries, "  train: data.parquet"))
    assert "\n  train: data.parquet\n" in config.read_text()
    assert paths(load_config(SFTConfig, config).data.train) == [("data.parquet", 1.0)]
    cfg = load_config(SPINConfig, CONF_DIR / "gpt_spin.yaml", ["model.init_from=x", "data.train=d.parquet"])
    assert [entry.path for entry in cfg.data.train] == ["d.parquet"]


# ----------------------------------------------------------------------------- checked before the model is built
def test_every_config_checks_its_data_files_and_columns(tmp_path):
    sft = write_records(tmp_path, "parquet", SFT_RECORDS, "sft")
    pairs = write_records(tmp_path, "arrow_stream", PAIRS, "pairs")
    prompts = write_records(tmp_path, "datasets", PROMPTS, "prompts")
    unpaired = write_jsonl(tmp_path / "kto.jsonl", UNPAIRED)
    labelled = write_jsonl(tmp_path / "labelled.jsonl", LABELLED)

    def check(schema, yaml_name, *overrides):
        load_config(schema, CONF_DIR / yaml_name, ["model.init_from=x", *overrides]).check_data_sources()

    for schema, yaml_name, good, bad, what in (
            (SFTConfig, "gpt_sft.yaml", sft, pairs, "SFT"), (DPOConfig, "gpt_dpo.yaml", pairs, sft, "preference"),
            (KTOConfig, "gpt_kto.yaml", unpaired, pairs, r"unpaired \(KTO\)"),
            (RewardModelConfig, "training_rm.yaml", pairs, sft, "reward-model comparison")):
        check(schema, yaml_name, f"data.train={good}")
        with pytest.raises(DataError, match=rf"^data.validation\[0\].path: {bad}: no .* columns for {what} data"):
            check(schema, yaml_name, f"data.train={good}", f"data.validation={bad}")
    check(SPINConfig, "gpt_spin.yaml", f"data.train={sft}")
    with pytest.raises(DataError, match=rf"^data.train\[1\].path: {pairs}: no .* columns for demonstration data"):
        check(SPINConfig, "gpt_spin.yaml", f"data.train=[{sft}, {pairs}]")
    check(RewardModelConfig, "training_rm.yaml", f"data.train={labelled}", "reward.type=regression",
          "reward.attributes=[helpfulness]")
    with pytest.raises(DataError, match=r"no 'text'/'label' or 'prompt'/'response'/'label' columns"):
        check(RewardModelConfig, "training_rm.yaml", f"data.train={pairs}", "reward.type=regression",
              "reward.attributes=[helpfulness]")
    with pytest.raises(DataError, match=rf"^data.train\[0\].path: {sft}: no .*'attributes' columns for SFT data"):
        check(SFTConfig, "gpt_sft.yaml", f"data.train={sft}", "data.steerlm.attributes=[correctness]")
    check(KDConfig, "gpt_knowledge_distillation.yaml", f"data.train=[{{path: {sft}, teacher_topk: t}}]")
    actor = ("gpt_ppo_actor.yaml", f"data.prompts={prompts}")
    check(RLActorConfig, *actor)
    with pytest.raises(DataError, match=rf"^data.validation_prompts: {tmp_path / 'v.jsonl'}: cannot open data file"):
        check(RLActorConfig, *actor, f"data.validation_prompts={tmp_path / 'v.jsonl'}")
    with pytest.raises(DataError, match=rf"^ptx.data: {pairs}: no .* columns for SFT data"):
        check(RLActorConfig, *actor, f"ptx.data={pairs}", "ptx.coef=0.1")
    with pytest.raises(DataError, match=rf"^data.prompts: {sft}: no 'prompt' columns for prompt data"):
        check(RLActorConfig, "gpt_reinforce_actor.yaml", f"data.prompts={sft}")


def test_a_missing_data_file_stops_the_sft_entry_point_before_the_model_is_built(tmp_path, monkeypatch,
                                                                                  arithmetic_tokenizer_dir):
    built = []
    monkeypatch.setattr(setup, "build_training_model", lambda **kwargs: built.append(kwargs))
    good = write_jsonl(tmp_path / "train.jsonl", SFT_RECORDS)
    monkeypatch.setattr(sys, "argv", ["train_gpt_sft.py", f"data.train=[{good}]",
                                      f"data.validation={tmp_path / 'val.parquet'}",
                                      f"tokenizer.path={arithmetic_tokenizer_dir}",
                                      f"logging.log_dir={tmp_path / 'logs'}"])
    with pytest.raises(DataError) as error:
        run_training(SFTConfig, "gpt_sft.yaml", build_sft_trainer)
    assert str(error.value) == (f"data.validation[0].path: {tmp_path / 'val.parquet'}: no such file; expected a JSONL "
                                "file (.jsonl), a Parquet file (.parquet), an Arrow file (.arrow) or a directory "
                                "written by datasets' Dataset.save_to_disk")
    assert built == []
