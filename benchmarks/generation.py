"""Native generation engine vs Hugging Face `generate` on the identical model, in one process.

Our side is an aligner checkpoint loaded as the entry points load it (megatron chunks + NativeEngine);
HF's side is the same weights as an HF directory loaded by transformers, both in --precision (fp32 by
default). Without --model
both come from one random toy model (saved and exported with `aligner.hf.convert.export_hf`); with
--model they come from `benchmarks/models.py`'s `resolve_model` (an HF dir, a .gguf file, an aligner
checkpoint or `smollm2`) and the prompts are windows of an English text, tokenised. Logits are
checked to agree before anything is timed. Both sides continue the same prompts at the same batch
size with the same sampling (temperature 1, or greedy with --greedy) in fixed-length mode: every row
gets exactly --new-tokens tokens, so both do the same work.

Per side and batch size, `generate` is timed with --new-tokens tokens and with one token (prefill +
first token); decode ms/step = (t_N - t_1) / (N - 1). Sides alternate repeat by repeat; ratios are
medians of per-pair ratios (see README.md). The measured-rate floor of a decode step is the larger of
its FLOPs over the matmul rate in the model's dtype and its bytes (weights + KV cache, at that dtype's
element size) over the read rate, each rate the highest of this run's measurements (before, after each
batch size, after; every sample printed; benchmarks/machine.py): not a physical floor, the strictest
one this run's measurements support.

    python benchmarks/generation.py [--model SPEC] [--batches 1,8,32,64] [--prompt-tokens 16]
        [--new-tokens 64] [--greedy] [--repeats N] [--threads 2] [--arch llama] [--static-decode]
        [--precision fp32|bf16] [--cuda-graphs | --compare-graphs]
        [--layers 16 --hidden 2048 --heads 32 --query-groups 8 --ffn 8192 --vocab 32000]

--static-decode times the engine's static decode step (whole cache, masked: what CUDA graphs
capture on a GPU) instead of the default one, to show what it costs on this machine.
--no-pack-weights runs the engine with pack_weights=False (on CPU in fp32 its products then read the
weights as they are instead of oneDNN-packed copies); the run reports what a refit, which repacks
every weight, costs.
--cuda-graphs builds the engine with cuda_graphs=True (GPU only). --compare-graphs (GPU only) times the
engine without and with CUDA graphs (two engines on the same model) and HF, the three alternating repeat
by repeat, and adds per batch size each one's decode bandwidth as a share of the measured read (HBM)
rate (a step's bytes / its time / the read rate) and `gpu_decode_*` ratio lines.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

if not __package__:  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import (  # noqa: E402
    DRAM_BUFFER_BYTES,
    MachineRates,
    cpu_header,
    describe_peak_rss,
    load_average,
    read_rate,
    timed,
)
from benchmarks.peer.protocol import in_turn  # noqa: E402
from benchmarks.run_bench import ratio_line  # noqa: E402

# Prompts of a real model: windows of this text, so rows differ but all have the same length.
PROMPT_TEXT = (
    "The river starts high in the mountains, where snow melts in late spring and runs down through "
    "narrow valleys full of pine trees. Small towns sit along its banks, and each one has a bridge, a "
    "market and a school. Farmers grow wheat and apples in the wide fields near the coast, and fishing "
    "boats leave the harbour before sunrise. In the evening people walk along the water, talk about the "
    "weather and the price of bread, and watch the light fade behind the hills. Write a short story about "
    "a child who follows the river from its source to the sea, and what she learns on the way."
)
PROMPT_STRIDE = 5  # tokens between the starts of consecutive rows' windows


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


def step_matmuls_seconds(engine, batch: int, repeats: int) -> Optional[float]:
    """The decode step's weight matmuls alone (W @ x with x [in, batch]) on the tensors the engine's products
    read (the weights, or their packed copies), as its last call ran them: through oneDNN on a CPU in fp32
    (`aligner.runtime.cpu_products`), BLAS on the weights for a call of one sequence where BLAS is preferred.
    None where the step runs in C++ on its own products (`aligner.generation.native.cpu_decode`: one row, or up
    to its own_rows): they are not calls of their own."""
    from aligner.runtime import cpu_products

    cpu = engine.state.cpu_decode
    if cpu is not None and batch <= cpu.own_rows and cpu.available():
        return None

    segment = engine.state.segments[0]  # one process, one stage: every layer and the output layer
    on_blas = engine.state.single_sequence_on_blas
    linears = [linear for layer in segment.layers for linear in (layer.qkv, layer.proj, layer.fc1, layer.fc2)]
    weights = [linear.weight if on_blas else linear.product for linear in linears]
    weights.append(segment.output_weight if on_blas else segment.output_product)
    device = segment.output_weight.device
    inputs = [torch.randn(batch, w.shape[1], device=device, dtype=segment.output_weight.dtype).t() for w in weights]
    product = (cpu_products.weight_times_columns
               if cpu_products.available(device, segment.output_weight.dtype) and not on_blas else torch.mm)

    def run():
        for weight, x in zip(weights, inputs):
            product(weight, x)

    with torch.inference_mode():
        for _ in range(2):
            run()
        return statistics.median(timed(run, device) for _ in range(repeats))


@dataclass
class Sides:
    """Our model (TP=1, eval) and transformers' copy of the same weights."""

    cfg: object  # aligner.models.gpt.GPTConfig
    model: torch.nn.Module
    hf_model: torch.nn.Module
    description: str
    tokenizer: Optional[object] = None  # aligner.tokenizer.Tokenizer of a real model; None: random prompts


