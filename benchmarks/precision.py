"""bf16 against fp32 on a real model: generation and SFT steps, speed and what the precision changes.

    python benchmarks/precision.py [--model smollm2] [--batches 1,8] [--new-tokens 32] [--repeats 3]
                                   [--sft-steps 4] [--skip-sft] [--threads 2]

Generation: one process holds the model twice (fp32 and bf16 weights, each with its native engine)
and runs the same prompts greedily, fixed length, alternating the two repeat by repeat; the ratio
is the median of per-pair ratios (fp32 time / bf16 time). What bf16 changes is measured on the
same prompts: the share of greedy tokens equal to fp32's, and how far the bf16 model's logprobs of
fp32's own greedy continuation are from fp32's (the trainer's forward, both precisions).

SFT: `train_gpt_sft.py` at micro batch 4, sequences of 256 tokens (benchmarks/real_model_memory.py's
conversations), fp32 and bf16 as alternating processes; the per-step times of the steps after the
first are compared, with the first step's loss of each (same data, same initial weights) and each
process's peak RSS.

Prints `ratio bf16_generation_bN_vs_fp32 X` and `ratio bf16_sft_step_vs_fp32 X` (fp32 time / bf16
time: above 1 means bf16 is faster) with the absolute numbers and the load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import resolve_model  # noqa: E402
from real_model_memory import write_data  # noqa: E402
from run_bench import ratio_line  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("Explain in three short steps how a river carves a valley through rock over many years, "
          "and say which step takes the longest.")


def load_engine(checkpoint: Path, dtype: torch.dtype, max_batch: int, max_length: int):
    from aligner import checkpointing
    from aligner.generation.native import NativeEngine
    from aligner.models.gpt import GPTConfig, build_model_chunks
    from aligner.runtime.distributed import ParallelConfig
    from aligner.tokenizer import Tokenizer

    model_cfg = GPTConfig.from_dict(checkpointing.read_meta(checkpoint)["model"])
    chunks = build_model_chunks(model_cfg, ParallelConfig(), dtype)
    checkpointing.load(checkpoint, chunks)
    for chunk in chunks:
        chunk.eval()
    tokenizer = Tokenizer(checkpoint / checkpointing.TOKENIZER_DIR)
    engine = NativeEngine(chunks, model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                          max_batch_size=max_batch, max_sequence_length=max_length)
    return engine, chunks, tokenizer, model_cfg


def compare_generation(checkpoint: Path, batches: list[int], new_tokens: int, repeats: int) -> Iterator[str]:
    from aligner.generation.engine import SamplingParams
    from aligner.runtime import distributed, seeds

    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)  # megatron's RNG tracker, which attention forks even in eval mode
    fp32, fp32_chunks, tokenizer, model_cfg = load_engine(checkpoint, torch.float32, max(batches), 512)
    bf16, bf16_chunks, _, _ = load_engine(checkpoint, torch.bfloat16, max(batches), 512)
    prompt = tokenizer.encode(PROMPT)
    sampling = SamplingParams(max_new_tokens=new_tokens, greedy=True, fixed_length=True)
    for batch in batches:
        prompts = [list(prompt)] * batch
        ratios, times = [], {"fp32": [], "bf16": []}
        for _ in range(repeats + 1):  # the first pair warms both up and is not counted
            pair = {}
            for name, engine in (("fp32", fp32), ("bf16", bf16)):
                start = time.perf_counter()
                engine.generate(prompts, sampling)
                pair[name] = time.perf_counter() - start
            times["fp32"].append(pair["fp32"])
            times["bf16"].append(pair["bf16"])
            ratios.append(pair["fp32"] / pair["bf16"])
        ratio = statistics.median(ratios[1:])
        tokens = batch * new_tokens
        rates = {name: tokens / statistics.median(found[1:]) for name, found in times.items()}
        yield (f"generation b{batch}: fp32 {rates['fp32']:.1f} tokens/s, bf16 {rates['bf16']:.1f} tokens/s "
                     f"(load {os.getloadavg()[0]:.1f})")
        yield ratio_line(f"bf16_generation_b{batch}_vs_fp32", ratio)
    # What bf16 changes: its greedy tokens against fp32's, and its logprobs of fp32's own tokens.
    from aligner.models.logprobs import pack_sequences, sequence_logprobs

    reference = fp32.generate([list(prompt)], sampling)
    own = bf16.generate([list(prompt)], sampling)
    same = (reference.response_tokens == own.response_tokens)[0].tolist()
    first_difference = same.index(False) if False in same else None
    tokens, prompt_lengths = pack_sequences([prompt], reference.response_tokens, reference.response_lengths,
                                            tokenizer.pad_id)
    scored = {name: sequence_logprobs(chunks, tokens, prompt_lengths, reference.response_lengths,
                                      vocab_size=model_cfg.vocab_size)
              for name, chunks in (("fp32", fp32_chunks), ("bf16", bf16_chunks))}
    difference = (scored["fp32"] - scored["bf16"].float()).abs()
    yield (f"bf16 greedy tokens equal to fp32's: {sum(same) / len(same):.1%} (first difference at token "
                 f"{first_difference}); bf16 logprobs of fp32's tokens: max |diff| {difference.max().item():.4f}, "
                 f"mean {difference.mean().item():.4f}")
    distributed.shutdown()


def sft_run(checkpoint: Path, data: Path, precision: str, steps: int, work: Path, threads: int) -> dict:
    from aligner.training.metrics import read_metrics

    out = work / f"sft_{precision}_{time.monotonic_ns()}"
    command = [sys.executable, str(REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"),
               f"model.init_from={checkpoint}", f"data.train=[{{path: {data}, weight: 1.0}}]",
               "data.max_seq_length=256", "trainer.micro_batch_size=4", "trainer.global_batch_size=4",
               f"trainer.max_steps={steps}", "trainer.val_check_interval=0", "optim.warmup_steps=0",
               "logging.tensorboard=false", "logging.progress_bar=false", "checkpoint.save_at_end=false",
               "checkpoint.resume=false", f"checkpoint.save_dir={out}", f"logging.log_dir={out}",
               f"precision={precision}", "seed=1234"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO_ROOT)}
    with open(work / f"sft_{precision}.log", "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"sft at precision={precision} failed; see {work / f'sft_{precision}.log'}")
    rows = read_metrics(out, "train")
    return {"step_times": [row["step_time"] for row in rows[1:]], "first_loss": rows[0]["loss"],
            "mfu": [row["mfu"] for row in rows[1:]], "peak_rss_mb": usage.ru_maxrss / 1024}


def compare_sft(checkpoint: Path, steps: int, rounds: int, threads: int) -> Iterator[str]:
    work = Path(tempfile.mkdtemp(prefix="precision_sft_"))
    data = write_data(work)["sft"]
    runs: dict[str, list[dict]] = {"fp32": [], "bf16": []}
    for _ in range(rounds):  # alternate whole runs; each run's steps after the first are timed
        for precision in ("fp32", "bf16"):
            runs[precision].append(sft_run(checkpoint, data, precision, steps, work, threads))
    step = {name: statistics.median(t for run in found for t in run["step_times"]) for name, found in runs.items()}
    yield from [f"sft step (micro batch 4 x 256 tokens): fp32 {step['fp32']:.2f} s (MFU "
             f"{statistics.median(m for r in runs['fp32'] for m in r['mfu']):.2f}, peak RSS "
             f"{runs['fp32'][0]['peak_rss_mb']:.0f} MB), bf16 {step['bf16']:.2f} s (MFU against the fp32 matmul "
             f"rate {statistics.median(m for r in runs['bf16'] for m in r['mfu']):.2f}, peak RSS "
             f"{runs['bf16'][0]['peak_rss_mb']:.0f} MB) (load {os.getloadavg()[0]:.1f})",
             f"sft first-step loss: fp32 {runs['fp32'][0]['first_loss']:.5f}, bf16 {runs['bf16'][0]['first_loss']:.5f}",
             ratio_line("bf16_sft_step_vs_fp32", step["fp32"] / step["bf16"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sft-steps", type=int, default=4)
    parser.add_argument("--sft-rounds", type=int, default=1)
    parser.add_argument("--skip-sft", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model)
    print(f"model {args.model}: {resolved.checkpoint_dir}; {args.threads} threads")
    for line in compare_generation(resolved.checkpoint_dir, [int(b) for b in args.batches.split(",")],
                                   args.new_tokens, args.repeats):
        print(line, flush=True)
    if not args.skip_sft:
        for line in compare_sft(resolved.checkpoint_dir, args.sft_steps, args.sft_rounds, args.threads):
            print(line, flush=True)


if __name__ == "__main__":
    main()
