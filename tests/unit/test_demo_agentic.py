"""The demo's agentic stage: the long-addition task and its demonstrations, the character tokenizer's tool role (a
one-turn conversation renders as before; the renderer self-tests the template), SFT conversations with tool turns,
the evaluation with the calculator (episodes) and without, and the stage end to end on a tiny run (slow)."""
from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from aligner.agents.renderer import ChatRenderer
from aligner.data.sft import SFTDataset
from aligner.demo import long_addition
from aligner.demo.tokenizer import PRINTABLE_CHARACTERS, train_char_tokenizer
from aligner.demo.tool_eval import evaluate_long_addition
from aligner.generation.engine import GenerationEngine, Rollout
from aligner.tokenizer import Tokenizer

from ..conftest import REPO_ROOT, write_jsonl


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory) -> Tokenizer:
    """The agentic stage's tokenizer: the digits and '+=' of the task, and every printable character."""
    directory = tmp_path_factory.mktemp("tool_tokenizer")
    train_char_tokenizer(["0123456789+="], directory, PRINTABLE_CHARACTERS)
    return Tokenizer(directory)


def test_the_demonstrator_forgets_every_carry_and_writes_the_last_column_in_full():
    assert long_addition.carries(958, 167) == 3 and long_addition.carries(1234, 5678) == 2
    assert long_addition.carries(1234, 4321) == 0
    assert long_addition.wrong_answer_forgot_carries(958, 167) == "1015"  # 5, 1 (11 - 10), 10: not 1125
    assert long_addition.wrong_answer_forgot_carries(1234, 5678) == "6802"  # 2, 0 (11 - 10), 8, 6: not 6912
    assert long_addition.wrong_answer_forgot_carries(9999, 9999) == "18888"
    with pytest.raises(ValueError, match="no carry"):
        long_addition.wrong_answer_forgot_carries(1234, 4321)
    with pytest.raises(ValueError, match="100..9999"):
        long_addition.format_prompt(99, 100)


def test_demonstrations_call_the_calculator_with_p_call_and_otherwise_keep_the_habit():
    records = long_addition.sft_records(4000, seed=0, p_call=0.3, p_forget_carry=0.7)
    calls = [record["messages"] for record in records if len(record["messages"]) == 4]
    heads = [record["messages"] for record in records if len(record["messages"]) == 2]
    assert len(calls) + len(heads) == 4000 and abs(len(calls) / 4000 - 0.3) < 0.03
    for user, call, tool, answer in calls:
        a, b = long_addition.parse_prompt(user["content"])
        assert call == {"role": "assistant", "content": f'CALL calculate {{"expression": "{a}+{b}"}}'}
        assert tool == {"role": "tool", "content": str(a + b)} and answer["content"] == str(a + b)
    problems = [(long_addition.parse_prompt(user["content"]), answer["content"]) for user, answer in heads]
    forgot = [answer == long_addition.wrong_answer_forgot_carries(*problem)
              for problem, answer in problems if long_addition.carries(*problem)]
    assert abs(sum(forgot) / len(forgot) - 0.7) < 0.04
    assert all(long_addition.in_split(*long_addition.parse_prompt(r["messages"][0]["content"])) == "train"
               for r in records)
    heldout = long_addition.heldout_prompts(300)
    assert len({r["prompt"] for r in heldout}) == 300
    assert all(long_addition.in_split(*long_addition.parse_prompt(r["prompt"])) == "heldout" for r in heldout)
    assert long_addition.score_response("1234+5678=", " 6912 ") == 1.0
    assert long_addition.score_response([{"role": "user", "content": "1234+5678="}], "CALL calculate {}") == 0.0


def test_the_template_renders_a_tool_turn_and_a_one_turn_conversation_as_before(tool_tokenizer,
                                                                                arithmetic_tokenizer_dir):
    call = 'CALL calculate {"expression": "1234+5678"}'
    messages = [{"role": "user", "content": "1234+5678="}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "6912"}, {"role": "assistant", "content": "6912"}]
    assert tool_tokenizer.render_chat(messages, False) == f"<s>1234+5678={call}</s>6912\n6912</s>"
    # the layout the demo's other stages train on: [bos] + prompt + answer + [eos]
    arithmetic = Tokenizer(arithmetic_tokenizer_dir)
    tokens, mask = arithmetic.encode_chat([{"role": "user", "content": "12+79="},
                                           {"role": "assistant", "content": "91"}])
    assert tokens == [arithmetic.bos_id] + arithmetic.encode("12+79=91") + [arithmetic.eos_id]
    assert mask == [0] * 7 + [1] * 3
    # the renderer finds the tool role and passes its self-test (tool, system and user turns) on both vocabularies
    for tokenizer in (tool_tokenizer, arithmetic):
        assert ChatRenderer(tokenizer).roles == {"system", "user", "assistant", "tool"}


