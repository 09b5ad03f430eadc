"""Reward functions with the record (aligner/generation/rewards.py): a function named by its file or its module, the
record's other columns passed by keyword (only those its signature takes, all with **kwargs), a weighted list
of functions with each one's scores kept, batched calls, the probe call on the first prompt record before the
model is built, and the processes of a timed-out call stopped. The entry-point runs are in
tests/functional/test_reward_files.py; what every score must be is in tests/unit/test_rewards.py."""
from __future__ import annotations

import json
import sys
import textwrap
import time

import psutil
import pytest

from aligner.algorithms.rl_build import build_reward_source, build_rl_actor
from aligner.algorithms.rl_config import RLActorConfig
from aligner.config import CONF_DIR, load_config
from aligner.generation.rewards import RewardChecks, RewardError, RuleRewardSource
from aligner.runtime.errors import ConfigError

GROUP_YAML = CONF_DIR / "gpt_reinforce_actor.yaml"
HERE = "tests.unit.test_reward_functions"
SEEN: list = []  # what the functions of this module were called with


def legacy(prompt, response_text):
    """Today's two-argument function: called without columns."""
    SEEN.append(("legacy", prompt, response_text))
    return float(len(response_text))


def exact(prompt, response, answer):
    """Takes one column by name."""
    SEEN.append(("exact", prompt, response, answer))
    return float(response.strip() == answer)


def everything(prompt, response, **columns):
    SEEN.append(("everything", prompt, response, columns))
    return 0.25


def optional_hint(prompt, response, *, hint="none"):
    SEEN.append(("optional_hint", hint))
    return 0.0


def lengths(prompts, responses, answer):
    """Batched: lists in, a list out."""
    SEEN.append(("lengths", prompts, responses, answer))
    return [float(len(response)) for response in responses]


def one_number(prompts, responses):
    return 1.0


def trl_accuracy(completions, answer, **kwargs):
    """A TRL reward function: the batch by keyword (prompts among the other keywords)."""
    SEEN.append(("trl_accuracy", completions, answer, kwargs))
    return [float(completion.strip() == truth) for completion, truth in zip(completions, answer)]


@pytest.fixture(autouse=True)
def fresh_log():
    SEEN.clear()
    yield
    SEEN.clear()


def source(settings: list[str]) -> RuleRewardSource:
    cfg = load_config(RLActorConfig, GROUP_YAML, ["model.init_from=x", "data.prompts=p.jsonl",
                                                  "reward.source=function", *settings])
    return build_reward_source(cfg.reward)


PROMPTS = ["1+2=", [{"role": "user", "content": "3+4="}], "5+6="]
RESPONSES = ["3", "8", "11 "]
RECORDS = ["p.jsonl:1", "p.jsonl:2", "p.jsonl:4"]
COLUMNS = [{"answer": "3", "level": 1}, {"answer": "7", "level": 2}, {"answer": "11", "level": 1}]


def score(rule: RuleRewardSource, columns=COLUMNS):
    return rule.score_async([[1]] * 3, PROMPTS, RESPONSES, RECORDS, columns=columns).result()


# ----------------------------------------------------------------------------- columns
def test_columns_are_passed_by_keyword_as_the_signature_takes_them():
    scores = score(source([f"reward.function={HERE}:exact"]))
    assert scores.values.tolist() == [1.0, 0.0, 1.0]
    assert SEEN == [("exact", prompt, response, column["answer"])
                    for prompt, response, column in zip(PROMPTS, RESPONSES, COLUMNS)]
    SEEN.clear()
    score(source([f"reward.function={HERE}:everything"]))
    assert [call[3] for call in SEEN] == COLUMNS  # **kwargs: every column
    SEEN.clear()
    score(source([f"reward.function={HERE}:optional_hint"]))  # no such column: its default
    assert SEEN == [("optional_hint", "none")] * 3


def test_a_two_argument_function_still_works_without_columns():
    scores = score(source([f"reward.function={HERE}:legacy"]))
    assert scores.values.tolist() == [1.0, 1.0, 3.0]
    assert SEEN == [("legacy", prompt, response) for prompt, response in zip(PROMPTS, RESPONSES)]


def test_a_column_the_function_needs_but_the_record_lacks_is_one_line():
    columns = [COLUMNS[0], {"level": 2}, COLUMNS[2]]
    with pytest.raises(RewardError) as raised:
        score(source([f"reward.function={HERE}:exact"]), columns)
    assert str(raised.value) == (f"reward function {HERE}:exact takes the column 'answer', but the record of the "
                                 "prompt at p.jsonl:2 has none (its columns: level)")


