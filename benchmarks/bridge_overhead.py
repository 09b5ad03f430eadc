"""What the CPU bridge's TorchFunctionMode (`cpu_bridge.CudaToCpuMode`) costs, in one process.

The mode sees every torch call made while it is active. The bridge enters it only around
megatron's schedules, DDP init, finalize_model_grads, optimizer init/step and dist_checkpointing,
so this script measures:
  1. a GPTModel forward (decode: one token, no KV cache; prefill: 64 tokens), batch 32, plain and
     inside `cuda_to_cpu()`: the ratio is what any code path running under the mode pays;
  2. the mode's cost per torch call (forward overhead / torch calls per forward, and a tight loop
     of small ops as a cross-check);
  3. one training step (schedule forward+backward, finalize_model_grads, optimizer step), which
     runs inside the mode by construction: calls made there x cost per call = the mode's share.

    python benchmarks/bridge_overhead.py [--repeats 30] [--warmup 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from peer.protocol import in_turn  # benchmarks/peer: this file runs as a script, its folder on the path

BATCH = 32
PREFILL_TOKENS = 64
SMALL_OP_CALLS = 2000


def _count_bridge_calls(fn: Callable[[], object]) -> int:
    """How many torch calls the bridge's mode handles while fn() runs (counted, not timed)."""
    from aligner.runtime.cpu_bridge import CudaToCpuMode

    original = CudaToCpuMode.__torch_function__
    calls = 0

    def counting(self, func, types, args=(), kwargs=None):
        nonlocal calls
        calls += 1
        return original(self, func, types, args, kwargs)

    CudaToCpuMode.__torch_function__ = counting
    try:
        fn()
    finally:
        CudaToCpuMode.__torch_function__ = original
    return calls


def _in_scope(fn: Callable[[], object]) -> object:
    from aligner.runtime.cpu_bridge import cuda_to_cpu

    with cuda_to_cpu():
        return fn()


@dataclass
class Paired:
    """fn() timed plain and inside cuda_to_cpu(), alternately; medians in seconds."""

    plain: float
    scoped: float
    ratio: float  # median over pairs of scoped / plain: a burst of load hits both sides of a pair
    extra: float  # median over pairs of scoped - plain


