"""PPO at several parallel layouts: the first minibatch of a step runs on the rollout policy's own
weights, so its ratio is exactly 1 and its approximate KL 0 (the NeMo-Aligner #68 / verl #2088 check)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aligner.demo import arithmetic
from aligner.demo.tokenizer import train_char_tokenizer

from ..conftest import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "distributed" / "scripts" / "ppo_step.py"
SFT_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_parity")
    records = arithmetic.sft_records(128, seed=5)
    train = root / "sft.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in arithmetic.rl_prompts(64, seed=5)))
    train_char_tokenizer([r["input"] + r["output"] for r in records], root / "tokenizer")
    # A few SFT steps from random init, so responses are short digit strings that often stop.
    result = subprocess.run([
        sys.executable, str(SFT_SCRIPT), f"tokenizer.path={root / 'tokenizer'}", f"data.train=[{{path: {train}}}]",
        "data.split='100,0'", "data.max_seq_length=16", "model.architecture.num_layers=2",
        "model.architecture.hidden_size=32", "model.architecture.num_attention_heads=4",
        "model.architecture.num_query_groups=2", "model.architecture.ffn_hidden_size=64", "trainer.max_steps=20",
        "trainer.global_batch_size=32", "trainer.micro_batch_size=32", "trainer.val_check_interval=0", "optim.lr=3e-3",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0",
        f"checkpoint.save_dir={root / 'sft'}", f"logging.log_dir={root / 'sft_logs'}",
    ], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return root, root / "sft" / "step_00000020", prompts


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_first_minibatch_ratio_is_one(setup, tp, pp, dp):
    root, policy, prompts = setup
    output = root / f"metrics_{tp}{pp}{dp}.json"
    run_torchrun(SCRIPT, tp * pp * dp, str(output), f"model.init_from={policy}", f"data.prompts={prompts}",
                 f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                 "data.max_prompt_length=8", "generation.max_new_tokens=5", "generation.micro_batch_size=4",
                 "ppo.prompts_per_step=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
                 "ppo.epochs=2", "optim.lr=1e-2", "logging.progress_bar=false", "logging.tensorboard=false",
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
