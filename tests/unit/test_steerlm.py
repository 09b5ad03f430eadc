"""SteerLM: attribute rendering and parsing, conditioned SFT records, annotation helpers (no server)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from aligner.data.jsonl import DataError
from aligner.data.steerlm import (
    AttributeConditioning,
    SteerLMConfig,
    check_values,
    condition_messages,
    condition_prompt,
    conditioning_from_meta,
    parse_attributes,
    parse_requested_values,
    render_attributes,
    split_conditioned_prompt,
)

from ..conftest import REPO_ROOT

NAMED = SteerLMConfig(attributes=["helpfulness", "correctness"], format="named")
VALUES = SteerLMConfig(attributes=["helpfulness", "correctness"], format="values")
DEMO = SteerLMConfig(attributes=["correctness"], format="values")


def _load_annotate():
    spec = importlib.util.spec_from_file_location("annotate", REPO_ROOT / "examples/nlp/data/steerlm/annotate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    """The demo's character tokenizer (digits, '+', '=', space, newline)."""
    from aligner.demo import arithmetic
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.tokenizer import Tokenizer

    directory = tmp_path_factory.mktemp("steerlm_tokenizer")
    train_char_tokenizer([r["input"] + r["output"] for r in arithmetic.sft_records(200, seed=0)], directory)
    return Tokenizer(directory)


# ----------------------------------------------------------------------------- rendering


def test_rendered_lines_are_the_documented_layout():
    values = {"correctness": 3, "helpfulness": 4}  # any key order: the config's order renders
    assert render_attributes(values, NAMED) == "helpfulness:4,correctness:3"
    assert render_attributes(values, VALUES) == "4 3"
    assert condition_prompt("12+7=", {"correctness": 4}, DEMO) == "4\n12+7="
    assert render_attributes({"helpfulness": 4.0, "correctness": 0}, VALUES) == "4 0"  # integral floats are ints


@pytest.mark.parametrize("cfg", [NAMED, VALUES], ids=["named", "values"])
def test_render_parse_round_trip(cfg):
    for helpfulness in (0, 1, 4, 9, 10, 123):
        for correctness in (0, 3, 42):
            values = {"helpfulness": helpfulness, "correctness": correctness}
            line = render_attributes(values, cfg)
            assert parse_attributes(line, cfg) == values
            prompt = "what is 12+7?\nanswer briefly"  # a newline inside the prompt stays in the prompt
            assert split_conditioned_prompt(condition_prompt(prompt, values, cfg), cfg) == (values, prompt)


def test_condition_messages_puts_the_line_into_the_system_message():
    user = [{"role": "user", "content": "12+7="}]
    assert condition_messages(user, {"correctness": 4}, DEMO) == [{"role": "system", "content": "4"}, *user]
    with_system = [{"role": "system", "content": "Be exact."}, *user]
    assert condition_messages(with_system, {"correctness": 1}, DEMO)[0] == {"role": "system", "content": "1\nBe exact."}


@pytest.mark.parametrize("values, message", [
    ({"helpfulness": 4}, "missing 'correctness'"),
    ({"helpfulness": 4, "correctness": 3, "verbosity": 1}, "unknown 'verbosity'"),
    ({"helpfulness": 4, "correctness": 2.5}, "non-negative integer"),
    ({"helpfulness": -1, "correctness": 2}, "non-negative integer"),
    ({"helpfulness": True, "correctness": 2}, "non-negative integer"),
    ({"helpfulness": "4", "correctness": 2}, "non-negative integer"),
])
def test_bad_values_are_errors(values, message):
    with pytest.raises(ValueError, match=message):
        render_attributes(values, NAMED)


@pytest.mark.parametrize("cfg, line, message", [
    (NAMED, "helpfulness:4", "missing 'correctness'"),
    (NAMED, "helpfulness=4,correctness:3", "not 'name:value"),
    (NAMED, "helpfulness:4,helpfulness:3", "twice"),
    (NAMED, "helpfulness:x,correctness:3", "not a non-negative integer"),
    (VALUES, "4", "has 1 values, expected 2"),
    (VALUES, "4 -3", "not a non-negative integer"),
])
def test_bad_lines_are_errors(cfg, line, message):
    with pytest.raises(ValueError, match=message):
        parse_attributes(line, cfg)


def test_config_validation_and_checkpoint_meta():
    for bad, message in ((SteerLMConfig(["a"], format="json"), "format"), (SteerLMConfig(["a:b"]), "without"),
                         (SteerLMConfig(["a", "a"]), "twice")):
        with pytest.raises(ValueError, match=message):
            bad.validate()
    assert conditioning_from_meta({"model": {}}) is None
    assert conditioning_from_meta({"steerlm": VALUES.to_dict()}) == VALUES