# ----------------------------------------------------------------------------- a weighted list, batched calls
def test_a_weighted_list_sums_the_scores_and_keeps_each_function_s():
    rule = source([f"reward.functions=[{{function: {HERE}:exact, weight: 2.5}}, "
                   f"{{function: {HERE}:lengths, weight: -0.125, batched: true, name: length}}]"])
    assert rule.names == ["exact", "length"]
    scores = score(rule)
    expected_exact = [1.0, 0.0, 1.0]
    expected_length = [float(len(response)) for response in RESPONSES]
    expected = [2.5 * e - 0.125 * n for e, n in zip(expected_exact, expected_length)]  # float64 reference
    assert scores.values.tolist() == pytest.approx(expected, abs=1e-6)
    assert scores.parts["exact"].tolist() == expected_exact
    assert scores.parts["length"].tolist() == expected_length


def test_a_batched_function_gets_lists_once_per_request():
    score(source([f"reward.functions=[{{function: {HERE}:lengths, batched: true}}]"]))
    assert SEEN == [("lengths", PROMPTS, RESPONSES, [column["answer"] for column in COLUMNS])]


def test_a_trl_reward_function_gets_the_batch_by_trl_s_keywords():
    scores = score(source([f"reward.functions=[{{function: {HERE}:trl_accuracy, batched: true}}]"]))
    assert scores.values.tolist() == [1.0, 0.0, 1.0]
    assert SEEN == [("trl_accuracy", RESPONSES, [column["answer"] for column in COLUMNS],
                     {"prompts": PROMPTS, "level": [1, 2, 1]})]
    with pytest.raises(ConfigError) as raised:
        source([f"reward.function={HERE}:trl_accuracy"])
    assert str(raised.value) == (f"reward.function={HERE}:trl_accuracy: the function takes TRL's `completions` (a "
                                 "batch of responses): list it in reward.functions with batched: true")


def test_a_batched_function_that_returns_no_list_is_one_line():
    with pytest.raises(RewardError) as raised:
        score(source([f"reward.functions=[{{function: {HERE}:one_number, batched: true}}]"]))
    assert str(raised.value) == (f"reward function {HERE}:one_number returned 1.0 for the batch of 3 responses to "
                                 "the prompts at p.jsonl:1, p.jsonl:2, p.jsonl:4: a batched function returns a "
                                 "list of 3 scores, one per response")


@pytest.mark.parametrize("settings, message", [
    ([f"reward.function={HERE}:exact", f"reward.functions=[{{function: {HERE}:legacy}}]"],
     "reward.function='tests.unit.test_reward_functions:exact': set reward.function (one function) or "
     "reward.functions (a weighted list), not both"),
    ([f"reward.functions=[{{function: {HERE}:exact, weight: .nan}}]"],
     "reward.functions[0].weight=nan: must be a finite number"),
])
def test_a_reward_list_that_cannot_work_is_refused_when_the_config_loads(settings, message):
    with pytest.raises(ConfigError) as raised:
        load_config(RLActorConfig, GROUP_YAML, ["model.init_from=x", "data.prompts=p.jsonl", *settings])
    assert str(raised.value) == message


def test_two_functions_with_one_metric_name_are_refused():
    with pytest.raises(ConfigError) as raised:
        source([f"reward.functions=[{{function: {HERE}:exact}}, {{function: tests.unit.test_rewards:scripted_reward, "
                "name: exact}]"])
    assert str(raised.value) == ("reward.functions[1].function=tests.unit.test_rewards:scripted_reward: its metric "
                                 "name reward/exact is reward.functions[0].function's too: give one of them a `name`")


# ----------------------------------------------------------------------------- files, the probe before the model
def write_prompts(directory) -> str:
    path = directory / "prompts.jsonl"
    path.write_text("\n" + json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n" + json.dumps({"prompt": "3+4="}) + "\n")
    return str(path)


@pytest.fixture
def no_model(monkeypatch):
    from aligner.training import setup

    def build_training_model(**settings):
        raise AssertionError("the model was built first")

    monkeypatch.setattr(setup, "build_training_model", build_training_model)


def test_a_reward_file_is_imported_by_its_path_and_probed_on_the_first_record(tmp_path, monkeypatch, no_model):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "helper.py").write_text("def same(a, b):\n    return a.strip() == b\n")
    (tmp_path / "rewards" / "math_reward.py").write_text(textwrap.dedent("""
        from helper import same  # a module beside the file imports

        CALLS = []

        def graded(prompt, response, answer):
            CALLS.append((prompt, response, answer))
            return float(same(response, answer))
    """))
    monkeypatch.chdir(tmp_path)
    prompts = write_prompts(tmp_path)
    cfg = load_config(RLActorConfig, GROUP_YAML, ["model.init_from=x", f"data.prompts={prompts}",
                                                  "reward.source=function",
                                                  "reward.function=rewards/math_reward.py:graded"])
    with pytest.raises(AssertionError, match="the model was built first"):  # loaded and probed: then the model
        build_rl_actor(cfg)
    module = next(module for name, module in sys.modules.items() if name.startswith("aligner_reward_file_math_reward"))
    assert module.__file__ == str(tmp_path / "rewards" / "math_reward.py")
    assert module.CALLS == [("1+2=", "", "3")]  # the first record (line 2), the response ""