def build_toy_sides(arch: str, work: Path, layers: int, hidden: int, heads: int, vocab: int, max_len: int,
                    query_groups: Optional[int] = None, ffn: Optional[int] = None,
                    dtype: torch.dtype = torch.float32) -> Sides:
    """A random megatron model and its HF export, sharing identical weights in dtype.
    query_groups, ffn: None for the architecture's defaults (no GQA, 4 x hidden)."""
    import transformers

    from aligner import checkpointing
    from aligner.hf.convert import export_hf
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config

    factory = GPTConfig.gpt2 if arch == "gpt2" else GPTConfig.llama
    cfg = factory(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=query_groups,
                  ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=max_len)
    # megatron makes its norm weights fp32 whatever params_dtype; in dtype they equal HF's (as under the
    # trainer's bf16 wrapper)
    model = build_gpt_model(cfg, transformer_config(cfg, params_dtype=dtype)).to(dtype).eval()
    checkpointing.save(work / "ckpt", [model], model_config=cfg.to_dict())
    export_hf(work / "ckpt", work / "hf", arch=arch)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(work / "hf"), dtype=dtype).eval()
    return Sides(cfg, model, hf_model, f"random {arch}-style toy model")


def load_sides(spec: str, cache_dir: Optional[Path] = None, dtype: torch.dtype = torch.float32) -> Sides:
    """Both sides of a real model in dtype: our checkpoint loaded as chat.py loads it, and HF's directory.
    cache_dir: where resolve_model keeps converted copies (None: its default)."""
    import transformers

    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, build_model_chunks
    from aligner.runtime.distributed import ParallelConfig
    from aligner.tokenizer import Tokenizer
    from benchmarks.models import BENCH_CACHE, resolve_model

    resolved = resolve_model(spec, cache_dir or BENCH_CACHE)
    cfg = GPTConfig.from_dict(checkpointing.read_meta(resolved.checkpoint_dir)["model"])
    chunks = build_model_chunks(cfg, ParallelConfig(), dtype)
    checkpointing.load(resolved.checkpoint_dir, chunks)
    model = chunks[0].to(dtype).eval()  # norm weights too, as HF's (see build_toy_sides)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(resolved.hf_dir), dtype=dtype).eval()
    tokenizer = Tokenizer(resolved.checkpoint_dir / checkpointing.TOKENIZER_DIR)
    return Sides(cfg, model, hf_model, f"{spec} ({resolved.checkpoint_dir.parent.name})", tokenizer)


