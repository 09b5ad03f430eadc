"""Steps 1-2 of an RL step: the step's prompts generated through the router, k samples each, and scored.

Right after each generation micro-batch the reward requests (and, with a critic, the value requests) are
sent as futures, so scoring overlaps generation. With dynamic sampling (DAPO), groups whose samples all
scored the same are dropped and more prompts are drawn until the batch is full (or the round cap is reached).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from aligner.algorithms.rl_config import GenerationSection, RLActorConfig
from aligner.config import ConfigError
from aligner.generation.engine import GenerationEngine, SamplingParams
from aligner.generation.rewards import ScoreCheck, wait_for
from aligner.generation.rollouts import (
    PromptDataset,
    PromptOrder,
    RolloutBatch,
    collect_rollouts,
    full_sequences,
    values_at_response,
)
from aligner.generation.router_client import rebalance_rollouts
from aligner.rl import advantages
from aligner.runtime.seeds import SAMPLER_SEED_RANGE, derive_seed
from aligner.training.microbatch_plan import DataParallel


def group_indices(prompt_indices: list[int], samples_per_prompt: int) -> list[int]:
    """Each prompt samples_per_prompt times, adjacent: rollout j is a sample of prompt_indices[j // k]."""
    return [index for index in prompt_indices for _ in range(samples_per_prompt)]


class RolloutCollector:
    """Generates and scores an RL run's rollouts (collective over the job).

    engine / router: the generation engine of this replica and the router that hands it prompts;
    reward_source: what scores responses (None: the combined critic server sends the rewards with the
    values); critic: the critic client when the estimator needs values, else None; order: the run's
    prompt order (the actor saves and resumes it); model_parallel_group: this replica's ranks, whose
    first talks to the servers.
    """

    def __init__(self, cfg: RLActorConfig, *, chunks: list, engine: GenerationEngine, router, reward_source, critic,
                 prompts: PromptDataset, order: PromptOrder, tokenizer, data_parallel: DataParallel,
                 model_parallel_group: Optional[dist.ProcessGroup]):
        self.cfg = cfg
        self.chunks = chunks
        self.engine = engine
        self.router = router
        self.reward_source = reward_source
        self.critic = critic
        self.prompts = prompts
        self.order = order
        self.tokenizer = tokenizer
        self.data_parallel = data_parallel
        self.mp_group = model_parallel_group
        self.is_replica_leader = dist.get_rank(model_parallel_group) == 0  # talks to the servers for its replica
        critic_server = cfg.critic.server
        self.combined_check = ScoreCheck(f"critic server {critic_server.host}:{critic_server.port} (combined mode)",
                                         cfg.reward)

    def collect(self, seed: int, timings: dict, policy_version: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's RolloutBatch of a step (k samples per prompt, scored, sampled with `seed`) and the
        rollout metrics; `timings` gets the time spent generating and waiting for scores. (policy_version: the
        step whose weights generate; single-turn rows do not record it.)"""
        rollout, k = self.cfg.rollout, self.cfg.rollout.samples_per_prompt
        timings["time_generation"] = timings["time_scoring_wait"] = 0.0
        if not rollout.dynamic_sampling:
            indices = group_indices(self.order.take(rollout.prompts_per_step), k)
            local, generated = self.generate_and_score(indices, timings, seed=seed,
                                                       with_values=self.critic is not None)
            mine = rebalance_rollouts(local, len(indices), data_parallel_group=self.data_parallel.group)
            return self.to_batch(mine), {"generated_tokens": generated}
        return self.collect_informative(seed, timings)

    def collect_informative(self, seed: int, timings: dict) -> tuple[RolloutBatch, dict[str, float]]:
        """DAPO's dynamic sampling: generate rounds of prompts_per_step prompts x k, keep the groups whose
        k scores differ (the others have advantage 0 and teach nothing), until prompts_per_step groups
        are kept or rollout.max_sampling_rounds rounds ran; a batch still short is filled with the most
        recent uniform groups (counted in `dynamic_sampling_filled_groups`)."""
        rollout, k = self.cfg.rollout, self.cfg.rollout.samples_per_prompt
        needed = rollout.prompts_per_step
        kept: list[list] = []  # groups of RolloutRows
        uniform: list[list] = []
        generated, rounds = 0.0, 0
        while len(kept) < needed and rounds < rollout.max_sampling_rounds:
            indices = group_indices(self.order.take(needed), k)
            round_seed = seed if rounds == 0 else derive_seed(seed, rounds, modulus=SAMPLER_SEED_RANGE)
            local, round_tokens = self.generate_and_score(indices, timings, seed=round_seed,
                                                          with_values=self.critic is not None)
            generated += round_tokens
            rows = self._all_rows(local, len(indices))
            scores = torch.tensor([row.score for row in rows], dtype=torch.float64)
            informative = advantages.informative_groups(scores, k).tolist()
            for group, keep in enumerate(informative):
                (kept if keep else uniform).append(rows[group * k:(group + 1) * k])
            rounds += 1
        filled = max(needed - len(kept), 0)
        groups = kept[:needed] + uniform[len(uniform) - filled:]  # the newest uniform groups when short
        share, rank = needed // self.data_parallel.size, self.data_parallel.rank
        mine = [(position, row) for group in range(rank * share, (rank + 1) * share)
                for position, row in enumerate(groups[group], start=group * k)]
        metrics = {"generated_tokens": generated, "dynamic_sampling_rounds": float(rounds),
                   "dynamic_sampling_kept_fraction": len(kept) / (rounds * needed),
                   "dynamic_sampling_filled_groups": float(filled)}
        return self.to_batch(mine), metrics

    def _all_rows(self, local: dict, count: int) -> list:
        """Every rank's rows of a round, in rollout order, on every rank."""
        parts = [local]
        if self.data_parallel.size > 1:
            parts = [None] * self.data_parallel.size
            dist.all_gather_object(parts, local, group=self.data_parallel.group)
        merged = {position: row for part in parts for position, row in part.items()}
        return [merged[position] for position in range(count)]

    def to_batch(self, mine: list[tuple]) -> RolloutBatch:
        """Rows (position, RolloutRow) as a batch of the run's fixed widths (one sequence length per schedule)."""
        return to_batch(self.cfg, mine, self.tokenizer.pad_id)

    def generate_and_score(self, indices: list[int], timings: dict, *, seed: int, greedy: bool = False,
                           prompts=None, with_values: bool = True) -> tuple[dict, float]:
        """Generate the prompts `indices` through the router and score them; returns (this replica's rows
        by position in `indices`, response tokens generated over all ranks). Collective."""
        scoring = _Scoring(self.prompts if prompts is None else prompts, indices, with_values)

        def on_generated(micro_indices, rollout):  # score each micro-batch as soon as it is generated
            responses = [self.response_text(rollout.response_tokens[row, :int(rollout.response_lengths[row])])
                         for row in range(len(micro_indices))]
            self.send_scoring(scoring, micro_indices, full_sequences(rollout), responses)

        tick = time.perf_counter()
        self.engine.refit(self.chunks)
        sampling = rollout_sampling(self.cfg.generation, greedy, seed)
        local = collect_rollouts(self.engine, self.router, scoring.tokens, sampling, on_generated)
        self.engine.release_for_update()  # training gets the memory of what its update makes stale
        timings["time_generation"] = timings.get("time_generation", 0.0) + time.perf_counter() - tick
        return self.await_scores(scoring, local, timings)

    def score(self, local: dict, indices: list[int], timings: dict) -> tuple[dict, float]:
        """Score rows generated elsewhere (a generation worker: `aligner.algorithms.rl_async`), by position in
        `indices`, as `generate_and_score` scores its own: the requests in micro-batches of
        generation.micro_batch_size rows, then the answers. Returns what generate_and_score returns."""
        scoring = _Scoring(self.prompts, indices, self.critic is not None)
        positions = sorted(local)
        size = self.cfg.generation.micro_batch_size
        for first in range(0, len(positions), size):
            micro_indices = positions[first:first + size]
            rows = [local[position] for position in micro_indices]
            self.send_scoring(scoring, micro_indices, [row.prompt + row.response.tolist() for row in rows],
                              [self.response_text(row.response) for row in rows])
        return self.await_scores(scoring, local, timings)

    def send_scoring(self, scoring: "_Scoring", micro_indices: list[int], sequences: list, responses: list) -> None:
        """The reward (and, with a critic, value) requests of one micro-batch, as futures (the replica's leader)."""
        if not self.is_replica_leader:
            return
        values = self.critic.infer_async(sequences) if (scoring.with_values or self.reward_source is None) else None
        rewards = None  # combined critic server: the rewards arrive with the values
        if self.reward_source is not None:
            rewards = self.reward_source.score_async(sequences, [scoring.given_prompts[i] for i in micro_indices],
                                                     responses, [scoring.records[i] for i in micro_indices],
                                                     columns=[scoring.given_columns[i] for i in micro_indices])
        scoring.pending.append((micro_indices, rewards, values))

    def await_scores(self, scoring: "_Scoring", local: dict, timings: dict) -> tuple[dict, float]:
        """Attach the answers of the pending requests to the rows; (this replica's rows, response tokens
        generated over all ranks). Collective."""
        records = scoring.records
        for position, row in local.items():
            row.given_prompt = scoring.given_prompts[position]
        tick = time.perf_counter()
        critic = self.cfg.critic.server
        for micro_indices, rewards, values in scoring.pending:
            inferred = wait_for(values, lambda: f"the critic server {critic.host}:{critic.port}") if (
                values is not None) else None
            if rewards is not None:
                scores = rewards.result()
            elif inferred.rewards is None:
                raise ConfigError("reward.source=combined, but the critic server sent no rewards: start it in combined "
                                  "mode (combined.reward_model_init_from=<reward-model checkpoint>)")
            else:
                scores = self.combined_check(inferred.rewards.tolist(), [records[i] for i in micro_indices])
            value_rows = inferred.values if (inferred is not None and scoring.with_values) else None  # [rows, columns]
            for j, position in enumerate(micro_indices):
                row = local[position]
                row.score, row.score_replaced = float(scores.values[j]), bool(scores.replaced[j])
                row.score_parts = {name: float(part[j]) for name, part in scores.parts.items()}
                if value_rows is not None:
                    row.values = values_at_response(torch.as_tensor(value_rows[j], dtype=torch.float32),
                                                    len(row.prompt), len(row.response))
        timings["time_scoring_wait"] = timings.get("time_scoring_wait", 0.0) + time.perf_counter() - tick
        if dist.get_world_size(self.mp_group) > 1:  # the replica's other ranks get the scores too
            holder = [local]
            dist.broadcast_object_list(holder, src=dist.get_global_rank(self.mp_group, 0), group=self.mp_group)
            local = holder[0]
        generated = torch.tensor([float(sum(len(row.response) for row in local.values()))])
        dist.all_reduce(generated, group=self.data_parallel.group)
        return local, float(generated.item())

    def response_text(self, response_tokens: torch.Tensor) -> str:
        return response_text(self.tokenizer, response_tokens)

    def close(self) -> None:
        self.router.close()
        if hasattr(self.reward_source, "close"):
            self.reward_source.close()


class _Scoring:
    """What scoring the rollouts of prompts `indices` needs: the prompts' tokens, as the data gave them (for
    reward functions), their records' other columns, "file:line" (for messages), and the pending requests."""

    def __init__(self, prompts, indices: list[int], with_values: bool):
        self.tokens = [prompts.tokens[i] for i in indices]
        self.given_prompts = [prompts.prompts[i] for i in indices]
        self.given_columns = [prompts.columns(i) for i in indices]
        self.records = [prompts.record(i) for i in indices]
        self.with_values = with_values
        self.pending: list = []  # (micro-batch positions, pending scores, values future)


def rollout_sampling(gen: GenerationSection, greedy: bool = False, seed: int = 0) -> SamplingParams:
    """The sampling of the run's rollouts (greedy: validation's)."""
    return SamplingParams(max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
                          temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, greedy=greedy,
                          stop_strings=list(gen.stop_strings), fixed_length=gen.fixed_length, seed=seed)


def response_text(tokenizer, response_tokens) -> str:
    """What reward functions and sample tables read; the tokens themselves go on unchanged."""
    ids = [t for t in torch.as_tensor(response_tokens).tolist() if t != tokenizer.eos_id]
    return tokenizer.decode(ids)


def to_batch(cfg: RLActorConfig, mine: list[tuple], pad_id: int) -> RolloutBatch:
    """Rows (position, RolloutRow) as a batch of the run's fixed widths (one sequence length per schedule)."""
    return RolloutBatch.from_rows(mine, pad_id, seq_length=cfg.sequence_length, response_width=cfg.response_width)
