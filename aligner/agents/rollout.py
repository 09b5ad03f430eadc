"""Multi-turn rollouts: episodes of a model and its environments, turn by turn, within limits.

    runner = EpisodeRunner(engine, make_renderer, make_environment, sampling, EpisodeLimits(max_turns=4))
    batch = runner.run(records, names)         # every episode ended with a status; failures by the policy
    batch.episodes, batch.metrics()

The engine's `generate_turns` runs the turns: each reply's text goes to its episode's environment (in a thread:
the environments live in sandbox workers, and the engine goes on decoding the other episodes meanwhile), and the
environment's answer is appended as boundary + environment tokens (`ChatRenderer.continuation`), from which the
episode's next turn continues (the native engine keeps its KV cache across turns). An episode ends
`done` (the environment says so), `max_turns`, `truncated` (`max_episode_tokens` reached, or a turn cut by
max_new_tokens under on_cut_turn=end), `timeout` (its deadline or an environment call's), or `env_error`.

Failures of environment code (EnvironmentFailure) follow `on_failure`: `fail` ends the run with one line
naming the environment and the record; `zero_reward` keeps the episode (status env_error / timeout,
reward 0, info["failure"] set), unless it failed before the model's first turn (nothing to train: dropped);
`drop` leaves it out, and `collect_groups` draws new records until every group is whole, so a
batch is never short. Failures of the sandbox itself (a crashed worker) are counted apart from those of
the environment's code.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from aligner.agents.environment import Environment, EnvironmentFailure, StepResult
from aligner.agents.episode import EPISODE_STATUSES, Episode, Segment
from aligner.agents.renderer import ChatRenderer, RenderedChat
from aligner.agents.tool_calls import OUTCOMES
from aligner.generation.engine import GenerationEngine, SamplingParams
from aligner.generation.rollouts import RolloutRow
from aligner.runtime.errors import ConfigError, UserError
from aligner.runtime.seeds import SAMPLER_SEED_RANGE, derive_seed

FAILURE_POLICIES = ("drop", "zero_reward", "fail")
CUT_MARK = " [... {count} tokens cut ...] "


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8  # model turns
    max_episode_tokens: int = 2048  # every token of the episode, prompt included
    max_observation_tokens: int = 512  # an environment message longer than this is cut in the middle, marked
    episode_timeout_s: float = 600.0  # wall clock from the episode's reset
    on_failure: str = "drop"  # drop | zero_reward | fail (see the module docstring)
    on_cut_turn: str = "continue"  # a reply cut by max_new_tokens: continue (the template closes it) | end

    def __post_init__(self):
        if self.on_failure not in FAILURE_POLICIES:
            raise ConfigError(f"rollout.on_failure={self.on_failure!r} is not one of {', '.join(FAILURE_POLICIES)}")
        if self.on_cut_turn not in ("continue", "end"):
            raise ConfigError(f"rollout.on_cut_turn={self.on_cut_turn!r} is not one of continue, end")
        for key in ("max_turns", "max_episode_tokens", "max_observation_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"rollout.{key} must be at least 1, got {getattr(self, key)}")


class EpisodeFailed(UserError, RuntimeError):
    """on_failure=fail: an environment failed (one line naming it and the record)."""


@dataclass
class RunningEpisode:
    index: int
    name: str  # the record's "file:line"
    record: dict
    environment: Environment
    renderer: ChatRenderer
    chat: RenderedChat
    episode: Episode
    started: float
    failure: Optional[str] = None  # "environment" or "infrastructure" when an environment call failed
    failure_message: str = ""
    cut_observations: int = 0


@dataclass
class EpisodeBatch:
    episodes: list[Episode]
    names: list[str]
    indices: list[int]  # each episode's position in the records run
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (record, why) of episodes left out
    counts: dict = field(default_factory=dict)

    @classmethod
    def concatenate(cls, parts: Sequence["EpisodeBatch"], offsets: Sequence[int]) -> "EpisodeBatch":
        """One batch of runs over consecutive slices of the records (`offsets`: each slice's first position)."""
        counts: dict = {}
        for part in parts:
            for key, value in part.counts.items():
                counts[key] = counts.get(key, 0) + value
        return cls([e for part in parts for e in part.episodes], [n for part in parts for n in part.names],
                   [offset + i for part, offset in zip(parts, offsets) for i in part.indices],
                   [d for part in parts for d in part.dropped], counts)

    def to_plain(self) -> dict:
        """The batch as JSON-able values (`Episode.to_plain`)."""
        return {"episodes": [episode.to_plain() for episode in self.episodes], "names": list(self.names),
                "indices": list(self.indices), "dropped": [list(pair) for pair in self.dropped],
                "counts": dict(self.counts)}

    @classmethod
    def from_plain(cls, plain: dict) -> "EpisodeBatch":
        return cls([Episode.from_plain(episode) for episode in plain["episodes"]], list(plain["names"]),
                   list(plain["indices"]), [tuple(pair) for pair in plain["dropped"]], dict(plain["counts"]))

    def metrics(self) -> dict[str, float]:
        """Fractions of episodes per status, means per episode (turns, tokens, tool calls by outcome) and counts
        (dropped episodes, failures, cut observations)."""
        count = max(len(self.episodes), 1)
        metrics = {f"episodes/{status}": sum(e.status == status for e in self.episodes) / count
                   for status in EPISODE_STATUSES}
        metrics.update({
            "episodes/turns": sum(e.model_turns for e in self.episodes) / count,
            "episodes/model_tokens": sum(e.count("model") for e in self.episodes) / count,
            "episodes/environment_tokens": sum(e.count("environment") for e in self.episodes) / count,
            "episodes/dropped": float(len(self.dropped)),
        })
        calls = [e.info.get("tool_calls") for e in self.episodes if isinstance(e.info.get("tool_calls"), dict)]
        if calls:  # a tool environment's outcome counts (aligner.agents.tool_calls.OUTCOMES), per episode
            metrics["episodes/tool_calls"] = sum(sum(c.values()) for c in calls) / count
            metrics.update({f"episodes/tool_calls_{outcome}": sum(c.get(outcome, 0) for c in calls) / count
                            for outcome in OUTCOMES})
        metrics.update({f"episodes/{key}": float(value) for key, value in self.counts.items()})
        return metrics


class EpisodeRunner:
    """Runs episodes turn by turn (see the module docstring).

    make_renderer(tools) -> ChatRenderer for the tools an environment offers (cached per tool set);
    make_environment() -> a fresh environment (one per episode); policy_version: the step whose weights the
    engine holds, recorded in every model segment.
    """

    def __init__(self, engine: GenerationEngine, make_renderer: Callable[[Optional[list]], ChatRenderer],
                 make_environment: Callable[[], Environment], sampling: SamplingParams, limits: EpisodeLimits,
                 *, parallel_environments: int = 8):
        self.engine, self.sampling, self.limits = engine, sampling, limits
        self.make_environment = make_environment
        self._make_renderer = make_renderer
        self._renderers: dict[str, ChatRenderer] = {}
        self.parallel = max(1, parallel_environments)

    def renderer(self, tools: Optional[list]) -> ChatRenderer:
        key = repr(tools)
        if key not in self._renderers:
            self._renderers[key] = self._make_renderer(tools)
        return self._renderers[key]

    def run(self, records: Sequence[dict], names: Sequence[str], policy_version: int = 0,
            seed: Optional[int] = None) -> EpisodeBatch:
        """Episodes of `records` (one each; `names` say where they are, "file:line"); seed: this call's sampling
        seed in place of the runner's (episode i of the call draws stream i of it at its first turn)."""
        sampling = self.sampling if seed is None else replace(self.sampling, seed=seed)
        counts = {"environment_failures": 0, "infrastructure_failures": 0, "cut_observations": 0}
        with ThreadPoolExecutor(self.parallel) as threads:
            started = list(threads.map(self._start, range(len(records)), records, names))
            running = [episode for episode in started if episode.episode.status is None]
            if running:
                def on_turn(index, ids, logprobs, stopped):
                    return threads.submit(self._step, running[index], (ids, logprobs, stopped, policy_version))

                # An episode's tokens before a turn stay below max_episode_tokens (`_step` ends it otherwise).
                self.engine.generate_turns([r.episode.tokens for r in running], self._stopping(running, sampling),
                                           on_turn, longest_prompt=self.limits.max_episode_tokens - 1)
        for episode in started:
            if episode.environment is not None:
                episode.environment.close()
            counts["cut_observations"] += episode.cut_observations
            if episode.failure is not None:
                counts[f"{episode.failure}_failures"] += 1
        return self._apply_policy(started, counts)

    # -- one episode's start and turns
    def _start(self, index: int, record: dict, name: str) -> RunningEpisode:
        started = time.monotonic()
        try:
            environment = self.make_environment()
        except EnvironmentFailure as failure:
            return self._failed(index, name, record, None, failure, started)
        try:
            start = environment.reset(record)
        except EnvironmentFailure as failure:
            return self._failed(index, name, record, environment, failure, started)
        renderer = self.renderer(start.tools)
        prompt, chat = renderer.start(start.messages)
        running = RunningEpisode(index, name, record, environment, renderer, chat, Episode([Segment.prompt(prompt)]),
                                 started)
        if len(prompt) >= self.limits.max_episode_tokens:  # no room for a single model token
            running.episode.end("truncated")
        return running

    def _failed(self, index, name, record, environment, failure: EnvironmentFailure, started) -> RunningEpisode:
        running = RunningEpisode(index, name, record, environment, None, None, Episode([Segment.prompt([])]), started)
        self._fail(running, failure)
        return running

    def _fail(self, running: RunningEpisode, failure: EnvironmentFailure) -> None:
        running.failure = "infrastructure" if failure.kind == "crashed" else "environment"
        running.failure_message = str(failure)
        running.episode.end("timeout" if failure.kind == "timeout" else "env_error")
        running.episode.info = {**running.episode.info, "failure": running.failure}

    @staticmethod
    def _stopping(running: list[RunningEpisode], sampling: SamplingParams) -> SamplingParams:
        """The episodes' sampling, also stopping where the environments' calls end (`Environment.stop_strings`; the
        environments of a run come from one factory, so they declare the same ends). An end that is one added
        token of the vocabulary (Qwen's `</tool_call>`) stops as a token id: decoding may skip it, and an engine
        without stop strings can still stop there; any other stops as a string. (Each turn's seed:
        `aligner.generation.engine.turn_sampling`.)"""
        ends = sorted({end for r in running for end in r.environment.stop_strings})
        if not ends:
            return sampling
        tokenizer = running[0].renderer.tokenizer
        added = tokenizer.hf.get_added_vocab()
        stop_ids, stop_strings = list(sampling.stop_token_ids), list(sampling.stop_strings)
        for end in ends:
            if end in added:
                stop_ids = sorted(set(stop_ids or [tokenizer.eos_id]) | {added[end]})  # eos still stops
            elif end not in stop_strings:
                stop_strings.append(end)
        return replace(sampling, stop_token_ids=stop_ids, stop_strings=stop_strings)

    def _step(self, running: RunningEpisode, row) -> Optional[list[int]]:
        """Add the model's turn and the environment's answer; returns the tokens appended after the model's
        (what the next turn continues from), None once the episode has ended."""
        ids, logprobs, stopped, version = row
        episode, limits = running.episode, self.limits
        room = limits.max_episode_tokens - len(episode)
        if len(ids) > room:  # the last tokens would not fit the episode: cut, and end it
            episode.add_model(ids[:room], logprobs[:room], version, stopped=False)
            episode.end("truncated")
            return None
        episode.add_model(ids, logprobs, version, stopped)
        if not stopped and limits.on_cut_turn == "end":
            episode.end("truncated")
            return None
        text, _ = running.renderer.model_text(ids)
        try:
            result = running.environment.step(text)
        except EnvironmentFailure as failure:
            self._fail(running, failure)
            return None
        episode.turn_rewards.append(result.reward)
        episode.info = result.info
        if result.done:
            episode.reward = result.reward
            episode.end("done")
            return None
        if episode.model_turns >= limits.max_turns:
            episode.end("max_turns")
            return None
        if time.monotonic() - running.started > limits.episode_timeout_s:
            episode.end("timeout")
            return None
        segments = running.renderer.continuation(running.chat, ids, self._cut(running, result))
        if len(episode) + sum(len(segment) for segment in segments) >= limits.max_episode_tokens:
            episode.end("truncated")  # no room left for the model's next turn
            return None
        episode.add(segments)
        return [token for segment in segments for token in segment.tokens]

    def _cut(self, running: RunningEpisode, result: StepResult) -> list[dict]:
        """The environment's messages, each cut in the middle to max_observation_tokens (marked)."""
        tokenizer, limit = running.renderer.tokenizer, self.limits.max_observation_tokens
        messages = []
        for message in result.messages:
            ids = tokenizer.encode(message["content"])
            if len(ids) > limit:
                head, tail = (limit + 1) // 2, limit // 2
                mark = CUT_MARK.format(count=len(ids) - head - tail)
                content = tokenizer.hf.decode(ids[:head]) + mark + (tokenizer.hf.decode(ids[-tail:]) if tail else "")
                message = {**message, "content": content}
                running.cut_observations += 1
            messages.append(message)
        return messages

    def _apply_policy(self, started: list[RunningEpisode], counts: dict) -> EpisodeBatch:
        policy = self.limits.on_failure
        failed = [r for r in started if r.failure is not None]
        if failed and policy == "fail":
            first = failed[0]
            raise EpisodeFailed(f"episode of record {first.name}: {first.failure} failure: {first.failure_message} "
                                "(rollout.on_failure=fail; drop or zero_reward keep the run going)")
        episodes, names, indices, dropped = [], [], [], []
        for r in started:
            # An episode whose environment failed before the model's first turn has no tokens to train: dropped
            # under zero_reward too.
            if r.failure is not None and (policy == "drop" or r.episode.model_turns == 0):
                dropped.append((r.name, r.failure_message))
                continue
            if r.failure is not None:  # zero_reward
                r.episode.reward = 0.0
            episodes.append(r.episode)
            names.append(r.name)
            indices.append(r.index)
        return EpisodeBatch(episodes, names, indices, dropped, counts)


def episode_row(episode: Episode, given_prompt=None) -> RolloutRow:
    """An episode as the RL actor's row: the prompt segment is the prompt, everything after it the response,
    trained on the model's tokens only (`loss_mask`), with the engine's logprobs there (0 elsewhere).
    ended_with_stop: its last model turn ended with a stop token. A single-turn episode gives exactly the row
    of the single-turn rollout (no loss mask)."""
    prompt = episode.prompt_length
    response = torch.tensor(episode.tokens[prompt:], dtype=torch.long)
    multi_segment = len(episode.segments) > 2
    return RolloutRow(list(episode.segments[0].tokens), response,
                      torch.tensor(episode.behaviour_logprobs[prompt:], dtype=torch.float32),
                      ended_with_stop=episode.last_turn_stopped, given_prompt=given_prompt,
                      score=episode.reward,
                      loss_mask=torch.tensor(episode.loss_mask[prompt:], dtype=torch.bool) if multi_segment else None)


def collect_groups(runner: EpisodeRunner, draw: Callable[[], tuple[dict, str]], groups: int, group_size: int,
                   policy_version: int = 0, max_draws: Optional[int] = None,
                   seed: Optional[int] = None) -> EpisodeBatch:
    """`groups` whole groups of `group_size` episodes of one record each (GRPO's groups): a group with a dropped
    episode is drawn again from a new record (`draw()` -> (record, name)), up to max_draws records (default:
    three times `groups`), then the run ends with one line. seed: the first round's sampling seed (later rounds
    derive theirs from it); None: the runner's."""
    max_draws = max_draws if max_draws is not None else 3 * groups
    kept: list[tuple[list[Episode], str]] = []
    dropped: list[tuple[str, str]] = []
    counts: dict[str, int] = {}
    draws = 0
    while len(kept) < groups:
        wanted = groups - len(kept)
        if draws + wanted > max_draws:
            raise EpisodeFailed(f"only {len(kept)} of {groups} episode groups completed after {draws} prompt records: "
                                f"{len(dropped)} episodes failed, the last: {dropped[-1][0]}: {dropped[-1][1]}"
                                if dropped else f"only {len(kept)} of {groups} episode groups completed")
        picked = [draw() for _ in range(wanted)]
        draws += wanted
        records = [record for record, _ in picked for _ in range(group_size)]
        names = [name for _, name in picked for _ in range(group_size)]
        first_round = draws == wanted
        round_seed = seed if seed is None or first_round else derive_seed(seed, draws, modulus=SAMPLER_SEED_RANGE)
        batch = runner.run(records, names, policy_version, seed=round_seed)
        for key, value in batch.counts.items():
            counts[key] = counts.get(key, 0) + value
        dropped += batch.dropped
        by_group: dict[int, list[Episode]] = {}
        for episode, index in zip(batch.episodes, batch.indices):
            by_group.setdefault(index // group_size, []).append(episode)
        for number, (_, name) in enumerate(picked):
            if len(by_group.get(number, [])) == group_size:  # a group with a dropped episode is drawn again
                kept.append((by_group[number], name))
    episodes = [episode for group, _ in kept for episode in group]
    names = [name for group, name in kept for _ in group]
    return EpisodeBatch(episodes, names, list(range(len(episodes))), dropped, counts)
