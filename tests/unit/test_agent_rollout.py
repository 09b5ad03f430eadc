"""Multi-turn rollouts: turns, statuses, limits, failure policies and whole groups, with a scripted model."""
from __future__ import annotations

import re

import pytest
import torch

from aligner.agents.builtin import GuessTheNumber
from aligner.agents.environment import Environment, EnvironmentFailure, start_from, step_from
from aligner.agents.renderer import ChatRenderer
from aligner.agents.rollout import CUT_MARK, EpisodeFailed, EpisodeLimits, EpisodeRunner, collect_groups
from aligner.generation.engine import GenerationEngine, Rollout, SamplingParams
from aligner.runtime.errors import ConfigError
from tests.chat_tokenizers import build_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chatml"), "smollm2")


class ScriptedModel(GenerationEngine):
    """Answers each prompt with reply(text of the prompt) (+ the end token unless cut at max_new_tokens)."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.calls = tokenizer, reply, []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling.seed))
        rows = []
        for prompt in prompts:
            ids = self.tokenizer.encode(self.reply(self.tokenizer.hf.decode(prompt))) + [self.tokenizer.eos_id]
            rows.append(ids[:sampling.max_new_tokens])
        width = sampling.max_new_tokens
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width)
        for i, ids in enumerate(rows):
            tokens[i, :len(ids)] = torch.tensor(ids)
            logprobs[i, :len(ids)] = -0.01 * torch.arange(1, len(ids) + 1)
        stopped = torch.tensor([ids[-1] == self.tokenizer.eos_id for ids in rows])
        return Rollout(prompts, tokens, logprobs, torch.tensor([len(ids) for ids in rows]), stopped)


def binary_search(text: str) -> str:
    """A model that plays the guessing game well: narrows the range from the feedback so far."""
    low, high = 1, 100
    guesses = [int(g) for g in re.findall(r"assistant\n(\d+)", text)]
    feedback = re.findall(r"user\n(Higher|Lower)\.", text)
    for guess, said in zip(guesses, feedback):
        low, high = (guess + 1, high) if said == "Higher" else (low, guess - 1)
    return str((low + high) // 2)


class Game(Environment):
    """The built-in game in this process, answering as a sandboxed environment does."""

    def __init__(self, **arguments):
        self.game = GuessTheNumber(**arguments)

    def reset(self, record):
        return start_from(self.game.reset(record), "game")

    def step(self, action):
        return step_from(self.game.step(action), "game")

    def close(self):
        pass


def runner(tokenizer, reply, make_environment=Game, max_new_tokens=8, **limits):
    return EpisodeRunner(ScriptedModel(tokenizer, reply), lambda tools: ChatRenderer(tokenizer, tools=tools),
                         make_environment, SamplingParams(max_new_tokens=max_new_tokens, seed=5),
                         EpisodeLimits(**limits))


def test_a_game_played_to_the_end_is_the_template_on_the_whole_conversation(tokenizer):
    batch = runner(tokenizer, binary_search).run([{"secret": 37}, {"secret": 50}, {"secret": 99}], ["a", "b", "c"])
    assert [e.status for e in batch.episodes] == ["done"] * 3 and [e.reward for e in batch.episodes] == [1.0] * 3
    episode = batch.episodes[0]
    # the conversation the episode holds, as a chat: the template applied to all of it is the episode
    text = tokenizer.hf.decode(episode.tokens, skip_special_tokens=False)
    replies = re.findall(r"assistant\n(\d+)<\|im_end\|>", text)
    assert replies[-1] == "37" and len(replies) == episode.model_turns == len(episode.turn_rewards)
    messages = [{"role": "user", "content": GuessTheNumber().reset({"secret": 37})["messages"][0]["content"]}]
    for index, reply in enumerate(replies):
        messages.append({"role": "assistant", "content": reply})
        if index + 1 < len(replies):
            messages.append({"role": "user", "content": "Higher." if int(reply) < 37 else "Lower."})
    whole, mask = tokenizer.encode_chat(messages)
    assert episode.tokens == whole[:len(episode.tokens)] and episode.loss_mask == mask[:len(episode.tokens)]
    assert len(whole) - len(episode.tokens) <= 1  # the template's newline after the last end token
    assert episode.behaviour_logprobs[len(episode.segments[0]):][:2] == pytest.approx([-0.01, -0.02])
    assert batch.metrics()["episodes/done"] == 1.0 and batch.metrics()["episodes/turns"] > 1


def test_each_turn_draws_with_its_own_seed(tokenizer):
    run = runner(tokenizer, binary_search)
    run.run([{"secret": 37}], ["a"])
    seeds = [seed for _, seed in run.engine.calls]
    assert len(seeds) > 2 and len(set(seeds)) == len(seeds) and seeds[0] == 5


def test_limits_end_episodes_with_their_status(tokenizer):
    assert runner(tokenizer, lambda text: "1", max_turns=3).run([{"secret": 90}], ["a"]).episodes[0].status \
        == "max_turns"
    short = runner(tokenizer, lambda text: "1", max_episode_tokens=130).run([{"secret": 90}], ["a"]).episodes[0]
    assert short.status == "truncated" and 100 < len(short) <= 130 and short.model_turns >= 2
    no_room = runner(tokenizer, lambda text: "1", max_episode_tokens=50).run([{"secret": 90}], ["a"]).episodes[0]
    assert no_room.status == "truncated" and no_room.model_turns == 0
    cut = runner(tokenizer, lambda text: "the number is surely fifty", max_new_tokens=3, on_cut_turn="end")
    episode = cut.run([{"secret": 90}], ["a"]).episodes[0]
    assert episode.status == "truncated" and episode.model_turns == 1 and episode.count("model") == 3
    kept = runner(tokenizer, lambda text: "the number is surely fifty", max_new_tokens=3, max_turns=2)
    episode = kept.run([{"secret": 90}], ["a"]).episodes[0]
    assert episode.status == "max_turns" and episode.model_turns == 2  # a cut turn is closed by the template


class Verbose(Game):
    def step(self, action):
        result = super().step(action)
        result.messages = [{"role": "user", "content": "word " * 200 + "Higher."}] if not result.done else []
        return result


def test_a_long_observation_is_cut_in_the_middle_and_marked(tokenizer):
    batch = runner(tokenizer, lambda text: "1", make_environment=Verbose, max_turns=2,
                   max_observation_tokens=20).run([{"secret": 90}], ["a"])
    episode = batch.episodes[0]
    observation = [s for s in episode.segments if s.kind == "environment"][0]
    text = tokenizer.hf.decode(list(observation.tokens))
    assert CUT_MARK.format(count=len(tokenizer.encode("word " * 200 + "Higher.")) - 20).strip() in text
    assert text.startswith("word") and text.endswith("Higher.")
    assert batch.counts["cut_observations"] == 1


class Flaky(Game):
    """Fails on records marked to fail: at reset, or at the first step with a given kind."""

    def reset(self, record):
        self.fail = record.get("fail")
        if self.fail == "reset":
            raise EnvironmentFailure("game.reset: KeyError: 'secret'")
        return super().reset(record)

    def step(self, action):
        if self.fail in ("error", "timeout", "crashed"):
            raise EnvironmentFailure(f"game.step: it went wrong ({self.fail})", self.fail)
        return super().step(action)


@pytest.mark.parametrize("policy", ["drop", "zero_reward", "fail"])
def test_failure_policies(tokenizer, policy):
    records = [{"secret": 37}, {"secret": 5, "fail": "reset"}, {"secret": 6, "fail": "timeout"},
               {"secret": 7, "fail": "crashed"}]
    run = runner(tokenizer, binary_search, make_environment=Flaky, on_failure=policy)
    if policy == "fail":
        with pytest.raises(EpisodeFailed) as failure:
            run.run(records, ["p:1", "p:2", "p:3", "p:4"])
        assert str(failure.value).startswith("episode of record p:2: environment failure: game.reset: KeyError")
        assert "\n" not in str(failure.value)
        return
    batch = run.run(records, ["p:1", "p:2", "p:3", "p:4"])
    assert batch.counts["environment_failures"] == 2 and batch.counts["infrastructure_failures"] == 1
    if policy == "drop":
        assert batch.names == ["p:1"] and [name for name, _ in batch.dropped] == ["p:2", "p:3", "p:4"]
    else:  # kept with reward 0, except the one that failed at reset: no model turn, nothing to train
        assert batch.names == ["p:1", "p:3", "p:4"] and [name for name, _ in batch.dropped] == ["p:2"]
        assert [e.status for e in batch.episodes] == ["done", "timeout", "env_error"]
        assert [e.reward for e in batch.episodes] == [1.0, 0.0, 0.0]
        assert [e.info.get("failure") for e in batch.episodes] == [None, "environment", "infrastructure"]


def test_whole_groups_are_collected_by_drawing_again(tokenizer):
    pool = iter([({"secret": 10, "fail": "error"}, "p:1"), ({"secret": 20}, "p:2"), ({"secret": 30}, "p:3"),
                 ({"secret": 40, "fail": "error"}, "p:4"), ({"secret": 50}, "p:5")])
    run = runner(tokenizer, binary_search, make_environment=Flaky)
    batch = collect_groups(run, lambda: next(pool), groups=3, group_size=2)
    assert batch.names == ["p:2", "p:2", "p:3", "p:3", "p:5", "p:5"]
    assert all(e.status == "done" for e in batch.episodes) and len(batch.dropped) == 4
    always_failing = runner(tokenizer, binary_search, make_environment=Flaky)
    with pytest.raises(EpisodeFailed, match="only 0 of 2 episode groups completed after 6 prompt records"):
        collect_groups(always_failing, lambda: ({"fail": "error"}, "p:9"), groups=2, group_size=2)


def test_bad_limits_are_refused():
    with pytest.raises(ConfigError, match="rollout.on_failure='retry'"):
        EpisodeLimits(on_failure="retry")
    with pytest.raises(ConfigError, match="rollout.max_turns must be at least 1"):
        EpisodeLimits(max_turns=0)
