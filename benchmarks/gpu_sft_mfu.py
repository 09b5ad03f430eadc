"""SFT MFU of a ~1B Llama-style model (random init, bf16, seq 2048), against the bf16 matmul rate of this GPU.

The run is the project's own SFT entry point (`examples/nlp/gpt/train_gpt_sft.py`), so the MFU reported is
the trainer's own metric (6 x parameters + attention FLOPs per token, over the step's wall time, see
`aligner.training.metrics`), with `logging.peak_tflops` set to the bf16 matmul rate measured here first
(benchmarks/machine.py, 8192^3 on a GPU). Data: an offline word-level tokenizer of --vocab tokens (w0, w1, ...
plus the special tokens) and records of random words, each a short prompt and a response long enough to fill
--seq tokens, so no row is padded and the output layer runs at nearly every position (the trainer computes
logits only where the loss is, and its FLOP count assumes all). Micro batches of --micro-batches are tried
from the largest down until one fits (a run that ends in a CUDA out-of-memory error is followed by the next);
global batch = micro batch (one GPU). No checkpoint, validation, TensorBoard or progress bar; everything is
written to a temporary directory. Prints the matmul rate, step time, tokens/s, the median MFU over the steps
after --warmup-steps, peak GPU memory and `ratio gpu_sft_mfu_1b MFU` (a fraction).

    python benchmarks/gpu_sft_mfu.py [--layers 16 --hidden 2048 --heads 32 --query-groups 8 --ffn 8192]
        [--vocab 32000] [--seq 2048] [--micro-batches 1,2,4,8] [--steps 10] [--precision bf16]
    python benchmarks/gpu_sft_mfu.py --tiny   # CPU smoke run: 2 layers x 64, seq 128, vocab 512, fp32
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import GPU_MATMUL_SIZE, MATMUL_SIZE, matmul_rate  # noqa: E402
from benchmarks.run_bench import ratio_line  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0-3: pad, bos, eos, unk
PROMPT_WORDS = 32
PEAK_PREFIX = "peak_gpu_bytes "
# Runs the entry point as its own __main__ and reports the process's peak GPU memory as it exits.
RUNNER = f"""
import atexit, runpy, sys, torch
if torch.cuda.is_available():
    atexit.register(lambda: print("{PEAK_PREFIX}%d" % torch.cuda.max_memory_allocated(), file=sys.stderr, flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def write_word_tokenizer(vocab: int, out_dir: Path) -> None:
    """An HF tokenizer directory of exactly `vocab` tokens: the special tokens, then words w0, w1, ...
    (one token each, split on whitespace), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{index}": len(SPECIAL_TOKENS) + index for index in range(vocab - len(SPECIAL_TOKENS))}
    model = models.WordLevel(vocab={token: index for index, token in enumerate(SPECIAL_TOKENS)} | words,
                             unk_token="<unk>")
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    pad, bos, eos, unk = SPECIAL_TOKENS
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad, bos_token=bos, eos_token=eos,
                            unk_token=unk).save_pretrained(str(out_dir))


def write_records(path: Path, count: int, seq: int, vocab: int, seed: int = 0) -> None:
    """SFT records {"input", "output"} of random words: a short prompt and a response longer than seq
    tokens, so every row is cut to exactly seq + 1 tokens (seq inputs and their labels)."""
    rng = random.Random(seed)
    words = vocab - len(SPECIAL_TOKENS)

    def text(length: int) -> str:
        return " ".join(f"w{rng.randrange(words)}" for _ in range(length))

    with path.open("w") as out:
        for _ in range(count):
            out.write(json.dumps({"input": text(PROMPT_WORDS), "output": text(seq)}) + "\n")


def sft_overrides(args, work: Path, micro_batch: int, peak_tflops: float) -> list[str]:
    """train_gpt_sft.py's key=value settings for one run at this micro batch (= global batch, one GPU)."""
    architecture = {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads,
                    "num_query_groups": args.query_groups, "ffn_hidden_size": args.ffn,
                    "max_position_embeddings": args.seq}  # llama family: the defaults (RMSNorm, SwiGLU, RoPE)
    return [
        f"precision={args.precision}",
        f"tokenizer.path={work / 'tokenizer'}",
        f"data.train=[{{path: {work / 'train.jsonl'}}}]", "data.split='100,0'",
        f"data.max_seq_length={args.seq + 1}",  # tokens and labels are the row shifted by one: seq positions
        *(f"model.architecture.{key}={value}" for key, value in architecture.items()),
        f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={micro_batch}",
        f"trainer.micro_batch_size={micro_batch}", "trainer.val_check_interval=0",
        f"logging.log_dir={work / f'logs_mb{micro_batch}'}", "logging.log_interval=1",
        "logging.tensorboard=false", "logging.progress_bar=false", f"logging.peak_tflops={peak_tflops}",
        f"checkpoint.save_dir={work / 'checkpoints'}", "checkpoint.save_interval=0", "checkpoint.save_at_end=false",
    ]


def out_of_memory(stderr: str) -> bool:
    return "OutOfMemoryError" in stderr or "out of memory" in stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--query-groups", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row (every row full)")
    parser.add_argument("--micro-batches", default="1,2,4,8", help="tried from the largest down until one fits")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                        help="the trainer's precision and the dtype of the measured matmul rate")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: 2 layers x 64 (4 heads, 2 groups, ffn 256), vocab 512, seq 128, "
                        "micro batches 1,2, 4 steps, fp32")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.heads, args.query_groups, args.ffn = 2, 64, 4, 2, 256
        args.vocab, args.seq, args.micro_batches, args.steps, args.precision = 512, 128, "1,2", 4, "fp32"
    if args.steps <= args.warmup_steps:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup-steps {args.warmup_steps}")
    micro_batches = sorted({int(part) for part in args.micro_batches.split(",") if part.strip()}, reverse=True)

    import torch

    from aligner.runtime import distributed
    from aligner.training.metrics import read_metrics
    from benchmarks.machine import describe_peak_rss

    device = distributed.device()
    dtype = distributed.resolve_precision(args.precision)
    size = GPU_MATMUL_SIZE if device.type == "cuda" else MATMUL_SIZE
    peak_flops = matmul_rate(size, device, repeats=50, dtype=dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_sft_mfu: {where}, torch {torch.__version__}; matmul {peak_flops / 1e12:.1f} TFLOP/s "
          f"({args.precision} {size}^3, median of 50): the MFU's denominator", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the trainer's process gets the memory back

    with tempfile.TemporaryDirectory(prefix="gpu_sft_mfu_") as scratch:
        work = Path(scratch)
        write_word_tokenizer(args.vocab, work / "tokenizer")
        write_records(work / "train.jsonl", args.steps * max(micro_batches), args.seq, args.vocab)
        for micro_batch in micro_batches:
            command = [sys.executable, "-c", RUNNER, str(TRAIN_SCRIPT),
                       *sft_overrides(args, work, micro_batch, peak_flops / 1e12)]
            run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
            if run.returncode == 0:
                break
            if not out_of_memory(run.stderr):
                raise SystemExit(f"micro batch {micro_batch}: train_gpt_sft.py failed (exit {run.returncode}):\n"
                                 f"{run.stderr[-4000:]}")
            print(f"micro batch {micro_batch}: out of memory, trying the next", flush=True)
        else:
            raise SystemExit(f"no micro batch of {micro_batches} fits: every run ran out of memory")
        rows = read_metrics(work / f"logs_mb{micro_batch}", "train")

    timed = [row for row in rows if row["step"] > args.warmup_steps]
    step_time = statistics.median(row["step_time"] for row in timed)
    tokens_per_s = statistics.median(row["tokens_per_second"] for row in timed)
    mfu = statistics.median(row["mfu"] for row in timed)
    peak = [line for line in run.stderr.splitlines() if line.startswith(PEAK_PREFIX)]
    memory = (f"peak GPU memory {int(peak[-1].removeprefix(PEAK_PREFIX)) / 2**30:.1f} GiB (torch allocator)"
              if peak else "peak GPU memory: n/a")
    params = re.search(r"([\d.]+M) parameters", run.stdout + run.stderr)  # the trainer's own count
    print(f"model: {args.layers} layers x {args.hidden}, {args.heads} heads ({args.query_groups} KV groups), "
          f"ffn {args.ffn}, vocab {args.vocab}, {params.group(1) if params else '?'} parameters, {args.precision}")
    print(f"run: seq {args.seq}, micro batch {micro_batch} (= global batch), {len(rows)} steps, medians over the "
          f"{len(timed)} after {args.warmup_steps} warm-up steps")
    per_step = ", ".join(f"{row['mfu']:.3f}" for row in rows)
    print(f"step {step_time * 1e3:.0f} ms, {tokens_per_s:.0f} tokens/s, MFU {mfu:.1%} of "
          f"{peak_flops / 1e12:.1f} TFLOP/s (per step: {per_step})")
    print(f"{memory}; {describe_peak_rss()}")
    print(ratio_line("gpu_sft_mfu_1b", mfu))


if __name__ == "__main__":
    main()
