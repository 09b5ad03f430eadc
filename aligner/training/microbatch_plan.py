"""The RL policy update's micro batches: a planner handed a step's rollouts once, returning typed micro batches.

A minibatch's rollouts are laid out in one of three ways (`MicroBatchPlanner`):
- padded: trainer.micro_batch_size rows per micro batch, one right-padded row per sequence;
- packed (`aligner.models.packing`): the minibatch's sequences end to end in rows of `row_length`,
  `rows_per_micro_batch` rows per micro batch; where packed rows share prompts, a prompt's samples
  hold it once;
- token budgets (packing.micro_batch_tokens): the minibatch of every data-parallel rank balanced across
  the ranks by tokens, each rank's share cut into micro batches of at most that many tokens, as many on
  every rank. Every rank then plans from the rollouts of all ranks (`StepPlan.rows`).

The logprob pass of a step (`StepPlan.logprobs`) packs the first epoch's micro batches, so the first
minibatch's sequences sit exactly where the update puts them: a sequence's float rounding depends on
its place in a row, and with the same rows the first minibatch's ratio is exactly 1.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from aligner.data.loader import MicroBatchLoader
from aligner.generation.rollouts import RolloutBatch
from aligner.models import packing
from aligner.models.packed_logprobs import sequence_logprobs
from aligner.models.packing import PackedRows, SharedPromptPackingSection
from aligner.runtime.distributed import device
from aligner.runtime.seeds import derive_seed

Plan = list[list[list[int]]]  # row indices per packed row per micro batch


# ----------------------------------------------------------------------------- records
@dataclass
class SequenceRows:
    """Right-padded rollouts as the logprob pass and the policy micro batches read them (a RolloutBatch's
    tensors, or those of every data-parallel rank, rank r's rows at r * B ...)."""

    tokens: torch.Tensor  # [B, S] prompt + response from column 0
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] bool, True on response tokens
    engine_logprobs: Optional[torch.Tensor] = None  # [B, T] the generation engine's

    @classmethod
    def of(cls, batch: RolloutBatch) -> "SequenceRows":
        return cls(batch.tokens, batch.prompt_lengths, batch.response_lengths, batch.mask, batch.engine_logprobs)

    @property
    def count(self) -> int:
        return self.tokens.shape[0]


@dataclass
class PolicyTargets:
    """Per rollout ([B, T] over response tokens) what the policy loss weighs its logprobs with."""

    advantages: torch.Tensor  # [B, T]
    # [B, T] the rollout policy's; None: the update's own forward gives them (detached), and the
    # engine/trainer mismatch is measured on that forward
    old_logprobs: Optional[torch.Tensor]
    importance_weights: Optional[torch.Tensor] = None  # [B, T] truncated IS weights (engine -> trainer), or None


@dataclass
class PolicyMicrobatch:
    """One micro batch of the policy loss; loss_scale turns its aggregated sum into its share of the
    minibatch loss (`MicroBatchPlanner.scale_losses`). Packed (`packed` set): tokens and position_ids
    are its b sequences laid end to end in r rows (`aligner.models.packing`); the per-sequence tensors
    are as in the padded layout."""

    tokens: torch.Tensor  # [b, S], or [r, L] packed
    position_ids: torch.Tensor  # [b, S], or [r, L] packed
    prompt_lengths: torch.Tensor  # [b]
    response_lengths: torch.Tensor  # [b]
    mask: torch.Tensor  # [b, T] bool
    old_logprobs: Optional[torch.Tensor]  # [b, T]; None: this forward's own logprobs, detached
    advantages: torch.Tensor  # [b, T]
    importance_weights: Optional[torch.Tensor]  # [b, T] or None
    loss_scale: float
    packed: Optional[PackedRows] = None  # the b sequences as packed rows, or None: padded
    engine_logprobs: Optional[torch.Tensor] = None  # [b, T] with old_logprobs None: the mismatch is measured here

    @property
    def real_tokens(self) -> int:
        """Tokens the forward runs over, padding not counted (a shared prompt once)."""
        if self.packed is not None:
            return self.packed.real_tokens
        return int(self.prompt_lengths.sum() + self.response_lengths.sum())


