"""Rewards checked at the source (aligner/generation/rewards.py): what a reward function or server may return, what
the run does when it returns something else, raises, fails to import, hangs or edits its prompt, and the
replace-and-count mode. Most cases go through the real RL actor (one tiny actor for the module, scoring its
rollouts with `RolloutCollector.generate_and_score`); the subprocess runs are in tests/faults/test_reward_faults.py."""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from aligner.algorithms.rl_build import build_reward_source, build_rl_actor
from aligner.algorithms.rl_config import RLActorConfig
from aligner.config import CONF_DIR, load_config
from aligner.runtime import stopping
from aligner.runtime.errors import ConfigError, UserError

from ..tiny_actor import MESSAGES_LINE, actor_settings, write_tiny_policy

GROUP_YAML = CONF_DIR / "gpt_reinforce_actor.yaml"
FUNCTION = "tests.unit.test_rewards:scripted_reward"
INDICES = [0, 0, 1, 1, 2, 2, 3, 3]  # every prompt twice: two micro-batches of 4
SCRIPT = {"score": lambda prompt, response_text: 0.5}  # what scripted_reward does (each test sets its own)


def scripted_reward(prompt, response_text: str):
    return SCRIPT["score"](prompt, response_text)


def on_messages(value, otherwise=0.5):
    """A script: `value` for the conversation prompt (file line MESSAGES_LINE), `otherwise` for the rest."""
    return lambda prompt, response_text: value if isinstance(prompt, list) else otherwise


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, arithmetic_tokenizer_dir):
    root = tmp_path_factory.mktemp("rewards")
    return (root, *write_tiny_policy(root, arithmetic_tokenizer_dir))


@pytest.fixture(scope="module")
def actor(tiny):
    """The actor, and megatron's parallel state for the module's tests."""
    from aligner.runtime import distributed

    root, policy, prompts = tiny
    trainer = build_rl_actor(load_config(RLActorConfig, GROUP_YAML, actor_settings(policy, prompts, root, FUNCTION)))
    yield trainer
    trainer.rollouts.router.close()
    trainer.metrics.close()
    distributed.shutdown()


def score(actor) -> dict:
    rows, _ = actor.rollouts.generate_and_score(INDICES, {}, seed=1, with_values=False)
    return rows


def use_checks(actor, monkeypatch, **checks) -> None:
    """The actor's reward.* checks set to `checks` (undone after the test), its function source rebuilt."""
    for key, value in checks.items():
        monkeypatch.setattr(actor.cfg.reward, key, value)
    monkeypatch.setattr(actor.rollouts, "reward_source", build_reward_source(actor.cfg.reward))


@pytest.fixture
def release():
    """An event that a blocking reward function waits on; set when the test ends, so its thread ends too."""
    event = threading.Event()
    yield event
    event.set()


# ----------------------------------------------------------------------------- invalid scores
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e300, "0.5", True, [0.5], None],
                         ids=["nan", "inf", "-inf", "1e300", "str", "bool", "list", "none"])
def test_an_invalid_score_stops_the_run_with_one_line_naming_function_prompt_and_value(actor, monkeypatch, value):
    monkeypatch.setitem(SCRIPT, "score", on_messages(value))
    with pytest.raises(UserError) as raised:
        score(actor)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"reward function {FUNCTION} returned {value!r} for the prompt at "
                              f"{actor.prompts.path}:{MESSAGES_LINE}: ")
    assert "reward.on_invalid=replace" in message


def test_numbers_of_every_kind_within_the_bound_are_scores(actor, monkeypatch):
    values = iter([1, np.float32(0.25), np.int64(-2), torch.tensor(0.75), -1e6, 1e6, 0.0, 3.5])
    monkeypatch.setitem(SCRIPT, "score", lambda prompt, response_text: next(values))
    rows = score(actor)
    assert sorted(row.score for row in rows.values()) == [-1e6, -2.0, 0.0, 0.25, 0.75, 1.0, 3.5, 1e6]
    assert not any(row.score_replaced for row in rows.values())


