"""Steps 1-2 of an RL step on multi-turn episodes (`rollout.environment` or `rollout.tools`): each data-parallel
rank runs whole groups of episodes and scores them.

    collector = EpisodeCollector(cfg, chunks=..., engine=..., reward_source=..., prompts=..., order=...,
                                 tokenizer=..., data_parallel=..., environments=Environments.build(cfg.rollout))
    batch, metrics = collector.collect(seed, timings, policy_version=step)

The step's prompts come from the run's saved order, the same on every rank; rank r runs the groups of prompts
[r*N/D, (r+1)*N/D), k episodes each (`aligner.agents.rollout.collect_groups`). A group with an episode the
failure policy dropped is replaced by a group of another prompt, drawn from a stream of the step's seed and the
rank (not from the saved order, which stays the same on every rank), so a batch is never short. With
rollout.asynchronous a generation worker runs them (`WorkerEpisodes`, the same `run_share`) and the trainer scores
them (`EpisodeCollector.finish`).

Each episode becomes a row (`episode_row`): its prompt segment is the prompt, everything after it the response,
trained on the model's tokens only. Its score: with reward.source=environment the environment's final reward (else
the sum of its turn rewards); otherwise the reward source scores the conversation: a reward-model server reads the
episode's tokens (tool results included), a reward function the prompt and the final answer's text.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from aligner.agents.builtin import BUILTIN
from aligner.agents.environment import (
    Environment,
    EnvironmentFailure,
    SandboxedEnvironment,
    ToolEnvironment,
    sandboxed_tools,
)
from aligner.agents.episode import Episode
from aligner.agents.renderer import ChatRenderer
from aligner.agents.rollout import EpisodeBatch, EpisodeFailed, EpisodeRunner, collect_groups, episode_row
from aligner.algorithms.rl_config import RLActorConfig, RolloutSection
from aligner.algorithms.rl_rollouts import response_text, rollout_sampling, to_batch
from aligner.config import ConfigError
from aligner.generation.engine import GenerationEngine
from aligner.generation.rewards import wait_for
from aligner.generation.rollouts import PromptDataset, RolloutBatch, RolloutRow, micro_batch_seed, values_at_response
from aligner.runtime.sandbox import SandboxLimits, SandboxPool
from aligner.runtime.seeds import derive_seed
from aligner.training.microbatch_plan import DataParallel

# Counts summed over the data-parallel ranks; every other episode metric is a mean per episode (equal counts per rank).
SUMMED_METRICS = ("episodes/dropped", "episodes/environment_failures", "episodes/infrastructure_failures",
                  "episodes/cut_observations")


@dataclass
class Environments:
    """The sandbox pool and a factory of one environment per episode, built from the rollout section."""

    pool: SandboxPool
    make: Callable[[], Environment]
    description: str
    pool_size: int  # workers: how many episodes step their environments at once

    @classmethod
    def build(cls, rollout: RolloutSection, episodes_at_once: int) -> "Environments":
        """Starts the sandbox workers and checks, before anything else is built, that the environment class loads
        (one instance is made and closed) or that every tool can be described; one line naming the key if not."""
        box = rollout.sandbox
        workers = box.workers or episodes_at_once
        if rollout.environment is not None and workers < episodes_at_once:
            raise ConfigError(f"rollout.sandbox.workers={workers}: each of the {episodes_at_once} episodes a rank runs "
                              "at once holds a worker for its environment; raise it, or leave it null")
        pool = SandboxPool(workers, SandboxLimits(timeout_s=box.timeout_s, memory_mb=box.memory_mb,
                                                  processes=box.processes, network=box.network))
        try:
            if rollout.environment is not None:
                target = BUILTIN.get(rollout.environment, rollout.environment)
                arguments = dict(rollout.environment_args)
                try:
                    SandboxedEnvironment(pool, target, arguments).close()
                except EnvironmentFailure as failure:
                    raise ConfigError(f"rollout.environment={rollout.environment}: {failure}") from None
                return cls(pool, lambda: SandboxedEnvironment(pool, target, arguments),
                           f"environment {rollout.environment}", workers)
            tools = sandboxed_tools(pool, [BUILTIN.get(name, name) for name in rollout.tools])
            return cls(pool, lambda: ToolEnvironment(pool, tools, call_format=rollout.tool_call_format,
                                                     max_parallel_calls=rollout.max_parallel_calls,
                                                     on_bad_call=rollout.on_bad_call),
                       f"tools {', '.join(tools)} ({rollout.tool_call_format} calls)", workers)
        except BaseException:
            pool.close()
            raise


class MicroBatched:
    """A runner that runs episodes in runs of `size` (generation.micro_batch_size), each sampled with the seed of
    its first position in the step (`micro_batch_seed`, as single-turn micro-batches are), so an episode's draws do
    not depend on how many data-parallel ranks share the step. first: the position of the first episode given."""

    def __init__(self, runner: EpisodeRunner, size: int, first: int):
        self.runner, self.size, self.first = runner, size, first

    def run(self, records, names, policy_version: int = 0, seed: Optional[int] = None) -> EpisodeBatch:
        starts = list(range(0, len(records), self.size))
        parts = [self.runner.run(records[start:start + self.size], names[start:start + self.size], policy_version,
                                 seed=None if seed is None else micro_batch_seed(seed, self.first + start))
                 for start in starts]
        return EpisodeBatch.concatenate(parts, starts)


def episode_score(episode: Episode) -> Optional[float]:
    """The environment's reward of an episode: its final reward, else the sum of its turn rewards; None if none."""
    if episode.reward is not None:
        return float(episode.reward)
    turns = [reward for reward in episode.turn_rewards if reward is not None]
    return float(sum(turns)) if turns else None


