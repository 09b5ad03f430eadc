"""The GPU paths against their references (`make test-gpu`; skipped on a machine without CUDA).

References: the same model on the CPU (native engine), the engine's eager step (CUDA-graph replay),
an fp32 forward (bf16 SFT loss), exact 1 (the first minibatch's PPO ratio), transformers (SmolLM2).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from aligner.generation.engine import SamplingParams

from ..conftest import REPO_ROOT, metrics_rows, run_torchrun, train_tiny_arithmetic_policy
from ..real_model.conftest import python_env
from ..unit.test_native_engine import EOS, PAD, VOCAB, make_engine, make_model, make_prompts, responses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPT_EXAMPLES = REPO_ROOT / "examples" / "nlp" / "gpt"
# fp32 on two devices sums in other orders (cuBLAS vs oneDNN); the engine's own CPU tests hold 1e-5.
CROSS_DEVICE_LOGPROB_TOLERANCE = 1e-5
SAMPLING = {
    "greedy": SamplingParams(max_new_tokens=14, greedy=True),
    # stop tokens end rows at different steps, so continuous batching changes the decode batch size
    # and the engine captures one graph per size it reaches
    "sampled-stops": SamplingParams(max_new_tokens=14, temperature=0.9, top_k=20, top_p=0.9, seed=3,
                                    stop_token_ids=[5, 6, 7]),
}


def _on_gpu(name: str):
    """make_model(name)'s model (the same seed: the same weights) built again and moved to the GPU (a megatron
    model holding NCCL groups cannot be deep-copied)."""
    return make_model(name)[1].cuda()


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen"])
def test_native_engine_greedy_on_gpu_equals_the_cpu(single_process, name):
    cfg, model = make_model(name)
    sampling = SAMPLING["greedy"]
    on_cpu = make_engine(cfg, model).generate(make_prompts(), sampling)
    on_gpu = make_engine(cfg, _on_gpu(name)).generate(make_prompts(), sampling)
    assert responses(on_gpu) == responses(on_cpu)
    difference = float((on_gpu.logprobs.cpu() - on_cpu.logprobs).abs().max())
    print(f"{name}: max |gpu - cpu| logprob {difference:.1e}")
    assert difference < CROSS_DEVICE_LOGPROB_TOLERANCE


def test_native_engine_greedy_of_an_moe_model_on_gpu_equals_full_forward_decoding(single_process):
    """An MoE model cannot run on the CPU of a machine with CUDA (megatron's router moves its weight to
    the GPU at its first forward), so its reference is argmax decoding with full forwards on the GPU."""
    from aligner.generation.reference import generate_full_forward

    cfg, _ = make_model("moe")
    model, prompts = _on_gpu("moe"), make_prompts()
    rollout = make_engine(cfg, model).generate(prompts, SAMPLING["greedy"])
    expected = generate_full_forward([model], prompts, vocab_size=VOCAB, eos_id=EOS, pad_id=PAD, max_new_tokens=14)
    assert responses(rollout) == expected


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen"])
def test_cuda_graph_decode_equals_the_eager_step(single_process, name, sampling):
    cfg, model = make_model(name)
    model = _on_gpu(name)
    params = SAMPLING[sampling]
    eager = make_engine(cfg, model).generate(make_prompts(), params)
    engine = make_engine(cfg, model, cuda_graphs=True)
    replayed = engine.generate(make_prompts(), params)
    assert responses(replayed) == responses(eager)
    difference = float((replayed.logprobs - eager.logprobs).abs().max())
    print(f"{name} {sampling}: max |graph - eager| logprob {difference:.1e}")
    assert difference <= 1e-5
    # A refit after an update must reach the graphs (they read the weights' storage in place).
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.05)
    engine.refit([model])
    updated_eager = make_engine(cfg, model).generate(make_prompts(), params)
    assert responses(engine.generate(make_prompts(), params)) == responses(updated_eager)


def _sft_batch(generator: torch.Generator, batch: int = 4, length: int = 48) -> dict:
    tokens = torch.randint(3, VOCAB, (batch, length), generator=generator)
    loss_mask = torch.zeros(batch, length)
    loss_mask[:, length // 3:] = 1.0  # the response part
    return {"tokens": tokens.cuda(), "labels": torch.roll(tokens, -1, 1).cuda(), "loss_mask": loss_mask.cuda(),
            "position_ids": torch.arange(length).expand(batch, -1).cuda(), "attention_mask": None}


# bf16 keeps 8 significant bits (unit roundoff u = 2^-9 = 2e-3). The weights, activations and each
# product's output are rounded to it, so logits carry relative errors of a few u, and the mean loss
# (~log(vocab) = 4.6 here) moves by about that much: 2.2e-4 relative on an H100. 2e-2 is 10 u: a wrong
# cast or an fp16 overflow moves it by far more.
BF16_LOSS_RELATIVE_TOLERANCE = 2e-2


def test_sft_loss_in_bf16_is_the_fp32_loss_within_bf16_rounding(single_process):
    from megatron.core.transformer.module import Float16Module

    from aligner.algorithms.sft import SFTObjective
    from aligner.models.gpt import build_gpt_model, transformer_config

    cfg, model = make_model("llama")
    objective = SFTObjective(cfg.vocab_size)
    batch = _sft_batch(torch.Generator().manual_seed(0))

    def loss(module, batch) -> float:
        with torch.no_grad():
            loss_sum, tokens, _ = objective.loss(batch, objective.forward(module, batch))
        return float(loss_sum) / float(tokens)

    fp32 = loss(_on_gpu("llama"), batch)
    cpu_batch = {key: value.cpu() if value is not None else None for key, value in batch.items()}
    assert fp32 == pytest.approx(loss(model, cpu_batch), rel=1e-5)  # the fp32 GPU forward is the CPU's

    config = transformer_config(cfg, params_dtype=torch.bfloat16)
    bf16_model = build_gpt_model(cfg, config).cuda().eval()
    bf16_model.load_state_dict(model.state_dict())  # rounds each fp32 weight to bf16
    assert next(bf16_model.parameters()).dtype == torch.bfloat16
    bf16 = loss(Float16Module(config, bf16_model), batch)  # the trainer's mixed-precision wrapper
    print(f"SFT loss fp32 {fp32:.6f}, bf16 {bf16:.6f}: relative difference {abs(bf16 - fp32) / fp32:.2e}")
    assert bf16 != fp32  # bf16 arithmetic really ran
    assert bf16 == pytest.approx(fp32, rel=BF16_LOSS_RELATIVE_TOLERANCE)


def _sft_run(root, data_dir, steps: int, resume: bool, precision: str, on_cpu: bool = False) -> dict:
    """train_gpt_sft.py on a ~76M model (12 layers of 4 x 768^2 attention + 3 x 768 x 2048 SwiGLU MLP);
    on_cpu: with CUDA hidden (gloo, torch's Adam). Returns {step: loss} of every run logged into root."""
    env = {**python_env(), **({"CUDA_VISIBLE_DEVICES": ""} if on_cpu else {}), "OMP_NUM_THREADS": "8"}
    command = [
        sys.executable, str(GPT_EXAMPLES / "train_gpt_sft.py"), f"tokenizer.path={data_dir / 'tokenizer'}",
        f"data.train=[{{path: {data_dir / 'sft.jsonl'}}}]", "data.split='100,0'", "data.max_seq_length=32",
        f"precision={precision}", "model.architecture.num_layers=12", "model.architecture.hidden_size=768",
        "model.architecture.num_attention_heads=12", "model.architecture.num_query_groups=4",
        "model.architecture.ffn_hidden_size=2048", f"trainer.max_steps={steps}", "trainer.global_batch_size=32",
        "trainer.micro_batch_size=16", "trainer.val_check_interval=0", "optim.lr=1e-5", "optim.warmup_steps=0",
        "optim.decay_style=constant", "logging.progress_bar=false", "logging.tensorboard=false",
        f"checkpoint.save_dir={root / 'ckpt'}", f"logging.log_dir={root / 'logs'}", f"checkpoint.resume={resume}",
        "checkpoint.save_interval=3"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-6000:]
    return {row["step"]: row["loss"] for row in metrics_rows(root / "logs", "train")}


def _stopped_and_resumed(root, data_dir, precision: str) -> dict:
    """3 steps on the GPU with megatron's distributed optimizer, then a resumed run to step 5."""
    from megatron.core import dist_checkpointing

    _sft_run(root, data_dir, steps=3, resume=False, precision=precision)
    common = dist_checkpointing.load_common_state_dict(str(root / "ckpt" / "step_00000003"))
    # Only megatron's distributed optimizer writes its parameter state in this format.
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    return _sft_run(root, data_dir, steps=5, resume=True, precision=precision)


# fp32 reductions in another order (cuBLAS vs oneDNN) give ~1e-6 relative; Adam's first updates are
# ~lr x sign(gradient), so entries whose gradient is ~0 can flip and add ~1e-5 by step 5 (see the
# real-model tier). A resumed run that lost the Adam moments moves by far more (its first step is
# lr x sign(gradient) again).
RESUME_LOSS_RELATIVE_TOLERANCE = 1e-4


def test_sft_with_the_distributed_optimizer_resumes_as_the_uninterrupted_cpu_run_and_trains_in_bf16(tmp_path):
    """fp32 on the GPU, stopped after 3 steps and resumed to 5, gives the losses of 5 uninterrupted fp32 steps
    on the CPU (torch's Adam): the resumed distributed optimizer state is the one saved. bf16 does the same
    run; at lr 1e-5 most updates are below bf16's resolution of a weight (2^-8 x |w|), so its losses part
    from fp32's after the first step: it is checked to start at fp32's loss and to learn."""
    from aligner.demo import arithmetic
    from aligner.demo.tokenizer import train_char_tokenizer

    records = arithmetic.sft_records(256, seed=0)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train_char_tokenizer([r["input"] + r["output"] for r in records], tmp_path / "tokenizer")
    cpu = _sft_run(tmp_path / "cpu", tmp_path, steps=5, resume=False, precision="fp32", on_cpu=True)
    fp32 = _stopped_and_resumed(tmp_path / "fp32", tmp_path, "fp32")
    bf16 = _stopped_and_resumed(tmp_path / "bf16", tmp_path, "bf16")
    print(f"SFT losses\n  fp32 CPU:                    {cpu}\n  fp32 GPU (resumed after 3): {fp32}\n"
          f"  bf16 GPU (resumed after 3): {bf16}")
    assert sorted(cpu) == sorted(fp32) == sorted(bf16) == [1, 2, 3, 4, 5]
    for step in cpu:
        assert fp32[step] == pytest.approx(cpu[step], rel=RESUME_LOSS_RELATIVE_TOLERANCE), step
    assert bf16[1] == pytest.approx(cpu[1], rel=BF16_LOSS_RELATIVE_TOLERANCE)
    assert bf16[5] < bf16[1] and bf16[5] < bf16[3]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return train_tiny_arithmetic_policy(tmp_path_factory.mktemp("gpu_policy"), seed=6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_first_minibatch_ratio_is_one_on_gpu_with_a_function_reward(tiny_policy, tmp_path, precision):
    policy, prompts = tiny_policy
    output = tmp_path / "step.json"
    run_torchrun(REPO_ROOT / "tests" / "distributed" / "scripts" / "group_rl_step.py", 1, "step", str(output),
                 f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
                 "generation.max_new_tokens=5", "rollout.samples_per_prompt=4", "logging.progress_bar=false",
                 "logging.tensorboard=false", f"checkpoint.save_dir={tmp_path / 'ckpt'}",
                 f"logging.log_dir={tmp_path / 'logs'}", "checkpoint.resume=false", f"precision={precision}",
                 "generation.micro_batch_size=8", "rollout.prompts_per_step=8", "trainer.global_batch_size=16",
                 "trainer.micro_batch_size=4", "loss.epochs=2", "optim.lr=1e-2", "kl.init_coef=0.0",
                 "advantage.estimator=grpo")
    metrics = json.loads(output.read_text())["metrics"]
    print(f"{precision}: " + ", ".join(f"{key} {metrics[key]:.3g}" for key in sorted(metrics)
                                      if "ratio" in key or key.startswith("mismatch")))
    for key in ("first_ratio_mean", "first_ratio_max", "first_ratio_min"):
        assert metrics[key] == pytest.approx(1.0, abs=1e-6), key  # same weights, kernels and layout
    assert metrics["ratio_max"] - metrics["ratio_min"] > 1e-4  # later minibatches moved: not vacuous
    if precision == "fp32":  # the engine samples from the training weights in fp32
        assert metrics["mismatch_kl"] < 1e-5
