"""Native generation engine vs Hugging Face `generate` on the identical model, in one process.

The megatron model (random weights) is saved as an aligner checkpoint and exported with
`aligner.hf.convert.export_hf`; transformers loads the export, and its logits are checked against
megatron's before anything is timed. Both sides then continue the same prompts at the same batch
size with the same sampling (temperature 1, no top-k/top-p), in fixed-length mode: every row gets
exactly --new-tokens tokens, so both do the same work.

Per side, `generate` is timed with --new-tokens tokens and with one token (prefill + first
sample); decode ms/step = (t_N - t_1) / (N - 1). Sides alternate repeat by repeat; ratios are
medians of per-pair ratios (see README.md). The floor is the decode step's FLOPs (all matmuls,
attention over the average context included) over the fp32 matmul rate measured in this run.

    python benchmarks/generation.py [--arch llama] [--batch 32] [--prompt-tokens 16]
                                    [--new-tokens 48] [--repeats 7] [--threads 1] [--static-decode]

--static-decode times the engine's static decode step (whole cache, masked: what CUDA graphs
capture on a GPU) instead of the default one, to show what it costs on this machine.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds fn() takes, its device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def matmul_rate(size: int, device: torch.device, repeats: int = 20) -> float:
    """FLOP/s of a [size, size] x [size, size] fp32 product (median of repeats)."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    for _ in range(3):
        a @ b
    return 2 * size**3 / statistics.median(timed(lambda: a @ b, device) for _ in range(repeats))


def decode_step_flops(cfg, batch: int, context: float) -> float:
    """FLOPs of one decode step: every matmul of one token per row, attention over `context` keys."""
    hidden, heads, groups, head_dim, ffn = (cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups,
                                            cfg.head_dim, cfg.ffn_size)
    gated = 2 if cfg.activation == "swiglu" else 1
    attention_weights = hidden * (heads + 2 * groups) * head_dim + heads * head_dim * hidden
    per_layer = attention_weights + hidden * ffn * gated + ffn * hidden
    attention = 2 * heads * head_dim * context  # q.k and p.v
    per_token = cfg.num_layers * (per_layer + attention) + hidden * cfg.vocab_size
    return 2.0 * batch * per_token


def decode_step_bytes(model, cfg, batch: int, context: float) -> float:
    """Bytes one decode step must read: every weight once (embedding rows aside) and the KV cache
    over `context` columns of every layer, K and V (the cache's dtype is the model's)."""
    embedding = model.embedding.word_embeddings.weight
    positions = getattr(model.embedding, "position_embeddings", None)
    gathered = {id(positions.weight)} if positions is not None else set()  # rows looked up, not read whole
    if not model.share_embeddings_and_output_weights:  # tied: the output layer reads it whole
        gathered.add(id(embedding))
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in gathered)
    kv = 2 * cfg.num_layers * batch * cfg.query_groups * cfg.head_dim * context * embedding.element_size()
    return weights + kv