def make_prompts(sides: Sides, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of exactly `length` tokens: windows of PROMPT_TEXT, or random ids for a toy model."""
    if sides.tokenizer is None:
        generator = torch.Generator().manual_seed(1)
        return torch.randint(3, sides.cfg.vocab_size, (batch, length), generator=generator).tolist()
    text = sides.tokenizer.encode(PROMPT_TEXT)
    starts = len(text) - length + 1
    if starts < 1:
        raise SystemExit(f"--prompt-tokens {length}: the prompt text has only {len(text)} tokens")
    return [text[(row * PROMPT_STRIDE) % starts:][:length] for row in range(batch)]


def logit_difference(sides: Sides, tokens: torch.Tensor) -> tuple[float, float]:
    """Max |our logits - HF's| on `tokens`, and max |HF logit| (the scale the difference is read against)."""
    from aligner.models.forward import forward_logits

    with torch.no_grad():
        expected = sides.hf_model(tokens).logits.float()
    ours = forward_logits([sides.model], tokens, sides.cfg.vocab_size)
    return float((ours.to(expected.device) - expected).abs().max()), float(expected.abs().max())


def logit_tolerance(dtype: torch.dtype, logit_scale: float) -> float:
    """The largest |our logits - HF's| that still means both sides run the same model."""
    if dtype == torch.float32:
        return 1e-4 + 1e-5 * logit_scale  # fp32 sums in another order drift with the logits' size
    # bf16 keeps 8 significant bits, a rounding step of up to 2^-8 of a value; the two sides round at
    # different places in every layer, so their logits differ by several such steps of the logit scale.
    # 5% of the scale allows that and still fails a wrong weight or layout, which is off by the scale itself.
    return 0.05 * logit_scale


def alternated(runs: list[Callable[[], object]], repeats: int, device: torch.device) -> list[tuple[float, ...]]:
    """Seconds of each of runs per repeat, in run order; every other repeat runs them in reverse order,
    so a burst of load, or a first-in-line cost, hits every side alike."""
    rounds = []
    for repeat in range(repeats):
        seconds = {index: timed(runs[index], device) for index in in_turn(range(len(runs)), repeat)}
        rounds.append(tuple(seconds[index] for index in range(len(runs))))
    return rounds


@dataclass
class BatchResult:
    batch: int
    hf_tokens_per_s: float
    native_tokens_per_s: float
    tokens_ratio: float  # median per pair of HF time / native time, whole generate call
    hf_step: float  # decode step seconds (median)
    native_step: float
    step_ratio: float  # median per pair of HF step / native step
    hf_prefill: float  # seconds of a one-token generate (prompt forward + first token)
    native_prefill: float
    step_flops: float
    step_bytes: float
    matmuls: Optional[float]  # seconds of the step's weight products alone (None: run inside the C++ step)
    greedy_rows_equal: Optional[int]  # rows whose greedy tokens agree between the sides (None: sampling)
    # --compare-graphs: the engine with CUDA graphs, timed in the same rounds (None otherwise)
    graphs_tokens_per_s: Optional[float] = None
    graphs_step: Optional[float] = None
    graphs_tokens_ratio: Optional[float] = None  # median per round of HF time / graphs time
    graphs_step_ratio: Optional[float] = None  # median per round of HF step / graphs step


def time_batch(sides: Sides, engines: list, prompts: list[list[int]], args, device: torch.device) -> BatchResult:
    """engines: the native engine, then (--compare-graphs) the one with CUDA graphs; all alternate with HF."""
    from aligner.generation.engine import SamplingParams

    batch, prompt_length = len(prompts), len(prompts[0])
    prompt_ids = torch.tensor(prompts, device=device)

    last = {}  # each side's latest full-length output, to compare greedy tokens without another run

    def native(engine, new_tokens: int) -> Callable[[], object]:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, greedy=args.greedy, fixed_length=True,
                                seed=1)

        def run():
            last[id(engine), new_tokens] = engine.generate(prompts, params).response_tokens
        return run

    def hf(new_tokens: int) -> Callable[[], object]:
        sampling = {"do_sample": False} if args.greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0,
                                                             "top_p": 1.0}
        def run():
            with torch.inference_mode():
                out = sides.hf_model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                              pad_token_id=0, eos_token_id=None, **sampling)
            assert out.shape[1] == prompt_length + new_tokens, out.shape
            last["hf", new_tokens] = out[:, prompt_length:]
        return run

    for _ in range(args.warmup):  # first-call costs (allocations, BLAS set-up) of every path
        hf(2)()
        for engine in engines:  # full length: the KV cache reaches its size (and CUDA graphs are captured for it)
            native(engine, args.new_tokens)()
    # per round, seconds of: HF, then each engine
    full = alternated([hf(args.new_tokens)] + [native(engine, args.new_tokens) for engine in engines],
                      args.repeats, device)
    first = alternated([hf(1)] + [native(engine, 1) for engine in engines], args.repeats, device)
    greedy_rows_equal = None
    if args.greedy:
        ours, theirs = last[id(engines[0]), args.new_tokens].to(device), last["hf", args.new_tokens]
        greedy_rows_equal = int((ours == theirs).all(dim=1).sum())

    steps = args.new_tokens - 1
    step = [[(f[side] - o[side]) / steps for f, o in zip(full, first)] for side in range(1 + len(engines))]
    tokens = batch * args.new_tokens
    context = prompt_length + args.new_tokens / 2

    def side(index: int) -> dict:
        """Tokens/s and decode step of side index (0: HF), and HF's time and step over its (medians per round)."""
        return dict(tokens_per_s=statistics.median(tokens / f[index] for f in full),
                    step=statistics.median(step[index]),
                    tokens_ratio=statistics.median(f[0] / f[index] for f in full),
                    step_ratio=statistics.median(h / s for h, s in zip(step[0], step[index])))

    hf_side, native_side = side(0), side(1)
    graphs = {f"graphs_{key}": value for key, value in side(2).items()} if len(engines) > 1 else {}
    return BatchResult(
        batch=batch,
        hf_tokens_per_s=hf_side["tokens_per_s"],
        native_tokens_per_s=native_side["tokens_per_s"],
        tokens_ratio=native_side["tokens_ratio"],
        hf_step=hf_side["step"],
        native_step=native_side["step"],
        step_ratio=native_side["step_ratio"],
        hf_prefill=statistics.median(o[0] for o in first),
        native_prefill=statistics.median(o[1] for o in first),
        step_flops=decode_step_flops(sides.cfg, batch, context),
        step_bytes=decode_step_bytes(sides.model, sides.cfg, batch, context),
        matmuls=step_matmuls_seconds(engines[0], batch, repeats=max(args.repeats, 5)),
        greedy_rows_equal=greedy_rows_equal,
        **graphs,
    )


