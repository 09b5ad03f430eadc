"""The critic server under torchrun at DP=2, TP=2 and PP=2: at DP=2 inference rows and each optimizer
step's batch are split over the two data-parallel ranks (gradients all-reduced); at TP=2 and PP=2
the model is split. Every layout answers as the single-process references do: per-token values,
and the first train call's loss and gradient norm (float64 reference)."""
from __future__ import annotations

import signal
import sys

import numpy as np
import pytest

from aligner.clients.critic import CriticClient
from tests.conftest import free_port_block, live_processes_in_group
from tests.functional.test_critic_server import float64_reference, pool, references, rollout, start_server  # noqa: F401 - fixtures

pytestmark = [pytest.mark.distributed, pytest.mark.slow]



@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_two_rank_critic_matches_single_process(references, pool, rollout, layout):  # noqa: F811 - a fixture imported above
    sequences, reference_values, _ = pool
    loss, grad_norm, _ = float64_reference(references, rollout)
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                f"--master_port={free_port_block(1)}", "--master_addr=127.0.0.1")
    split = {"dp2": [], "tp2": ["parallel.tensor_model_parallel_size=2"],
             "pp2": ["parallel.pipeline_model_parallel_size=2"]}[layout]
    server = start_server(references, f"{layout}.log",
                          f"checkpoint.save_dir={references['root'] / f'{layout}_checkpoints'}", *split,
                          launcher=torchrun)
    try:
        with CriticClient("127.0.0.1", server.port, timeout_s=120, train_timeout_s=300) as client:
            values = client.infer(sequences).values
            difference = float(np.abs(values - reference_values).max())
            metrics = client.train(rollout["sequences"], rollout["prompt_lengths"], rollout["returns"],
                                   rollout["old_values"])
        print(f"\n{layout}: values vs TP=1 in-process: {difference:.2e}; loss {metrics['value_loss']:.7f} vs float64 "
              f"{loss:.7f}; grad norm {metrics['grad_norm']:.6f} vs {grad_norm:.6f}")
        assert difference < 1e-5
        assert metrics["value_loss"] == pytest.approx(loss, rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
        assert metrics["critic_step"] == 1.0

        # torchrun and two ranks winding down on 2 busy cores can pass the one-process bound (20 s)
        code, _ = server.stop(signal.SIGINT, group=True, timeout_s=60)
        log = server.log()
        assert "rank 1: rank 0 stopped serving" in log, log[-6000:]
        assert 'serve_ppo_critic.py", line' not in log, log[-6000:]
        assert live_processes_in_group(server.process.pid) == []  # nothing left running (workers, tritonserver)
    finally:
        server.kill()