def test_requested_values_from_the_command_line():
    assert parse_requested_values("correctness=4, helpfulness=0") == {"correctness": 4, "helpfulness": 0}
    for bad in ("correctness", "correctness=high", "correctness=-1", "c=1,c=2", ""):
        with pytest.raises(ValueError):
            parse_requested_values(bad)
    with pytest.raises(ValueError, match="missing 'correctness'"):
        check_values(parse_requested_values("helpfulness=3"), NAMED)


# ----------------------------------------------------------------------------- conditioned SFT records


def test_conditioned_records_both_layouts_and_label_strings():
    conditioning = AttributeConditioning(NAMED)
    record = {"input": "12+7=", "output": "19", "attributes": {"correctness": 4, "helpfulness": 2}}
    assert conditioning(record, "a.jsonl", 1) == {"input": "helpfulness:2,correctness:4\n12+7=", "output": "19"}
    # The regression data's label string works too.
    as_string = {**record, "attributes": "correctness:4,helpfulness:2"}
    assert conditioning(as_string, "a.jsonl", 2) == conditioning(record, "a.jsonl", 1)
    chat = {"conversations": [{"from": "User", "value": "hi"}, {"from": "Assistant", "value": "hello"}],
            "attributes": {"correctness": 1, "helpfulness": 3}}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    line = {"role": "system", "content": "helpfulness:3,correctness:1"}
    # Both conversational layouts become {"messages"} with the attribute line as (or opening) the system message.
    assert conditioning(chat, "a.jsonl", 3) == {"messages": [line, *turns]}
    with_system = {"role": "system", "content": "helpfulness:3,correctness:1\nBe nice."}
    assert conditioning({**chat, "system": "Be nice."}, "a.jsonl", 4) == {"messages": [with_system, *turns]}
    messages = {"messages": [{"role": "system", "content": "Be nice."}, *turns], "attributes": chat["attributes"]}
    assert conditioning(messages, "a.jsonl", 5) == {"messages": [with_system, *turns]}
    assert conditioning({**messages, "messages": turns}, "a.jsonl", 6) == {"messages": [line, *turns]}


@pytest.mark.parametrize("record, message", [
    ({"input": "1+1=", "output": "2"}, r"b.jsonl:7: record has no 'attributes'.*annotate.py"),
    ({"input": "1+1=", "output": "2", "attributes": {"correctness": 4}}, r"b.jsonl:7: .*missing 'helpfulness'"),
    ({"input": "1+1=", "output": "2", "attributes": {"correctness": 4, "helpfulness": 1.5}},
     r"b.jsonl:7: attribute 'helpfulness' has value 1.5"),
    ({"input": "1+1=", "output": "2", "attributes": {"correctness": 4, "helpfulness": 1, "tone": 2}},
     r"b.jsonl:7: unknown attribute 'tone'"),
])
def test_bad_annotated_records_name_file_and_line(record, message):
    with pytest.raises(DataError, match=message):
        AttributeConditioning(NAMED)(record, "b.jsonl", 7)


def test_demo_tokenizer_cannot_spell_names_but_can_spell_values(demo_tokenizer, tmp_path):
    from aligner.data.sft import SFTDataset

    record = {"input": "18+5=", "output": "23", "attributes": {"correctness": 4}}
    with pytest.raises(DataError, match=r"c.jsonl:1: the tokenizer cannot spell the attribute line 'correctness:4'.*"
                                        r"format=values"):
        AttributeConditioning(SteerLMConfig(["correctness"], "named"), demo_tokenizer)(record, "c.jsonl", 1)

    path = tmp_path / "annotated.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps({**record, "attributes": {"correctness": 2}}) + "\n")
    dataset = SFTDataset(path, demo_tokenizer, 32, prepare_record=AttributeConditioning(DEMO, demo_tokenizer))
    tok = demo_tokenizer
    for index, value in enumerate("42"):
        prompt = [tok.bos_id] + tok.encode(f"{value}\n18+5=")
        expected = prompt + tok.encode("23") + [tok.eos_id]
        assert dataset[index]["tokens"].tolist() == expected
        assert dataset[index]["loss_mask"].tolist() == [0] * len(prompt) + [1] * 3  # the response and eos only
    # The prompt tokens equal what generation renders for the same request.
    assert dataset[0]["tokens"].tolist()[1:8] == tok.encode(condition_prompt("18+5=", {"correctness": 4}, DEMO))