CACHED_READ_SAMPLES = 3


def step_read_rate(step_bytes: float, machine: MachineRates, device: torch.device) -> float:
    """The rate a step's working set is read at: the DRAM rate when it exceeds the buffer that measures
    that rate, else a summing pass over a buffer of its own size (hot in cache, as the step finds it), the
    highest of CACHED_READ_SAMPLES measurements (each printed)."""
    if step_bytes >= DRAM_BUFFER_BYTES or device.type == "cuda":
        return machine.read_bytes
    samples = [read_rate(step_bytes, device) for _ in range(CACHED_READ_SAMPLES)]
    print(f"  read rate over {step_bytes / 1e6:.1f} MB (the step's working set, cached): "
          + ", ".join(f"{rate / 1e9:.1f}" for rate in samples) + " GB/s; the highest is the floor's")
    return max(samples)


def report(result: BatchResult, machine: MachineRates, read_bytes: float) -> list[str]:
    """The lines of one batch size; the `ratio` lines are what run_bench.py collects."""
    compute_floor = result.step_flops / machine.matmul_flops
    memory_floor = result.step_bytes / read_bytes
    floor = max(compute_floor, memory_floor)
    bound = "memory" if memory_floor >= compute_floor else "compute"
    name = f"generation_b{result.batch}"
    lines = [
        f"batch {result.batch}",
        f"  tokens/s      HF generate {result.hf_tokens_per_s:9.1f}   native {result.native_tokens_per_s:9.1f}   "
        f"HF time / native {result.tokens_ratio:.2f}x",
        f"  decode step   HF generate {result.hf_step * 1e3:8.2f} ms  native {result.native_step * 1e3:8.2f} ms  "
        f"HF / native {result.step_ratio:.2f}x",
        f"  prefill+1     HF generate {result.hf_prefill * 1e3:8.2f} ms  native {result.native_prefill * 1e3:8.2f} ms",
        f"  measured-rate floor {bound}-bound {floor * 1e3:.3f} ms: compute {result.step_flops / 1e9:.3f} GFLOP / "
        f"{machine.matmul_flops / 1e9:.0f} GFLOP/s = {compute_floor * 1e3:.3f} ms, memory "
        f"{result.step_bytes / 1e6:.1f} MB (weights + KV) / {read_bytes / 1e9:.1f} GB/s = {memory_floor * 1e3:.3f} ms; "
        f"floor / native {floor / result.native_step:.2f}, floor / HF {floor / result.hf_step:.2f}",
        f"  matmuls only  the step's weight products alone (W @ x, x [in, {result.batch}]): " + (
            "not timed apart: they run inside the C++ step, on its own products (aligner/generation/native/"
            "cpu_decode.py)"
            if result.matmuls is None else
            f"{result.matmuls * 1e3:.3f} ms = {result.step_flops / result.matmuls / 1e9:.0f} GFLOP/s "
            "(attention aside)"),
    ]
    if result.greedy_rows_equal is not None:
        lines.append(f"  greedy tokens equal in {result.greedy_rows_equal} of {result.batch} rows")
    lines += [ratio_line(f"{name}_vs_hf", result.tokens_ratio),
              ratio_line(f"{name}_decode_vs_hf", result.step_ratio),
              ratio_line(f"{name}_vs_measured_floor", floor / result.native_step)]
    if result.graphs_step is not None:
        lines += graphs_report(result, read_bytes)
    return lines


