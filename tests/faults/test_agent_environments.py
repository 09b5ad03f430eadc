"""Environments run in the sandbox: a user's class in a few lines, the built-in game and tool environment, and
failures of environment code told apart from the model's mistakes."""
from __future__ import annotations

import textwrap

import pytest

from aligner.agents.builtin import BUILTIN, calculate
from aligner.agents.environment import EnvironmentFailure, SandboxedEnvironment, ToolEnvironment, sandboxed_tools
from aligner.runtime.errors import ConfigError
from aligner.runtime.sandbox import SandboxLimits, SandboxPool

pytestmark = pytest.mark.faults

USER_ENVIRONMENTS = textwrap.dedent('''
    import time

    class Echo:
        """A user's environment: repeats the reply twice, then ends with reward 1."""
        def __init__(self, suffix="!"):
            self.suffix, self.turns = suffix, 0

        def reset(self, record):
            return {"messages": [{"role": "user", "content": record["prompt"]}]}

        async def step(self, action):  # async methods work as well
            self.turns += 1
            done = self.turns == 2
            return {"messages": [] if done else [{"role": "user", "content": action + self.suffix}],
                    "reward": 1.0 if done else None, "done": done, "info": {"turns": self.turns}}

    class Raises:
        def reset(self, record):
            raise KeyError("answer")

    class Hangs:
        def reset(self, record):
            time.sleep(60)

    class Nonsense:
        def reset(self, record):
            return {"messages": [{"role": "user"}]}

        def step(self, action):
            return {"messages": [], "reward": float("nan"), "done": True}

    def undocumented(x: int) -> int:
        return x
''')


@pytest.fixture()
def pool(tmp_path, monkeypatch):
    (tmp_path / "user_envs.py").write_text(USER_ENVIRONMENTS)
    monkeypatch.chdir(tmp_path)
    pool = SandboxPool(workers=2, limits=SandboxLimits(timeout_s=3.0))
    yield pool
    pool.close()


def test_a_users_environment_runs_in_a_worker(pool):
    environment = SandboxedEnvironment(pool, "user_envs:Echo", {"suffix": "?"})
    start = environment.reset({"prompt": "hello"})
    assert start.messages == [{"role": "user", "content": "hello"}] and start.tools is None
    first = environment.step("hi")
    assert (first.messages, first.reward, first.done, first.info) == ([{"role": "user", "content": "hi?"}], None,
                                                                      False, {"turns": 1})
    second = environment.step("bye")
    assert (second.reward, second.done) == (1.0, True)
    environment.close()
    environment.close()  # idempotent


@pytest.mark.parametrize("target, kind, words", [
    ("user_envs:Raises", "error", "KeyError"),
    ("user_envs:Hangs", "timeout", "within 3 s"),
    ("user_envs:Nonsense", "error", '"messages" must be a list'),
    ("user_envs:Missing", "error", "AttributeError"),
])
def test_failures_of_environment_code_are_environment_failures(pool, target, kind, words):
    with pytest.raises(EnvironmentFailure) as failure:
        environment = SandboxedEnvironment(pool, target)
        try:
            environment.reset({"prompt": "x"})
        finally:
            environment.close()
    assert failure.value.kind == kind and words in str(failure.value) and "\n" not in str(failure.value)
    assert pool.call(BUILTIN["calculator"], "1+1").value == "2"  # the pool serves on


def test_a_bad_reward_is_an_environment_failure(pool):
    environment = SandboxedEnvironment(pool, "user_envs:Nonsense")
    with pytest.raises(EnvironmentFailure, match="reward must be a finite number"):
        environment.step("x")
    environment.close()


def test_the_guessing_game_gives_feedback_until_found(pool):
    game = SandboxedEnvironment(pool, BUILTIN["guess_the_number"], {"low": 1, "high": 100, "max_guesses": 7})
    assert "from 1 to 100" in game.reset({"secret": 42}).messages[0]["content"]
    low, high, turns = 1, 100, 0
    while True:  # binary search finds it within 7 guesses
        guess = (low + high) // 2
        step = game.step(f"{guess}")
        turns += 1
        if step.done:
            break
        assert step.messages[0]["content"] in ("Higher.", "Lower.")
        low, high = (guess + 1, high) if step.messages[0]["content"] == "Higher." else (low, guess - 1)
    assert (step.reward, step.info["guesses"], guess) == (1.0, turns, 42)
    game.close()


def test_the_calculator_evaluates_arithmetic_only():
    assert calculate("(12 + 79) * 3") == "273" and calculate("7 / 2") == "3.5" and calculate("-2 ** 3") == "-8"
    for bad in ("__import__('os')", "2 ** 100000", "x + 1"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_the_tool_environment_runs_calls_in_the_sandbox_and_ends_on_an_answer(pool):
    tools = sandboxed_tools(pool, [BUILTIN["calculator"]])
    assert list(tools) == ["calculate"] and tools["calculate"].parameters["required"] == ["expression"]
    environment = ToolEnvironment(pool, tools, call_format="hermes", max_parallel_calls=2,
                                  reward=lambda record, answer: float(record["answer"] in answer))
    start = environment.reset({"prompt": "What is 12+79?", "answer": "91"})
    assert start.tools[0]["function"]["name"] == "calculate"
    step = environment.step('<tool_call>{"name": "calculate", "arguments": {"expression": "12+79"}}</tool_call>'
                            '<tool_call>{"name": "calculate", "arguments": {"expression": "1/0"}}</tool_call>'
                            '<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert [m["role"] for m in step.messages] == ["tool"] * 3
    assert step.messages[0]["content"] == "91"
    assert step.messages[1]["content"].startswith("error: ZeroDivisionError: division by zero (builtin.py:")
    assert step.messages[2]["content"] == "error: only 2 tool call(s) per turn; search was not run"
    assert not step.done and step.info["tool_calls"]["ok"] == 2 and step.info["tool_calls"]["too_many_calls"] == 1
    final = environment.step("12+79 = 91.")
    assert (final.done, final.reward) == (True, 1.0)


@pytest.mark.parametrize("policy", ["end", "fixed_advantage"])
def test_on_bad_call_end_ends_the_episode(pool, policy):
    """Both end it, marked, reward 0 (fixed_advantage: the RL actor then gives its tokens the fixed advantage)."""
    tools = sandboxed_tools(pool, [BUILTIN["calculator"]])
    environment = ToolEnvironment(pool, tools, call_format="hermes", on_bad_call=policy)
    environment.reset({"prompt": "?"})
    step = environment.step("<tool_call>not json</tool_call>")
    assert (step.done, step.reward, step.info["ended_by"]) == (True, 0.0, "bad tool call")


def test_a_tool_that_cannot_be_described_is_refused_in_one_line(pool):
    with pytest.raises(ConfigError, match="tool user_envs:undocumented: DocstringParsingException: .*no docstring"):
        sandboxed_tools(pool, ["user_envs:undocumented"])