# ----------------------------------------------------------------------------- annotation helpers


def test_scales_and_rounding():
    annotate = _load_annotate()
    assert annotate.parse_scales([], ["a", "b"]) == {"a": (0, 4), "b": (0, 4)}
    assert annotate.parse_scales(["0:9", "b=1:5"], ["a", "b"]) == {"a": (0, 9), "b": (1, 5)}
    for bad in ("4", "4:0", "x:4", "c=0:4"):
        with pytest.raises(annotate.AnnotationError):
            annotate.parse_scales([bad], ["a", "b"])
    scale = (0, 4)
    cases = {3.49: 3, 3.5: 4, 2.5: 3, -0.3: 0, -7.0: 0, 4.4: 4, 9.0: 4, 0.5: 1, 1.2: 1}
    assert {score: annotate.to_scale(score, scale) for score in cases} == cases
    with pytest.raises(annotate.AnnotationError, match="non-finite"):
        annotate.to_scale(float("nan"), scale)


def test_resume_bookkeeping(tmp_path):
    annotate = _load_annotate()
    records = [(line, {"input": f"{line}+1=", "output": str(line + 1)}) for line in range(1, 6)]
    output = tmp_path / "out.jsonl"
    assert annotate.count_done(output, records) == 0
    done = [json.dumps({**record, "attributes": {"correctness": 4}}) for _, record in records[:2]]
    output.write_text("\n".join(done) + "\n" + '{"input": "3+1=", "outp')  # interrupted mid-line
    assert annotate.count_done(output, records) == 2
    assert output.read_text() == "\n".join(done) + "\n"  # the partial line is gone
    other = [(line, {**record, "output": "0"}) for line, record in records]
    with pytest.raises(annotate.AnnotationError, match=r"out.jsonl:1 is not the annotation of input line 1"):
        annotate.count_done(output, other)
    with pytest.raises(annotate.AnnotationError, match="only 1 records"):
        annotate.count_done(output, records[:1])


def test_the_sample_scored_for_each_record_layout():
    annotate = _load_annotate()
    assert annotate.record_sample({"input": "12+7=", "output": "19"}, "d.jsonl", 1) == ("12+7=", "19")
    user, reply = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    later = [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]
    # A conversation is scored at its last assistant turn, with everything before it as the prompt.
    conversation = {"system": "Be nice.", "conversations": [user, reply, *later, {"role": "user", "content": "?"}]}
    assert annotate.record_sample(conversation, "d.jsonl", 2) == (
        [{"role": "system", "content": "Be nice."}, user, reply, later[0]], "bye")
    assert annotate.record_sample({"messages": [user, reply]}, "d.jsonl", 3) == ([user], "hello")
    with pytest.raises(DataError, match="d.jsonl:4: 'messages': the last assistant turn does not follow"):
        annotate.record_sample({"messages": [user, reply, reply]}, "d.jsonl", 4)
    with pytest.raises(DataError, match=r"d.jsonl:4: 'messages' opens with an assistant turn \(messages\[0\]\)"):
        annotate.record_sample({"messages": [reply]}, "d.jsonl", 4)
    with pytest.raises(DataError, match="d.jsonl:5: 'conversations' has no assistant turn"):
        annotate.record_sample({"conversations": [user]}, "d.jsonl", 5)
    with pytest.raises(DataError, match="d.jsonl:6: record has none of"):
        annotate.record_sample({"text": "x"}, "d.jsonl", 6)


def test_steering_a_checkpoint_checks_its_conditioning(tmp_path):
    from aligner.checkpointing import FORMAT, META_FILE
    from aligner.data.steerlm import steering_for_checkpoint

    plain, steered = tmp_path / "plain", tmp_path / "steered"
    for directory, extra in ((plain, {}), (steered, {"steerlm": DEMO.to_dict()})):
        directory.mkdir()
        (directory / META_FILE).write_text(json.dumps({"format": FORMAT, "model": {}, **extra}))
    assert steering_for_checkpoint(plain, None) is None  # nothing asked for: any checkpoint
    assert steering_for_checkpoint(steered, {"correctness": 4}) == DEMO
    with pytest.raises(ValueError, match="was not trained with attribute conditioning"):
        steering_for_checkpoint(plain, {"correctness": 4})
    with pytest.raises(ValueError, match=r"steered: .*unknown 'helpfulness'"):
        steering_for_checkpoint(steered, {"correctness": 4, "helpfulness": 1})
