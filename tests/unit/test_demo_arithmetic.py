"""The demo task: answers, the demonstrator's systematic error, splits, rewards, records, tokenizer."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

from aligner.demo import arithmetic as task
from aligner.demo.tokenizer import CHAT_TEMPLATE, train_char_tokenizer

from ..conftest import REPO_ROOT

# --- answers and the forgotten carry ------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, answer",
    [(12, 7, "19"), (0, 0, "0"), (18, 5, "23"), (95, 7, "102"), (99, 99, "198"), (50, 50, "100")],
)
def test_correct_answer(a, b, answer):
    assert task.correct_answer(a, b) == answer


@pytest.mark.parametrize(
    "a, b, carry",
    [(12, 7, False), (18, 5, True), (5, 5, True), (50, 50, False), (45, 54, False), (99, 1, True)],
)
def test_has_carry(a, b, carry):
    assert task.has_carry(a, b) is carry


def test_carry_share_is_45_percent():
    carries = sum(task.has_carry(a, b) for a in range(100) for b in range(100))
    assert carries == 4500


@pytest.mark.parametrize(
    "a, b, wrong",
    [(18, 5, "13"), (95, 7, "92"), (99, 99, "188"), (5, 5, "0"), (27, 38, "55"), (91, 19, "100")],
)
def test_wrong_answer_forgot_carry(a, b, wrong):
    assert task.wrong_answer_forgot_carry(a, b) == wrong


def test_forgot_carry_is_always_ten_less_and_wrong():
    for a in range(100):
        for b in range(100):
            if task.has_carry(a, b):
                wrong = task.wrong_answer_forgot_carry(a, b)
                assert int(wrong) == a + b - 10
                assert task.score_response(task.format_prompt(a, b), wrong) == 0.0


def test_forgot_carry_requires_a_carry():
    with pytest.raises(ValueError, match="no carry"):
        task.wrong_answer_forgot_carry(12, 7)


@pytest.mark.parametrize("a, b", [(100, 1), (-1, 3), (1.5, 2), (True, 3)])
def test_operands_out_of_range_are_rejected(a, b):
    with pytest.raises(ValueError, match="operand"):
        task.correct_answer(a, b)


# --- prompts and scoring ------------------------------------------------------------------------


def test_parse_prompt_round_trips_every_problem():
    for a in range(100):
        for b in range(100):
            assert task.parse_prompt(task.format_prompt(a, b)) == (a, b)
    assert task.parse_prompt(" 12+7=\n") == (12, 7)


@pytest.mark.parametrize("prompt", ["12+7", "12 + 7 =", "123+4=", "12-7=", "", "a+b=", "12+7=19", "+12+7="])
def test_parse_prompt_rejects_malformed(prompt):
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        task.parse_prompt(prompt)


def test_score_response():
    assert task.score_response("18+5=", "23") == 1.0
    assert task.score_response("18+5=", " 23\n") == 1.0
    assert task.score_response("18+5=", "13") == 0.0
    assert task.score_response("18+5=", "023") == 0.0
    assert task.score_response("18+5=", "23.") == 0.0
    assert task.score_response("18+5=", "") == 0.0
    assert task.score_response("95+7=", "102") == 1.0


def test_accuracy_and_accuracy_by_carry():
    prompts = ["18+5=", "27+38=", "12+7=", "40+40="]  # two carry, two no-carry
    responses = ["23", "55", "19", "81"]
    assert task.accuracy(prompts, responses) == 0.5
    split = task.accuracy_by_carry(prompts, responses)
    assert split == {"all": 0.5, "carry": 0.5, "no_carry": 0.5, "num_carry": 2, "num_no_carry": 2}
    only_no_carry = task.accuracy_by_carry(["12+7="], ["19"])
    assert only_no_carry["no_carry"] == 1.0 and math.isnan(only_no_carry["carry"])
    with pytest.raises(ValueError, match="pair up"):
        task.accuracy(prompts, responses[:3])
    with pytest.raises(ValueError, match="zero responses"):
        task.accuracy([], [])


@pytest.mark.parametrize(
    "response, grade",
    [("23", 4), ("22", 3), ("25", 3), ("023", 3), ("13", 2), ("30", 2), ("43", 1), ("73", 1), ("74", 0),
     ("", 0), ("x", 0), ("-3", 0)],
)
def test_correctness_grade(response, grade):
    assert task.correctness_grade("18+5=", response) == grade


# --- split ----------------------------------------------------------------------------------------


def test_split_is_disjoint_complete_and_stratified():
    train, heldout = set(task.problems("train")), set(task.problems("heldout"))
    assert len(train) == 8000 and len(heldout) == 2000
    assert not train & heldout
    assert len(train | heldout) == 10000
    assert sum(task.has_carry(*p) for p in heldout) == 900  # 45 % of 2000
    with pytest.raises(ValueError, match="unknown split"):
        task.problems("test")


def test_generators_use_their_split():
    train, heldout = set(task.problems("train")), set(task.problems("heldout"))
    problems_of = lambda prompts: {task.parse_prompt(p) for p in prompts}  # noqa: E731
    assert problems_of(r["input"] for r in task.sft_records(3000, 1)) <= train
    assert problems_of(r["prompt"] for r in task.preference_records(3000, 1)) <= train
    assert problems_of(r["text"].split("=")[0] + "=" for r in task.attribute_records(3000, 1)) <= train
    assert problems_of(r["prompt"] for r in task.rl_prompts(3000, 1)) <= train
    assert problems_of(r["prompt"] for r in task.heldout_prompts(None, 1)) == heldout
    assert problems_of(r["input"] for r in task.sft_records(500, 1, split="heldout")) <= heldout
    assert problems_of(r["prompt"] for r in task.preference_records(500, 1, split="heldout")) <= heldout


def test_heldout_prompts_are_distinct_and_correct():
    records = task.heldout_prompts(500, seed=3)
    assert len({r["prompt"] for r in records}) == 500
    assert all(task.score_response(r["prompt"], r["answer"]) == 1.0 for r in records)
    with pytest.raises(ValueError, match="only 2000"):
        task.heldout_prompts(2001, seed=0)


def test_draw_covers_the_split_before_repeating():
    prompts = [r["prompt"] for r in task.rl_prompts(8000, seed=0)]
    assert len(set(prompts)) == 8000


# --- determinism ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "generate",
    [
        lambda seed: task.sft_records(300, seed),
        lambda seed: task.heldout_prompts(300, seed),
        lambda seed: task.preference_records(300, seed),
        lambda seed: task.attribute_records(300, seed),
        lambda seed: task.rl_prompts(300, seed),
    ],
)
def test_generators_are_deterministic_by_seed(generate):
    random.seed(123)  # the global RNG must not matter
    first = generate(7)
    random.seed(456)
    assert generate(7) == first
    assert generate(8) != first


def test_generators_draw_different_problems_for_one_seed():
    sft = [r["input"] for r in task.sft_records(100, 0)]
    rl = [r["prompt"] for r in task.rl_prompts(100, 0)]
    assert sft != rl


# --- the demonstrator -----------------------------------------------------------------------------


def test_demonstrations_forget_carries_at_the_given_rate_and_only_there():
    records = task.sft_records(20000, seed=0, p_forget_carry=0.7)
    carry, no_carry = [], []
    for record in records:
        a, b = task.parse_prompt(record["input"])
        (carry if task.has_carry(a, b) else no_carry).append((a, b, record["output"]))
    assert abs(len(carry) / len(records) - 0.45) < 0.02  # the natural share
    wrong = [output != task.correct_answer(a, b) for a, b, output in carry]
    assert abs(sum(wrong) / len(carry) - 0.7) < 0.02  # ~9000 samples: 3 sigma is ~0.015
    # every wrong demonstration is exactly the forgot-carry answer
    allowed = {(a, b): (task.correct_answer(a, b), task.wrong_answer_forgot_carry(a, b)) for a, b, _ in carry}
    assert all(output in allowed[a, b] for a, b, output in carry)
    assert all(output == task.correct_answer(a, b) for a, b, output in no_carry)


@pytest.mark.parametrize("p, expected_wrong", [(0.0, 0.0), (1.0, 1.0)])
def test_demonstrator_extremes(p, expected_wrong):
    records = task.sft_records(2000, seed=0, p_forget_carry=p)
    carry_records = [r for r in records if task.has_carry(*task.parse_prompt(r["input"]))]
    accuracy = task.accuracy_by_carry([r["input"] for r in records], [r["output"] for r in records])
    assert accuracy["no_carry"] == 1.0
    assert accuracy["carry"] == 1.0 - expected_wrong
    assert len(carry_records) == accuracy["num_carry"]


def test_invalid_p_forget_carry():
    with pytest.raises(ValueError, match="p_forget_carry"):
        task.sft_records(10, 0, p_forget_carry=1.5)


# --- preferences and attributes -------------------------------------------------------------------


def test_preference_chosen_right_rejected_plausibly_wrong():
    for record in task.preference_records(5000, seed=0):
        a, b = task.parse_prompt(record["prompt"])
        assert task.score_response(record["prompt"], record["chosen"]) == 1.0
        assert task.score_response(record["prompt"], record["rejected"]) == 0.0
        if task.has_carry(a, b):
            assert record["rejected"] == task.wrong_answer_forgot_carry(a, b)
        else:
            assert int(record["rejected"]) - (a + b) in (-1, 1, -10, 10)
            assert int(record["rejected"]) >= 0


def test_attribute_labels_match_the_responses():
    records = task.attribute_records(5000, seed=0)
    grades = []
    for record in records:
        prompt, response = record["text"].split("=", 1)
        prompt += "="
        grade = record["label"]["correctness"]
        assert set(record["label"]) == {"correctness"}
        assert grade == task.correctness_grade(prompt, response)
        assert (grade == task.MAX_CORRECTNESS) == (task.score_response(prompt, response) == 1.0)
        grades.append(grade)
    assert set(grades) == {0, 1, 2, 3, 4}
    assert 0.35 < grades.count(4) / len(grades) < 0.45


# --- tokenizer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out_dir = tmp_path_factory.mktemp("tokenizer")
    texts = [r["input"] + r["output"] for r in task.sft_records(2000, seed=0)]
    train_char_tokenizer(texts, out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def test_tokenizer_special_tokens_and_vocab(tokenizer):
    assert len(tokenizer) < 40
    special = ("pad", "bos", "eos", "unk")
    assert [getattr(tokenizer, f"{name}_token_id") for name in special] == [0, 1, 2, 3]
    assert [getattr(tokenizer, f"{name}_token") for name in special] == ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = tokenizer.get_vocab()
    for character in "0123456789+=\n ":
        assert character in vocab


def test_tokenizer_round_trips_one_token_per_character(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        response = rng.choice([task.correct_answer(a, b), str(rng.randint(0, 198)), ""])
        text = task.format_prompt(a, b) + response
        ids = tokenizer.encode(text)
        assert len(ids) == len(text)  # every character its own token, no specials added
        assert tokenizer.encode(text, add_special_tokens=True) == ids
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        framed = [tokenizer.bos_token_id] + ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
        assert tokenizer.decode(framed, skip_special_tokens=True) == text
    for _ in range(200):  # any string over the vocabulary, whitespace included, round-trips exactly
        text = "".join(rng.choice("0123456789+=\n ") for _ in range(rng.randint(1, 20)))
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("12a")[-1] == tokenizer.unk_token_id


def test_tokenizer_chat_template(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    user = [{"role": "user", "content": "12+7="}]
    assert tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == "<s>12+7="
    dialogue = [{"role": "system", "content": "1"}, *user, {"role": "assistant", "content": "19"}]
    assert tokenizer.apply_chat_template(dialogue, tokenize=False) == "<s>1\n12+7=19</s>"
    rendered_ids = tokenizer.apply_chat_template(user + dialogue[2:], tokenize=True, return_dict=False)
    assert list(rendered_ids) == [tokenizer.bos_token_id] + tokenizer.encode("12+7=19") + [tokenizer.eos_token_id]


def test_every_demo_record_encodes_to_the_plain_layout_under_the_template(tokenizer, tmp_path):
    """The template renders bos, so every record of the demo's files has the tokens of the layout without
    a template: [bos] + prompt (+ answer + [eos]); the demo's runs are unchanged by chat templates."""
    from aligner.data.conversation import ChatEncoder
    from aligner.data.preference import PreferenceDataset
    from aligner.data.reward import ComparisonDataset, RegressionDataset, RewardTokenLayout, request_sample_tokens
    from aligner.data.sft import SFTDataset
    from aligner.data.steerlm import AttributeConditioning, SteerLMConfig
    from aligner.tokenizer import Tokenizer

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    demo = Tokenizer(tmp_path / "tokenizer")
    assert demo.has_chat_template
    bos, eos, encode = demo.bos_id, demo.eos_id, demo.encode

    def write(name, records):
        (tmp_path / name).write_text("".join(json.dumps(record) + "\n" for record in records))
        return tmp_path / name

    for use_template in (True, False):
        sft = task.sft_records(50, seed=1)
        dataset = SFTDataset(write("sft.jsonl", sft), demo, 32, use_template=use_template)
        for item, record in zip(dataset, sft):
            prompt = [bos] + encode(record["input"])
            assert item["tokens"].tolist() == prompt + encode(record["output"]) + [eos]
            assert item["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(record["output"]) + 1)

        annotated = [{**record, "attributes": {"correctness": index % 5}} for index, record in enumerate(sft)]
        steerlm = SteerLMConfig(attributes=["correctness"], format="values")
        conditioned = SFTDataset(write("annotated.jsonl", annotated), demo, 32, use_template=use_template,
                                 prepare_record=AttributeConditioning(steerlm, demo))
        for item, record in zip(conditioned, annotated):
            expected = [bos] + encode(f"{record['attributes']['correctness']}\n{record['input']}{record['output']}")
            assert item["tokens"].tolist() == expected + [eos]

        pairs = task.preference_records(50, seed=1)
        preference = PreferenceDataset.from_jsonl(write("pairs.jsonl", pairs), demo, 32, use_template=use_template)
        ranking = ComparisonDataset(tmp_path / "pairs.jsonl", demo, 32, use_template=use_template)
        for item, comparison, record in zip(preference, ranking, pairs):
            assert item["prompt"].tolist() == [bos] + encode(record["prompt"])
            for side in ("chosen", "rejected"):
                assert item[side].tolist() == encode(record[side]) + [eos]
                assert comparison[side].tolist() == [bos] + encode(record["prompt"] + record[side]) + [eos]

        labelled = task.attribute_records(50, seed=1)
        regression = RegressionDataset(write("labels.jsonl", labelled), demo, 32, ["correctness"],
                                       use_template=use_template)
        layout = RewardTokenLayout(demo, use_template=use_template)
        for item, record in zip(regression, labelled):
            assert item["tokens"].tolist() == [bos] + encode(record["text"]) + [eos]
        for record in sft:  # what SteerLM annotation sends to the attribute model
            request = json.dumps({"prompt": record["input"], "response": record["output"]}).encode()
            assert request_sample_tokens(request, layout) == [bos] + encode(record["input"] + record["output"]) + [eos]

        encoder = ChatEncoder(demo, use_template=use_template)
        for record in task.rl_prompts(50, seed=1) + task.heldout_prompts(50):
            assert encoder.prompt_tokens(record["prompt"]) == [bos] + encode(record["prompt"])


# --- scripts --------------------------------------------------------------------------------------


def test_scripts_write_data_and_tokenizer(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    scripts = REPO_ROOT / "examples/nlp/data/arithmetic"
    data_dir = tmp_path / "data"
    made = subprocess.run(
        [sys.executable, scripts / "make_data.py", "--out-dir", data_dir, "--num-sft", "2000",
         "--num-preference", "500", "--num-attributes", "500", "--num-rl-prompts", "500"],
        env=env, capture_output=True, text=True, check=True,
    )
    names = ["sft_train", "sft_validation", "heldout_prompts", "preference_train",
             "preference_validation", "attributes_train", "attributes_validation", "rl_prompts", "sft_correct_train"]
    lines = made.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [f"{name}.jsonl" for name in names]
    assert lines[0].startswith("sft_train.jsonl: 2000 records")
    with open(data_dir / "sft_train.jsonl") as handle:
        assert [json.loads(line) for line in handle] == task.sft_records(2000, 0)
    assert "sft_correct_train.jsonl: 5000 records, carry problems" in made.stdout
    assert made.stdout.strip().endswith("wrong 0.0% (on carry problems 0.0%)")

    trained = subprocess.run(
        [sys.executable, scripts / "train_tokenizer.py", "--data-dir", data_dir, "--out-dir", tmp_path / "tok"],
        env=env, capture_output=True, text=True, check=True,
    )
    assert "vocab size 18" in trained.stdout
    assert (tmp_path / "tok" / "tokenizer.json").exists()
