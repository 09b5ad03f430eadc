"""The reward server under torchrun at TP=2: rank 0 serves, rank 1 follows every collective call.

Its rewards must match the in-process TP=1 rewards of the same checkpoint, and a Ctrl-C (SIGINT to
the whole process group, as a terminal sends it) must end every process within seconds, the
follower after rank 0's STOP.
"""
from __future__ import annotations

import signal
import sys

import numpy as np
import pytest

from aligner.clients.reward import RewardClient
from tests.conftest import live_processes_in_group
from tests.functional.test_reward_server import (
    ENTRY_POINT,
    ServerProcess,
    free_port_block,
    in_process_rewards,
    make_reward_checkpoint,
    random_sequences,
)

pytestmark = pytest.mark.distributed



@pytest.fixture(scope="module")
def tp1_reference(tmp_path_factory):
    """(checkpoint, sequences, their in-process TP=1 rewards)."""
    from aligner.models.reward import load_reward_model
    from aligner.runtime import distributed

    distributed.initialize(distributed.ParallelConfig())
    try:
        checkpoint = make_reward_checkpoint(tmp_path_factory.mktemp("reward_tp"))
        loaded = load_reward_model(checkpoint, micro_batch_size=2)
        sequences = random_sequences(24, loaded.model_cfg.vocab_size, seed=5)
        return checkpoint, sequences, in_process_rewards(loaded.inference, sequences)
    finally:
        distributed.shutdown()


def test_tp2_server_matches_tp1_and_stops_cleanly(tp1_reference, tmp_path):
    checkpoint, sequences, reference = tp1_reference
    port = free_port_block()
    server = ServerProcess(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port_block(1)}",
         "--master_addr=127.0.0.1", str(ENTRY_POINT), f"init_from={checkpoint}",
         "parallel.tensor_model_parallel_size=2", "inference.micro_batch_size=2", f"server.port={port}"],
        tmp_path / "server.log", new_session=True)
    try:
        server.wait_ready()
        with RewardClient("127.0.0.1", port, ready_timeout_s=30, timeout_s=120) as client:
            whole = client.infer(sequences)
            singles = [client.infer_async([ids]) for ids in sequences[:8]]  # merged differently by the batcher
            singles = np.concatenate([future.result(timeout=120) for future in singles])
        tp_difference = float(np.abs(whole - reference).max())
        print(f"\nTP=2 served vs TP=1 in-process: max abs diff {tp_difference:.2e}")
        assert tp_difference < 1e-5
        assert np.abs(singles - reference[:8]).max() < 1e-5

        # Ctrl-C: every process gets SIGINT (torchrun and two ranks on 2 busy cores can pass the one-process 20 s)
        code, elapsed = server.stop(signal.SIGINT, group=True, timeout_s=60)
        print(f"all ranks exited {elapsed:.1f} s after SIGINT (torchrun exit code {code})")
        log = server.log()
        assert "rank 1: rank 0 stopped serving" in log, log[-6000:]
        # torchrun itself reports the SIGINT with a traceback; no worker may fail (their tracebacks
        # would pass through the entry point).
        assert 'serve_reward_model.py", line' not in log, log[-6000:]
        assert live_processes_in_group(server.process.pid) == []  # nothing left running (workers, tritonserver)
    finally:
        server.kill()