@dataclass
class PTXMicrobatch:
    """One micro batch of the next-token (PTX) loss mixed into the policy update."""

    tokens: torch.Tensor  # [b, S]
    labels: torch.Tensor  # [b, S]
    loss_mask: torch.Tensor  # [b, S]
    position_ids: torch.Tensor  # [b, S]
    lengths: torch.Tensor  # [b]
    loss_scale: float

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


Microbatch = Union[PolicyMicrobatch, PTXMicrobatch]


@dataclass
class DataParallel:
    """This rank's place among the data-parallel ranks."""

    group: Optional[dist.ProcessGroup]  # None: the default group
    rank: int
    size: int

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (each [B, ...], equal B), concatenated in rank order."""
        if self.size == 1:
            return tensor
        local = tensor.to(device())
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts).to(tensor.device)

    def gather_sequence_rows(self, rows: SequenceRows) -> SequenceRows:
        """The rollouts of every rank (rank r's rows at r * B ...), on every rank; the engine's logprobs left out
        (`StepPlan.minibatches` gathers them where the update reads them)."""
        return SequenceRows(self.gather_rows(rows.tokens), self.gather_rows(rows.prompt_lengths),
                            self.gather_rows(rows.response_lengths), self.gather_rows(rows.mask))


# ----------------------------------------------------------------------------- the planner
class MicroBatchPlanner:
    """Lays out the policy update's micro batches (and the logprob pass's) of a run; `plan_step` hands it
    a step's rollouts.

    packs / shares_prompts: whether batches are packed at this layout (`packing.packs_here`) and packed
    rows share prompts (`packing.shares_prompts_here`); minibatch_size: rollouts per minibatch over all
    ranks (trainer.global_batch_size); normalizer: what the loss aggregation divides a micro batch's
    summed loss by, for its mask [b, T]; ptx_loader: the PTX data's loader, mixed into every minibatch.
    """

    def __init__(self, section: SharedPromptPackingSection, *, packs: bool, shares_prompts: bool, seq_length: int,
                 micro_batch_size: int, minibatch_size: int, samples_per_prompt: int, seed: int, pad_id: int,
                 data_parallel: DataParallel, normalizer: Callable[[torch.Tensor], float], ptx_coef: float = 0.0,
                 ptx_loader: Optional[MicroBatchLoader] = None):
        self.section = section
        self.packs = packs
        self.shares_prompts = shares_prompts
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.samples_per_prompt = samples_per_prompt
        self.seed = seed
        self.pad_id = pad_id
        self.data_parallel = data_parallel
        self.minibatch_rows = minibatch_size // data_parallel.size  # this rank's rollouts per minibatch
        self.normalizer = normalizer
        self.ptx_coef = ptx_coef
        self.ptx_loader = ptx_loader
        self._ptx_batches = None

    @property
    def uses_token_budget(self) -> bool:
        return self.section.micro_batch_tokens is not None and self.packs

    @property
    def _doubles_rows(self) -> bool:
        section = self.section
        return (section.row_length is None and section.micro_batch_tokens is None
                and self.samples_per_prompt > 1 and self.shares_prompts)

    @property
    def row_length(self) -> int:
        """Tokens per packed row: packing.row_length; null: the padded row's length, twice that where
        several samples of a prompt share it without a token budget (room for a group: prompt + samples;
        attention's cost per token, which grows with the row, at most doubles). Rows are then cut to
        the longest of each micro batch (`pack_rows(trim=True)`)."""
        if self.section.row_length is not None:
            return self.section.row_length
        return self.seq_length * (2 if self._doubles_rows else 1)

    @property
    def rows_per_micro_batch(self) -> int:
        """Packed rows per micro batch: trainer.micro_batch_size (half that, at least 1, of the doubled
        default rows: about as many token slots as before)."""
        micro = self.micro_batch_size
        return max(1, micro // 2) if self._doubles_rows else micro

    def plan_step(self, step: int, rows: SequenceRows) -> "StepPlan":
        """The micro batches of step `step`, whose rollouts on this rank are `rows` (collective with token budgets)."""
        return StepPlan(self, step, rows)

    def minibatch_order(self, step: int, rows: int, epoch: int, rank: Optional[int] = None) -> torch.Tensor:
        """A rank's (default: this one's) rows in the order an epoch's minibatches take them (consecutive slices)."""
        generator = torch.Generator().manual_seed(derive_seed(
            self.seed, step, epoch, self.data_parallel.rank if rank is None else rank, weights=(131, 17, 1),
            seed_weight=7919))
        return torch.randperm(rows, generator=generator)

    def prompts_of(self, rows: SequenceRows, members: list[int]) -> Optional[tuple[list[int], list[tuple]]]:
        """(prompt lengths, prompt keys) of the sequences `members` of `rows` where prompts are shared
        (`packing.shared_prompt_rows` lays out each prompt's samples together), else None."""
        if not self.shares_prompts:
            return None
        ids = torch.tensor(members, dtype=torch.long)  # long also when empty (an evened micro batch)
        prompt_lengths = rows.prompt_lengths[ids]
        return prompt_lengths.tolist(), packing.prompt_keys(rows.tokens[ids], prompt_lengths)

    def budget_plan(self, rows: SequenceRows, step: int, epoch: int, minibatch: int) -> Plan:
        """This rank's token-budget micro batches of a minibatch, as row indices (into `rows`, the rollouts
        of every rank) per packed row per micro batch; an empty micro batch has no rows. The minibatch
        holds every rank's share of it (each rank's own order), balanced across ranks. Where prompts are
        shared, a prompt's samples are planned together and its tokens counted once."""
        ranks = self.data_parallel.size
        local = rows.count // ranks
        window = slice(minibatch * self.minibatch_rows, (minibatch + 1) * self.minibatch_rows)
        ids = torch.cat([self.minibatch_order(step, local, epoch, rank)[window] + rank * local
                         for rank in range(ranks)]).tolist()
        lengths = (rows.prompt_lengths + rows.response_lengths).tolist()
        prompts = self.prompts_of(rows, ids)
        if prompts is None:  # an item a sequence
            items, item_prompts = [[position] for position in range(len(ids))], None
        else:  # an item a prompt's samples that share a row with it once, counted so
            items = packing.shared_prompt_parts([lengths[i] for i in ids], *prompts, self.row_length)
            item_prompts = [[(prompts[0][p], prompts[1][p]) for p in item] for item in items]
        plan = packing.plan_token_budget([[lengths[ids[p]] for p in item] for item in items], ranks,
                                         self.section.micro_batch_tokens, self.row_length,
                                         item_prompts)[self.data_parallel.rank]
        micro_batches = []
        for batch in plan:
            positions = [p for item in batch for p in items[item]]
            shared = None  # the minibatch's prompt keys, computed once above
            if prompts is not None:
                shared = ([prompts[0][p] for p in positions], [prompts[1][p] for p in positions])
            layout = packing.packed_rows_plan([lengths[ids[p]] for p in positions], self.row_length, shared,
                                              no_more_rows=True)
            micro_batches.append([[ids[positions[i]] for i in row] for row in layout])
        return micro_batches

    def packed_plan(self, rows: SequenceRows, ids: torch.Tensor) -> Plan:
        """Packed micro batches of the rows `ids` of `rows`: row indices per packed row per micro batch."""
        lengths = (rows.prompt_lengths[ids] + rows.response_lengths[ids]).tolist()
        return [[[int(ids[i]) for i in row] for row in packed_rows]
                for packed_rows in packing.plan_micro_batches(lengths, self.row_length, self.rows_per_micro_batch,
                                                              self.prompts_of(rows, ids.tolist()))]

    def logprob_plan(self, rows: SequenceRows, step: int) -> Plan:
        """The packed logprob pass's micro batches: the first epoch's (see the module's docstring). With
        token budgets `rows` holds every rank's rollouts and the plan is this rank's share of them."""
        if self.uses_token_budget:
            minibatches = rows.count // self.data_parallel.size // self.minibatch_rows
            return [micro for minibatch in range(minibatches) for micro in self.budget_plan(rows, step, 0, minibatch)
                    if micro]
        order = self.minibatch_order(step, rows.count, 0)
        return [micro for start in range(0, rows.count, self.minibatch_rows)
                for micro in self.packed_plan(rows, order[start:start + self.minibatch_rows])]

    def policy_microbatches(self, rows: SequenceRows, targets: PolicyTargets, ids: torch.Tensor,
                            plan: Optional[Plan] = None) -> list[PolicyMicrobatch]:
        """The minibatch `ids` (indices into `rows`) as micro batches: padded rows, trainer.micro_batch_size
        sequences each; or packed, the minibatch's sequences laid end to end in rows of `row_length`, so
        fewer micro batches carry the same tokens; or as `plan` says (a token-budget plan, `budget_plan`).
        Every loss aggregation is a sum over sequences, so the minibatch loss is the same whichever micro
        batch a sequence lands in. Loss scales are 1 (`scale_losses` sets them)."""
        weights, old_logprobs = targets.importance_weights, targets.old_logprobs

        def microbatch(part: torch.Tensor, **layout) -> PolicyMicrobatch:
            return PolicyMicrobatch(
                prompt_lengths=rows.prompt_lengths[part], response_lengths=rows.response_lengths[part],
                mask=rows.mask[part], old_logprobs=None if old_logprobs is None else old_logprobs[part],
                advantages=targets.advantages[part], importance_weights=None if weights is None else weights[part],
                loss_scale=1.0, engine_logprobs=rows.engine_logprobs[part] if old_logprobs is None else None,
                **layout)

        if not self.packs:
            positions = torch.arange(self.seq_length).unsqueeze(0).expand(self.micro_batch_size, -1)
            return [microbatch(part, tokens=rows.tokens[part], position_ids=positions[:len(part)])
                    for part in ids.split(self.micro_batch_size)]
        lengths = (rows.prompt_lengths + rows.response_lengths).tolist()
        sequences = [rows.tokens[row, :length] for row, length in enumerate(lengths)]
        prompt_lengths = rows.prompt_lengths.tolist() if self.shares_prompts else None
        microbatches = []
        for packed_rows in self.packed_plan(rows, ids) if plan is None else plan:
            if not packed_rows:
                empty = packing.empty_packed_rows(self.pad_id)
                microbatches.append(microbatch(torch.zeros(0, dtype=torch.long), tokens=empty.tokens,
                                               position_ids=empty.position_ids, packed=empty))
                continue
            members, packed = packing.pack_micro_batch(sequences, packed_rows, self.row_length, self.pad_id,
                                                       prompt_lengths, trim=True)
            microbatches.append(microbatch(torch.tensor(members), tokens=packed.tokens,
                                           position_ids=packed.position_ids, packed=packed))
        return microbatches

    def ptx_microbatches(self) -> list[PTXMicrobatch]:
        """The PTX loader's next micro batches (none without PTX data), each as long as its longest sequence
        where batches are packed (one pipeline stage, as the packed policy rows cut to their longest), else
        padded to the rollouts' sequence length (a pipeline schedule sends one shape between stages)."""
        if self.ptx_loader is None:
            return []
        if self._ptx_batches is None:
            self._ptx_batches = self.ptx_loader.iterate(0)

        def pad(tensor, value):
            if self.packs:
                return tensor
            return torch.nn.functional.pad(tensor, (0, self.seq_length - tensor.shape[1]), value=value)

        return [PTXMicrobatch(tokens=pad(mb["tokens"], self.pad_id), labels=pad(mb["labels"], self.pad_id),
                              loss_mask=pad(mb["loss_mask"], 0.0), position_ids=pad(mb["position_ids"], 0),
                              lengths=mb["lengths"], loss_scale=1.0)
                for mb in next(self._ptx_batches)]

    def scale_losses(self, microbatches: list[Microbatch]) -> list[Microbatch]:
        """Each micro batch with its loss_scale: (micro batches in the minibatch over all ranks) / (the
        minibatch's normaliser of its kind over all ranks), times the PTX coefficient for PTX batches."""
        policy_count, ptx_count = 0.0, 0.0
        for mb in microbatches:
            if isinstance(mb, PTXMicrobatch):
                ptx_count += float(mb.loss_mask.sum())
            else:
                policy_count += self.normalizer(mb.mask)
        totals = torch.tensor([policy_count, ptx_count, float(len(microbatches))], dtype=torch.float64)
        dist.all_reduce(totals, group=self.data_parallel.group)
        policy_total, ptx_total, microbatch_total = totals.tolist()
        policy_scale = microbatch_total / max(policy_total, 1.0)
        ptx_scale = microbatch_total * self.ptx_coef / max(ptx_total, 1.0)
        return [replace(mb, loss_scale=ptx_scale if isinstance(mb, PTXMicrobatch) else policy_scale)
                for mb in microbatches]


