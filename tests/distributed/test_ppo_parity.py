"""PPO at several parallel layouts: the first minibatch of a step runs on the rollout policy's own
weights, so its ratio is exactly 1 and its approximate KL 0 (the NeMo-Aligner #68 / verl #2088 check)."""
from __future__ import annotations

import json

import pytest

from ..conftest import REPO_ROOT, run_torchrun, train_tiny_arithmetic_policy

SCRIPT = REPO_ROOT / "tests" / "distributed" / "scripts" / "ppo_step.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_parity")
    policy, prompts = train_tiny_arithmetic_policy(root, seed=5)
    return root, policy, prompts


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_first_minibatch_ratio_is_one(setup, tp, pp, dp):
    root, policy, prompts = setup
    output = root / f"metrics_{tp}{pp}{dp}.json"
    run_torchrun(SCRIPT, tp * pp * dp, str(output), f"model.init_from={policy}", f"data.prompts={prompts}",
                 f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                 "data.max_prompt_length=8", "generation.max_new_tokens=5", "generation.micro_batch_size=4",
                 "rollout.prompts_per_step=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
                 "loss.epochs=2", "optim.lr=1e-2", "logging.progress_bar=false", "logging.tensorboard=false",
                 "logging.peak_tflops=1.0", f"checkpoint.save_dir={root / f'ckpt_{tp}{pp}{dp}'}",
                 f"logging.log_dir={root / f'logs_{tp}{pp}{dp}'}", "checkpoint.resume=false")
    metrics = json.loads(output.read_text())
    assert metrics["first_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["first_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["first_ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert abs(metrics["first_approx_kl"]) < 1e-6
    # Later minibatches run on updated weights: the ratio moves, so the check above is not vacuous.
    assert metrics["ratio_max"] - metrics["ratio_min"] > 1e-3
    assert metrics["response_length"] > 0