def test_the_bound_is_reward_max_abs(actor, monkeypatch):
    use_checks(actor, monkeypatch, max_abs=10.0)
    monkeypatch.setitem(SCRIPT, "score", on_messages(10.5))
    with pytest.raises(UserError, match=r"returned 10\.5 for .*: \|score\| must be <= reward.max_abs=10"):
        score(actor)


def test_replace_mode_replaces_invalid_scores_counts_them_and_warns_once(actor, monkeypatch, capsys):
    use_checks(actor, monkeypatch, on_invalid="replace", invalid_value=-1.0)
    monkeypatch.setitem(SCRIPT, "score", on_messages(math.nan, otherwise=1.0))
    rows = score(actor)
    replaced = [position for position, row in rows.items() if row.score_replaced]
    assert replaced == [4, 5]  # the two samples of the conversation prompt
    assert [rows[position].score for position in range(8)] == [1.0] * 4 + [-1.0] * 2 + [1.0] * 2
    metrics = actor.make_experience(actor.rollouts.to_batch(sorted(rows.items())), None, None).metrics
    assert metrics["invalid_rewards"] == 2 and metrics["reward_mean"] == pytest.approx(0.5)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: reward function {FUNCTION} returned nan for the prompt at {actor.prompts.path}:"
                        f"{MESSAGES_LINE}: a score must be finite; replaced by reward.invalid_value=-1 "
                        "(reward.on_invalid=replace); further replacements are counted in the metrics"]