class StepPlan:
    """One step's micro batches, from its rollouts on this rank (`MicroBatchPlanner.plan_step`)."""

    def __init__(self, planner: MicroBatchPlanner, step: int, rows: SequenceRows):
        self.planner = planner
        self.step = step
        self.local_rows = rows

    @cached_property
    def rows(self) -> SequenceRows:
        """The rollouts the plans index: with token budgets those of every rank (gathered once, where first
        needed: a collective), else this rank's."""
        planner = self.planner
        return planner.data_parallel.gather_sequence_rows(self.local_rows) if planner.uses_token_budget else (
            self.local_rows)

    def logprobs(self, chunks: list, vocab_size: int, temperature: float, response_width: int) -> torch.Tensor:
        """This rank's rollouts' logprobs [B, response_width] under the model `chunks`, on the host. With token
        budgets every rank computes the rows the first epoch trains on it (of the rollouts of all ranks);
        the sum over ranks (each row nonzero on one rank only, so exact) hands each rank its own rows."""
        planner, rows = self.planner, self.rows
        result = sequence_logprobs(chunks, rows.tokens, rows.prompt_lengths, rows.response_lengths,
                                   vocab_size=vocab_size, packing=planner.section, pad_id=planner.pad_id,
                                   temperature=temperature, response_width=response_width,
                                   micro_batch_size=planner.rows_per_micro_batch,
                                   plan=planner.logprob_plan(rows, self.step), row_length=planner.row_length,
                                   share_prompts=planner.shares_prompts, trim=True)
        if planner.uses_token_budget:
            result = result.to(device())
            dist.all_reduce(result, group=planner.data_parallel.group)
            local, rank = self.local_rows.count, planner.data_parallel.rank
            result = result[rank * local:(rank + 1) * local]
        return result.cpu()

    def minibatches(self, targets: PolicyTargets, epochs: int) -> Iterator[list[Microbatch]]:
        """Each minibatch of `epochs` passes over the step's rollouts (`targets` of this rank's rows): its
        policy micro batches, then the PTX ones, loss-scaled (collective: one all-reduce a minibatch)."""
        planner, budget = self.planner, self.planner.uses_token_budget
        rows = self.local_rows
        if budget:  # every rank's rollouts, rows in rank order: a token-budget plan draws on them all
            gather = planner.data_parallel.gather_rows
            rows = replace(self.rows, engine_logprobs=gather(rows.engine_logprobs)
                           if targets.old_logprobs is None else None)
            weights, old_logprobs = targets.importance_weights, targets.old_logprobs
            targets = PolicyTargets(advantages=gather(targets.advantages),
                                    old_logprobs=None if old_logprobs is None else gather(old_logprobs),
                                    importance_weights=None if weights is None else gather(weights))
        count = self.local_rows.count
        for epoch in range(epochs):
            order = planner.minibatch_order(self.step, count, epoch)
            for minibatch, start in enumerate(range(0, count, planner.minibatch_rows)):
                ids = order[start:start + planner.minibatch_rows]
                plan = planner.budget_plan(rows, self.step, epoch, minibatch) if budget else None
                microbatches = planner.policy_microbatches(rows, targets, ids, plan)
                yield planner.scale_losses(microbatches + planner.ptx_microbatches())
