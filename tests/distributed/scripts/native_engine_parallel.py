"""Native engine under tensor and pipeline parallelism (see tests/distributed/test_native_engine_parallel.py).

Run with 2 processes: `native_engine_parallel.py WORK`. At TP=1 (x DP=2) it builds random
llama- and gpt2-style models, saves them with aligner.checkpointing and generates the reference
rollouts; then it loads the same checkpoints at TP=2 (DDP-wrapped chunks), PP=2 and PP=2 with two
virtual stages (llama), generates the same rollouts and compares. It also checks the
vocab-parallel sampling helpers at TP=2 against their single-shard versions. The *_lora models are
their base checkpoint plus LoRA adapters saved on their own, generated with the live adapters.
Cases named static_* run the engine's static decode step (static_decode=True), the reference
always the default one. Cases named *refill* decode 8 prompts in 3 cache rows with continuous batching
(rows stop early and are refilled), the reference in the static-batch loop (continuous_batching=False).
Rank 0 prints one `RESULT <json>` line.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from aligner import checkpointing
from aligner.generation import sampling as S
from aligner.generation.engine import SamplingParams
from aligner.generation.native import NativeEngine
from aligner.models.gpt import GPTConfig, build_model_chunks
from aligner.models.logprobs import pack_sequences, sequence_logprobs
from aligner.runtime.distributed import ParallelConfig, initialize, shutdown
from aligner.runtime.seeds import set_seed
from aligner.training import setup

VOCAB, PAD, EOS = 100, 0, 2  # padded to 128: at TP=2 the second shard holds the padding
CONFIGS = {
    "llama": GPTConfig.llama(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=128, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                             max_position_embeddings=64),
    "gpt2": GPTConfig.gpt2(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                           make_vocab_size_divisible_by=64, max_position_embeddings=64),
    # q/k norm, Llama 3.x RoPE scaling, megatron's MoE layer (experts split over TP at TP=2)
    "moe": GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                           ffn_hidden_size=96, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                           max_position_embeddings=64, qk_layernorm=True, llama3_rope_scaling_factor=8.0,
                           num_moe_experts=4, moe_ffn_hidden_size=48),
    # Gemma 3-like: zero-centred and post norms, scaled tied embeddings, gated GELU, local/global RoPE bases
    # (at PP=2 the sliding-window layer on the first stage, the global one on the second)
    "gemma": GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                             ffn_hidden_size=96, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                             max_position_embeddings=64, activation="geglu_tanh", qk_layernorm=True,
                             zero_centered_norm=True, post_layer_norms=True, scale_embeddings=True,
                             query_pre_attn_scalar=24.0, rotary_base=1000000.0, sliding_window=32,
                             sliding_window_pattern=2, local_rotary_base=10000.0, tie_embeddings=True),
}
CASES = {
    "greedy": SamplingParams(max_new_tokens=12, greedy=True),
    "sample": SamplingParams(max_new_tokens=12, temperature=1.0, seed=5),
    "top_k_top_p": SamplingParams(max_new_tokens=12, temperature=0.8, top_k=10, top_p=0.9, seed=6),
    "top_p": SamplingParams(max_new_tokens=12, temperature=1.2, top_p=0.8, seed=7),
    # the static (CUDA-graph-capturable) decode step: whole cache, masked, fixed buffers
    "static_greedy": SamplingParams(max_new_tokens=12, greedy=True),
    "static_sample": SamplingParams(max_new_tokens=12, temperature=1.0, seed=5),
    # continuous batching with refills: 3 cache rows for 8 prompts, rows stopping early at different steps;
    # the TP=1 reference runs the static-batch loop (continuous_batching=False)
    "refill_greedy": SamplingParams(max_new_tokens=12, greedy=True, stop_token_ids=list(range(3, 25))),
    "refill_top_k_top_p": SamplingParams(max_new_tokens=12, temperature=0.9, top_k=10, top_p=0.9, seed=8,
                                         min_new_tokens=2, stop_token_ids=list(range(3, 25))),
    "static_refill_sample": SamplingParams(max_new_tokens=12, temperature=1.0, seed=9,
                                           stop_token_ids=list(range(3, 25))),
}
LORA = {"llama_lora": "llama", "gpt2_lora": "gpt2"}  # the model with live LoRA adapters on every target -> its base
LAYOUTS = {
    "tp2": (ParallelConfig(tensor_model_parallel_size=2),
            ("llama", "gpt2", "moe", "gemma", "llama_lora", "gpt2_lora")),
    "pp2": (ParallelConfig(pipeline_model_parallel_size=2), ("llama", "gpt2", "moe", "gemma", "llama_lora")),
    "pp2_vpp2": (ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), ("llama",)),
}


def prompts() -> list[list[int]]:
    """8 prompts, two of them twice in a row (as a group's samples): those are prefilled once, their cache
    rows copied, where they are admitted together (continuous batching's shared prefill)."""
    generator = torch.Generator().manual_seed(1)
    distinct = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (1, 9, 4, 12, 6, 11)]
    return [distinct[index] for index in (0, 1, 1, 2, 3, 3, 4, 5)]


def random_model(cfg: GPTConfig, seed: int) -> torch.nn.Module:
    """TP=1 model whose every tensor carries signal (identical on every rank: same seed)."""
    model = build_model_chunks(cfg, ParallelConfig(), torch.float32)[0].eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm_weight = "norm" in name and name.endswith("weight")
            param.copy_((1.0 if is_norm_weight else 0.0) + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def run_cases(cfg: GPTConfig, chunks, reference: bool = False) -> dict:
    options = dict(pad_id=PAD, eos_id=EOS, max_sequence_length=32)
    refill = dict(max_batch_size=3, continuous_batching=not reference)
    engines = {(static, refills): NativeEngine(chunks, cfg, static_decode=static and not reference,
                                               **options, **(refill if refills else dict(max_batch_size=8)))
               for static in (False, True) for refills in (False, True)}
    out = {}
    for case, sampling in CASES.items():
        engine = engines[case.startswith("static_"), "refill" in case]
        rollout = engine.generate(prompts(), sampling)
        tokens, prompt_lengths = pack_sequences(rollout.prompt_tokens, rollout.response_tokens,
                                                rollout.response_lengths, PAD)
        training = sequence_logprobs(chunks, tokens, prompt_lengths, rollout.response_lengths, vocab_size=VOCAB,
                                     temperature=1.0 if sampling.is_greedy else sampling.temperature,
                                     response_width=sampling.max_new_tokens)
        out[case] = {"tokens": rollout.response_tokens, "lengths": rollout.response_lengths,
                     "logprobs": rollout.logprobs, "training_logprobs": training.cpu()}
    return out


def worst(value: float) -> float:
    """The largest value over all ranks (every rank holds the full rollout)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def compare(reference: dict, result: dict) -> dict:
    report = {}
    for case in CASES:
        ref, got = reference[case], result[case]
        same_rows = [bool(torch.equal(ref["tokens"][i], got["tokens"][i])) for i in range(len(prompts()))]
        both = [i for i, same in enumerate(same_rows) if same]
        report[case] = {
            "same_rows": int(worst(-sum(same_rows)) * -1),  # the fewest over ranks
            "rows": len(same_rows),
            "logprob_vs_tp1": worst(float((ref["logprobs"][both] - got["logprobs"][both]).abs().max())),
            "logprob_vs_training": worst(float((got["logprobs"] - got["training_logprobs"]).abs().max())),
        }
    return report


def check_sampling_helpers() -> dict:
    """TP=2 vocab-parallel helpers on shards of one logits tensor vs single-shard versions on all of it."""
    from megatron.core import parallel_state as ps

    initialize(ParallelConfig(tensor_model_parallel_size=2))
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    logits = 2.0 * torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    logits[:, 100:] = float("-inf")
    shard = logits[:, rank * 64:(rank + 1) * 64].contiguous()
    start = rank * 64
    uniform = S.uniforms(S.sample_keys(0, torch.arange(64)), torch.tensor([0]))[:, 0]
    tokens = logits.argmax(-1)
    values, ids = S.vocab_parallel_top_k(shard, 7, start, group)
    top = torch.topk(logits, 7)
    checks = {
        "argmax": torch.equal(S.vocab_parallel_argmax(shard, start, group), tokens),
        "sample": torch.equal(S.vocab_parallel_sample(shard, uniform, start, group),
                              S.vocab_parallel_sample(logits, uniform)),
        "top_k": torch.equal(ids, top.indices) and torch.equal(values, top.values),
        "logsumexp": bool(torch.allclose(S.vocab_parallel_logsumexp(shard, group), torch.logsumexp(logits, -1),
                                         atol=1e-5)),
        "logprobs": bool(torch.allclose(S.vocab_parallel_token_logprobs(shard, tokens, start, group),
                                        S.token_logprobs(logits, tokens), atol=1e-5)),
        "select_top_p": torch.equal(
            S.select_tokens(shard, greedy=False, top_p=0.7, uniform=uniform, vocab_start=start, group=group),
            S.select_tokens(logits, greedy=False, top_p=0.7, uniform=uniform)),
        "select_top_k": torch.equal(
            S.select_tokens(shard, greedy=False, top_k=5, top_p=0.9, uniform=uniform, vocab_start=start, group=group),
            S.select_tokens(logits, greedy=False, top_k=5, top_p=0.9, uniform=uniform)),
    }
    return {name: bool(worst(-float(ok)) == -1.0) for name, ok in checks.items()}


def add_adapters(chunks) -> None:
    """LoRA adapters on every target linear, the same initial A at any layout (seeded per layer and module)."""
    from aligner.models import lora

    lora.apply_lora(chunks, lora.PEFTConfig(scheme="lora", rank=4, alpha=8.0), seed=1)


def randomise_b(model) -> None:
    from aligner.models import lora

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in lora.adapter_modules([model]):
            module.lora_b.copy_(0.05 * torch.randn(module.lora_b.shape, generator=generator))


def main() -> None:
    work = Path(sys.argv[1])
    initialize(ParallelConfig())  # TP=1 x DP=2: both ranks compute the reference, the save deduplicates
    set_seed(0)
    references = {}
    for index, (name, cfg) in enumerate(CONFIGS.items()):
        model = random_model(cfg, seed=10 + index)
        checkpointing.save(work / name, [model], model_config=cfg.to_dict())
        references[name] = run_cases(cfg, [model], reference=True)
    for name, base in LORA.items():  # the base checkpoint above, adapters saved on their own (as LoRA training does)
        model = build_model_chunks(CONFIGS[base], ParallelConfig(), torch.float32)[0].eval()
        checkpointing.load(work / base, [model])
        add_adapters([model])
        randomise_b(model)
        checkpointing.save(work / name, [model], model_config=CONFIGS[base].to_dict(), extra_meta={"peft": {}})
        references[name] = run_cases(CONFIGS[base], [model], reference=True)
    result = {}
    for layout, (parallel, names) in LAYOUTS.items():
        initialize(parallel)
        set_seed(0)
        for name in names:
            cfg = CONFIGS[LORA.get(name, name)]
            chunks = build_model_chunks(cfg, parallel, torch.float32)
            checkpointing.load(work / LORA.get(name, name), chunks)
            if name in LORA:
                add_adapters(chunks)
                checkpointing.load(work / name, chunks)
            if layout == "tp2" and not cfg.is_moe:  # what a trainer hands the engine: DDP-wrapped chunks
                chunks = setup.wrap_for_training(chunks)
            # (an MoE model does not train at TP=2, see setup.check_trainable; its chunks stay in training
            # mode here, which megatron's MoE layer refuses at TP>1 unless the engine switches it to eval)
            result[f"{name}/{layout}"] = compare(references[name], run_cases(cfg, chunks))
    result["sampling_helpers_tp2"] = check_sampling_helpers()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
