"""A two-rank job (run by tests/faults/test_peer_loss.py, one process per rank, RANK/WORLD_SIZE/MASTER_* set by
the test) that all-reduces in a loop; the rank named by STOP_RANK stops itself (SIGSTOP: alive, silent, as on a
node whose link is cut) after 3 rounds, or kills itself (SIGKILL: as on a node that died) with KILL_RANK."""
from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

from aligner.config import run_main
from aligner.runtime import distributed


def main() -> None:
    distributed.initialize(distributed.ParallelConfig(timeout_s=float(os.environ["TIMEOUT_S"])))
    rank = dist.get_rank()
    for round_index in range(1000):
        if round_index == 3 and str(rank) in (os.environ.get("STOP_RANK"), os.environ.get("KILL_RANK")):
            print(f"rank {rank} goes silent", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP if os.environ.get("STOP_RANK") else signal.SIGKILL)
        value = torch.ones(4)
        dist.all_reduce(value)
        print(f"round {round_index}: {value[0].item():.0f}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    run_main(main)