def graphs_report(result: BatchResult, read_bytes: float) -> list[str]:
    """--compare-graphs lines of one batch size: the engine with CUDA graphs beside the eager one and HF,
    and each one's decode bandwidth as a share of the read rate (bytes a step reads / its time / the rate)."""
    steps = {"hf": result.hf_step, "eager": result.native_step, "graphs": result.graphs_step}
    share = {side: result.step_bytes / step / read_bytes for side, step in steps.items()}
    suffix = f"_b{result.batch}"
    return [
        f"  CUDA graphs   tokens/s {result.graphs_tokens_per_s:9.1f} (HF time / graphs "
        f"{result.graphs_tokens_ratio:.2f}x), decode step {result.graphs_step * 1e3:.3f} ms (HF / graphs "
        f"{result.graphs_step_ratio:.2f}x, eager / graphs {result.native_step / result.graphs_step:.2f}x)",
        f"  read share    decode step bytes / step time / read rate: HF {share['hf']:.1%}, eager "
        f"{share['eager']:.1%}, graphs {share['graphs']:.1%}",
        ratio_line("gpu_decode_eager_vs_hf" + suffix, result.step_ratio),
        ratio_line("gpu_decode_graphs_vs_hf" + suffix, result.graphs_step_ratio),
        ratio_line("gpu_decode_graphs_vs_eager" + suffix, result.native_step / result.graphs_step),
        *(ratio_line(f"gpu_decode_{side}_hbm_share{suffix}", value) for side, value in share.items()),
    ]


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--batches {text!r}: expected comma-separated integers, e.g. 1,8,32,64") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batches {text!r}: expected positive batch sizes")
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="an HF dir, a .gguf file, an aligner checkpoint or "
                        "`smollm2` (default: a random toy model)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 32; with --model "
                        "1,8,32,64)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 48; with --model 64")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding on both sides (default: temperature 1)")
    parser.add_argument("--arch", choices=["llama", "gpt2"], default="llama", help="toy model's architecture")
    parser.add_argument("--layers", type=int, default=4, help="toy model")
    parser.add_argument("--hidden", type=int, default=128, help="toy model")
    parser.add_argument("--heads", type=int, default=4, help="toy model")
    parser.add_argument("--query-groups", type=int, default=None, help="toy model's KV heads (default: --heads)")
    parser.add_argument("--ffn", type=int, default=None, help="toy model's MLP width (default: 4 x --hidden)")
    parser.add_argument("--vocab", type=int, default=256, help="toy model")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="both sides' weights and compute, and the matmul rate of the floor")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed pairs per batch size (medians reported); default 7, with --model 2")
    parser.add_argument("--warmup", type=int, default=2, help="untimed short pairs per batch size")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both sides (0: torch's choice); one keeps a shared "
                        "machine's timings steady")
    parser.add_argument("--static-decode", action="store_true",
                        help="run the engine with static_decode=True (the CUDA-graph-capturable step, eagerly)")
    parser.add_argument("--no-pack-weights", action="store_true",
                        help="run the engine with pack_weights=False (products on the weights as they are)")
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graphs", action="store_true", help="run the engine with cuda_graphs=True (GPU only)")
    graphs.add_argument("--compare-graphs", action="store_true",
                        help="time the engine without and with CUDA graphs, and HF, alternating (GPU only)")
    args = parser.parse_args()
    real = args.model is not None
    batches = parse_batches(args.batches or ("1,8,32,64" if real else "32"))
    args.new_tokens = args.new_tokens or (64 if real else 48)
    args.repeats = args.repeats or (2 if real else 7)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (the decode step is t(N) - t(1) over N - 1 steps)")
    warnings.filterwarnings("ignore")  # megatron's "no transformer-engine/apex" notices, HF generation notices
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from aligner.generation.native import NativeEngine
    from aligner.runtime import distributed, seeds
    from aligner.runtime.errors import ConfigError

    distributed.initialize(distributed.ParallelConfig())
    device = distributed.device()  # the megatron model's device; HF runs on the same one
    dtype = distributed.resolve_precision(args.precision)
    # before the models load: its buffer never adds to theirs in the RSS
    rates_before = MachineRates.measure(device, dtype)
    seeds.set_seed(0)
    max_len = args.prompt_tokens + args.new_tokens
    if real:
        sides = load_sides(args.model, dtype=dtype)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            sides = build_toy_sides(args.arch, Path(scratch), args.layers, args.hidden, args.heads, args.vocab,
                                    max(max_len, 64), args.query_groups, args.ffn, dtype)
    sides.model.to(device)  # the toy model is built on the CPU
    sides.hf_model.to(device)
    sides.hf_model.generation_config.eos_token_id = None  # fixed length: nothing stops a row early
    prompts = make_prompts(sides, max(batches), args.prompt_tokens)
    check_tokens = torch.tensor(prompts[:2], device=device)
    logit_diff, logit_scale = logit_difference(sides, check_tokens)
    tolerance = logit_tolerance(dtype, logit_scale)
    if logit_diff > tolerance:
        raise SystemExit(f"the HF side does not reproduce our model (max logit diff {logit_diff:.2e} > "
                         f"{tolerance:.1e})")
    make_engine = partial(NativeEngine, [sides.model], sides.cfg, pad_id=0, eos_id=2, max_batch_size=max(batches),
                          max_sequence_length=max_len, static_decode=args.static_decode,
                          pack_weights=not args.no_pack_weights)
    try:
        engines = [make_engine(cuda_graphs=args.cuda_graphs)]
        if args.compare_graphs:
            engines.append(make_engine(cuda_graphs=True))
    except ConfigError as error:  # cuda_graphs on a CPU
        raise SystemExit(f"{'--compare-graphs' if args.compare_graphs else '--cuda-graphs'}: {error}") from None
    engine = engines[0]
    refit_seconds = statistics.median([timed(partial(engine.refit, [sides.model]), device) for _ in range(3)])

    cfg = sides.cfg
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    if device.type == "cpu":
        print(cpu_header(), flush=True)
    rounds = "rounds (HF, eager, CUDA graphs)" if args.compare_graphs else "pairs"
    print(f"generation: torch {torch.__version__}, transformers {transformers.__version__}, {where}; "
          f"{args.repeats} alternating {rounds} per batch after {args.warmup} warm-up {rounds}", flush=True)
    print(f"model: {sides.description}: {cfg.num_layers} layers x {cfg.hidden_size} wide, "
          f"{cfg.num_attention_heads} heads ({cfg.query_groups} KV groups), vocab {cfg.vocab_size}, "
          f"{sum(p.numel() for p in sides.model.parameters()) / 1e6:.1f}M parameters, {args.precision}; "
          f"max |logit diff| vs HF {logit_diff:.1e} (logits up to {logit_scale:.1f})")
    decode_step = "static (whole cache, masked)" if args.static_decode or args.cuda_graphs else "dynamic (default)"
    if args.cuda_graphs:
        decode_step += ", replayed from CUDA graphs"
    elif args.compare_graphs:
        decode_step += "; and static, replayed from CUDA graphs"
    print(f"work: prompts of {args.prompt_tokens} tokens ({'text windows' if real else 'random ids'}), "
          f"{args.new_tokens} new tokens (fixed length), {'greedy' if args.greedy else 'sampling at temperature 1'}; "
          f"native decode step: {decode_step}", flush=True)
    packing = (f"products on packed weight copies ({engine.packed_weight_bytes / 1e6:.0f} MB, remade at each refit)"
               if engine.packed_weight_bytes else "products on the weights as they are")
    print(f"engine: {packing}; refit {refit_seconds * 1e3:.0f} ms (median of 3, load {load_average():.2f})",
          flush=True)

    results, samples = [], [rates_before]
    for batch in batches:
        results.append(time_batch(sides, engines, prompts[:batch], args, device))
        samples.append(MachineRates.measure(device, dtype))  # beside each batch: the rates move with the load
        print(f"  batch {batch} timed (load {load_average():.2f})", flush=True)
    peak = describe_peak_rss()  # before the rate buffers below
    del engine, engines, sides
    gc.collect()
    samples.append(MachineRates.measure(device, dtype))
    rates = MachineRates.best(samples)
    for result in results:
        print("\n".join(report(result, rates, step_read_rate(result.step_bytes, rates, device))))
    print(rates.describe() + " (the highest of the samples below: the measured-rate floor's rates)")
    print(MachineRates.describe_samples(samples))
    print(peak)
    distributed.shutdown()


if __name__ == "__main__":
    main()
