"""Spreading rollout generation over data-parallel ranks, and evening the results out for training.

    router = DynamicRouter(micro_batch_size=8)                 # collective: every rank constructs it
    work = router.route(len(prompts), lambda idx: generate([prompts[i] for i in idx]))
    mine = rebalance_rollouts(work.results, len(prompts))      # [(index, rollout)], equal share per rank

`DynamicRouter`: global rank 0 serves a queue of micro-batches of prompt indices
(`aligner.generation.work_queue.WorkQueueServer`); every data-parallel replica takes the next micro-batch,
generates it, and comes back for more until the queue is empty. A slow replica therefore takes
fewer prompts instead of holding the others up. `StaticRouter` deals the micro-batches out
round-robin instead (the fixed split, for comparison and for runs that want no server).

Model parallelism: a replica spans a model-parallel group (TP x PP ranks) that generates
collectively. Only the group's first rank talks to the queue; it broadcasts each micro-batch to
the group, so all its ranks call `generate_fn` with the same indices.

After routing, replicas hold different numbers of rollouts. `rebalance_rollouts` redistributes
them so every data-parallel rank trains on an equal, contiguous block of prompt indices (rank r
gets indices [r*N/D, (r+1)*N/D)), whatever replica generated them: training then sees exactly
the batch a static split would have given it.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from aligner.generation.engine import Rollout
from aligner.generation.work_queue import RouterError, WorkQueueClient, WorkQueueServer
from aligner.runtime.errors import ConfigError

T = TypeVar("T")
GenerateFn = Callable[[list[int]], Sequence[Any]]  # micro-batch of item indices -> one result per index
NextIndices = Callable[[], Optional[list[int]]]  # the next micro-batch handed to this replica, None: no more
# next_indices -> (micro-batch, one result per index) as each micro-batch completes, after next_indices gave None
GenerateStreamFn = Callable[[NextIndices], Iterable[tuple[list[int], Sequence[Any]]]]


@dataclass
class RoutedWork:
    """What one data-parallel replica generated in a routing round."""

    results: dict[int, Any] = field(default_factory=dict)  # item index -> generate_fn's result for it
    micro_batches: list[list[int]] = field(default_factory=list)  # in the order they were generated
    seconds: float = 0.0  # wall time of the round on this rank


def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _run_micro_batch(indices: list[int], generate_fn: GenerateFn, work: RoutedWork) -> None:
    _record(indices, generate_fn(indices), work)


def _record(indices: list[int], results: Sequence[Any], work: RoutedWork) -> None:
    results = list(results)
    if len(results) != len(indices):
        raise ValueError(f"generate_fn returned {len(results)} results for a micro-batch of {len(indices)} prompts")
    for index, result in zip(indices, results):
        if index in work.results:
            raise RouterError(f"prompt {index} was handed out twice")  # an internal invariant, checked anyway
        work.results[index] = result
    work.micro_batches.append(indices)


def _broadcast_in_group(value: Any, group) -> Any:
    """`value` of the group's first rank, on every rank of the group (no-op for a group of one)."""
    if group is None or _group_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