def final_answer(episode: Episode) -> list[int]:
    """The ids of the episode's last model turn (what a reward function reads as the response)."""
    models = [segment for segment in episode.segments if segment.kind == "model"]
    return list(models[-1].tokens) if models else []


def run_share(runner: EpisodeRunner, prompts: PromptDataset, step_prompts: list[int], cfg: RLActorConfig, *,
              seed: int, policy_version: int, rank: int, ranks: int) -> tuple[EpisodeBatch, list[int]]:
    """Rank `rank`'s groups of a step (prompt indices `step_prompts`, the same on every rank): the prompts
    [rank*N/ranks, (rank+1)*N/ranks), k episodes each, in micro-batches seeded by their positions in the step; a
    group with a dropped episode is replaced by a group of another prompt, drawn from a stream of the step's seed
    and the rank. Returns the episodes and each one's prompt index. The trainer's step and a generation worker's
    (`WorkerEpisodes`) run this, so both make the same episodes from the same weights and seed."""
    k, share = cfg.rollout.samples_per_prompt, len(step_prompts) // ranks
    queue = iter(step_prompts[rank * share:(rank + 1) * share])
    spare = random.Random(derive_seed(seed, rank))  # replacements of dropped groups
    drawn: dict[str, int] = {}

    def draw() -> tuple[dict, str]:
        index = next(queue, None)
        if index is None:
            index = spare.randrange(len(prompts))
        drawn[prompts.record(index)] = index
        return episode_record(prompts, index), prompts.record(index)

    micro_batched = MicroBatched(runner, cfg.generation.micro_batch_size, first=rank * share * k)
    batch = collect_groups(micro_batched, draw, share, k, policy_version, seed=seed)
    return batch, [drawn[name] for name in batch.names]


def episode_record(prompts: PromptDataset, index: int) -> dict:
    """What an environment's reset gets: the prompt record (its prompt as the data gave it, and its columns)."""
    return {"prompt": prompts.prompts[index], **prompts.columns(index)}