def test_rejection_sampling_checks_its_scores_the_same_way(tiny, actor, monkeypatch):
    from aligner.algorithms.rejection_sampling import RSConfig, build_rs_run

    root, policy, prompts = tiny
    cfg = load_config(RSConfig, CONF_DIR / "gpt_rs.yaml", [
        f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=32",
        f"reward.function={FUNCTION}", "rs.prompts_per_iteration=4", "rs.samples_per_prompt=2",
        "rs.generation.max_new_tokens=4", "rs.generation.batch_size=8", "trainer.global_batch_size=4",
        "trainer.micro_batch_size=4", f"checkpoint.save_dir={root / 'rs'}", f"logging.log_dir={root / 'rs'}",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0"])
    monkeypatch.setitem(SCRIPT, "score", on_messages("0.5"))
    run = build_rs_run(cfg)
    try:
        with pytest.raises(UserError, match=f"reward function {FUNCTION} returned '0.5' for the prompt at "
                                            f"{prompts}:{MESSAGES_LINE}: a str is not a score"):
            run.sample_and_score(0)
        monkeypatch.setattr(cfg.reward, "on_invalid", "replace")
        run.reward_source = build_reward_source(cfg.reward)
        *_, scores, replaced = run.sample_and_score(0)
        assert replaced == 2 and sorted(scores) == [0.0, 0.0] + [0.5] * 6
    finally:
        run.engine.free()
        run.reward_source.close()
        run.trainer.metrics.close()


# ----------------------------------------------------------------------------- failures inside the function
def failing(prompt, response_text: str) -> float:
    raise ValueError(f"cannot grade {response_text!r}")


def test_an_exception_inside_the_function_is_one_line_naming_it_the_prompt_and_where(actor, monkeypatch):
    monkeypatch.setitem(SCRIPT, "score", lambda prompt, text: failing(prompt, text) if isinstance(prompt, list) else 0)
    with pytest.raises(UserError) as raised:
        score(actor)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"reward function {FUNCTION} raised ValueError: cannot grade ")
    assert f"(at {__file__}:{failing.__code__.co_firstlineno + 1})" in message
    assert message.endswith(f"for the prompt at {actor.prompts.path}:{MESSAGES_LINE}")


def test_a_function_that_edits_its_prompt_cannot_change_the_data_set(actor, monkeypatch):
    seen = []

    def vandal(prompt, response_text: str) -> float:
        if isinstance(prompt, list):
            seen.append(prompt[0]["content"])
            prompt[0]["content"] = "corrupted"
            prompt.append({"role": "assistant", "content": "x"})
        return 0.0

    monkeypatch.setitem(SCRIPT, "score", vandal)
    original = [{"role": "user", "content": "5+6="}]
    score(actor)
    score(actor)
    assert seen == ["5+6="] * 4  # every sample of every step got the prompt as the file gives it
    assert actor.prompts.prompts[2] == original


def test_a_call_past_reward_timeout_s_stops_the_run_naming_the_prompt(actor, monkeypatch, release):
    use_checks(actor, monkeypatch, timeout_s=0.5)
    monkeypatch.setitem(SCRIPT, "score", lambda prompt, text: release.wait(10) * 0.0 if isinstance(prompt, list)
                        else 0.0)
    start = time.monotonic()
    with pytest.raises(UserError) as raised:
        score(actor)
    assert time.monotonic() - start < 5
    assert str(raised.value) == (f"reward function {FUNCTION} did not return within reward.timeout_s=0.5 s for the "
                                 f"prompt at {actor.prompts.path}:{MESSAGES_LINE} (raise reward.timeout_s if its calls "
                                 "take that long)")
    with pytest.raises(UserError, match="did not return within"):  # the source stays failed: no call queues behind
        actor.rollouts.reward_source.score_async([[1]], ["1+2="], ["3"], ["x.jsonl:1"]).result()


def test_slow_calls_within_the_timeout_give_their_scores(actor, monkeypatch):
    """The timeout is per call: two calls of 0.6 s in one micro-batch take longer than it together."""
    use_checks(actor, monkeypatch, timeout_s=1.0)
    monkeypatch.setitem(SCRIPT, "score", lambda prompt, text: time.sleep(0.6) or 0.25 if isinstance(prompt, list)
                        else 0.5)
    rows = score(actor)
    assert [rows[position].score for position in range(8)] == [0.5] * 4 + [0.25] * 2 + [0.5] * 2


@pytest.mark.parametrize("setting, message", [
    ("reward.timeout_s=0", "reward.timeout_s=0.0: must be > 0"),
    ("reward.max_abs=inf", "reward.max_abs=inf: must be a finite number > 0"),
    ("reward.invalid_value=nan", "reward.invalid_value=nan: must be a finite number with |invalid_value| <= max_abs"),
    ("reward.invalid_value=-2e6", "reward.invalid_value=-2000000.0: must be a finite number"),
    ("reward.on_invalid=skip", "reward.on_invalid='skip' is not one of error, replace"),
])
def test_check_settings_that_cannot_work_are_refused_when_the_config_loads(setting, message):
    with pytest.raises(ConfigError) as raised:
        load_config(RLActorConfig, GROUP_YAML, ["model.init_from=x", "data.prompts=p.jsonl", setting])
    assert str(raised.value).startswith(message)


# ----------------------------------------------------------------------------- loading the function
@pytest.mark.parametrize("source, message", [
    ("import no_such_dependency_xyz\n", "ModuleNotFoundError: No module named 'no_such_dependency_xyz' (at {file}:1)"),
    ("x = 1\ndef f(prompt, response:\n    return 1.0\n", "SyntaxError: "),
    ("\nTABLE = {}\nWEIGHT = TABLE['w']\n", "KeyError: 'w' (at {file}:3)"),
], ids=["import_error", "syntax_error", "error_at_import"])
def test_a_module_that_fails_while_importing_is_one_line_with_its_error_and_file_line(tmp_path, monkeypatch, source,
                                                                                      message):
    from aligner.algorithms.rl_build import build_reward_source

    module = tmp_path / "broken_reward.py"
    module.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    section = load_config(RLActorConfig, GROUP_YAML, ["model.init_from=x", "data.prompts=p.jsonl",
                                                      "reward.source=function", "reward.function=broken_reward:f"])
    with pytest.raises(ConfigError) as raised:
        build_reward_source(section.reward)
    text = str(raised.value)
    assert "\n" not in text
    assert text.startswith("reward.function=broken_reward:f: importing broken_reward failed: ")
    assert message.format(file=module) in text
    if message.startswith("SyntaxError"):
        assert text.endswith(f"(at {module}:2)")


def test_a_function_that_cannot_take_prompt_and_response_is_refused_when_loaded():
    from aligner.generation.rewards import RuleRewardSource

    with pytest.raises(ConfigError, match=r"^reward.function=tests.unit.test_rewards:score: the function must take "
                                          r"\(prompt, response, \*\*columns\): too many positional arguments$"):
        RuleRewardSource("tests.unit.test_rewards:score")  # one argument


def test_the_reward_function_loads_before_the_model_is_built(monkeypatch, tmp_path):
    """A function that cannot load costs seconds, not a model build."""
    from aligner.training import setup

    def no_model(**settings):
        raise AssertionError("the model was built first")

    monkeypatch.setattr(setup, "build_training_model", no_model)
    cfg = load_config(RLActorConfig, GROUP_YAML, ["model.init_from=x", "data.prompts=p.jsonl", "reward.source=function",
                                                  "reward.function=no_such_reward_module_xyz:f"])
    with pytest.raises(ConfigError, match="cannot import 'no_such_reward_module_xyz'"):
        build_rl_actor(cfg)


# ----------------------------------------------------------------------------- the server path, waiting
class FakeRewardClient:
    host, port, model_name = "127.0.0.1", 5555, "reward_model"

    def __init__(self, outputs):
        self.outputs = outputs

    def infer_async(self, sequences) -> Future:
        future: Future = Future()
        future.set_result(np.asarray(self.outputs, dtype=np.float32))
        return future


@pytest.mark.parametrize("outputs, message", [
    ([[0.5], [math.nan]], "reward server 127.0.0.1:5555 (model reward_model) returned nan for the prompt at "
                          "b.jsonl:9: a score must be finite"),
    ([[0.5], [3e38]], "for the prompt at b.jsonl:9: |score| must be <= reward.max_abs=1e+06"),
    ([[0.5]], "reward server 127.0.0.1:5555 (model reward_model) returned 1 scores for 2 responses"),
    ([0.5, 0.5], "answered with an array of shape (2,): there is no reward.attribute_index=0 in it"),
])
def test_reward_server_scores_are_checked_like_a_function_s(outputs, message):
    from aligner.generation.rewards import RewardError, RewardServerSource

    source = RewardServerSource(FakeRewardClient(outputs))
    pending = source.score_async([[1, 2], [1, 3]], ["a", "b"], ["x", "y"], ["a.jsonl:1", "b.jsonl:9"])
    with pytest.raises(RewardError) as raised:
        pending.result()
    assert message in str(raised.value)


def test_a_reward_server_takes_the_call_the_rollouts_make():
    """The RL rollouts hand every source the prompt records' other columns (`columns=`); the server source reads
    only the tokens (it raised TypeError: the group RL actor could not use a reward server)."""
    from aligner.generation.rewards import RewardServerSource

    source = RewardServerSource(FakeRewardClient([[0.5, 9.0], [0.25, 9.0]]))
    pending = source.score_async([[1, 2], [1, 3]], ["a", "b"], ["x", "y"], ["a.jsonl:1", "b.jsonl:9"],
                                 columns=[{"answer": "3"}, {}])
    assert pending.result().values.tolist() == [0.5, 0.25]


def test_after_a_stop_the_wait_goes_on_while_scores_arrive_and_ends_once_they_stop(monkeypatch):
    """A healthy source finishes its step (a checkpoint follows at the boundary); a silent one is given up."""
    from aligner.generation import rewards

    monkeypatch.setattr(rewards, "STOP_PATIENCE_S", 0.4)
    monkeypatch.setattr(stopping._state, "signal_number", 15)  # as the handler records a SIGTERM in a loop
    progress = {"calls": 0}
    future: Future = Future()

    def answer_slowly():  # a call finishes every 0.2 s; the answer after 1.2 s, three patiences
        for _ in range(6):
            time.sleep(0.2)
            progress["calls"] += 1
        future.set_result("scores")

    threading.Thread(target=answer_slowly, daemon=True).start()
    assert rewards.wait_for(future, lambda: "the source", lambda: progress["calls"]) == "scores"
    start = time.monotonic()
    with pytest.raises(stopping.Interrupted, match="the source sent no score for 0.4 s after the signal"):
        rewards.wait_for(Future(), lambda: "the source")
    assert 0.4 <= time.monotonic() - start < 2