def _paired(fn: Callable[[], object], repeats: int, warmup: int) -> Paired:
    from aligner.runtime.cpu_bridge import cuda_to_cpu

    def plain() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def scoped() -> float:
        with cuda_to_cpu():
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

    for _ in range(warmup):
        plain()
        scoped()
    pairs = []
    for repeat in range(repeats):
        seconds = {run: run() for run in in_turn((plain, scoped), repeat)}
        pairs.append((seconds[plain], seconds[scoped]))
    return Paired(
        plain=statistics.median(p for p, _ in pairs),
        scoped=statistics.median(s for _, s in pairs),
        ratio=statistics.median(s / p for p, s in pairs),
        extra=statistics.median(s - p for p, s in pairs),
    )


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _training_step_fn(model_cfg, parallel, vocab_size: int) -> Callable[[], None]:
    """One step as the trainers run it: DDP-wrapped model, per-token loss, megatron schedule, optimizer."""
    import torch.nn.functional as F
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from aligner.models.gpt import build_model_chunks
    from aligner.training import setup

    chunks = setup.wrap_for_training(build_model_chunks(model_cfg, parallel, torch.float32))
    optimizer = setup.build_optimizer(chunks, setup.OptimConfig(lr=1e-4, clip_grad=1.0), torch.float32)
    setup.attach_grad_hooks(chunks, optimizer)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab_size, (BATCH, PREFILL_TOKENS + 1), generator=generator)
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(PREFILL_TOKENS).expand(BATCH, -1),
    }

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        logits = model(micro_batch["tokens"], micro_batch["position_ids"], None)  # [batch, seq, vocab]

        def loss_func(output):
            loss_sum = F.cross_entropy(output.float().reshape(-1, output.shape[-1]),
                                       micro_batch["labels"].reshape(-1), reduction="sum")
            return loss_sum, torch.tensor(micro_batch["labels"].numel(), dtype=torch.int), {}

        return logits, loss_func

    def step() -> None:
        for chunk in chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=chunks,
            num_microbatches=1,
            seq_length=PREFILL_TOKENS,
            micro_batch_size=BATCH,
            forward_only=False,
        )
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed repeats per case (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed repeats before timing")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's choice). The mode's cost is per Python-level "
                        "call; one thread keeps the arithmetic steady on a shared machine so the difference shows")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # megatron's "no transformer-engine/apex" import warnings
    if args.threads:
        torch.set_num_threads(args.threads)

    import megatron.core

    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import cpu_bridge, distributed, seeds
    from aligner.runtime.distributed import ParallelConfig

    if not cpu_bridge.needed():
        print("CUDA is available: the CPU bridge is not applied here, so there is nothing to measure.")
        return
    parallel = ParallelConfig()
    distributed.initialize(parallel)
    seeds.set_seed(0)
    model_cfg = GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=256)
    model = build_gpt_model(model_cfg, transformer_config(model_cfg)).eval()

    print(f"CPU bridge mode overhead: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} after {args.warmup} warm-up")
    print(f"model: GPTModel {model_cfg.num_layers} layers x {model_cfg.hidden_size} wide, "
          f"vocab {model_cfg.vocab_size}, local spec, fp32, torch.no_grad, no KV cache")

    per_call_by_case = {}
    for name, seq in (("decode ", 1), ("prefill", PREFILL_TOKENS)):
        tokens = torch.randint(0, model_cfg.vocab_size, (BATCH, seq), generator=torch.Generator().manual_seed(seq))
        positions = torch.arange(seq).expand(BATCH, -1)

        def forward(tokens=tokens, positions=positions):
            with torch.no_grad():
                return model(tokens, positions, None)

        timing = _paired(forward, args.repeats, args.warmup)
        calls = _count_bridge_calls(lambda: _in_scope(forward))
        per_call = timing.extra / calls
        per_call_by_case[name.strip()] = per_call
        print(f"{name} [{BATCH}, {seq:>2}]  plain {timing.plain * 1e3:7.2f} ms   "
              f"in scope {timing.scoped * 1e3:7.2f} ms   "
              f"ratio {timing.ratio:.3f}   ({calls} torch calls, {per_call * 1e6:+.2f} us/call)")

    small_a, small_b = torch.ones(4), torch.ones(4)

    def small_ops():
        for _ in range(SMALL_OP_CALLS):
            torch.add(small_a, small_b)

    timing = _paired(small_ops, max(args.repeats // 3, 3), 1)
    loop_per_call = timing.extra / SMALL_OP_CALLS
    print(f"small-op loop      plain {timing.plain / SMALL_OP_CALLS * 1e6:7.2f} us   in scope "
          f"{timing.scoped / SMALL_OP_CALLS * 1e6:7.2f} us   ratio {timing.ratio:.3f}   "
          f"({loop_per_call * 1e6:+.2f} us/call)")

    step = _training_step_fn(model_cfg, parallel, model_cfg.vocab_size)
    step_seconds = _median_seconds(step, max(args.repeats // 3, 3), 2)
    step_calls = _count_bridge_calls(step)
    print(f"training step [{BATCH} x {PREFILL_TOKENS}] (schedule fwd+bwd + finalize_model_grads + optimizer.step, "
          f"inside the scope by construction): {step_seconds * 1e3:.2f} ms, {step_calls} torch calls through the mode")
    # The decode forward is call-bound, so its difference is the cleanest forward estimate of the
    # per-call cost; in the prefill the same ~500 calls drown in arithmetic and timing noise.
    for label, per_call in (("decode forward", per_call_by_case["decode"]), ("small-op loop", loop_per_call)):
        cost = step_calls * per_call
        print(f"  mode's share of the step at {per_call * 1e6:+.2f} us/call ({label}): "
              f"{cost * 1e3:.2f} ms = {cost / step_seconds:.1%} of the step")
    print("generation: trainers enter the mode only around schedules, DDP init, finalize_model_grads, "
          "optimizer init/step and dist_checkpointing save/load, so a decoder that calls the model directly "
          "pays nothing (ratio 1.000); aligner/generation/reference.py decodes through forward_logits -> "
          "the schedule, so it pays the decode/prefill ratio above.")
    distributed.shutdown()


if __name__ == "__main__":
    main()