class StaticRouter:
    """Micro-batch b goes to data-parallel rank b mod D: a fixed split, whatever the ranks' speed.

    replica / replicas: this rank's place and D when they are not the group's (a generation worker, a world of
    its own, generating one trainer rank's share)."""

    def __init__(self, *, micro_batch_size: int, data_parallel_group=None, replica: Optional[int] = None,
                 replicas: Optional[int] = None):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.data_parallel_group = data_parallel_group
        self.replica = _group_rank(data_parallel_group) if replica is None else replica
        self.replicas = _group_size(data_parallel_group) if replicas is None else replicas

    def route(self, num_items: int, generate_fn: GenerateFn) -> RoutedWork:
        start = time.monotonic()
        work = RoutedWork()
        for indices in self._micro_batches(num_items):
            _run_micro_batch(indices, generate_fn, work)
        work.seconds = time.monotonic() - start
        return work

    def route_stream(self, num_items: int, generate_stream_fn: GenerateStreamFn) -> RoutedWork:
        """`route` for a generator that takes this rank's micro-batches as it can start them (continuous
        batching across micro-batches, see NativeEngine.generate_stream)."""
        start = time.monotonic()
        work = RoutedWork()
        mine = iter(self._micro_batches(num_items))
        for indices, results in generate_stream_fn(lambda: next(mine, None)):
            _record(indices, results, work)
        work.seconds = time.monotonic() - start
        return work

    def _micro_batches(self, num_items: int) -> list[list[int]]:
        starts = range(0, num_items, self.micro_batch_size)
        return [list(range(first, min(first + self.micro_batch_size, num_items)))
                for batch_number, first in enumerate(starts) if batch_number % self.replicas == self.replica]

    def close(self) -> None:
        pass


class DynamicRouter:
    """Micro-batches handed out from a queue on global rank 0 until it is empty (collective).

    Every rank of the job constructs it (rank 0 starts the queue server) and calls `route` with the
    same `num_items`. data_parallel_group: ranks that generate different prompts (None: all
    ranks). model_parallel_group: the ranks of this replica that generate together (None: each
    rank is its own replica). host: interface rank 0 binds and the address the others connect to;
    None: $MASTER_ADDR if set, else 127.0.0.1. port: the port it listens on (the RL actor's
    generation.router_port); 0: a free one. timeout_s bounds connecting, each answer, and a
    whole round.
    """

    def __init__(self, *, micro_batch_size: int, data_parallel_group=None, model_parallel_group=None,
                 host: Optional[str] = None, port: int = 0, timeout_s: float = 600.0):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.data_parallel_group = data_parallel_group
        self.model_parallel_group = model_parallel_group
        self.timeout_s = timeout_s
        self._round = 0
        self._server: Optional[WorkQueueServer] = None
        self._client: Optional[WorkQueueClient] = None
        host = host or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        is_global_zero = not dist.is_initialized() or dist.get_rank() == 0
        if is_global_zero:
            try:
                self._server = WorkQueueServer(host, port)
            except OSError as error:
                raise ConfigError(f"the rollout router cannot listen on {host}:{port} ({error.strerror or error}): "
                                  "choose another generation.router_port (0: a free port)") from None
        address = [self._server.address if self._server else None]
        if dist.is_initialized():
            dist.broadcast_object_list(address, src=0)
        if self._is_replica_leader:
            self._client = WorkQueueClient(address[0], timeout_s=timeout_s)

    @property
    def _is_replica_leader(self) -> bool:
        return self.model_parallel_group is None or _group_rank(self.model_parallel_group) == 0

    def route(self, num_items: int, generate_fn: GenerateFn) -> RoutedWork:
        """Generate all `num_items` items across the replicas; returns what this replica generated."""
        work = RoutedWork()
        next_indices = self._start_round(num_items)
        while (indices := next_indices()) is not None:
            _run_micro_batch(indices, generate_fn, work)
        work.seconds = time.monotonic() - self._round_start
        return work

    def route_stream(self, num_items: int, generate_stream_fn: GenerateStreamFn) -> RoutedWork:
        """`route` for a generator that takes micro-batches from the queue as it can start them (continuous
        batching across micro-batches, see NativeEngine.generate_stream); it must ask until it gets None."""
        work = RoutedWork()
        next_indices = self._start_round(num_items)
        for indices, results in generate_stream_fn(next_indices):
            _record(indices, results, work)
        work.seconds = time.monotonic() - self._round_start
        return work

    def _start_round(self, num_items: int) -> NextIndices:
        """Start a routing round (collective); returns the function that takes this replica's next micro-batch
        from the queue (collective over the model-parallel group; None once the queue is empty)."""
        self._round_start = start = time.monotonic()
        self._round += 1
        if self._server is not None:
            self._server.queue.start_round(self._round, num_items, self.micro_batch_size)
        if dist.is_initialized():
            dist.barrier()  # nobody asks for this round before rank 0 has started it
        worker = _group_rank(self.data_parallel_group)
        # +1: the last request is the one that finds the queue empty.
        requests_left = [math.ceil(num_items / self.micro_batch_size) + 1]

        def next_indices() -> Optional[list[int]]:
            if requests_left[0] == 0:
                raise RouterError(f"routing round {self._round}: the queue handed out more micro-batches than exist")
            requests_left[0] -= 1
            if time.monotonic() - start > self.timeout_s:
                raise RouterError(f"routing round {self._round} took longer than {self.timeout_s:.0f} s")
            indices = self._client.next_batch(self._round, worker) if self._client is not None else None
            indices = _broadcast_in_group(indices, self.model_parallel_group)
            return indices or None
        return next_indices

    def assignments(self) -> dict[int, list[int]]:
        """Rank 0 only: data-parallel rank -> indices it took in the last round (for logs and tests)."""
        if self._server is None:
            raise RuntimeError("only global rank 0 holds the router's assignment log")
        return {worker: list(indices) for worker, indices in self._server.queue.assigned.items()}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if dist.is_initialized():
            dist.barrier()  # every client is gone before the server stops
        if self._server is not None:
            self._server.close()
            self._server = None


