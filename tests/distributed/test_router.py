"""The rollout router: a slow data-parallel rank takes fewer prompts, every prompt is generated once.

The distributed test runs this file under torchrun (2 processes, gloo) with a fake generate
function that sleeps per micro-batch, rank 1 twenty times longer than rank 0; rank 0 prints one
`RESULT <json>` line. The other tests exercise the queue and its TCP transport in one process.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from aligner.generation.work_queue import RouterError, WorkQueue, WorkQueueClient, WorkQueueServer

NUM_PROMPTS = 64
MICRO_BATCH_SIZE = 2
FAST_S, SLOW_S = 0.005, 0.1  # per micro-batch: rank 0, rank 1


# ----------------------------------------------------------------------------- in one process
def test_queue_hands_out_every_index_once_under_concurrent_takers():
    queue = WorkQueue()
    queue.start_round(1, num_items=101, micro_batch_size=4)
    taken: list[list[int]] = [[] for _ in range(4)]

    def take_all(worker: int) -> None:
        for _ in range(200):  # bounded: 26 micro-batches exist
            batch = queue.take(1, worker)
            if not batch:
                return
            taken[worker].extend(batch)

    threads = [threading.Thread(target=take_all, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    everything = sorted(index for indices in taken for index in indices)
    assert everything == list(range(101))
    assert {w: sorted(v) for w, v in queue.assigned.items()} == {w: sorted(v) for w, v in enumerate(taken) if v}


def test_queue_rounds():
    queue = WorkQueue()
    with pytest.raises(RouterError, match="has not started"):
        queue.take(1, 0)
    queue.start_round(1, num_items=3, micro_batch_size=2)
    assert queue.take(1, 0) == [0, 1]
    queue.start_round(2, num_items=1, micro_batch_size=2)
    assert queue.take(1, 0) == []  # an earlier round's straggler is told it is done
    assert queue.take(2, 0) == [0]
    assert queue.take(2, 0) == []
    with pytest.raises(ValueError, match="already started"):
        queue.start_round(2, num_items=1, micro_batch_size=1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        queue.start_round(3, num_items=1, micro_batch_size=0)


def test_tcp_transport_and_errors():
    with WorkQueueServer("127.0.0.1", 0) as server:
        server.queue.start_round(1, num_items=5, micro_batch_size=2)
        client = WorkQueueClient(server.address, timeout_s=5)
        try:
            batches = [client.next_batch(1, worker=3) for _ in range(4)]
            assert batches == [[0, 1], [2, 3], [4], []]
            assert server.queue.assigned == {3: [0, 1, 2, 3, 4]}
            with pytest.raises(RouterError, match="has not started"):
                client.next_batch(7, worker=3)
            assert client.next_batch(1, worker=3) == []  # the connection survives an error answer
        finally:
            client.close()
        # A malformed line gets an error answer, not a dead server.
        import socket

        with socket.create_connection(server.address, timeout=5) as raw:
            raw.sendall(b"not json\n")
            assert "error" in json.loads(raw.makefile("rb").readline())
    started = time.monotonic()
    with pytest.raises(RouterError, match="cannot reach the rollout router"):
        WorkQueueClient(server.address, timeout_s=0.3)  # the server is closed now
    assert time.monotonic() - started < 5


def test_single_process_routers_and_rebalance():
    from aligner.generation.router_client import DynamicRouter, StaticRouter, rebalance_rollouts

    for router in (StaticRouter(micro_batch_size=3), DynamicRouter(micro_batch_size=3, host="127.0.0.1", timeout_s=10)):
        try:
            work = router.route(10, lambda indices: [f"r{i}" for i in indices])
        finally:
            router.close()
        assert work.results == {i: f"r{i}" for i in range(10)}
        assert [len(batch) for batch in work.micro_batches] == [3, 3, 3, 1]
        assert rebalance_rollouts(work.results, 10) == [(i, f"r{i}") for i in range(10)]
    with pytest.raises(ValueError, match="returned 1 results"):
        StaticRouter(micro_batch_size=2).route(2, lambda indices: ["only one"])


def test_single_process_routers_stream_micro_batches():
    """route_stream: the generator takes micro-batches when it wants them and answers in any order."""
    from aligner.generation.router_client import DynamicRouter, StaticRouter

    def two_at_a_time(next_indices):
        held = []
        while (indices := next_indices()) is not None:
            held.append(indices)
            if len(held) == 2:  # the later micro-batch completes first
                yield from ((batch, [f"r{i}" for i in batch]) for batch in held[::-1])
                held = []
        yield from ((batch, [f"r{i}" for i in batch]) for batch in held)

    for router in (StaticRouter(micro_batch_size=3), DynamicRouter(micro_batch_size=3, host="127.0.0.1", timeout_s=10)):
        try:
            work = router.route_stream(10, two_at_a_time)
        finally:
            router.close()
        assert work.results == {i: f"r{i}" for i in range(10)}
        assert work.micro_batches == [[3, 4, 5], [0, 1, 2], [9], [6, 7, 8]]


def test_concat_rollouts_pads_to_the_widest():
    import torch

    from aligner.generation.engine import Rollout
    from aligner.generation.router_client import concat_rollouts

    rows = [Rollout([[1, 2]], torch.tensor([[5, 6, 0]]), torch.tensor([[-0.1, -0.2, 0.0]]), torch.tensor([2]),
                    torch.tensor([True])),
            Rollout([[3]], torch.tensor([[7, 0, 0]]), torch.tensor([[-0.3, 0.0, 0.0]]), torch.tensor([1]),
                    torch.tensor([False]))]
    narrow = Rollout([[4]], torch.tensor([[9]]), torch.tensor([[-1.0]]), torch.tensor([1]), torch.tensor([True]))
    merged = concat_rollouts([rows[1], narrow, rows[0]], pad_id=0)
    assert merged.prompt_tokens == [[3], [4], [1, 2]]
    assert merged.response_tokens.tolist() == [[7, 0, 0], [9, 0, 0], [5, 6, 0]]
    assert merged.logprobs[1].tolist() == [-1.0, 0.0, 0.0]
    assert merged.response_lengths.tolist() == [1, 1, 2]


# ----------------------------------------------------------------------------- under torchrun
@pytest.mark.distributed
def test_slow_rank_takes_fewer_prompts(torchrun):
    output = torchrun(Path(__file__), 2, timeout=300)
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])

    dynamic = result["dynamic"]
    generated = [index for rank_indices in dynamic["generated"] for index in rank_indices]
    assert sorted(generated) == list(range(NUM_PROMPTS)), "every prompt generated exactly once"
    fast, slow = (len(indices) for indices in dynamic["generated"])
    assert slow < 0.4 * NUM_PROMPTS, f"the slow rank took {slow} of {NUM_PROMPTS} prompts"
    assert fast > slow
    assert dynamic["server_log"] == {str(rank): sorted(idx) for rank, idx in enumerate(dynamic["generated"])}
    assert dynamic["rebalanced"] == [list(range(0, 32)), list(range(32, 64))]
    assert dynamic["rebalanced_results_match"] is True

    static = result["static"]
    assert [len(indices) for indices in static["generated"]] == [NUM_PROMPTS // 2, NUM_PROMPTS // 2]
    assert sorted(i for indices in static["generated"] for i in indices) == list(range(NUM_PROMPTS))
    assert static["rebalanced"] == [list(range(0, 32)), list(range(32, 64))]
    model_parallel = result["model_parallel"]
    assert model_parallel["micro_batches"][0] == model_parallel["micro_batches"][1] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert model_parallel["server_log"] == {"0": list(range(8))}  # one replica asked, as data-parallel rank 0

    # The point of routing: the round ends when the fast rank has done most of the work, instead
    # of when the slow rank has done half of it (16 micro-batches x 0.1 s).
    assert dynamic["seconds"] < static["seconds"]


def _worker() -> None:
    import torch.distributed as dist

    from aligner.generation.router_client import DynamicRouter, StaticRouter, rebalance_rollouts

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def fake_generate(indices: list[int]) -> list[str]:
        time.sleep(SLOW_S if rank == 1 else FAST_S)  # rank 1 plays the slow GPU
        return [f"response to prompt {index}" for index in indices]

    result = {}
    for name, router in (("dynamic", DynamicRouter(micro_batch_size=MICRO_BATCH_SIZE, host="127.0.0.1", timeout_s=60)),
                         ("static", StaticRouter(micro_batch_size=MICRO_BATCH_SIZE))):
        dist.barrier()
        work = router.route(NUM_PROMPTS, fake_generate)
        dist.barrier()
        server_log = router.assignments() if (name == "dynamic" and rank == 0) else None
        share = rebalance_rollouts(work.results, NUM_PROMPTS)
        router.close()
        generated = [None, None]
        dist.all_gather_object(generated, sorted(work.results))
        rebalanced = [None, None]
        dist.all_gather_object(rebalanced, [index for index, _ in share])
        matches = [None, None]
        dist.all_gather_object(matches, all(item == f"response to prompt {index}" for index, item in share))
        longest = [None, None]
        dist.all_gather_object(longest, work.seconds)
        result[name] = {
            "generated": generated,
            "rebalanced": rebalanced,
            "rebalanced_results_match": all(matches),
            "seconds": max(longest),
        }
        if server_log is not None:
            result[name]["server_log"] = {str(worker): sorted(idx) for worker, idx in server_log.items()}
    # One replica spanning both ranks (a model-parallel group of 2, data-parallel size 1): rank 0
    # takes the micro-batches from the queue and both ranks generate the same ones.
    own_group = [dist.new_group([0]), dist.new_group([1])][rank]
    router = DynamicRouter(micro_batch_size=MICRO_BATCH_SIZE, data_parallel_group=own_group,
                           model_parallel_group=dist.group.WORLD, host="127.0.0.1", timeout_s=60)
    work = router.route(8, lambda indices: [f"r{i}" for i in indices])
    server_log = router.assignments() if rank == 0 else None
    router.close()
    batches = [None, None]
    dist.all_gather_object(batches, work.micro_batches)
    result["model_parallel"] = {"micro_batches": batches, "server_log": server_log}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_worker())