def episodes_at_once(cfg: RLActorConfig, data_parallel_size: int) -> int:
    """How many episodes a rank (or its generation worker) runs at once: its share of a step, at most
    generation.micro_batch_size; each holds a sandbox worker for its environment."""
    return min(cfg.rollouts_per_step // data_parallel_size, cfg.generation.micro_batch_size)


def episode_runner(cfg: RLActorConfig, engine: GenerationEngine, tokenizer,
                   environments: Environments) -> EpisodeRunner:
    """The runner of a run's episodes on `engine`: a renderer per tool set on the run's chat template (self-tested
    on the template when made; the runner keeps it), the rollout sampling settings and episode limits."""
    return EpisodeRunner(engine, lambda tools: ChatRenderer(tokenizer, tools=tools, template=cfg.rollout.chat_template),
                         environments.make, rollout_sampling(cfg.generation), cfg.rollout.limits(),
                         parallel_environments=environments.pool_size)


class WorkerEpisodes:
    """A generation worker's program (`aligner.generation.worker.WorkerSpec.program`) for multi-turn episodes:
    the worker reads the run's prompt file and starts its own sandbox pool and environments; each "generate"
    command's work is the step's rollout prompt indices (k per prompt, as the trainer's order gave them) and its
    answer this rank's episodes (`run_share`, the trainer's own code) as JSON-able values with each one's prompt
    index. The trainer scores them (`EpisodeCollector.finish`)."""

    def __init__(self, cfg: RLActorConfig):
        self.cfg = cfg
        self.environments: Optional[Environments] = None

    def open(self, engine: GenerationEngine, tokenizer, spec) -> Callable:
        cfg = self.cfg
        prompts = PromptDataset(cfg.data.prompts, tokenizer, cfg.data.max_prompt_length, cfg.data.chat_template)
        self.environments = Environments.build(cfg.rollout, episodes_at_once(cfg, spec.replicas))
        runner = episode_runner(cfg, engine, tokenizer, self.environments)
        k = cfg.rollout.samples_per_prompt

        def generate(indices: list[int], sampling, version: int) -> dict:
            batch, drawn = run_share(runner, prompts, indices[::k], cfg, seed=sampling.seed, policy_version=version,
                                     rank=spec.replica, ranks=spec.replicas)
            return {"batch": batch.to_plain(), "drawn": drawn}

        return generate

    def close(self) -> None:
        if self.environments is not None:
            self.environments.pool.close()


class EpisodeCollector:
    """Generates and scores an RL run's episodes (collective over the data-parallel ranks).

    engine: this rank's generation engine (the native engine: episodes run at TP = PP = 1); reward_source: what
    scores the conversations, None with reward.source=environment; critic: the critic client when the estimator
    needs values (PPO: it values every position of an episode; GAE reads the model tokens'), else None; order:
    the run's prompt order (saved); environments: the sandbox pool and environment factory.
    """

    def __init__(self, cfg: RLActorConfig, *, chunks: list, engine: GenerationEngine, reward_source, critic=None,
                 prompts: PromptDataset, order, tokenizer, data_parallel: DataParallel, environments: Environments):
        self.cfg, self.chunks, self.engine = cfg, chunks, engine
        self.reward_source, self.critic = reward_source, critic
        self.prompts, self.order, self.tokenizer = prompts, order, tokenizer
        self.data_parallel = data_parallel
        self.environments = environments
        self.runner = episode_runner(cfg, engine, tokenizer, environments)

    def collect(self, seed: int, timings: dict, policy_version: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's batch of a step: its share of the step's prompts, k episodes each, scored; and the metrics."""
        rollout = self.cfg.rollout
        step_prompts = self.order.take(rollout.prompts_per_step)
        batch, drawn = self._run(lambda: run_share(self.runner, self.prompts, step_prompts, self.cfg, seed=seed,
                                                   policy_version=policy_version, rank=self.data_parallel.rank,
                                                   ranks=self.data_parallel.size), timings)
        return self.finish(batch, drawn, timings)

    def finish(self, batch: EpisodeBatch, drawn: list[int], timings: dict,
               versioned: bool = False) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's share of a step's episodes (`run_share`: the batch and each episode's prompt index) as its
        scored batch, and the step's metrics. versioned: each row records its episode's oldest policy version
        (episodes from a generation worker: `aligner.algorithms.rl_async`)."""
        rows = self.score(batch, drawn, self.prompts, timings)
        if versioned:
            for row, episode in zip(rows, batch.episodes):
                row.policy_version = episode.oldest_version
        if self.critic is not None:
            self.attach_values(batch, rows, timings)
        metrics = self.metrics(batch)
        first = self.data_parallel.rank * len(rows)  # this rank's first rollout position in the step
        return to_batch(self.cfg, list(enumerate(rows, start=first)), self.tokenizer.pad_id), metrics

    def generate_and_score(self, indices: list[int], timings: dict, *, seed: int, greedy: bool = False,
                           prompts: Optional[PromptDataset] = None, with_values: bool = False) -> tuple[dict, float]:
        """One episode of each of `indices` (validation: greedy), this rank's share (every D-th); returns (rows by
        position in `indices`, model tokens generated over all ranks). Collective. Dropped episodes are left out."""
        prompts = self.prompts if prompts is None else prompts
        mine = indices[self.data_parallel.rank::self.data_parallel.size]
        positions = list(range(len(indices)))[self.data_parallel.rank::self.data_parallel.size]
        runner = EpisodeRunner(self.engine, self.runner.renderer, self.environments.make,  # (its renderers)
                               rollout_sampling(self.cfg.generation, greedy, seed), self.cfg.rollout.limits(),
                               parallel_environments=self.environments.pool_size)
        names = [prompts.record(index) for index in mine]
        batch = self._run(lambda: runner.run([episode_record(prompts, index) for index in mine], names), timings)
        rows = self.score(batch, [mine[i] for i in batch.indices], prompts, timings)
        local = {positions[i]: row for i, row in zip(batch.indices, rows)}
        return local, self._generated(batch)

    def _run(self, episodes: Callable[[], EpisodeBatch], timings: dict) -> EpisodeBatch:
        tick = time.perf_counter()
        self.engine.refit(self.chunks)
        batch = episodes()
        self.engine.release_for_update()  # training gets the memory of what its update makes stale
        timings["time_generation"] = timings.get("time_generation", 0.0) + time.perf_counter() - tick
        return batch

    def score(self, batch: EpisodeBatch, indices: list[int], prompts: PromptDataset, timings: dict) -> list[RolloutRow]:
        """The episodes as rows with their scores (see the module docstring)."""
        tick = time.perf_counter()
        rows = [episode_row(episode, given_prompt=prompts.prompts[index])
                for episode, index in zip(batch.episodes, indices)]
        if self.reward_source is None:  # reward.source=environment
            for row, episode, name in zip(rows, batch.episodes, batch.names):
                score = episode_score(episode)
                if score is None or not math.isfinite(score):
                    raise EpisodeFailed(f"episode of record {name} ({self.environments.description}) ended "
                                        f"{episode.status} with reward {score}: reward.source=environment needs a "
                                        "finite reward from the environment (or set reward.source=function/server)")
                row.score = score
        elif rows:
            scores = self.reward_source.score_async(
                [episode.tokens for episode in batch.episodes], [prompts.prompts[index] for index in indices],
                [response_text(self.tokenizer, final_answer(episode)) for episode in batch.episodes], batch.names,
                columns=[prompts.columns(index) for index in indices]).result()
            for j, row in enumerate(rows):
                row.score, row.score_replaced = float(scores.values[j]), bool(scores.replaced[j])
                row.score_parts = {name: float(part[j]) for name, part in scores.parts.items()}
        for row, episode in zip(rows, batch.episodes):
            if episode.info.get("failure"):  # kept by on_failure=zero_reward: scored 0, whatever the source says
                row.score, row.score_parts = 0.0, {name: 0.0 for name in row.score_parts}
        if self.cfg.rollout.on_bad_call == "fixed_advantage":
            for row, episode in zip(rows, batch.episodes):
                if episode.info.get("ended_by") == "bad tool call":
                    row.fixed_advantage = self.cfg.rollout.bad_call_advantage
        timings["time_scoring_wait"] = timings.get("time_scoring_wait", 0.0) + time.perf_counter() - tick
        return rows

    def attach_values(self, batch: EpisodeBatch, rows: list[RolloutRow], timings: dict) -> None:
        """The critic's value of every response position of each episode (row.values)."""
        tick = time.perf_counter()
        critic = self.cfg.critic.server
        inferred = wait_for(self.critic.infer_async([episode.tokens for episode in batch.episodes]),
                            lambda: f"the critic server {critic.host}:{critic.port}")
        for j, row in enumerate(rows):
            row.values = values_at_response(torch.as_tensor(inferred.values[j], dtype=torch.float32),
                                            len(row.prompt), len(row.response))
        timings["time_scoring_wait"] = timings.get("time_scoring_wait", 0.0) + time.perf_counter() - tick

    def metrics(self, batch: EpisodeBatch) -> dict[str, float]:
        """The step's episode metrics over all ranks (`EpisodeBatch.metrics`) and the model tokens generated."""
        local = batch.metrics()
        keys = sorted(local)
        if self.data_parallel.size > 1:  # a rank whose episodes made no tool call has no tool-call keys
            gathered = [None] * self.data_parallel.size
            dist.all_gather_object(gathered, keys, group=self.data_parallel.group)
            keys = sorted(set().union(*gathered))
        values = torch.tensor([local.get(key, 0.0) for key in keys], dtype=torch.float64)
        if self.data_parallel.size > 1:
            dist.all_reduce(values, group=self.data_parallel.group)
            values = torch.tensor([value if key in SUMMED_METRICS else value / self.data_parallel.size
                                   for key, value in zip(keys, values.tolist())], dtype=torch.float64)
        metrics = dict(zip(keys, values.tolist()))
        metrics["generated_tokens"] = self._generated(batch)
        return metrics

    def _generated(self, batch: EpisodeBatch) -> float:
        generated = torch.tensor([float(sum(episode.count("model") for episode in batch.episodes))])
        if self.data_parallel.size > 1:
            dist.all_reduce(generated, group=self.data_parallel.group)
        return float(generated.item())

    def response_text(self, response_tokens: torch.Tensor) -> str:
        return response_text(self.tokenizer, response_tokens)

    def close(self) -> None:
        self.environments.pool.close()
        if hasattr(self.reward_source, "close"):
            self.reward_source.close()