def rebalance_rollouts(local: Mapping[int, T], num_items: int, *, data_parallel_group=None) -> list[tuple[int, T]]:
    """This rank's equal share of all items, as [(index, item)] sorted by index (collective over DP).

    local: the items this replica generated (`RoutedWork.results`); across the data-parallel
    group they must cover 0..num_items-1 exactly once. Rank r receives indices
    [r*num_items/D, (r+1)*num_items/D). Items travel as pickled objects (tensors inside are fine).
    """
    size, rank = _group_size(data_parallel_group), _group_rank(data_parallel_group)
    if num_items % size:
        raise ValueError(
            f"{num_items} rollouts cannot be split equally over {size} data-parallel ranks; make the number of "
            f"prompts per step a multiple of the data-parallel size"
        )
    share = num_items // size
    buckets: list[dict[int, T]] = [{} for _ in range(size)]
    for index, item in local.items():
        if not 0 <= index < num_items:
            raise ValueError(f"rollout index {index} is outside 0..{num_items - 1}")
        buckets[index // share][index] = item
    if size == 1:
        received = [buckets]
    else:
        received = [None] * size
        dist.all_gather_object(received, buckets, group=data_parallel_group)
    mine: dict[int, T] = {}
    for source, source_buckets in enumerate(received):
        for index, item in source_buckets[rank].items():
            if index in mine:
                raise RuntimeError(f"prompt {index} was generated by more than one data-parallel rank "
                                   f"(also by {source})")
            mine[index] = item
    expected = range(rank * share, (rank + 1) * share)
    missing = [index for index in expected if index not in mine]
    if missing:
        raise RuntimeError(f"prompts {missing[:10]} were generated by no data-parallel rank")
    return [(index, mine[index]) for index in expected]


# ----------------------------------------------------------------------------- Rollout rows
def concat_rollouts(rollouts: Sequence, pad_id: int):
    """One batch `Rollout` from several, response columns right-padded to the widest (pad_id, logprob 0)."""
    if not rollouts:
        raise ValueError("no rollouts to concatenate")
    width = max(r.response_tokens.shape[1] for r in rollouts)

    def pad(tensor: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)

    return Rollout(
        prompt_tokens=[tokens for r in rollouts for tokens in r.prompt_tokens],
        response_tokens=torch.cat([pad(r.response_tokens, pad_id) for r in rollouts]),
        logprobs=torch.cat([pad(r.logprobs, 0.0) for r in rollouts]),
        response_lengths=torch.cat([r.response_lengths for r in rollouts]),
        ended_with_stop=torch.cat([r.ended_with_stop for r in rollouts]),
    )