def read_rate(nbytes: float, device: torch.device, repeats: int = 30) -> float:
    """Bytes/s of a summing pass over a float32 buffer: of nbytes on CPU (kept hot, like the step's
    working set), of at least 1 GiB on a GPU (more than its L2 cache: the HBM read rate)."""
    if device.type == "cuda":
        nbytes = max(nbytes, 2**30)
    buffer = torch.randn(max(int(nbytes) // 4, 1 << 16), device=device)
    for _ in range(3):
        buffer.sum()
    return buffer.numel() * 4 / statistics.median(timed(buffer.sum, device) for _ in range(repeats))


def step_matmuls_seconds(model, batch: int, repeats: int = 50) -> float:
    """The decode step's weight matmuls alone (W @ x with x [in, batch], as the engine runs them), hot in cache."""
    weights = [p for name, p in model.named_parameters() if name.startswith("decoder.") and p.dim() == 2]
    weights.append(model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                   else model.output_layer.weight)
    inputs = [torch.randn(w.shape[1], batch, device=w.device) for w in weights]

    def run():
        for weight, x in zip(weights, inputs):
            torch.mm(weight, x)

    with torch.inference_mode():
        for _ in range(5):
            run()
        return statistics.median(timed(run, weights[0].device) for _ in range(repeats))


def build_models(arch: str, work: Path, layers: int, hidden: int, heads: int, vocab: int, max_len: int):
    """The megatron model (TP=1) and its HF export, sharing identical weights."""
    import transformers

    from aligner import checkpointing
    from aligner.hf.convert import export_hf
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config

    factory = GPTConfig.gpt2 if arch == "gpt2" else GPTConfig.llama
    cfg = factory(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                  max_position_embeddings=max_len)
    model = build_gpt_model(cfg, transformer_config(cfg)).eval()
    checkpointing.save(work / "ckpt", [model], model_config=cfg.to_dict())
    export_hf(work / "ckpt", work / "hf", arch=arch)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(work / "hf"), dtype=torch.float32).eval()
    return cfg, model, hf_model


def check_same_logits(model, hf_model, cfg) -> float:
    from aligner.models.forward import forward_logits

    device = next(hf_model.parameters()).device
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        expected = hf_model(tokens).logits.float()
    return float((forward_logits([model], tokens, cfg.vocab_size) - expected).abs().max())


def paired(first: Callable[[], object], second: Callable[[], object], repeats: int, warmup: int,
           device: torch.device):
    """Seconds of first() and second(), alternated so a burst of load hits both sides of a pair."""
    for _ in range(warmup):
        first()
        second()
    pairs = []
    for repeat in range(repeats):
        if repeat % 2:
            b = timed(second, device)
            pairs.append((timed(first, device), b))
        else:
            a = timed(first, device)
            pairs.append((a, timed(second, device)))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7, help="timed pairs per case (medians reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both sides (0: torch's choice); one keeps a shared "
                        "machine's timings steady")
    parser.add_argument("--static-decode", action="store_true",
                        help="run the engine with static_decode=True (the CUDA-graph-capturable step, eagerly)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # megatron's "no transformer-engine/apex" notices, HF generation notices
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from aligner.generation.engine import SamplingParams
    from aligner.generation.native import NativeEngine
    from aligner.runtime import distributed, seeds

    distributed.initialize(distributed.ParallelConfig())
    device = distributed.device()  # the megatron model's device; HF runs on the same one
    seeds.set_seed(0)
    max_len = args.prompt_tokens + args.new_tokens
    with tempfile.TemporaryDirectory() as scratch:
        cfg, model, hf_model = build_models(args.arch, Path(scratch), args.layers, args.hidden, args.heads,
                                            args.vocab, max(max_len, 64))
    hf_model.to(device)
    logit_diff = check_same_logits(model, hf_model, cfg)
    if logit_diff > 1e-4:
        raise SystemExit(f"HF export does not reproduce the megatron model (max logit diff {logit_diff:.2e})")

    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_tokens), generator=generator)
    prompts = prompt_ids.tolist()
    prompt_ids = prompt_ids.to(device)
    engine = NativeEngine([model], cfg, pad_id=0, eos_id=2, max_batch_size=args.batch, max_sequence_length=max_len,
                          static_decode=args.static_decode)
    hf_model.generation_config.eos_token_id = None  # fixed length: nothing stops a row early

    def native(new_tokens: int) -> Callable[[], object]:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, fixed_length=True, seed=1)
        return lambda: engine.generate(prompts, params)

    def hf(new_tokens: int) -> Callable[[], object]:
        def run():
            with torch.inference_mode():
                out = hf_model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=True,
                                        temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                        min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
            assert out.shape[1] == args.prompt_tokens + new_tokens, out.shape
            return out
        return run

    rate = matmul_rate(1024, device)
    full = paired(hf(args.new_tokens), native(args.new_tokens), args.repeats, args.warmup, device)
    first = paired(hf(1), native(1), args.repeats, args.warmup, device)
    rate = statistics.median([rate, matmul_rate(1024, device)])  # before and after: load drifts
    matmuls = step_matmuls_seconds(model, args.batch)

    steps = args.new_tokens - 1
    hf_step = [(f_hf - o_hf) / steps for (f_hf, _), (o_hf, _) in zip(full, first)]
    native_step = [(f_n - o_n) / steps for (_, f_n), (_, o_n) in zip(full, first)]
    tokens = args.batch * args.new_tokens
    hf_tps = statistics.median(tokens / f for f, _ in full)
    native_tps = statistics.median(tokens / n for _, n in full)
    context = args.prompt_tokens + args.new_tokens / 2
    floor = decode_step_flops(cfg, args.batch, context) / rate
    step_bytes = decode_step_bytes(model, cfg, args.batch, context)
    bandwidth = read_rate(step_bytes, device)

    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"generation: torch {torch.__version__}, transformers {transformers.__version__}, {where}; "
          f"{args.repeats} alternating pairs after {args.warmup} warm-up")
    print(f"model: {args.arch}-style, {cfg.num_layers} layers x {cfg.hidden_size} wide, "
          f"{cfg.num_attention_heads} heads, vocab {cfg.vocab_size}, fp32; HF export max |logit diff| {logit_diff:.1e}")
    print(f"work: batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens "
          f"(fixed length), sampling at temperature 1; native decode step: "
          f"{'static (whole cache, masked)' if args.static_decode else 'dynamic (default)'}")
    print(f"tokens/s      HF generate {hf_tps:9.0f}   native {native_tps:9.0f}   "
          f"ratio {statistics.median(h / n for h, n in full):.2f}x")
    print(f"decode step   HF generate {statistics.median(hf_step) * 1e3:7.3f} ms  native "
          f"{statistics.median(native_step) * 1e3:7.3f} ms  ratio "
          f"{statistics.median(h / n for h, n in zip(hf_step, native_step)):.2f}x")
    print(f"prefill+1     HF generate {statistics.median(h for h, _ in first) * 1e3:7.2f} ms  native "
          f"{statistics.median(n for _, n in first) * 1e3:7.2f} ms")
    print(f"floor         {decode_step_flops(cfg, args.batch, context) / 1e6:.1f} MFLOP per decode step at "
          f"{rate / 1e9:.0f} GFLOP/s (1024^3 fp32 matmul, this run) = {floor * 1e3:.3f} ms; native is "
          f"{statistics.median(native_step) / floor:.2f}x the floor, HF {statistics.median(hf_step) / floor:.2f}x")
    print(f"memory        {step_bytes / 1e6:.1f} MB read per decode step (weights + KV cache) "
          f"at {bandwidth / 1e9:.1f} GB/s "
          f"(sum over a {'>= 1 GiB' if device.type == 'cuda' else 'same-size'} buffer, this run) = "
          f"{step_bytes / bandwidth * 1e3:.3f} ms; native moves "
          f"{step_bytes / statistics.median(native_step) / 1e9:.1f} GB/s = "
          f"{step_bytes / statistics.median(native_step) / bandwidth:.0%} of that rate")
    print(f"matmuls only  the decode step's weight products alone (W @ x, x [in, {args.batch}], hot in cache): "
          f"{matmuls * 1e3:.3f} ms = {decode_step_flops(cfg, args.batch, 0) / matmuls / 1e9:.0f} GFLOP/s")
    distributed.shutdown()


if __name__ == "__main__":
    main()