def test_sft_trains_on_the_assistant_turns_of_a_conversation_with_a_tool_turn(tmp_path, tool_tokenizer):
    record = long_addition.conversation(1234, 5678, random.Random(0), p_call=1.0, p_forget_carry=0.0)
    item = SFTDataset(write_jsonl(tmp_path / "sft.jsonl", [{"messages": record}]), tool_tokenizer, 72)[0]
    text = "".join("_" if not trained else tool_tokenizer.hf.decode([token])
                   for token, trained in zip(item["tokens"].tolist(), item["loss_mask"].tolist()))
    assert text == "_" * 11 + 'CALL calculate {"expression": "1234+5678"}</s>' + "_" * 5 + "6912</s>"


class ScriptedModel(GenerationEngine):
    """Greedy replies from a rule on the text so far: calls the calculator on a fresh problem unless the problem's
    first operand is odd (then answers with the forgotten carries); copies a tool answer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def reply(self, text: str) -> str:
        if text.endswith("\n"):  # the tool has answered
            return text.rsplit("</s>", 1)[1].strip()
        a, b = long_addition.parse_prompt(text.removeprefix("<s>"))
        if a % 2:
            return long_addition.wrong_answer_forgot_carries(a, b) if long_addition.carries(a, b) else str(a + b)
        return long_addition.tool_call(a, b)

    def generate(self, prompts, sampling):
        rows = [(self.tokenizer.encode(self.reply(self.tokenizer.hf.decode(prompt))) + [self.tokenizer.eos_id])
                [:sampling.max_new_tokens] for prompt in prompts]
        tokens = torch.zeros(len(rows), sampling.max_new_tokens, dtype=torch.long)
        for row, ids in enumerate(rows):
            tokens[row, :len(ids)] = torch.tensor(ids)
        return Rollout(prompts, tokens, torch.zeros(tokens.shape), torch.tensor([len(ids) for ids in rows]),
                       torch.tensor([ids[-1] == self.tokenizer.eos_id for ids in rows]))


def test_the_evaluation_runs_episodes_with_the_sandboxed_calculator_and_counts_calls(tmp_path, tool_tokenizer):
    prompts = write_jsonl(tmp_path / "heldout.jsonl", [{"prompt": "1234+5678="}, {"prompt": "1235+5678="},
                                                       {"prompt": "2468+1357="}, {"prompt": "999+101="}])
    model = ScriptedModel(tool_tokenizer)
    with_tools = evaluate_long_addition(model, tool_tokenizer, prompts, tools=True, sandbox_workers=2)
    # two calls answered by the calculator and copied; 1235+5678 and 999+101 (odd: no call) forget their carries
    assert with_tools["all"] == 0.5 and with_tools["tool_calls"] == 0.5 and with_tools["tool_calls_ok"] == 0.5
    assert with_tools["done"] == 1.0 and with_tools["turns"] == 1.5
    assert with_tools["examples"][:3] == ["1234+5678=6912", "1235+5678=6803", "2468+1357=3825"]
    one_turn = evaluate_long_addition(model, tool_tokenizer, prompts, tools=False)
    # a call left as the answer scores 0
    assert one_turn["all"] == 0.0 and one_turn["call_replies"] == 0.5
    assert "tool_calls" not in one_turn


@pytest.mark.slow
@pytest.mark.usefixtures("single_process")
def test_the_agentic_stage_runs_its_commands_and_fills_its_table(tmp_path, monkeypatch, capfd):
    """Two SFT steps, one GRPO step each way, 16 held-out problems: every command of the stage runs, the tool run
    ran episodes, and the table has its four rows."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples" / "demo"))
    sys.modules.pop("run_demo", None)
    import run_demo

    monkeypatch.setattr(run_demo, "AGENTIC_SFT_OVERRIDES", [*run_demo.AGENTIC_SFT_OVERRIDES, "trainer.max_steps=2"])
    monkeypatch.setattr(run_demo, "AGENTIC_RL_OVERRIDES", [
        *run_demo.AGENTIC_RL_OVERRIDES, "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "trainer.max_steps=1"])
    monkeypatch.setattr(run_demo, "AGENTIC_EVAL_LIMIT", 16)
    # what two steps of 64 and one of 2 prompts read (20,000 conversations cost each SFT start ~5 s of tokenizing)
    monkeypatch.setattr(run_demo, "AGENTIC_DATA_ARGS", ["--num-sft", "512", "--num-sft-validation", "16",
                                                        "--num-heldout", "16", "--num-rl-prompts", "64"])
    args = type("Args", (), {"precision": "auto", "seed": None})()
    demo = run_demo.Demo(tmp_path / "work", args)
    demo.agentic()
    names = [name for name, _ in demo.agentic_table]
    assert names == ["SFT, one turn", "SFT, with the calculator", "GRPO single-turn", "GRPO with the calculator"]
    for name, result in demo.agentic_table:
        assert result["num_carry"] + result["num_no_carry"] == 16
        assert ("tool_calls" in result) == ("calculator" in name)
    metrics = [json.loads(line) for line in (tmp_path / "work" / "agentic" / "grpo_tools" / "metrics.jsonl")
               .read_text().splitlines()]
    assert any("episodes/turns" in row for row in metrics)
    table = run_demo.format_agentic_table(demo.agentic_table)
    assert "GRPO with the calculator" in table and "tool calls/episode" in table