PROBE_FAILURES = {
    "raises": ("def f(prompt, response, answer):\n    return 1.0 / int(response)\n",
               'reward function {file}:f raised ValueError: invalid literal for int() with base 10: \'\' (at '
               '{path}:2) for the prompt at {prompts}:2 (the probe before the model loads: the first prompt record, '
               'with the response "")'),
    "not_a_number": ("def f(prompt, response, answer):\n    return answer\n",
                     "reward function {file}:f returned '3' for the prompt at {prompts}:2 (the probe before the model "
                     'loads: the first prompt record, with the response ""): a str is not a score (return a number, '
                     "not its text) (reward.on_invalid=replace would replace such scores by reward.invalid_value and "
                     "count them)"),
    "missing_column": ("def f(prompt, response, solution):\n    return 0.0\n",
                       "reward function {file}:f takes the column 'solution', but the record of the prompt at "
                       '{prompts}:2 (the probe before the model loads: the first prompt record, with the response "") '
                       "has none (its columns: answer)"),
    "import_error": ("import math\nimport no_such_dependency_xyz\n",
                     "reward.function={file}:f: importing {path} failed: ModuleNotFoundError: No module named "
                     "'no_such_dependency_xyz' (at {path}:2)"),
    "no_function": ("def g(prompt, response):\n    return 0.0\n",
                    "reward.function={file}:f: {file} has no function 'f'"),
    "signature": ("def f(response):\n    return 0.0\n",
                  "reward.function={file}:f: the function must take (prompt, response, **columns): too many "
                  "positional arguments"),
}


@pytest.mark.parametrize("case", PROBE_FAILURES)
def test_a_function_that_fails_on_the_probe_ends_the_run_before_the_model_is_built(tmp_path, monkeypatch, no_model,
                                                                                   case):
    source_text, message = PROBE_FAILURES[case]
    path = tmp_path / f"probe_{case}.py"
    path.write_text(source_text)
    monkeypatch.chdir(tmp_path)
    prompts = write_prompts(tmp_path)
    cfg = load_config(RLActorConfig, GROUP_YAML, ["model.init_from=x", f"data.prompts={prompts}",
                                                  "reward.source=function", f"reward.function={path.name}:f"])
    with pytest.raises((ConfigError, RewardError)) as raised:
        build_rl_actor(cfg)
    assert str(raised.value) == message.format(file=path.name, path=path, prompts=prompts)


def test_a_missing_reward_file_names_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        source(["reward.function=nowhere/reward.py:f"])
    assert str(raised.value) == (f"reward.function=nowhere/reward.py:f: there is no file {tmp_path}/nowhere/reward.py "
                                 f"(a relative path is read from the working directory {tmp_path})")


# ----------------------------------------------------------------------------- a hung call's processes
def spawning_function(directory) -> str:
    """A reward file whose function starts a process, writes its pid, and waits on it (a sandbox that hangs)."""
    (directory / "spawning.py").write_text(textwrap.dedent(f"""
        import subprocess, sys

        def f(prompt, response):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            open({str(directory / "child.pid")!r}, "w").write(str(child.pid))
            child.wait()
            return 0.0
    """))
    return f"{directory / 'spawning.py'}:f"


def stopped(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_processes_a_call_past_the_timeout_started_are_stopped(tmp_path):
    rule = RuleRewardSource(spawning_function(tmp_path), RewardChecks(timeout_s=1.0))
    with pytest.raises(RewardError) as raised:
        rule.score_async([[1]], ["1+2="], ["3"], ["p.jsonl:1"]).result()
    assert str(raised.value) == (f"reward function {tmp_path / 'spawning.py'}:f did not return within "
                                 "reward.timeout_s=1 s for the prompt at p.jsonl:1 (raise reward.timeout_s if its "
                                 "calls take that long); the 1 process(es) it started were stopped")
    assert stopped(int((tmp_path / "child.pid").read_text()))


def test_the_processes_of_a_call_hung_at_a_stop_request_are_stopped(tmp_path, monkeypatch):
    from aligner.generation import rewards
    from aligner.runtime import stopping

    monkeypatch.setattr(rewards, "STOP_PATIENCE_S", 0.4)
    rule = RuleRewardSource(spawning_function(tmp_path), RewardChecks(timeout_s=60.0))
    pending = rule.score_async([[1]], ["1+2="], ["3"], ["p.jsonl:1"])
    deadline = time.monotonic() + 30
    while not (tmp_path / "child.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "child.pid").read_text())
    monkeypatch.setattr(stopping._state, "signal_number", 15)  # as the handler records a SIGTERM
    with pytest.raises(stopping.Interrupted, match="sent no score for 0.4 s after the signal"):
        pending.result()
    assert stopped(child)
